"""Load probe: many streaming clients (some hanging up mid-stream), then SIGTERM under load.

    python benchmarks/load_probe.py                    # starts `sous serve` (bundled model)
    python benchmarks/load_probe.py --clients 16 --duration 10 --serve-args "--max-model-len 1024"
    python benchmarks/load_probe.py --base-url http://127.0.0.1:8000   # a running server

Phases: (1) `--clients` streaming chat clients loop for `--duration` seconds; a
`--close-fraction` of them close each connection after a few events. (2) Once every client
has stopped, /metrics must return to idle: `vllm:kv_cache_usage_perc` 0 and no request
running or waiting (a leak otherwise). (3) With a server this probe started: a fresh wave of
streams, SIGTERM once they are flowing, then a new request during the drain (503 expected),
and the exit. Prints one JSON object; `ok` is true when no stream was cut (ended without its
final event and `data: [DONE]`, or mid-body), nothing leaked, the server exited 0 and its log
has no traceback. Exit status 0 iff `ok`. Peak RSS of the server process comes from psutil.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil


@dataclass
class Tally:
    """Outcomes of the streams of one phase."""

    streams: int = 0
    completed: int = 0
    """Well-formed: a finish_reason, then `data: [DONE]` as the last event."""
    aborted_by_client: int = 0
    cut: int = 0
    refused: Counter = field(default_factory=Counter)
    """Streams not started: HTTP status (e.g. 503 while draining) or "connect"."""
    finish_reasons: Counter = field(default_factory=Counter)
    error_events: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"streams": self.streams, "completed": self.completed,
                "aborted_by_client": self.aborted_by_client, "cut": self.cut,
                "refused": dict(self.refused), "finish_reasons": dict(self.finish_reasons),
                "error_events": self.error_events}


async def one_stream(client: httpx.AsyncClient, body: dict, close_after: int | None,
                     tally: Tally, started: asyncio.Event | None = None) -> None:
    """Run one streaming request and record how it ended."""
    tally.streams += 1
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                tally.refused[str(r.status_code)] += 1
                return
            events, finish, done, after_done = 0, None, False, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if started is not None:
                    started.set()
                data = line[len("data: "):]
                if done:
                    after_done = True
                if data == "[DONE]":
                    done = True
                    continue
                obj = json.loads(data)
                tally.error_events += "error" in obj
                for choice in obj.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                events += 1
                if close_after is not None and events >= close_after:
                    tally.aborted_by_client += 1
                    return
    except httpx.ConnectError:
        tally.refused["connect"] += 1
        return
    except (httpx.TransportError, json.JSONDecodeError):
        tally.cut += 1
        return
    if done and finish is not None and not after_done:
        tally.completed += 1
        tally.finish_reasons[finish] += 1
    else:
        tally.cut += 1


def chat_body(model: str, rng: random.Random, max_tokens: int, tag: str) -> dict:
    return {"model": model, "stream": True, "ignore_eos": True, "temperature": 0,
            "max_tokens": rng.randint(max(1, max_tokens // 4), max_tokens),
            "messages": [{"role": "user", "content": f"Tell me a long story ({tag})."}]}


async def load_phase(base: str, model: str, args: argparse.Namespace) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + args.duration
    num_closers = round(args.clients * args.close_fraction)

    async def client_loop(i: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(args.seed * 1000 + i)
        k = 0
        while time.monotonic() < deadline:
            close_after = rng.randint(2, 8) if i < num_closers else None
            await one_stream(client, chat_body(model, rng, args.max_tokens, f"{i}-{k}"),
                             close_after, tally)
            k += 1

    limits = httpx.Limits(max_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout, limits=limits) as client:
        await asyncio.gather(*(client_loop(i, client) for i in range(args.clients)))
    return tally


def read_metrics(base: str) -> dict[str, float]:
    """The first sample of each `vllm:` metric (gauges carry one)."""
    out: dict[str, float] = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out.setdefault(name, float(line.rsplit(" ", 1)[1]))
    return out


def wait_idle(base: str, timeout: float) -> dict[str, Any]:
    """Poll /metrics until nothing runs, waits or holds KV blocks (or `timeout` passes)."""
    start = time.monotonic()
    while True:
        m = read_metrics(base)
        state = {"kv_cache_usage_perc": m.get("vllm:kv_cache_usage_perc"),
                 "num_requests_running": m.get("vllm:num_requests_running"),
                 "num_requests_waiting": m.get("vllm:num_requests_waiting")}
        if not any(state.values()) or time.monotonic() - start > timeout:
            return {**state, "idle_wait_s": round(time.monotonic() - start, 2)}
        time.sleep(0.25)


async def shutdown_phase(base: str, model: str, proc: subprocess.Popen,
                         args: argparse.Namespace) -> dict[str, Any]:
    """Streams in flight, SIGTERM, a new request during the drain, the exit."""
    tally, during = Tally(), Tally()
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout, limits=limits) as client:
        flowing = [asyncio.Event() for _ in range(args.clients)]
        tasks = [asyncio.ensure_future(one_stream(
            client, {**chat_body(model, rng, args.max_tokens, f"last-{i}"),
                     "max_tokens": args.max_tokens}, None, tally, flowing[i]))
            for i in range(args.clients)]
        with_deadline = asyncio.wait([asyncio.ensure_future(e.wait()) for e in flowing],
                                     timeout=30)
        await with_deadline
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        await asyncio.sleep(0.2)
        await one_stream(client, chat_body(model, rng, 8, "after-sigterm"), None, during)
        await asyncio.gather(*tasks)
    try:
        code = await asyncio.to_thread(proc.wait, args.shutdown_timeout + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    return {**tally.as_dict(), "request_during_drain": during.as_dict(), "exit_code": code,
            "exit_s": round(time.monotonic() - sent, 2)}


class RssSampler:
    """Peak resident set size of a process and its children, sampled every 0.2 s."""

    def __init__(self, pid: int | None) -> None:
        self.proc = psutil.Process(pid) if pid else None
        self.peak = 0
        self._task: asyncio.Task | None = None

    def sample(self) -> None:
        if self.proc is None:
            return
        try:
            procs = [self.proc, *self.proc.children(recursive=True)]
            self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
        except psutil.Error:
            pass

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(0.2)

    @property
    def peak_mib(self) -> float | None:
        return round(self.peak / 2**20, 1) if self.proc is not None else None


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "sous.cli", "serve", *shlex.split(args.serve_args),
           "--port", str(port), "--shutdown-timeout", str(args.shutdown_timeout)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"sous serve exited {proc.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"sous serve not ready:\n{log.read_text()}")
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


async def probe(args: argparse.Namespace) -> dict[str, Any]:
    log = Path(args.log or tempfile.mkstemp(prefix="sous-probe-", suffix=".log")[1])
    proc, base = (None, args.base_url.rstrip("/").removesuffix("/v1")) if args.base_url \
        else start_server(args, log)
    rss = RssSampler(proc.pid if proc else args.pid)
    sampler = asyncio.ensure_future(rss.run())
    try:
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        load = await load_phase(base, model, args)
        idle = await asyncio.to_thread(wait_idle, base, args.idle_timeout)
        shutdown = await shutdown_phase(base, model, proc, args) if proc else None
    finally:
        sampler.cancel()
        if proc is not None and proc.poll() is None:
            proc.kill()
    text = log.read_text() if proc else ""
    report = {"config": {k: v for k, v in vars(args).items() if k != "log"}, "log": str(log),
              "load": load.as_dict(), "after_idle": idle, "shutdown": shutdown,
              "peak_rss_mib": rss.peak_mib,
              "tracebacks_in_log": text.count("Traceback"),
              "cancelled_errors_in_log": text.count("CancelledError")}
    report["ok"] = is_ok(report)
    return report


def is_ok(report: dict[str, Any]) -> bool:
    idle, shutdown = report["after_idle"], report["shutdown"]
    ok = (report["load"]["cut"] == 0 and not idle["kv_cache_usage_perc"]
          and not idle["num_requests_running"] and not idle["num_requests_waiting"])
    if shutdown is not None:
        ok = ok and shutdown["cut"] == 0 and shutdown["exit_code"] == 0 \
            and report["tracebacks_in_log"] == 0 and report["cancelled_errors_in_log"] == 0
    return bool(ok)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server (no SIGTERM phase); default: start "
                   "`sous serve`")
    p.add_argument("--pid", type=int, help="with --base-url: the server's pid, for its RSS")
    p.add_argument("--serve-args", default="", help="extra `sous serve` flags")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    p.add_argument("--close-fraction", type=float, default=0.25,
                   help="share of clients that hang up mid-stream")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--shutdown-timeout", type=int, default=5,
                   help="the server's --shutdown-timeout")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds for /metrics to return to idle after the load")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", help="the server's log file (default: a temporary file)")
    args = p.parse_args(argv)
    report = asyncio.run(probe(args))
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
