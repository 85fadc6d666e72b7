"""Reasoning parsers (deepseek_r1, deepseek_v3, minimax_m2, minimax_m2_append_think) and the
per-choice chat output parser (reasoning first, then tool calls in the content), fed whole,
token by token and three tokens at a time with the bundled SmolLM2 tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from sous.server import reasoning
from sous.server.tool_parsers.base import ToolDelta, assemble
from sous.server.tool_parsers.chat_output import ChatParsing
from text_pieces import token_pieces


def split_all_ways(tok: Any, name: str, text: str, kwargs: dict | None = None,
                   ) -> tuple[str | None, str | None]:
    parser = reasoning.get(name)
    whole = parser.split(text, kwargs)
    for group in (1, 3):
        stream = parser.stream(kwargs)
        parts = [stream.feed(p) for p in token_pieces(tok, text, group)] + [stream.finish()]
        joined = ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None)
        assert joined == whole, (group, joined, whole)
    return whole


THINK = "<think>\nThe user asks about Paris. </think>\n\nParis is sunny."
NO_OPEN = "The user asks about Paris. </think>Paris is sunny."
UNCLOSED = "<think>Still thinking about </thi"


@pytest.mark.parametrize("name,text,expected", [
    ("deepseek_r1", THINK, ("\nThe user asks about Paris. ", "\n\nParis is sunny.")),
    ("deepseek_r1", NO_OPEN, ("The user asks about Paris. ", "Paris is sunny.")),
    ("deepseek_r1", UNCLOSED, ("Still thinking about </thi", None)),
    ("deepseek_r1", "</think>Only content", (None, "Only content")),
    ("deepseek_r1", "thinking <b>bold</b> text", ("thinking <b>bold</b> text", None)),
    ("minimax_m2", NO_OPEN, ("The user asks about Paris. ", "Paris is sunny.")),
    ("minimax_m2", THINK, ("\nThe user asks about Paris. ", "\n\nParis is sunny.")),
    ("minimax_m2", "a<think>b</think>c</think>d", ("ab", "c</think>d")),
    ("minimax_m2_append_think", NO_OPEN, (None, "<think>" + NO_OPEN)),
    ("minimax_m2_append_think", "", (None, "<think>")),
    ("deepseek_v3", THINK, (None, THINK)),
])
def test_split(smollm_tokenizer: Any, name: str, text: str,
               expected: tuple[str | None, str | None]) -> None:
    assert split_all_ways(smollm_tokenizer, name, text) == expected


@pytest.mark.parametrize("kwargs,expected", [
    (None, (None, NO_OPEN)),
    ({"thinking": False}, (None, NO_OPEN)),
    ({"thinking": True}, ("The user asks about Paris. ", "Paris is sunny.")),
    ({"enable_thinking": True}, ("The user asks about Paris. ", "Paris is sunny.")),
])
def test_deepseek_v3_follows_chat_template_kwargs(smollm_tokenizer: Any, kwargs: dict | None,
                                                  expected: tuple) -> None:
    assert split_all_ways(smollm_tokenizer, "deepseek_v3", NO_OPEN, kwargs) == expected


def test_append_think_prefixes_the_first_piece() -> None:
    stream = reasoning.get("minimax_m2_append_think").stream()
    assert stream.feed("a") == ("", "<think>a")
    assert stream.feed("b</think>") == ("", "b</think>")
    assert stream.finish() == ("", "")


def test_reasoning_ended() -> None:
    r1 = reasoning.get("deepseek_r1")
    assert not r1.reasoning_ended("thinking")
    assert r1.reasoning_ended("x</think>y")
    assert not r1.reasoning_ended("x</think><think>y")
    v3 = reasoning.get("deepseek_v3")
    assert v3.reasoning_ended("thinking") and not v3.reasoning_ended("t", {"thinking": True})
    assert reasoning.get("minimax_m2_append_think").reasoning_ended("a</think>")


def test_registry() -> None:
    assert reasoning.names() == ["deepseek_r1", "deepseek_v3", "minimax_m2",
                                 "minimax_m2_append_think"]
    with pytest.raises(KeyError, match="known: deepseek_r1, deepseek_v3"):
        reasoning.get("qwen3")


# ---- reasoning + tool calls in one choice ------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


@pytest.mark.parametrize("reasoning_name,tool_parser,text,expected", [
    ("deepseek_r1", "hermes",
     'Need weather.</think>Sure.<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": 2}}\n</tool_call>',
     ("Need weather.", "Sure.", [("get_weather", '{"city": "Paris", "days": 2}')])),
    ("deepseek_r1", "hermes",  # a call inside the thinking is reasoning, not a call
     '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call></think>Done.',
     ('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', "Done.", [])),
    ("minimax_m2", "minimax_m2",
     "Think.</think>\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter "
     'name="city">Oslo</parameter>\n<parameter name="days">4</parameter>\n</invoke>\n'
     "</minimax:tool_call>",
     ("Think.", "\n", [("get_weather", '{"city": "Oslo", "days": 4}')])),
    (None, "hermes", "No calls here.", (None, "No calls here.", [])),
])
def test_chat_output_reasoning_then_tools(smollm_tokenizer: Any, reasoning_name: str | None,
                                          tool_parser: str, text: str, expected: tuple) -> None:
    parsing = ChatParsing.for_request(reasoning_name, tool_parser, "auto", TOOLS, None)
    assert parsing is not None
    full, called = parsing.parse(text)
    got = (full.reasoning, full.content, [(c.name, c.arguments) for c in full.tool_calls])
    assert got == expected and called == bool(expected[2])
    assert parsing.finish_reason("stop", called) == ("tool_calls" if called else "stop")
    for group in (1, 3):
        parser = parsing.new()
        deltas = [parser.feed(p) for p in token_pieces(smollm_tokenizer, text, group)]
        deltas.append(parser.finish())
        content, calls = assemble([ToolDelta(d.content, d.tool_calls) for d in deltas])
        streamed = ("".join(d.reasoning for d in deltas) or None, content,
                    [(c.name, c.arguments) for c in calls])
        assert streamed == got
        for d in deltas:
            delta = d.to_openai()
            assert delta.get("reasoning") == delta.get("reasoning_content")


def test_chat_parsing_what_applies() -> None:
    assert ChatParsing.for_request(None, "hermes", "none", TOOLS, None) is None
    assert ChatParsing.for_request(None, None, "auto", None, None) is None
    only_reasoning = ChatParsing.for_request("deepseek_r1", "hermes", "none", TOOLS, None)
    assert only_reasoning is not None and only_reasoning.tool_parser is None
    named = ChatParsing.for_request(None, None, {"type": "function", "function": {
        "name": "get_weather"}}, TOOLS, None)
    assert named is not None and named.named
    full, called = named.parse('{"city": "Rome"}')
    assert full.content == "" and called and full.tool_calls[0].arguments == '{"city": "Rome"}'
    assert named.finish_reason("stop", called) == "stop"
    required = ChatParsing.for_request(None, None, "required", TOOLS, None)
    assert required is not None
    full, called = required.parse('[{"name": "get_weather", "parameters": {"days": 1}}]')
    assert [(c.name, c.arguments) for c in full.tool_calls] == [("get_weather", '{"days": 1}')]
    assert required.finish_reason("stop", called) == "tool_calls"
    assert required.finish_reason("length", called) == "length"


@pytest.mark.parametrize("text, ended", [
    ("<think>plan</think>{\"a\": 1}", True),
    ("<think>still planning", False),
    ("opened by the template</think>answer", True),
    ("<think>x</think> more <think>again", False),
    ("no tags at all", False),
])
def test_token_level_reasoning_end(smollm_tokenizer: Any, text: str, ended: bool) -> None:
    """What structured output waits for: found on the token ids of the output."""
    from sous.server.reasoning.token_end import reasoning_end_detector

    detector = reasoning_end_detector(reasoning.get("deepseek_r1"), smollm_tokenizer)
    assert detector is not None
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    assert detector.is_reasoning_end(ids) is ended
    assert reasoning_end_detector(reasoning.get("deepseek_v3"), smollm_tokenizer) is None
    assert reasoning_end_detector(reasoning.get("minimax_m2_append_think"),
                                  smollm_tokenizer) is None
