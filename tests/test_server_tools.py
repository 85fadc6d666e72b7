"""Tool calls and reasoning through the real server (`--enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser deepseek_r1`), the bundled SmolLM2 and the
official `openai` client.

The 135M model rarely calls a tool by itself, so the conversations are few-shot: the same
question was answered twice with a fixed reply, and greedy decoding repeats that reply
exactly (checked below), which drives the whole server path (engine -> detokenizer ->
reasoning parser -> tool parser -> OpenAI shapes) deterministically.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from sous.config.server import ServerConfig
from sous.server.handle import ServerHandle

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {
            "zone": {"type": "string"}}}}},
]
THOUGHT = "The user wants the weather."
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        "</tool_call>")
ARGS = '{"city": "Paris", "days": 3}'
Q_PARIS = "Weather in Paris for the next 3 days?"


def few_shot(reply: str, question: str = "Weather?") -> list[dict[str, str]]:
    turns: list[dict[str, str]] = []
    for _ in range(2):
        turns += [{"role": "user", "content": question},
                  {"role": "assistant", "content": reply}]
    return turns + [{"role": "user", "content": question}]


TOOL_TURN = few_shot(f"<think>{THOUGHT}</think>{CALL}")


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from sous.config.engine_args import engine_config_from_kwargs
    from sous.engine.async_llm import AsyncLLM

    config = engine_config_from_kwargs(model=None, dtype="float32", max_model_len=1024,
                                       kv_cache_memory_bytes=128 << 20, max_num_seqs=8)
    eng = AsyncLLM.from_config(config)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[openai.OpenAI]:
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes",
                          reasoning_parser="deepseek_r1", uvicorn_log_level="warning")
    with ServerHandle(engine, config) as handle:
        yield openai.OpenAI(base_url=handle.base_url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def plain(engine: Any) -> Iterator[ServerHandle]:
    """A server without tool or reasoning flags."""
    with ServerHandle(engine) as handle:
        yield handle


def create(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          temperature=0.0, **kw)


def test_auto_tool_call_non_streamed(client: openai.OpenAI) -> None:
    out = create(client, messages=TOOL_TURN, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content is None
    assert msg.model_dump()["reasoning"] == msg.model_dump()["reasoning_content"] == THOUGHT
    [call] = msg.tool_calls
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id) and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGS)
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}


def test_auto_tool_call_streamed_matches(client: openai.OpenAI) -> None:
    chunks = list(create(client, messages=TOOL_TURN, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    reasoning = "".join(d.model_dump().get("reasoning") or "" for d in deltas)
    assert reasoning == "".join(d.model_dump().get("reasoning_content") or "" for d in deltas)
    assert reasoning == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ""
    fragments = [t for d in deltas for t in (d.tool_calls or [])]
    headers = [t for t in fragments if t.id is not None]
    assert [(t.index, t.type, t.function.name) for t in headers] == [
        (0, "function", "get_weather")]
    assert all(t.function.name is None for t in fragments if t.id is None)
    assert len(fragments) > 2  # the arguments arrive in pieces
    assert "".join(t.function.arguments or "" for t in fragments) == ARGS
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "tool_calls" and not any(finals[:-1])


def test_content_before_several_calls(client: openai.OpenAI) -> None:
    reply = ("<think>Two lookups.</think>Checking.<tool_call>\n" + json.dumps(
        {"name": "get_weather", "arguments": {"city": "Oslo"}}) + "\n</tool_call>\n"
        "<tool_call>\n" + json.dumps({"name": "get_time", "arguments": {"zone": "CET"}})
        + "\n</tool_call>")
    messages = few_shot(reply, "Weather and time in Oslo?")
    full = create(client, messages=messages, tools=TOOLS, max_tokens=90)
    msg = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Checking." and msg.model_dump()["reasoning"] == "Two lookups."
    got = [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert got == [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "CET"}')]
    chunks = list(create(client, messages=messages, tools=TOOLS, max_tokens=90, stream=True))
    fragments = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    args: dict[int, str] = {}
    names = {}
    for t in fragments:
        args[t.index] = args.get(t.index, "") + (t.function.arguments or "")
        if t.id is not None:
            names[t.index] = t.function.name
    assert [(names[i], args[i]) for i in sorted(args)] == got
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Checking."


def test_tool_choice_none_keeps_text(client: openai.OpenAI) -> None:
    out = create(client, messages=TOOL_TURN, tools=TOOLS, tool_choice="none")
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "stop" and not msg.tool_calls
    assert msg.model_dump()["reasoning"] == THOUGHT and msg.content == CALL


def test_no_tools_reasoning_only(client: openai.OpenAI) -> None:
    out = create(client, messages=few_shot(f"<think>{THOUGHT}</think>Sunny.", "Weather?"))
    msg = out.choices[0].message
    assert (msg.model_dump()["reasoning"], msg.content) == (THOUGHT, "Sunny.")
    assert out.choices[0].finish_reason == "stop" and not msg.tool_calls


def test_named_and_required_tool_choice(plain: ServerHandle) -> None:
    client = openai.OpenAI(base_url=plain.base_url, api_key="x", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = create(client, messages=few_shot(ARGS, Q_PARIS), tools=TOOLS, tool_choice=named)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "stop" and msg.content == ""
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [
        ("get_weather", ARGS)]
    reply = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}])
    out = create(client, messages=few_shot(reply, Q_PARIS), tools=TOOLS,
                 tool_choice="required")
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and msg.content == ""
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [
        ("get_weather", ARGS)]
    chunks = list(create(client, messages=few_shot(reply, Q_PARIS), tools=TOOLS,
                         tool_choice="required", stream=True))
    fragments = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [t.function.name for t in fragments if t.id is not None] == ["get_weather"]
    assert "".join(t.function.arguments or "" for t in fragments) == ARGS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_history_with_tool_calls(plain: ServerHandle) -> None:
    def body(arguments: str) -> dict:
        call = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": arguments}}
        return {"messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
            "tools": TOOLS, "tool_choice": "none", "max_tokens": 1}
    url = plain.url + "/v1/chat/completions"
    assert httpx.post(url, json=body(ARGS), timeout=30).status_code == 200
    assert httpx.post(url, json=body(""), timeout=30).status_code == 200
    assert "not valid JSON" in _error(httpx.post(url, json=body("{oops"), timeout=30))


def _error(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError"
    return err["message"]


@pytest.mark.parametrize("extra,needle", [
    ({"tool_choice": "auto"}, '"auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set"),
    ({}, '"auto" tool choice requires --enable-auto-tool-choice'),
    ({"tool_choice": "sometimes"}, "Invalid value for `tool_choice`: sometimes!"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "does not match any of the specified `tools`"),
    ({"tool_choice": {"type": "function"}}, "Invalid value for `function`"),
])
def test_tool_errors_400(plain: ServerHandle, extra: dict, needle: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 2,
            **extra}
    assert needle in _error(httpx.post(plain.url + "/v1/chat/completions", json=body,
                                       timeout=30))


def test_tool_choice_without_tools_400(plain: ServerHandle) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}
    assert "When using `tool_choice`, `tools` must be set." in _error(
        httpx.post(plain.url + "/v1/chat/completions", json=body, timeout=30))


@pytest.mark.parametrize("argv,needle", [
    (["--tool-call-parser", "nope"], "choose from hermes, minimax_m2"),
    (["--reasoning-parser", "nope"],
     "choose from deepseek_r1, deepseek_v3, minimax_m2, minimax_m2_append_think"),
])
def test_startup_rejects_unknown_parsers(argv: list[str], needle: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "sous.cli", "serve", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
