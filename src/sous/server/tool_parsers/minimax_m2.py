"""`minimax_m2`: MiniMax-M2's XML-like calls, as vLLM's MinimaxM2ToolParser reads them.

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Seattle</parameter>
    <parameter name="days">5</parameter>
    </invoke>
    </minimax:tool_call>

Every `<invoke>` of every block is one call; names may be quoted with `"` or `'` or not at
all. Content is the text before the first `<minimax:tool_call>`. Parameter values are
strings converted by the tool's JSON schema (`coerce`). Streaming: the header (id `call_<24
hex>`, name) goes out when `<invoke ...>` is complete, then `{"k": v` / `, "k": v` as each
`</parameter>` arrives, and `}` at `</invoke>` (`{}` without parameters). A parameter still
open when the output ends is dropped and its call closed. Known limitation (as vLLM): a
literal `</parameter>` inside a value ends the value there.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable
from typing import Any

from sous.server.tool_parsers.base import (
    BlockToolStream,
    ToolCallDelta,
    ToolDelta,
    ToolParser,
    ToolStream,
    find_tool,
)

_NAME = re.compile(r"""name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))""")
_INVOKE = "<invoke"
_INVOKE_END = "</invoke>"
_PARAM = "<parameter"
_PARAM_END = "</parameter>"
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_JSON_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string",
               type(None): "null", list: "array", dict: "object"}


def _attr_name(header: str) -> str:
    m = _NAME.search(header)
    return next((g for g in m.groups() if g is not None), "").strip() if m else ""


def schema_types(schema: Any) -> list[str]:
    """Candidate JSON types of a property schema, in the order they are tried: `type`
    (a string or a list), then the types of `enum` values, then `anyOf`/`oneOf`/`allOf`
    members recursively, each in written order, without repeats."""
    out: list[str] = []

    def walk(s: Any) -> None:
        if not isinstance(s, dict):
            return
        t = s.get("type")
        names = [t] if isinstance(t, str) else list(t) if isinstance(t, list) else []
        if t is None and isinstance(s.get("enum"), list):
            names += [_JSON_NAMES.get(type(v), "string") for v in s["enum"]]
        out.extend(n for n in names if isinstance(n, str) and n not in out)
        for key in ("anyOf", "oneOf", "allOf"):
            for sub in s.get(key) or []:
                walk(sub)

    walk(schema)
    return out


def _to_int(v: str) -> Any:
    return int(v)


def _to_number(v: str) -> Any:
    f = float(v)
    if not math.isfinite(f):
        raise ValueError(v)
    return int(f) if f.is_integer() else f


def _to_bool(v: str) -> Any:
    low = v.lower()
    if low in _TRUE or low in _FALSE:
        return low in _TRUE
    raise ValueError(v)


def _to_json_of(kind: type) -> Callable[[str], Any]:
    def conv(v: str) -> Any:
        value = json.loads(v)
        if not isinstance(value, kind):
            raise ValueError(v)
        return value
    return conv


def _to_null(v: str) -> Any:
    if v.lower() in ("null", "none", "nil"):
        return None
    raise ValueError(v)


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "integer": _to_int, "number": _to_number, "boolean": _to_bool,
    "object": _to_json_of(dict), "array": _to_json_of(list), "null": _to_null,
    "string": lambda v: v,
}


def coerce(raw: str, schema: Any) -> Any:
    """A parameter's text -> its value. The text is stripped; `null` is None; then the
    schema's types (`schema_types`, default string) are tried in order; if none fits,
    JSON, else the text itself."""
    value = raw.strip()
    if value.lower() == "null":
        return None
    for name in schema_types(schema) or ["string"]:
        conv = _CONVERTERS.get(name)
        if conv is None:
            continue
        try:
            return conv(value)
        except (ValueError, TypeError):
            continue
    try:
        return json.loads(value)
    except ValueError:
        return value


class MinimaxM2ToolStream(BlockToolStream):
    START = "<minimax:tool_call>"
    END = "</minimax:tool_call>"

    def open_block(self) -> None:
        self.pos = 0
        self.call: tuple[int, str] | None = None
        self.num_params = 0

    def block(self, body: str, closed: bool, out: ToolDelta) -> None:
        while self._step(body, out):
            pass
        if closed and self.call is not None:
            self._close(out)

    def _step(self, body: str, out: ToolDelta) -> bool:
        """Consume one complete element at self.pos; False when more text is needed."""
        if self.call is None:
            start = body.find(_INVOKE, self.pos)
            head_end = body.find(">", start) if start >= 0 else -1
            if head_end < 0:
                return False
            self.pos = head_end + 1
            name = _attr_name(body[start + len(_INVOKE):head_end])
            self.call = (self.next_index(), name)
            self.num_params = 0
            out.add_call(ToolCallDelta(self.call[0], f"call_{uuid.uuid4().hex[:24]}", name))
            return True
        start = body.find(_PARAM, self.pos)
        end = body.find(_INVOKE_END, self.pos)
        if end >= 0 and (start < 0 or end < start):
            self.pos = end + len(_INVOKE_END)
            self._close(out)
            return True
        head_end = body.find(">", start) if start >= 0 else -1
        if head_end < 0:
            return False
        value_end = body.find(_PARAM_END, head_end)
        stop = body.find(_INVOKE_END, head_end)
        if value_end < 0 or 0 <= stop < value_end:
            if stop < 0:
                return False
            value_end, self.pos = stop, stop
        else:
            self.pos = value_end + len(_PARAM_END)
        self._param(_attr_name(body[start + len(_PARAM):head_end]),
                    body[head_end + 1:value_end], out)
        return True

    def _param(self, key: str, raw: str, out: ToolDelta) -> None:
        assert self.call is not None
        params = (find_tool(self.tools, self.call[1]) or {}).get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        value = coerce(raw, props.get(key) if isinstance(props, dict) else None)
        text = (json.dumps(key, ensure_ascii=False) + ": "
                + json.dumps(value, ensure_ascii=False))
        out.add_call(ToolCallDelta(self.call[0],
                                   arguments=("{" if self.num_params == 0 else ", ") + text))
        self.num_params += 1

    def _close(self, out: ToolDelta) -> None:
        assert self.call is not None
        out.add_call(ToolCallDelta(self.call[0], arguments="}" if self.num_params else "{}"))
        self.call = None


class MinimaxM2ToolParser(ToolParser):
    name = "minimax_m2"
    needs_special_tokens = True

    def stream(self, tools: list[dict[str, Any]] | None) -> ToolStream:
        return MinimaxM2ToolStream(tools)
