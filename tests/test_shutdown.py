"""`sous serve` under SIGTERM, as a real subprocess with real streaming clients: in-flight
streams finish or end with a proper final event (finish_reason "abort", then `data: [DONE]`),
new requests get 503, no tracebacks, exit status 0; a second signal exits at once. And the
load probe (benchmarks/load_probe.py), scaled down."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from serve_process import free_port

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def serve(tmp_path: Path, *args: str) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """`sous serve` with the bundled model; yields (process, base URL, log) once ready."""
    log = tmp_path / "serve.log"
    port = free_port()
    cmd = [sys.executable, "-m", "sous.cli", "serve", "--max-model-len", "1024",
           "--port", str(port), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def stream(client: httpx.AsyncClient, max_tokens: int, flowing: asyncio.Event,
                 ) -> dict[str, Any]:
    """One streaming chat completion: its final finish_reason, whether `[DONE]` ended it,
    and how it ended (`cut` for a transport error mid-body)."""
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    finish, done, events = None, False, []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"status": r.status_code}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                flowing.set()
                events.append(line[6:])
                if line == "data: [DONE]":
                    done = True
                    continue
                for choice in json.loads(line[6:]).get("choices") or []:
                    finish = choice.get("finish_reason") or finish
    except httpx.TransportError as e:
        return {"cut": repr(e)}
    return {"finish_reason": finish, "done_last": done and events[-1] == "[DONE]"}


async def status_once_draining(client: httpx.AsyncClient, within_s: float = 10.0) -> int:
    """The status of `GET /v1/models` once the server has taken the signal (polled: on a
    loaded machine the handler may run a while after `send_signal`); -1 if it closed the
    connection instead."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            status = (await client.get("/v1/models")).status_code
        except httpx.TransportError:
            return -1
        if status != 200 or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.1)


async def streams_then_sigterm(url: str, proc: subprocess.Popen, lengths: list[int],
                               second_signal_after: float | None = None) -> tuple[list, int]:
    """Start one stream per entry of `lengths`; SIGTERM once all flow (a second one after
    `second_signal_after` s); a request sent during the drain. Returns (results, its status)."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        flowing = [asyncio.Event() for _ in lengths]
        tasks = [asyncio.ensure_future(stream(client, n, f)) for n, f in zip(lengths, flowing,
                                                                            strict=True)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flowing)), 60)
        proc.send_signal(signal.SIGTERM)
        status = await status_once_draining(client)
        if second_signal_after is not None:
            await asyncio.sleep(second_signal_after)
            proc.send_signal(signal.SIGTERM)
        return await asyncio.gather(*tasks), status


def test_sigterm_drains_then_aborts_with_final_events(tmp_path: Path) -> None:
    # The signal comes once every stream flows: 8 s lets the 4-token ones finish even on a
    # loaded machine (a few steps each), and is too short for the 960-token ones on a fast one.
    with serve(tmp_path, "--shutdown-timeout", "8") as (proc, url, log):
        lengths = [4] * 3 + [960] * 5
        results, during = asyncio.run(streams_then_sigterm(url, proc, lengths))
        assert proc.wait(timeout=60) == 0
    text = log.read_text()
    assert during == 503, text
    assert [r["finish_reason"] for r in results[:3]] == ["length"] * 3, results
    assert [r["finish_reason"] for r in results[3:]] == ["abort"] * 5, results
    assert all(r["done_last"] for r in results), results
    assert "Traceback" not in text and "CancelledError" not in text, text
    assert "aborted 5 requests" in text


def test_second_signal_exits_at_once(tmp_path: Path) -> None:
    with serve(tmp_path, "--shutdown-timeout", "600") as (proc, url, log):
        _, during = asyncio.run(streams_then_sigterm(url, proc, [900] * 2,
                                                     second_signal_after=1.0))
        assert proc.wait(timeout=60) is not None  # not the 600 s drain
    assert during == 503, log.read_text()
    assert "second signal" in log.read_text()


def test_sigterm_as_soon_as_it_answers(tmp_path: Path) -> None:
    """A signal right after the first answer (while start-up is still checking /health)
    shuts down like any other: exit status 0, no traceback."""
    log, port = tmp_path / "serve.log", free_port()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sous.cli", "serve", "--max-model-len",
                                 "1024", "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env=os.environ)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).is_success:
                    break
            except httpx.HTTPError:
                time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text(), log.read_text()


def test_load_probe_scaled_down(tmp_path: Path) -> None:
    """16 clients for ~10 s, a quarter of them hanging up mid-stream, then SIGTERM under
    load: no stream cut, no KV block leaked once idle, every stream not closed by its client
    ends with a finish_reason and [DONE], clean exit."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "load_probe.py"), "--clients", "16",
         "--duration", "10", "--close-fraction", "0.25", "--max-tokens", "32",
         "--shutdown-timeout", "2", "--serve-args", "--max-model-len 1024",
         "--log", str(tmp_path / "probe-serve.log")],
        capture_output=True, text=True, timeout=900, env=os.environ)
    report = json.loads(out.stdout)
    load, idle, shutdown = report["load"], report["after_idle"], report["shutdown"]
    assert load["cut"] == 0 and shutdown["cut"] == 0, report
    assert load["aborted_by_client"] > 0 and load["completed"] > 0, report
    assert load["completed"] + load["aborted_by_client"] == load["streams"], report
    assert sum(load["finish_reasons"].values()) == load["completed"], report
    assert idle["kv_cache_usage_perc"] == 0 and idle["num_requests_running"] == 0, report
    assert shutdown["completed"] == shutdown["streams"] == 16, report
    assert shutdown["request_during_drain"]["refused"] == {"503": 1}, report
    assert shutdown["exit_code"] == 0 and report["tracebacks_in_log"] == 0, report
    assert report["ok"] and out.returncode == 0, report
