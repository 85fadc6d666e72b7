"""OpenAI / vLLM request fields -> `StructuredOutputsParams` (or a 400), as vLLM maps them.

Sources, in increasing precedence:
- `structured_outputs` (vLLM): `{json | regex | choice | grammar | json_object, options...}`;
- legacy `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (with
  `guided_whitespace_pattern`): replace `structured_outputs` when given (vLLM 0.10-0.12);
- `response_format`: `text` (nothing), `json_object`, `json_schema` (`json_schema.schema`);
  combined with another constraint it is a 400 ("only one kind");
- chat `tool_choice` "required" / named function: the tool-call JSON schema replaces every
  other constraint (vLLM drops `response_format` then): "required" -> an array (minItems 1)
  of `{"name": <enum of one tool>, "parameters": <its parameters>}` objects (`anyOf` over the
  tools, shared `$defs` merged at the top); named -> that function's `parameters`. Reading
  the output back into `tool_calls` is `sous.server.tool_parsers.forced`.

Every resulting constraint is parsed by xgrammar here, so an invalid schema, regex or grammar
is a 400 before the request reaches the engine. `structured_outputs_for` also awaits the
engine's compile of it (against the model's vocabulary, on the structured-output manager's
worker thread, cached and shared with the request once it is added), so a constraint that
parses but cannot compile (e.g. a grammar no token can start) is a 400 too, before any
streaming starts.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from sous.engine.structured_output.params import StructuredOutputsParams
from sous.server.errors import APIError, bad_request

_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern"}
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _base_fields(req: Any) -> tuple[dict[str, Any], str]:
    """`structured_outputs` or the legacy `guided_*` fields, and the param name to blame."""
    legacy = {name: getattr(req, field) for field, name in _LEGACY.items()
              if getattr(req, field, None) is not None}
    if any(k != "whitespace_pattern" for k in legacy):
        return legacy, next(f for f, name in _LEGACY.items() if name in legacy)
    so = req.structured_outputs
    if so is None:
        return {}, "structured_outputs"
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object.", "structured_outputs")
    return dict(so), "structured_outputs"


def _response_format_fields(rf: dict[str, Any] | None) -> dict[str, Any]:
    if not rf:
        return {}
    kind = rf.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema is required when its type is "
                              "'json_schema'.", "response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        return {"json_object": True} if schema is None else {"json": schema}
    if kind == "structural_tag":
        raise APIError("response_format of type 'structural_tag' is not supported yet.", 400,
                       "response_format")
    raise bad_request(f"response_format.type must be 'text', 'json_object', 'json_schema' or "
                      f"'structural_tag', got {kind!r}.", "response_format")


def build_structured_outputs(req: Any, tool_schema: dict[str, Any] | None = None,
                             ) -> StructuredOutputsParams | None:
    """The request's structured-output constraint (None: unconstrained). `req` is a
    completion or chat request; `tool_schema` (from `tool_choice_schema`) overrides the rest.
    Raises a 400 APIError for conflicting or malformed constraints."""
    return _build(req, tool_schema)[0]


async def structured_outputs_for(engine: Any, req: Any,
                                 tool_schema: dict[str, Any] | None = None,
                                 ) -> StructuredOutputsParams | None:
    """`build_structured_outputs`, then wait until `engine` (an AsyncLLM or DPAsyncLLM;
    anything without a structured-output manager skips this) has compiled the constraint. Raises a 400 APIError
    naming the problem when it cannot compile."""
    params, param = _build(req, tool_schema)
    manager = getattr(engine, "structured_output_manager", None)
    if params is None or manager is None:
        return params
    try:
        await asyncio.wrap_future(manager.compile_future(params))
    except ValueError as e:
        raise bad_request(str(e), param) from None
    return params


def _build(req: Any, tool_schema: dict[str, Any] | None,
           ) -> tuple[StructuredOutputsParams | None, str]:
    """The constraint and the request field it came from (what a 400 names)."""
    fields, param = _base_fields(req)
    if tool_schema is not None:
        fields = {k: v for k, v in fields.items() if k not in _CONSTRAINTS}
        fields["json"] = tool_schema
        param = "tools"
    else:
        rf = _response_format_fields(req.response_format)
        if rf:
            if any(fields.get(k) is not None for k in _CONSTRAINTS):
                raise bad_request("You can only use one kind of structured outputs constraint "
                                  "but multiple are specified (response_format and "
                                  f"{param}).", "response_format")
            fields.update(rf)
            param = "response_format"
    if not fields:
        return None, param
    try:
        params = StructuredOutputsParams(**fields)
        from sous.engine.structured_output.backend_xgrammar import validate
        validate(params)
    except TypeError as e:
        raise bad_request(f"Invalid {param}: {e}", param) from None
    except ValueError as e:
        raise bad_request(str(e), param) from None
    return params, param


def _tool_function(tool: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    function = tool.get("function") or {}
    params = function.get("parameters")
    return function.get("name", ""), copy.deepcopy(params) if params else dict(_EMPTY_PARAMETERS)


def tool_choice_schema(tool_choice: Any, tools: list[dict[str, Any]] | None,
                       ) -> dict[str, Any] | None:
    """The JSON schema that forces tool calls (vLLM's `get_json_schema_from_tools`): None for
    "none" / "auto" / no tools. `tool_choice` must already be validated against `tools`."""
    if not tools or tool_choice in (None, "none", "auto"):
        return None
    if isinstance(tool_choice, dict):
        wanted = tool_choice["function"]["name"]
        for tool in tools:
            name, params = _tool_function(tool)
            if name == wanted:
                return params
        raise bad_request(f"Tool '{wanted}' has not been passed in `tools`.", "tool_choice")
    any_of = []
    defs: dict[str, Any] = {}
    for tool in tools:
        name, params = _tool_function(tool)
        for def_name, def_schema in params.pop("$defs", {}).items():
            if def_name in defs and defs[def_name] != def_schema:
                raise bad_request(f"Tool definition '{def_name}' has multiple schemas, which "
                                  "is not supported.", "tools")
            defs[def_name] = def_schema
        any_of.append({"properties": {"name": {"type": "string", "enum": [name]},
                                      "parameters": params},
                       "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": any_of}}
    if defs:
        schema["$defs"] = defs
    return schema
