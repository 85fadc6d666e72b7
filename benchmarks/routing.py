"""Prefix-aware routing vs random picking, through `sous route`, on a multi-turn chat workload.

Two `sous serve` decode endpoints (prefix caching on) behind the router. The workload:
`--conversations` chats run concurrently; each uses one of `--system-prompts` long shared
system prompts and grows turn by turn (`--turns`: each turn appends the model's answer and a
new question). Each policy gets a fresh router and emptied prefix caches
(`POST /reset_prefix_cache`, the servers run with VLLM_SERVER_DEV_MODE=1), then runs the same
workload. Policies:

- `recipe`: the recipes' decode profile (decode-filter, approx-prefix-cache-producer,
  prefix-cache-scorer weight 2, queue-scorer weight 1, max-score-picker);
- `random`: decode-filter + random-picker;
- `precise`: as `recipe` with the precise-prefix-cache-producer fed by the servers' KV events,
  with `speculativeIndexing` (its own picks count until the events arrive).

Per policy and round: mean and median TTFT (first streamed content) and the cache hit rate
(sum of `cached_tokens` / sum of prompt tokens). Rounds alternate the policies; medians over
rounds are reported, and ratios against random from the same run.

    .venv/bin/python benchmarks/routing.py [--rounds 3] [--output F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]
from peer_engines import _wait_ready, free_port  # noqa: E402

from kv_offload import machine, stop  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
DECODE_PROFILE = """
plugins:
- type: decode-filter
- type: {producer}
{producer_params}
- type: prefix-cache-scorer
  parameters:
    prefixMatchInfoProducerName: {producer}
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: max-score-picker
"""
RANDOM = """
plugins:
- type: decode-filter
- type: random-picker
schedulingProfiles:
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: random-picker
"""
TOPICS = ["a maritime museum", "a railway archive", "a botanical garden", "an observatory",
          "a violin workshop", "a cheese cave", "a glass foundry", "a weather station"]
QUESTIONS = ["What should a first-time visitor see?", "What is the oldest object here?",
             "Which tour suits children?", "What do the staff do every morning?",
             "Where is the best view?", "What was restored last year?"]


def system_prompt(i: int, words: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    base = (f"You are the guide of {topic}. Answer briefly, politely and accurately, and "
            f"never invent facts about {topic}. ")
    return (base * (words // len(base.split()) + 1)).strip()


def config_text(policy: str, events_port: int) -> str:
    if policy == "random":
        return RANDOM
    if policy == "precise":
        params = ("  parameters:\n    speculativeIndexing: true\n    kvEventsConfig:\n"
                  f"      socketPort: {events_port}\n")
        return DECODE_PROFILE.format(producer="precise-prefix-cache-producer",
                                     producer_params=params)
    return DECODE_PROFILE.format(producer="approx-prefix-cache-producer", producer_params="")


def start_server(work: Path, name: str, events_port: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://127.0.0.1:{events_port}",
                         "topic": f"kv@127.0.0.1:{port}@{MODEL}"})
    cmd = [sys.executable, "-m", "sous.cli", "serve", "--port", str(port),
           "--max-model-len", "4096", "--kv-events-config", events]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "0.5",
           "OMP_NUM_THREADS": "1"}
    log = work / f"{name}.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    _wait_ready(proc, base + "/v1/models", 300, log)
    return proc, base


def start_router(work: Path, policy: str, servers: list[str], events_port: int
                 ) -> tuple[subprocess.Popen, str]:
    config = work / f"{policy}.yaml"
    config.write_text(config_text(policy, events_port))
    port = free_port()
    cmd = [sys.executable, "-m", "sous.cli", "route", "--config", str(config), "--port",
           str(port), *[w for s in servers for w in ("--endpoint", f"decode={s}")]]
    log = work / f"router-{policy}.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    _wait_ready(proc, base + "/health", 120, log)
    return proc, base


def one_turn(client: httpx.Client, router: str, messages: list[dict], max_tokens: int
             ) -> tuple[float, int, int, str]:
    """(TTFT s, prompt tokens, cached tokens, answer) of one streamed greedy chat turn."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start, ttft, text, usage = time.perf_counter(), None, "", {}
    with client.stream("POST", router + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or ():
                piece = c.get("delta", {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                text += piece
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft or time.perf_counter() - start, usage.get("prompt_tokens", 0), cached, text


def conversation(router: str, i: int, args: argparse.Namespace) -> list[tuple[float, int, int]]:
    rng = random.Random(i)
    messages = [{"role": "system", "content": system_prompt(i % args.system_prompts,
                                                          args.system_words)}]
    out = []
    with httpx.Client(timeout=300, trust_env=False) as client:
        for turn in range(args.turns):
            messages.append({"role": "user",
                             "content": f"(visitor {i}, turn {turn}) {rng.choice(QUESTIONS)}"})
            ttft, prompt, cached, text = one_turn(client, router, messages, args.max_tokens)
            messages.append({"role": "assistant", "content": text})
            out.append((ttft, prompt, cached))
    return out


def run_policy(policy: str, work: Path, servers: list[str], events_port: int,
               args: argparse.Namespace) -> dict[str, Any]:
    for s in servers:
        httpx.post(s + "/reset_prefix_cache", timeout=60).raise_for_status()
    proc, router = start_router(work, policy, servers, events_port)
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(args.conversations) as pool:
            turns = [t for conv in pool.map(lambda i: conversation(router, i, args),
                                            range(args.conversations)) for t in conv]
        wall = time.perf_counter() - start
    finally:
        stop(proc)
    ttfts = [t for t, _, _ in turns]
    prompt, cached = sum(p for _, p, _ in turns), sum(c for _, _, c in turns)
    return {"requests": len(turns), "mean_ttft_s": statistics.fmean(ttfts),
            "median_ttft_s": statistics.median(ttfts), "cache_hit_rate": cached / max(prompt, 1),
            "prompt_tokens": prompt, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    policies = ["recipe", "random", "precise"]
    work = Path(tempfile.mkdtemp(prefix="sous-routing-"))
    events_port = free_port()
    procs, servers = [], []
    try:
        for name in ("decode-0", "decode-1"):
            proc, base = start_server(work, name, events_port)
            procs.append(proc)
            servers.append(base)
        rounds: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        for r in range(args.rounds):
            for policy in policies if r % 2 == 0 else policies[::-1]:
                rounds[policy].append(run_policy(policy, work, servers, events_port, args))
                print(f"round {r} {policy}: {rounds[policy][-1]}", file=sys.stderr)
    finally:
        for proc in procs:
            stop(proc)
    summary = {p: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
               for p, rs in rounds.items()}
    base = summary["random"]
    result = {
        "benchmark": "routing", "machine": machine(), "workload": {
            k: getattr(args, k) for k in ("conversations", "system_prompts", "system_words",
                                          "turns", "max_tokens", "rounds")},
        "endpoints": 2, "policies": summary, "rounds": rounds,
        "ratios_vs_random": {p: {"mean_ttft": s["mean_ttft_s"] / base["mean_ttft_s"],
                                 "cache_hit_rate": s["cache_hit_rate"] / max(
                                     base["cache_hit_rate"], 1e-9)}
                             for p, s in summary.items() if p != "random"}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
