"""Structured output through the OpenAI server (real engine, bundled SmolLM2, `openai`
client): `response_format` json_schema / json_object, vLLM's `structured_outputs`, legacy
`guided_*`, `tool_choice` "required" and named (streamed and not), and the 400s."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from sous.engine.structured_output import StructuredOutputsParams
from sous.server.errors import APIError
from sous.server.handle import ServerHandle
from sous.server.protocol import ChatCompletionRequest, CompletionRequest
from sous.server.structured_request import build_structured_outputs, tool_choice_schema

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}},
                   "required": ["tz"]}}}
BOOK = {"type": "object",
        "properties": {"title": {"type": "string"},
                       "tags": {"type": "array", "items": {"type": "string"}},
                       "rating": {"type": "number"}},
        "required": ["title", "tags", "rating"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---- request mapping (no model) ------------------------------------------------------------

def _chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **kw})


def test_request_fields_map_to_params() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    assert build_structured_outputs(_chat(response_format=rf)) == \
        StructuredOutputsParams(json=PERSON)
    assert build_structured_outputs(_chat(response_format={"type": "text"})) is None
    assert build_structured_outputs(_chat()) is None
    assert build_structured_outputs(CompletionRequest(
        prompt="x", response_format={"type": "json_object"})) == \
        StructuredOutputsParams(json_object=True)
    so = build_structured_outputs(_chat(structured_outputs={
        "regex": "[a-z]+", "disable_any_whitespace": True}))
    assert so == StructuredOutputsParams(regex="[a-z]+", disable_any_whitespace=True)
    assert build_structured_outputs(_chat(guided_choice=["a", "b"], structured_outputs={
        "regex": "x"})) == StructuredOutputsParams(choice=["a", "b"])
    assert build_structured_outputs(_chat(guided_json=json.dumps(PERSON))).json == \
        json.dumps(PERSON)
    tool = tool_choice_schema("required", [WEATHER])
    forced = build_structured_outputs(_chat(response_format={"type": "json_object"},
                                            structured_outputs={"regex": "x"}), tool)
    assert forced == StructuredOutputsParams(json=tool)
    with pytest.raises(APIError, match="unexpected keyword") as info:
        build_structured_outputs(_chat(structured_outputs={"jsn": {}}))
    assert info.value.status == 400 and info.value.param == "structured_outputs"


def test_tool_choice_schemas() -> None:
    assert tool_choice_schema("auto", [WEATHER]) is None
    assert tool_choice_schema("none", [WEATHER]) is None
    named = {"type": "function", "function": {"name": "get_time"}}
    assert tool_choice_schema(named, [WEATHER, TIME]) == TIME["function"]["parameters"]
    bare = {"type": "function", "function": {"name": "ping"}}
    assert tool_choice_schema({"function": {"name": "ping"}}, [bare]) == \
        {"type": "object", "properties": {}}
    required = tool_choice_schema("required", [WEATHER, bare])
    assert required == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER["function"]["parameters"]},
         "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["ping"]},
                        "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"]}]}}
    unit = {"enum": ["c", "f"]}

    def with_defs(name: str, defs: dict) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}, "$defs": defs}}}

    merged = tool_choice_schema("required", [with_defs("a", {"Unit": unit}),
                                             with_defs("b", {"Unit": unit})])
    assert merged["$defs"] == {"Unit": unit}
    assert all("$defs" not in item["properties"]["parameters"]
               for item in merged["items"]["anyOf"])
    with pytest.raises(APIError, match="'Unit' has multiple schemas"):
        tool_choice_schema("required", [with_defs("a", {"Unit": unit}),
                                        with_defs("b", {"Unit": {"type": "string"}})])


# ---- over HTTP ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from sous.config.engine_args import engine_config_from_kwargs
    from sous.engine.async_llm import AsyncLLM

    config = engine_config_from_kwargs(model=None, max_model_len=512,
                                       kv_cache_memory_bytes=128 << 20, max_num_seqs=32)
    eng = AsyncLLM.from_config(config)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[openai.OpenAI]:
    with ServerHandle(engine) as handle:
        yield openai.OpenAI(base_url=handle.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(engine: Any) -> str:
    return engine.served_model_name


def check_person(obj: Any) -> None:
    assert isinstance(obj, dict) and set(obj) == {"name", "age", "city"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
    assert obj["city"] in ("Paris", "Rome", "Oslo")


def check_weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str)
    assert len(args["city"]) <= 16 and args["unit"] in ("celsius", "fahrenheit")
    return args


def check_book(obj: Any) -> None:
    assert isinstance(obj, dict) and set(obj) == {"title", "tags", "rating"}
    assert isinstance(obj["title"], str) and isinstance(obj["rating"], int | float)
    assert isinstance(obj["tags"], list) and all(isinstance(t, str) for t in obj["tags"])


@pytest.mark.parametrize(("schema", "question", "check"), [
    (PERSON, "Describe a person as JSON.", check_person),
    (BOOK, "Recommend a book.", check_book)])
def test_json_schema_20_seeds_temperature_1(client: openai.OpenAI, model: str, schema: dict,
                                            question: str, check: Any) -> None:
    """Seeds 0-19 (n=20 gives choice i the seed 0 + i): every answer is a document of the
    schema within max_tokens, even where the model would ramble on (BOOK's free strings)."""
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}],
        n=20, seed=0, temperature=1.0, max_tokens=120,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    assert len(resp.choices) == 20
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.message.content
        check(json.loads(choice.message.content))


def test_json_object_closes(client: openai.OpenAI, model: str) -> None:
    cat = [{"role": "user", "content": "Give me a JSON object describing a cat."}]
    for temperature, n in ((1.0, 3), (0.0, 1)):
        resp = client.chat.completions.create(
            model=model, messages=cat, n=n, seed=0, temperature=temperature, max_tokens=200,
            response_format={"type": "json_object"})
        for choice in resp.choices:
            assert choice.finish_reason == "stop", choice.message.content
            assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_grammar_that_cannot_compile_is_400(client: openai.OpenAI, model: str,
                                            stream: bool) -> None:
    """`root ::= a / a ::= a` parses but accepts nothing: a 400 naming the problem before any
    output (streamed or not), on both endpoints."""
    grammar = "root ::= a\na ::= a"
    with pytest.raises(openai.BadRequestError, match="accepts no output") as info:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, stream=stream,
                                       extra_body={"structured_outputs": {"grammar": grammar}})
    assert info.value.status_code == 400 and info.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError, match="accepts no output") as info:
        client.completions.create(model=model, prompt="Hi", max_tokens=4, stream=stream,
                                  extra_body={"guided_grammar": "root ::= [^\\x00-\\U0010FFFF]"})
    assert info.value.status_code == 400 and info.value.body["param"] == "guided_grammar"


def test_choice_regex_and_json_object(client: openai.OpenAI, model: str) -> None:
    choice = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is the sky blue?"}],
        temperature=0.0, max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert choice.choices[0].message.content in ("yes", "no", "maybe")
    regex = client.completions.create(
        model=model, prompt="My phone number is", temperature=0.0, max_tokens=12,
        extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert re.fullmatch(r" \d{3}-\d{4}", regex.choices[0].text)
    assert regex.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=model, temperature=0.0, max_tokens=40, stream=True,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


def test_tool_choice_named(client: openai.OpenAI, model: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                          tool_choice=named, temperature=0.0, max_tokens=40)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content in ("", None)
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = check_weather_args(call.function.arguments)
    stream = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                            tool_choice=named, temperature=0.0, max_tokens=40,
                                            stream=True)
    pieces, names, ids, reasons = [], [], [], []
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                assert d.index == 0
                names += [d.function.name] if d.function.name else []
                ids += [d.id] if d.id else []
                pieces.append(d.function.arguments or "")
            reasons += [c.finish_reason] if c.finish_reason else []
    assert names == ["get_weather"] and len(ids) == 1 and reasons == ["stop"]
    assert check_weather_args("".join(pieces)) == args


def test_tool_choice_required(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                          tool_choice="required", temperature=0.0,
                                          max_tokens=80)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    calls = {}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        assert call.function.name in ("get_weather", "get_time")
        calls.setdefault(call.function.name, []).append(json.loads(call.function.arguments))
    for args in calls.get("get_weather", []):
        check_weather_args(json.dumps(args))
    stream = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                            tool_choice="required", temperature=0.0,
                                            max_tokens=80, stream=True)
    streamed: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, {"name": None, "args": "", "id": None})
                entry["name"] = entry["name"] or d.function.name
                entry["id"] = entry["id"] or d.id
                entry["args"] += d.function.arguments or ""
            reasons += [c.finish_reason] if c.finish_reason else []
    assert reasons == ["tool_calls"] and all(e["id"] for e in streamed.values())
    got: dict[str, list] = {}
    for i in sorted(streamed):
        got.setdefault(streamed[i]["name"], []).append(json.loads(streamed[i]["args"]))
    assert got == calls


@pytest.mark.parametrize(("extra", "message"), [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objx"}}}}, "objx"),
    ({"structured_outputs": {"regex": "(abc"}}, "parenthesis"),
    ({"guided_grammar": "root ::= foo"}, "foo"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "only use one kind"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "only use one kind"),
    ({"response_format": {"type": "structural_tag"}}, "not supported yet"),
    ({"structured_outputs": {"json": "{bad"}}, "Invalid JSON grammar"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_constraints_400(client: openai.OpenAI, model: str, extra: dict, message: str,
                                 stream: bool) -> None:
    with pytest.raises(openai.BadRequestError, match=message) as info:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, stream=stream,
                                       extra_body=extra)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "BadRequestError"
