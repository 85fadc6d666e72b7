"""Tool-call parsers (hermes, minimax_m2, tool_choice required/named) on real token streams.

Each format is fed whole, token by token and three tokens at a time, the pieces cut by the
bundled SmolLM2 tokenizer (so tags split across tokens); streamed and non-streamed results
must agree exactly (content, names, order, argument text)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from sous.server import tool_parsers
from sous.server.tool_parsers.base import ToolCall, ToolCallDelta, ToolDelta, assemble
from sous.server.tool_parsers.forced import NamedToolStream, RequiredToolStream
from sous.server.tool_parsers.minimax_m2 import coerce, schema_types
from sous.server.tool_parsers.partial_json import parse_partial
from text_pieces import token_pieces

HERMES_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{32}$")
MINIMAX_ID = re.compile(r"^call_[0-9a-f]{24}$")


def streamed(parser: Any, pieces: list[str], tools: Any) -> tuple[list[ToolDelta], Any]:
    stream = parser.stream(tools)
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    return deltas, assemble(deltas)


def shape(result: tuple[str | None, list[ToolCall]]) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = result
    return content, [(c.name, c.arguments) for c in calls]


def check_all_chunkings(tok: Any, parser: Any, text: str, tools: Any, id_re: re.Pattern,
                        ) -> tuple[str | None, list[tuple[str, str]]]:
    """Whole / per token / per 3 tokens agree; every stream has one header per call, first."""
    whole = parser.extract(text, tools)
    for c in whole[1]:
        assert id_re.match(c.id)
    assert len({c.id for c in whole[1]}) == len(whole[1])
    for group in (1, 3):
        deltas, result = streamed(parser, token_pieces(tok, text, group), tools)
        assert shape(result) == shape(whole)
        headers = [d for delta in deltas for d in delta.tool_calls if d.id is not None]
        assert [(h.index, h.name) for h in headers] == [
            (i, c.name) for i, c in enumerate(whole[1])]
        fragments = [d for delta in deltas for d in delta.tool_calls if d.id is None]
        assert all(f.arguments for f in fragments)
    return shape(whole)


# ---- hermes ----------------------------------------------------------------------------

HERMES_TEXT = (
    'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "São Paulo", "days": 3, "units": null, "hourly": false}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"q": "a \\"quoted\\" {brace}", '
    '"filters": {"tags": ["x", "y"], "min": 1.50, "big": 1e3}}}\n</tool_call>\n'
    '<tool_call>{"arguments": {"tz": "CET"}, "name": "get_time"}</tool_call>'
    '<tool_call>{"name": "ping"}</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')


def test_hermes_several_calls_all_chunkings(smollm_tokenizer: Any) -> None:
    parser = tool_parsers.get("hermes")
    content, calls = check_all_chunkings(smollm_tokenizer, parser, HERMES_TEXT, None, HERMES_ID)
    assert content == "Let me check both.\n"
    assert calls == [
        ("get_weather", '{"city": "São Paulo", "days": 3, "units": null, "hourly": false}'),
        ("search", '{"q": "a \\"quoted\\" {brace}", "filters": {"tags": ["x", "y"], '
                   '"min": 1.5, "big": 1000.0}}'),
        ("get_time", '{"tz": "CET"}'),
        ("ping", "{}"),
        ("get_weather", '{"city": "Par"}'),  # cut off: closed where it stopped
    ]
    for _, args in calls:
        json.loads(args)


def test_hermes_streams_arguments_incrementally(smollm_tokenizer: Any) -> None:
    text = '<tool_call>{"name": "f", "arguments": {"text": "one two three four five"}}'
    deltas, _ = streamed(tool_parsers.get("hermes"), token_pieces(smollm_tokenizer, text, 1),
                         None)
    fragments = [d.arguments for delta in deltas for d in delta.tool_calls if d.id is None]
    assert fragments == ["{", '"text": "', "one", " two", " three", " four", " five", '"', "}"]


@pytest.mark.parametrize("text,content,calls", [
    ("Just text, no call.", "Just text, no call.", []),
    ("", None, []),
    ("a < b and <tool_", "a < b and <tool_", []),
    ("<tool_call>not json</tool_call>after", "<tool_call>not json</tool_call>after", []),
    ('x<tool_call>{"arguments": {"a": 1}}</tool_call>y',
     'x<tool_call>{"arguments": {"a": 1}}</tool_call>y', []),
    ('x<tool_call>{"name": "f"}</tool_call>y<tool_call>bad</tool_call>', "x", [("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1} "b"}</tool_call>', None, [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
     [("f", '"{\\"a\\": 1}"')]),
])
def test_hermes_edge_cases(smollm_tokenizer: Any, text: str, content: str | None,
                           calls: list[tuple[str, str]]) -> None:
    parser = tool_parsers.get("hermes")
    assert check_all_chunkings(smollm_tokenizer, parser, text, None, HERMES_ID) == (content, calls)


# ---- minimax_m2 ------------------------------------------------------------------------

MM_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "ratio": {"type": "number"}, "metric": {"type": "boolean"},
            "opts": {"type": "object"}, "ids": {"type": "array", "items": {"type": "integer"}},
            "when": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
            "code": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
            "note": {"type": ["null", "string"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]
MM_TEXT = (
    "I'll look that up.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n"
    '<parameter name="city">São Paulo</parameter>\n<parameter name="days">5</parameter>\n'
    '<parameter name="ratio">2.50</parameter>\n<parameter name="metric">True</parameter>\n'
    '<parameter name="opts">{"a": [1, 2]}</parameter>\n<parameter name="ids">[3, 4]</parameter>\n'
    '<parameter name="when">12</parameter>\n<parameter name="code">007</parameter>\n'
    '<parameter name="note">null</parameter>\n<parameter name="extra">\nfree text\n</parameter>\n'
    "</invoke>\n<invoke name='get_time'>\n<parameter name=zone>CET</parameter>\n</invoke>\n"
    "</minimax:tool_call>\nignored\n<minimax:tool_call>\n<invoke name=get_time></invoke>\n"
    '</minimax:tool_call><minimax:tool_call><invoke name="get_time">'
    '<parameter name="zone">UT')


def test_minimax_m2_several_calls_coercion_all_chunkings(smollm_tokenizer: Any) -> None:
    parser = tool_parsers.get("minimax_m2")
    content, calls = check_all_chunkings(smollm_tokenizer, parser, MM_TEXT, MM_TOOLS, MINIMAX_ID)
    assert content == "I'll look that up.\n"
    assert calls == [
        ("get_weather", '{"city": "São Paulo", "days": 5, "ratio": 2.5, "metric": true, '
                        '"opts": {"a": [1, 2]}, "ids": [3, 4], "when": 12, "code": "007", '
                        '"note": null, "extra": "free text"}'),
        ("get_time", '{"zone": "CET"}'),
        ("get_time", "{}"),
        ("get_time", "{}"),  # cut off inside a parameter: that parameter is dropped
    ]
    assert tool_parsers.get("minimax_m2").needs_special_tokens


@pytest.mark.parametrize("raw,schema,expected", [
    ("5", {"type": "integer"}, 5),
    ("5.5", {"type": "integer"}, 5.5),  # not an integer: JSON fallback
    ("-3", {"type": "number"}, -3),
    ("2.25", {"type": "number"}, 2.25),
    ("inf", {"type": "number"}, "inf"),
    ("yes", {"type": "boolean"}, True),
    ("Off", {"type": "boolean"}, False),
    ("maybe", {"type": "boolean"}, "maybe"),
    ('{"a": 1}', {"type": "object"}, {"a": 1}),
    ("[1]", {"type": "object"}, [1]),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("NULL", {"type": "string"}, None),
    ("nil", {"type": ["null", "string"]}, None),
    (" 42 ", None, "42"),
    ("\nline one\nline two\n", {"type": "string"}, "line one\nline two"),
    ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
    ("7", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "7"),
    ("x", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, "x"),
    ("true", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True),
    ("3", {"enum": [1, 2, 3]}, 3),
    ("8", {"type": "weird"}, 8),
])
def test_coerce(raw: str, schema: Any, expected: Any) -> None:
    value = coerce(raw, schema)
    assert value == expected and type(value) is type(expected)


def test_schema_types_order() -> None:
    schema = {"type": ["string", "null"], "anyOf": [{"type": "integer"},
                                                   {"oneOf": [{"type": "number"}]}],
              "allOf": [{"type": "string"}]}
    assert schema_types(schema) == ["string", "null", "integer", "number"]
    assert schema_types({"enum": ["a", 1, True]}) == ["string", "integer", "boolean"]
    assert schema_types(None) == []


# ---- tool_choice required / named -------------------------------------------------------

def test_required_array_all_chunkings(smollm_tokenizer: Any) -> None:
    text = ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, '
            '{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": '
            '{"zone": "C')
    for group in (1, 3, 10_000):
        stream = RequiredToolStream()
        pieces = token_pieces(smollm_tokenizer, text, group)
        content, calls = assemble([stream.feed(p) for p in pieces] + [stream.finish()])
        assert content is None
        assert [(c.name, c.arguments) for c in calls] == [
            ("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}"),
            ("get_time", '{"zone": "C"}')]
    stream = RequiredToolStream()
    assert assemble([stream.feed("Sorry, "), stream.feed("no."), stream.finish()]) == (
        "Sorry, no.", [])


def test_named_stream() -> None:
    stream = NamedToolStream("get_weather")
    deltas = [stream.feed('{"city": '), stream.feed('"Paris"}'), stream.finish()]
    content, calls = assemble(deltas)
    assert content is None and len(calls) == 1 and HERMES_ID.match(calls[0].id)
    assert (calls[0].name, calls[0].arguments) == ("get_weather", '{"city": "Paris"}')
    assert deltas[0].tool_calls[0].to_openai() == {
        "index": 0, "id": calls[0].id, "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": '}}
    assert deltas[1].tool_calls[0].to_openai() == {
        "index": 0, "function": {"arguments": '"Paris"}'}}


# ---- partial JSON and the registry -------------------------------------------------------

def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([0, -17, 123456, 1.5, -0.25, 1e20, 2.5e-7])
    if kind == 1:
        return rng.choice([True, False, None])
    if kind in (2, 3):
        return "".join(rng.choice('ab "\\/\n\té😀{}<>,:') for _ in range(rng.randrange(6)))
    if kind == 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {"k" + str(i) + rng.choice(["", "é", '"']): _random_value(rng, depth + 1)
            for i in range(rng.randrange(4))}


def test_partial_json_prefixes_grow_and_start_the_final_text() -> None:
    rng = random.Random(0)
    for _ in range(300):
        value = {"v": _random_value(rng)}
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 1]), separators=rng.choice([None, (",", ":")]))
        final = json.dumps(value, ensure_ascii=False)
        node, end = parse_partial(text + "\n</tool_call>")
        assert node is not None and node.complete and node.render() == final
        assert end == len(text)
        prev = ""
        for i in range(len(text) + 1):
            node, _ = parse_partial(text[:i])
            prefix = node.prefix() if node else ""
            assert prefix.startswith(prev) and final.startswith(prefix)
            if node is not None:
                json.loads(node.render())
            prev = prefix


def test_registry() -> None:
    assert tool_parsers.names() == ["hermes", "minimax_m2"]
    assert tool_parsers.get("hermes").name == "hermes"
    with pytest.raises(KeyError, match="known: hermes, minimax_m2"):
        tool_parsers.get("nope")


def test_delta_merging() -> None:
    out = ToolDelta()
    out.add_call(ToolCallDelta(0, "id0", "f"))
    out.add_call(ToolCallDelta(0, arguments="{"))
    out.add_call(ToolCallDelta(0, arguments="}"))
    out.add_call(ToolCallDelta(1, "id1", "g", "{}"))
    assert [(d.index, d.id, d.name, d.arguments) for d in out.tool_calls] == [
        (0, "id0", "f", "{}"), (1, "id1", "g", "{}")]
