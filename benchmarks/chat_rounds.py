"""Shared by the benchmarks that compare `sous serve` configurations on greedy chat rounds
(`spec_decode.py`, `parallel.py`): start a server per configuration, time rounds of
concurrent requests, and compare every configuration with a baseline measured in the same run
(ratio of medians, identical answers)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]
from peer_engines import _wait_ready, free_port  # noqa: E402

from kv_offload import stop  # noqa: E402


def add_round_args(p: argparse.ArgumentParser, concurrency: list[int], max_tokens: int,
                   ) -> None:
    """The options every chat-round benchmark takes (`--concurrency` as a comma list)."""
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                   default=concurrency)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--idle-wait", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=300.0, help="server start-up limit, s")
    p.add_argument("--output", type=Path)


def start_sous(work: Path, name: str, extra: list[str], timeout_s: float,
               ) -> tuple[subprocess.Popen, str]:
    """`sous serve --port <free> *extra`, logging to `work/<name>.log`; (process, base URL)
    once `/v1/models` answers. Leading `NAME=value` words of `extra` are environment
    variables for the server."""
    log = work / f"{name}.log"
    port = free_port()
    env = dict(os.environ)
    while extra and "=" in extra[0] and not extra[0].startswith("-"):
        key, _, value = extra[0].partition("=")
        env[key], extra = value, extra[1:]
    cmd = [sys.executable, "-m", "sous.cli", "serve", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    _wait_ready(proc, base + "/v1/models", timeout_s, log)
    return proc, base


def ask(client: httpx.Client, base: str, model: str, prompt: str, max_tokens: int
        ) -> tuple[str, int, float]:
    """One greedy chat, streamed: (answer, completion tokens, seconds from the first
    content to the end of the stream, the decode time)."""
    text, usage, first = [], {}, None
    with client.stream("POST", base + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                if piece := choice["delta"].get("content"):
                    first = first if first is not None else time.perf_counter()
                    text.append(piece)
    decode_s = time.perf_counter() - first if first is not None else 0.0
    return "".join(text), usage["completion_tokens"], decode_s


def one_round(base: str, prompts: list[str], concurrency: int, max_tokens: int
              ) -> tuple[float, list[str], list[float]]:
    """Answering `prompts` with `concurrency` in flight: output tok/s (completion tokens over
    wall time), the answers, and each answer's decode tok/s (tokens after the first over the
    time from the first to the last)."""
    with httpx.Client(trust_env=False, timeout=900.0) as client, \
            ThreadPoolExecutor(concurrency) as pool:
        model = client.get(base + "/v1/models").json()["data"][0]["id"]
        start = time.perf_counter()
        done = list(pool.map(lambda p: ask(client, base, model, p, max_tokens), prompts))
        elapsed = time.perf_counter() - start
    decode = [(n - 1) / s for _, n, s in done if n > 1 and s > 0]
    return sum(n for _, n, _ in done) / elapsed, [text for text, _, _ in done], decode


def measure(configs: dict[str, list[str]], baseline: str, timeout_s: float,
            run: Callable[[str], dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """`run(base_url)` on one server per configuration (`baseline` first), each case's
    `output_tok_per_s` (and `decode_tok_per_s` where measured) and `answers` compared with the
    baseline's: `ratio_vs_<baseline>` (`decode_ratio_vs_<baseline>`) and `identical` added,
    the answers removed."""
    names = [baseline, *(n for n in configs if n != baseline)]
    measured: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sous-bench-") as tmp:
        for name in names:
            proc, base = start_sous(Path(tmp), name, configs[name], timeout_s)
            try:
                measured[name] = run(base)
            finally:
                stop(proc)
    for cases in measured.values():
        for case, r in cases.items():
            ref = measured[baseline][case]
            r[f"ratio_vs_{baseline}"] = r["output_tok_per_s"] / ref["output_tok_per_s"]
            if "decode_tok_per_s" in r:
                r[f"decode_ratio_vs_{baseline}"] = (r["decode_tok_per_s"]
                                                    / ref["decode_tok_per_s"])
            r["identical"] = r["answers"] == ref["answers"]
    for cases in measured.values():
        for r in cases.values():
            del r["answers"]
    return measured


def report(fields: dict[str, Any], output: Path | None) -> int:
    """Print (and write to `output`) the JSON report; exit status 1 if an answer differed."""
    text = json.dumps(fields, indent=2)
    print(text)
    if output:
        output.write_text(text + "\n")
    results = fields["results"]
    return 0 if all(r["identical"] for cases in results.values() for r in cases.values()) else 1
