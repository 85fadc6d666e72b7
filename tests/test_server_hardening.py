"""The server against bad requests and failures, over real HTTP on the real engine (bundled
SmolLM2, float32): parameter limits (seed, non-finite floats, n, body size, prompts that
cannot fit), the engine-thread boundary, a dead engine, one request's fault, admin paths."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from sous.config.server import ServerConfig
from sous.server.handle import ServerHandle

MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from sous.config.engine_args import engine_config_from_kwargs
    from sous.engine.async_llm import AsyncLLM

    config = engine_config_from_kwargs(model=None, dtype="float32", max_model_len=MAX_MODEL_LEN,
                                       kv_cache_memory_bytes=128 << 20,
                                       max_num_seqs=MAX_NUM_SEQS)
    eng = AsyncLLM.from_config(config)
    yield eng
    eng.shutdown()


def serve(engine: Any, dev_mode: bool = False, **config: Any) -> ServerHandle:
    with pytest.MonkeyPatch.context() as mp:
        if dev_mode:
            mp.setenv("VLLM_SERVER_DEV_MODE", "1")
        else:
            mp.delenv("VLLM_SERVER_DEV_MODE", raising=False)
        return ServerHandle(engine, ServerConfig(uvicorn_log_level="warning", **config))


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[ServerHandle]:
    with serve(engine) as handle:
        yield handle


def post(server: ServerHandle, path: str, **kw: Any) -> httpx.Response:
    kw.setdefault("timeout", 60.0)
    return httpx.post(server.url + path, **kw)


def assert_error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["message"], str) and err["type"]
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err


def sse_events(r: httpx.Response) -> list[Any]:
    """The `data:` payloads of a finished SSE response (JSON, or the string "[DONE]")."""
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- the engine thread boundary ------------------------------------------------------------

def test_engine_core_is_only_called_on_the_engine_thread(
        server: ServerHandle, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests (valid and invalid) and /metrics scrapes never call EngineCore from the
    server's thread: validation happens on the engine thread, stats are a snapshot."""
    core = engine.core
    seen: dict[str, set[str]] = {}
    for name in ("validate", "add_request", "abort", "stats", "step",
                 "has_unfinished_requests"):
        method = getattr(core, name)

        def spy(*a: Any, _name: str = name, _method: Any = method, **kw: Any) -> Any:
            seen.setdefault(_name, set()).add(threading.current_thread().name)
            return _method(*a, **kw)

        monkeypatch.setattr(core, name, spy)
    assert post(server, "/v1/chat/completions", json=CHAT).status_code == 200
    assert_error(post(server, "/v1/completions", json={"prompt": [1] * 600, "max_tokens": 1}),
                 400)
    assert_error(post(server, "/v1/completions", json={"prompt": [49152], "max_tokens": 1}),
                 400, "out of vocabulary")
    assert "vllm:num_requests_running" in httpx.get(server.url + "/metrics").text
    assert {"validate", "add_request", "stats", "step"} <= set(seen)
    assert set().union(*seen.values()) == {"sous-engine"}, seen


def test_a_batched_steps_outputs_are_passed_on_before_the_next_step(
        server: ServerHandle, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the step's threads fill the machine, a step with outputs for several requests is
    consumed by the server's event loop before the engine starts the next step (so that work
    does not preempt a step thread): every such output is taken by its consumer before the
    next step begins."""
    import sous.engine.async_llm as async_llm
    from sous.engine.cpu_threads import allowed_cpus

    if torch.get_num_threads() < len(allowed_cpus()):
        pytest.skip("a CPU is left to the front end: outputs overlap the next step")
    monkeypatch.setattr(async_llm, "FRONT_END_WAIT_S", 30.0)  # never the timeout, even loaded
    step_starts: list[float] = []
    made_by: dict[int, int] = {}  # id(output) -> the step (index into step_starts) it came from
    batched: set[int] = set()  # steps with outputs for several requests
    taken: list[tuple[int, float]] = []  # (step, when its output was taken)
    real_flush, real_step = engine._flush_outputs, engine.core.step
    real_get = async_llm.OutputCollector.get

    def flush(wait: bool) -> None:
        k = len(step_starts) - 1
        for _, item in engine._outbox.items:
            made_by[id(item)] = k
        if len(engine._outbox.items) > 1:
            batched.add(k)
        real_flush(wait)

    def step() -> int:
        step_starts.append(time.perf_counter())
        return real_step()

    async def get(collector: Any) -> Any:
        out = await real_get(collector)
        if id(out) in made_by:
            taken.append((made_by[id(out)], time.perf_counter()))
        return out

    monkeypatch.setattr(engine, "_flush_outputs", flush)
    monkeypatch.setattr(engine.core, "step", step)
    monkeypatch.setattr(async_llm.OutputCollector, "get", get)
    body = {**CHAT, "max_tokens": 12, "ignore_eos": True, "stream": True}

    def one(_: int) -> int:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          timeout=60) as r:
            return sum(line.startswith("data: {") for line in r.iter_lines())

    with ThreadPoolExecutor(4) as pool:
        assert all(n >= 12 for n in pool.map(one, range(4)))
    checked = [(k, t) for k, t in taken if k in batched and k + 1 < len(step_starts)]
    assert len(checked) >= 16
    late = [(k, t - step_starts[k + 1]) for k, t in checked if t > step_starts[k + 1]]
    assert not late, late


# ---- parameter limits -----------------------------------------------------------------------

@pytest.mark.parametrize("seed", [2**64, 2**70, -(2**63) - 1])
def test_seed_outside_int64_is_400(server: ServerHandle, seed: int) -> None:
    r = post(server, "/v1/chat/completions", json={**CHAT, "temperature": 1.0, "seed": seed})
    assert_error(r, 400, "seed")
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("seed", [-(2**63), -1, 2**63 - 1])
def test_int64_seeds_are_served(server: ServerHandle, seed: int) -> None:
    """The whole int64 range, n=2 included (the second sequence is seeded seed + 1, wrapped
    into int64): served, and reproducible."""
    body = {**CHAT, "temperature": 1.0, "seed": seed, "n": 2}
    texts = []
    for _ in range(2):
        r = post(server, "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        texts.append([c["message"]["content"] for c in r.json()["choices"]])
    assert texts[0] == texts[1] and len(texts[0]) == 2


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", ["1e309", "-1e309", "Infinity", "NaN"])
def test_non_finite_floats_are_400(server: ServerHandle, field: str, value: str) -> None:
    for path, body in [("/v1/chat/completions", CHAT), ("/v1/completions",
                                                         {"prompt": "x", "max_tokens": 2})]:
        raw = json.dumps(body)[:-1] + f', "{field}": {value}}}'
        r = post(server, path, content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, field)


def test_n_is_capped_by_max_num_seqs(server: ServerHandle) -> None:
    assert_error(post(server, "/v1/chat/completions", json={**CHAT, "n": 1_000_000}), 400,
                 f"at most {MAX_NUM_SEQS}", "--max-num-seqs")
    assert_error(post(server, "/v1/completions",
                      json={"prompt": "x", "max_tokens": 1, "n": MAX_NUM_SEQS + 1}), 400, "n")
    r = post(server, "/v1/completions",
             json={"prompt": ["a", "b", "c"], "max_tokens": 1, "n": MAX_NUM_SEQS // 2})
    assert_error(r, 400, f"{3 * MAX_NUM_SEQS // 2} sequences", "Split")
    r = post(server, "/v1/completions",
             json={"prompt": ["a", "b"], "max_tokens": 1, "n": MAX_NUM_SEQS // 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_NUM_SEQS


def test_body_over_the_limit_is_413(engine: Any) -> None:
    limit = 64 << 10
    with serve(engine, max_request_body_bytes=limit) as s:
        big = {"prompt": "x" * (limit + 10), "max_tokens": 1}
        assert_error(httpx.post(s.url + "/v1/completions", json=big, timeout=30), 413,
                     str(limit), "--max-request-body-bytes")

        def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(limit // 4096 + 2):
                yield b"y" * 4096
            yield b'", "max_tokens": 1}'

        r = httpx.post(s.url + "/v1/completions", content=chunked(), timeout=30,
                       headers={"content-type": "application/json"})
        assert_error(r, 413, str(limit))
        small = httpx.post(s.url + "/v1/completions", timeout=30,
                           json={"prompt": "x" * (limit // 2), "max_tokens": 1})
        assert_error(small, 400, "maximum context length")
        assert httpx.get(s.url + "/health").status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_text_that_cannot_fit_is_rejected_before_tokenizing(server: ServerHandle,
                                                            path: str) -> None:
    """A 4 MB text: the lower bound on its token count (bytes / longest token) already
    exceeds max_model_len, so the 400 says "at least" (the exact count would take the
    tokenizer seconds)."""
    text = "hello world " * 350_000
    body = ({"prompt": text, "max_tokens": 1} if path == "/v1/completions" else
            {"messages": [{"role": "user", "content": text}]})
    assert_error(post(server, path, json=body), 400, f"maximum context length is "
                 f"{MAX_MODEL_LEN} tokens", "at least")


def test_prompt_filling_max_model_len_same_rule_as_offline(server: ServerHandle) -> None:
    """max_tokens unset and no room left: 400 with the message the offline LLM raises."""
    r = post(server, "/v1/completions", json={"prompt": [1000] * MAX_MODEL_LEN,
                                              "max_tokens": None})
    assert_error(r, 400, f"your request has {MAX_MODEL_LEN} input tokens")
    r = post(server, "/v1/completions", json={"prompt": [1000] * (MAX_MODEL_LEN - 1),
                                              "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


# ---- failures -------------------------------------------------------------------------------

def test_dead_engine_fails_fast_with_503(engine: Any) -> None:
    """An engine-wide fault ends the step loop: the request in flight, /reset_prefix_cache
    (which used to wait forever) and every later call answer 503 at once; /health says 503;
    /metrics still answers."""
    from sous.engine.async_llm import AsyncLLM
    from sous.engine.core import EngineCore

    core = EngineCore(engine.core.config, loaded=engine.core.loaded)

    def broken(*args: object) -> None:
        raise RuntimeError("injected scheduler fault")

    core.scheduler.schedule = broken
    doomed = AsyncLLM(core)
    try:
        with serve(doomed, dev_mode=True) as s:
            assert httpx.get(s.url + "/health").status_code == 200
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                           timeout=10)
            assert_error(r, 503, "injected scheduler fault")
            assert httpx.get(s.url + "/health").status_code == 503
            assert_error(httpx.post(s.url + "/reset_prefix_cache", timeout=10), 503)
            assert_error(httpx.post(s.url + "/v1/chat/completions", json=CHAT, timeout=10), 503)
            assert_error(httpx.get(s.url + "/v1/models", timeout=10), 503)
            assert httpx.get(s.url + "/metrics", timeout=10).status_code == 200
    finally:
        doomed.shutdown()


class _FaultyModel:
    """Fault injection: the model, except that a forward pass whose input ids contain
    `poison` raises (as a kernel bug triggered by one request would)."""

    def __init__(self, model: Any, poison: int) -> None:
        self._model = model
        self._poison = poison

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, ids: Any, *args: Any, **kwargs: Any) -> Any:
        if self._poison in ids.tolist():
            raise RuntimeError("injected fault")
        return self._model(ids, *args, **kwargs)


def test_one_requests_fault_ends_only_its_stream(server: ServerHandle, engine: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [[504, 3458, 282, 4649, 314] * (i + 1) for i in range(4)]
    poison = 49150
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}

    async def run(bodies: list[dict]) -> list[list[Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async def one(b: dict) -> list[Any]:
                async with client.stream("POST", "/v1/completions", json=b) as r:
                    assert r.status_code == 200
                    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                            async for line in r.aiter_lines() if line.startswith("data: ")]
            return await asyncio.gather(*(one(b) for b in bodies))

    def text(events: list[Any]) -> str:
        return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])

    expected = [text(ev) for ev in asyncio.run(run([{**body, "prompt": p} for p in prompts]))]
    monkeypatch.setattr(engine.core.runner, "model", _FaultyModel(engine.core.runner.model,
                                                                  poison))
    bodies = [{**body, "prompt": p} for p in prompts]
    bodies.insert(2, {**body, "prompt": [poison] + prompts[0]})
    results = asyncio.run(run(bodies))
    bad = results.pop(2)
    assert bad[-1] == "[DONE]" and bad[-2]["choices"][0]["finish_reason"] == "abort"
    assert [text(ev) for ev in results] == expected
    assert all(ev[-1] == "[DONE]" and ev[-2]["choices"][0]["finish_reason"] == "length"
               for ev in results)
    assert httpx.get(server.url + "/health").status_code == 200
    monkeypatch.undo()
    r = post(server, "/v1/completions", json={**body, "stream": False, "prompt": prompts[0]})
    assert r.json()["choices"][0]["text"] == expected[0]


# ---- admin paths ----------------------------------------------------------------------------

def test_admin_paths_as_vllm(engine: Any) -> None:
    """--api-key guards /v1 only (as vLLM): /metrics and /version stay open; the state-changing
    /reset_prefix_cache exists only in dev mode (VLLM_SERVER_DEV_MODE=1)."""
    with serve(engine, api_key="sk-x") as s:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/metrics").status_code == 200
        assert httpx.get(s.url + "/version").status_code == 200
        assert_error(httpx.post(s.url + "/reset_prefix_cache"), 404)
    with serve(engine, dev_mode=True, api_key="sk-x") as s:
        assert httpx.post(s.url + "/reset_prefix_cache").status_code == 200
