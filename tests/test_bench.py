"""`sous bench serve`: SSE timing on canned streams, figures, and a run against `sous serve`."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

from conftest import BUNDLED_GGUF, bundled_model_dir
from serve_process import sous_serve
from sous.bench.client import (
    RequestResult,
    Target,
    make_client,
    normalize_base_url,
    stream_request,
)
from sous.bench.prompts import make_prompts
from sous.bench.serve import main as bench_main
from sous.bench.stats import distribution, percentile, summarize_level

LEVEL_KEYS = {"concurrency", "num_requests", "duration_s", "completed", "failed",
              "output_tokens", "output_tok_per_s", "request_per_s", "ttft_ms", "tpot_ms",
              "itl_ms", "e2e_ms"}


def _sse(events: list[dict | str]) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n"
                    for e in events)


Handler = Callable[[str, dict], tuple[int, bytes]]


def _run(target: Target, handler: Handler) -> RequestResult:
    """`stream_request` against a real local HTTP server (aiohttp) that answers each POST
    with `handler(path, json_body) -> (status, body)`, the body sent in 7-byte writes so
    that SSE lines arrive split across reads."""
    async def answer(request: web.Request) -> web.StreamResponse:
        status, body = handler(request.path, await request.json())
        sse = body.startswith(b"data:")
        resp = web.StreamResponse(status=status, headers={
            "Content-Type": "text/event-stream" if sse else "application/json"})
        await resp.prepare(request)
        for i in range(0, len(body), 7):
            await resp.write(body[i:i + 7])
        await resp.write_eof()
        return resp

    async def go() -> RequestResult:
        app = web.Application()
        app.router.add_post("/{tail:.*}", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            async with make_client(base, None, 1) as client:
                return await stream_request(client, replace(target, base_url=base), "hello")
        finally:
            await runner.cleanup()
    return asyncio.run(go())


def test_chat_stream_with_usage() -> None:
    seen: list[tuple[str, dict]] = []

    def handler(path: str, body: dict) -> tuple[int, bytes]:
        seen.append((path, body))
        events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                  *({"choices": [{"delta": {"content": f" w{i}"}}]} for i in range(3)),
                  {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}},
                  "[DONE]"]
        return 200, _sse(events)

    r = _run(Target("http://x", "m", max_tokens=4), handler)
    assert r.ok and r.output_tokens == 4 and r.prompt_tokens == 9 and r.text == " w0 w1 w2"
    assert r.ttft_s is not None and len(r.itl_s) == 2 and r.tpot_s is not None
    path, body = seen[0]
    assert path == "/v1/chat/completions"
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["max_tokens"] == 4
    assert body["messages"] == [{"role": "user", "content": "hello"}]


def test_completions_stream_counts_chunks_without_usage() -> None:
    def handler(path: str, body: dict) -> tuple[int, bytes]:
        assert path == "/v1/completions" and body["prompt"] == "hello"
        return 200, _sse([{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, "[DONE]"])

    r = _run(Target("http://x", "m", endpoint="completions", ignore_eos=False), handler)
    assert r.ok and r.output_tokens == 2 and r.text == "ab"


def test_http_error_stream_error_and_non_streamed() -> None:
    r = _run(Target("http://x", "m"), lambda path, body: (404, b'{"error": "nope"}'))
    assert not r.ok and r.error is not None and "HTTP 404" in r.error and "nope" in r.error

    r = _run(Target("http://x", "m"), lambda path, body: (200, _sse(
        [{"choices": [{"delta": {"content": "a"}}]}, {"error": {"message": "boom"}}])))
    assert not r.ok and r.error is not None and "boom" in r.error

    def whole(path: str, body: dict) -> tuple[int, bytes]:
        assert "stream_options" not in body
        return 200, json.dumps({"choices": [{"message": {"content": "hi"}}],
                                "usage": {"prompt_tokens": 3, "completion_tokens": 5}}).encode()

    r = _run(Target("http://x", "m", stream=False), whole)
    assert r.ok and r.output_tokens == 5 and r.text == "hi" and r.ttft_s is None


def test_no_server_is_an_error_result() -> None:
    """Nothing listening: `ok=False` with the connection error, no exception."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()

    async def go() -> RequestResult:
        async with make_client(base, None, 1) as client:
            return await stream_request(client, Target(base, "m"), "hello")
    r = asyncio.run(go())
    assert not r.ok and r.error is not None and "Connect" in r.error


def test_figures() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    assert distribution([]) == {"p50": None, "p99": None, "mean": None}
    assert distribution([0.001, 0.003])["mean"] == 2.0
    ok = RequestResult(True, e2e_s=1.0, ttft_s=0.2, itl_s=[0.1] * 8, output_tokens=9)
    assert ok.tpot_s == pytest.approx(0.1)
    level = summarize_level(4, [ok, RequestResult(False, 0.5, error="boom")], duration_s=2.0)
    assert set(level) >= LEVEL_KEYS
    assert (level["completed"], level["failed"], level["output_tokens"]) == (1, 1, 9)
    assert level["output_tok_per_s"] == 4.5 and level["errors"] == ["boom"]


def test_prompts_and_urls() -> None:
    a = make_prompts(20, seed=1)
    assert a == make_prompts(20, seed=1) and len(set(a)) == 20 and a != make_prompts(20, seed=2)
    assert all(p.startswith("Write a long essay about") for p in a)
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/", "h:1"):
        assert normalize_base_url(url) == "http://h:1"


# ------------------------------------------------------------ against a real `sous serve`


def _model_args(tmp_path: Path) -> list[str]:
    """A tiny random Llama when the fixture module exists, else the bundled model."""
    try:
        from tiny_models import make_tiny_llama  # type: ignore[import-not-found]
    except ImportError:
        return []
    return [str(make_tiny_llama(tmp_path))]


@pytest.fixture(scope="module")
def sous_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("bench-server")
    args = [*_model_args(tmp), "--max-model-len", "512", "--kv-cache-memory-bytes", "64MiB"]
    with sous_serve(args, tmp / "server.log") as url:
        yield url


@pytest.mark.parametrize("base", ["{url}", "{url}/v1"])
def test_bench_serve_against_sous(sous_server: str, base: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "bench.json"
    rc = bench_main(["--base-url", base.format(url=sous_server), "--concurrency", "1,4",
                     "--max-tokens", "8", "--num-prompts", "4", "--output", str(out_file)])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    assert report == json.loads(out_file.read_text())
    assert {"base_url", "model", "endpoint", "max_tokens", "results"} <= set(report)
    assert report["base_url"] == sous_server and report["endpoint"] == "chat"
    assert report["warmup"]["ok"]
    assert [level["concurrency"] for level in report["results"]] == [1, 4]
    for level in report["results"]:
        assert set(level) >= LEVEL_KEYS
        assert level["num_requests"] == 4 and level["completed"] == 4 and level["failed"] == 0
        assert level["output_tokens"] == 8 * level["num_requests"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(level[key]) == {"p50", "p99", "mean"} and level[key]["p50"] > 0


def test_peers_sous_offline_runner_on_a_small_job(tmp_path: Path, smollm_tokenizer) -> None:
    """benchmarks/peers/sous_run.py (the `sous-offline` row of `make bench-peers`) on a job of
    benchmarks/peers/job.py's shape: every prompt gets max_tokens, and the result has the
    shape peers.py reads."""
    prompts = [smollm_tokenizer.encode(p) for p in make_prompts(3, seed=7)]
    job = {"t0": time.time(), "model_dir": str(bundled_model_dir() / BUNDLED_GGUF),
           "max_tokens": 6, "single_repeats": 2, "kv_gib": 0.25, "single": prompts[0],
           "levels": {"2": [prompts[1:], prompts[:2]]}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    runner = Path(__file__).resolve().parents[1] / "benchmarks/peers/sous_run.py"
    proc = subprocess.run([sys.executable, str(runner), str(tmp_path / "job.json")],
                          capture_output=True, text=True, timeout=300, cwd=runner.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["all_full_length"] and len(result["single_runs"]) == 2
    level = result["levels"]["2"]
    assert len(level["runs"]) == 2 and level["tok_per_s"] > 0
    assert level["ttft_ms"]["p50"] > 0 and result["ready_s"] > 0
    assert len(result["sample_ids"]) == 6
