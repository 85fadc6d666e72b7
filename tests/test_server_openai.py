"""The OpenAI-compatible server over real HTTP with the official `openai` client, on the real
engine and the bundled SmolLM2 (float32, small max_tokens so the module stays quick)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from sous.config.server import ServerConfig
from sous.server.handle import ServerHandle

MAX_MODEL_LEN = 512
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from sous.config.engine_args import engine_config_from_kwargs
    from sous.engine.async_llm import AsyncLLM

    config = engine_config_from_kwargs(model=None, dtype="float32", max_model_len=MAX_MODEL_LEN,
                                       kv_cache_memory_bytes=256 << 20, max_num_seqs=64)
    eng = AsyncLLM.from_config(config)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[ServerHandle]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SERVER_DEV_MODE", "1")  # /reset_prefix_cache, as vLLM's dev mode
        handle = ServerHandle(engine)
    with handle:
        yield handle


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(engine: Any) -> str:
    return engine.served_model_name


def wait_idle(engine: Any, timeout: float = 15.0) -> Any:
    """Poll engine stats until nothing runs and no KV block is in use."""
    deadline = time.monotonic() + timeout
    stats = engine.get_stats()
    while time.monotonic() < deadline:
        stats = engine.get_stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
            return stats
        time.sleep(0.05)
    return stats


# ---- plain endpoints -------------------------------------------------------------------

def test_models_health_version(server: ServerHandle, client: openai.OpenAI, model: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    card = models[0].model_dump()
    assert card["object"] == "model" and card["owned_by"] == "sous"
    assert card["max_model_len"] == MAX_MODEL_LEN and card["root"] == model
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.content == b""
    assert "version" in httpx.get(server.url + "/version").json()


# ---- completions -----------------------------------------------------------------------

def test_completion_greedy_deterministic_with_usage(client: openai.OpenAI, engine: Any,
                                                    model: str) -> None:
    a = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    b = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert a.id.startswith("cmpl-") and a.object == "text_completion" and a.model == model
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text
    assert a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 8
    assert a.usage.prompt_tokens == len(engine.tokenizer.encode(PROMPT))
    assert a.usage.total_tokens == a.usage.prompt_tokens + 8
    assert a.usage.prompt_tokens_details is not None
    assert a.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_with_usage(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0.0)
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0.0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert all(c.id == chunks[0].id for c in chunks)


def test_completion_n2_token_prompts_and_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt=[[1, 2, 3], [4, 5, 6]], n=2,
                                    max_tokens=4, temperature=1.0, seed=7, logprobs=2,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 16 and out.usage.prompt_tokens == 6
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert "".join(lp.tokens) == c.text
        assert lp.text_offset[0] == 0 and all(x <= 0.0 for x in lp.token_logprobs)
        assert all(2 <= len(t) <= 3 for t in lp.top_logprobs)


def test_stop_string(client: openai.OpenAI, model: str) -> None:
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    words = [w for w in text.split() if w.isalpha()]
    assert len(words) >= 2, text
    stop = words[1]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0.0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_dump()["stop_reason"] == stop
    assert out.choices[0].text == text[:text.index(stop)]


# ---- chat ------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]


def test_chat_and_stream_match(client: openai.OpenAI, model: str) -> None:
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                          temperature=0.0)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.usage.completion_tokens <= 8 and full.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0.0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens)
    assert usage.prompt_tokens_details.cached_tokens > 0  # same prompt again: prefix cache
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == full.choices[0].finish_reason and not any(finals[:-1])


def test_chat_logprobs_and_max_completion_tokens(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0.0,
                                         max_completion_tokens=5, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode())
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)  # greedy


def test_chat_stream_continuous_usage(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    assert all(c.usage is not None for c in chunks)
    assert chunks[-1].usage.completion_tokens == 4


# ---- errors ----------------------------------------------------------------------------

def post(server: ServerHandle, path: str, **kw: Any) -> httpx.Response:
    kw.setdefault("timeout", 30.0)
    return httpx.post(server.url + path, **kw)


def assert_error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["message"], str) and "type" in err
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err


def test_prompt_too_long(server: ServerHandle) -> None:
    ids = [1000] * (MAX_MODEL_LEN + 5)
    r = post(server, "/v1/completions", json={"prompt": ids, "max_tokens": 1})
    assert_error(r, 400, str(MAX_MODEL_LEN), str(MAX_MODEL_LEN + 5))
    r = post(server, "/v1/chat/completions",
             json={"messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]})
    assert_error(r, 400, str(MAX_MODEL_LEN), "input tokens")


def test_max_tokens_beyond_room(server: ServerHandle) -> None:
    r = post(server, "/v1/completions", json={"prompt": [1000] * 100, "max_tokens": 500})
    err = assert_error(r, 400, str(MAX_MODEL_LEN), "600", "100", "500")
    assert err["type"] == "BadRequestError"


def test_unknown_model_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert "The model `nope` does not exist." in str(info.value)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"prompt": "x", '),
    ("/v1/chat/completions", b"not json"),
    ("/v1/completions", b""),
])
def test_malformed_json_400(server: ServerHandle, path: str, body: bytes) -> None:
    assert_error(post(server, path, content=body,
                      headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": 5}),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}),
    ("/v1/completions", {"max_tokens": 3}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": "two"}),
])
def test_wrong_types_400(server: ServerHandle, path: str, body: dict) -> None:
    assert_error(post(server, path, json=body), 400)


def test_bad_sampling_values_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt="x", max_tokens=2, temperature=-0.5)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=model, messages=MESSAGES, top_p=0.0)
    with pytest.raises(openai.BadRequestError, match="objx"):
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "objx"}}})


def test_api_key_401(engine: Any) -> None:
    with ServerHandle(engine, ServerConfig(api_key="sk-test", uvicorn_log_level="warning")) as s:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        bad = openai.OpenAI(base_url=s.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=s.base_url, api_key="sk-test", max_retries=0)
        assert good.models.list().data
        assert httpx.get(s.url + "/health").status_code == 200


# ---- disconnects, load, metrics --------------------------------------------------------

def test_disconnect_mid_stream_frees_blocks(server: ServerHandle, engine: Any) -> None:
    body = {"prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:  # still inside the iteration: the stream is open
                assert engine.get_stats().num_running == 1
                break
    stats = wait_idle(engine)
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0


def aborted_count(server: ServerHandle) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no abort counter")


def test_disconnect_non_streaming_aborts(server: ServerHandle, engine: Any) -> None:
    before = aborted_count(server)
    body = {"messages": MESSAGES, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/chat/completions", json=body, timeout=1.0)
    stats = wait_idle(engine)
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    assert aborted_count(server) == before + 1


def test_64_concurrent_requests(server: ServerHandle, engine: Any, model: str) -> None:
    async def run() -> list[Any]:
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                                     timeout=120)
        async def one(i: int) -> Any:
            if i % 2:
                return await aclient.completions.create(
                    model=model, prompt=f"Count to {i}:", max_tokens=8,
                    extra_body={"ignore_eos": True})
            stream = await aclient.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Number {i}?"}],
                max_tokens=8, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            return [c async for c in stream][-1]
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert [r.usage.completion_tokens for r in results] == [8] * 64
    stats = wait_idle(engine)
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0


def test_metrics(server: ServerHandle, model: str) -> None:
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:request_prompt_tokens_bucket",
                 "vllm:request_generation_tokens_bucket", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert f"\n{name}{{" in text, name
    assert f'model_name="{model}"' in text
    gen = [ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total{")]
    assert float(gen[0].rsplit(" ", 1)[1]) > 0


def test_reset_prefix_cache(server: ServerHandle, client: openai.OpenAI, engine: Any,
                            model: str) -> None:
    prompt = "Tell me about the history of the printing press in Europe, " * 4
    first = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    wait_idle(engine)
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    after = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert after.usage.prompt_tokens_details.cached_tokens == 0
