"""Data parallel serving: output throughput of `--data-parallel-size 2` (two engine ranks, one
CPU each under the default binding) against one engine process using both CPUs, on the
bundled SmolLM2-135M, 16 and 64 requests at once. Prints JSON.

    python benchmarks/parallel.py [--configs one,dp2] [--concurrency 16,64] [--rounds 3]
                                  [--max-tokens 128] [--output F]

One `sous serve` per configuration (the same flags otherwise), greedy chat requests on short
seeded topics. Per configuration and concurrency level, `--rounds` rounds of fresh prompts
after one warm-up round; each round's output tok/s is completion tokens over wall time.
Reported: the median over rounds and its ratio against `one` measured by the same script on
the same machine. Greedy answers are compared with `one`: `identical` is false if any
differed (it must not; the exit status is then 1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
from peer_engines import _wait_ready, free_port, wait_idle  # noqa: E402

from kv_offload import machine, median, stop  # noqa: E402

CONFIGS: dict[str, list[str]] = {
    "one": [],
    "dp2": ["--data-parallel-size", "2"],
}
TOPICS = ["a refrigerator", "the tides", "a compass", "yeast", "an elevator", "rainbows",
          "a thermostat", "bamboo", "a lighthouse", "snowflakes", "a microwave oven",
          "hummingbirds", "a submarine", "soap", "a windmill", "fireflies", "glass", "a kite"]
TASKS = ["How does {t} work?", "Tell me about {t}.", "Why is {t} useful?",
         "Describe {t} in simple words.", "Write a short story about {t}."]


def prompt(rng: random.Random) -> str:
    return rng.choice(TASKS).format(t=rng.choice(TOPICS)) + f" (note {rng.randrange(10**6)})"


def start_server(work: Path, name: str, timeout_s: float) -> tuple[subprocess.Popen, str]:
    log = work / f"{name}.log"
    port = free_port()
    cmd = [sys.executable, "-m", "sous.cli", "serve", "--port", str(port), *CONFIGS[name]]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    _wait_ready(proc, base + "/v1/models", timeout_s, log)
    return proc, base


def ask(client: httpx.Client, base: str, model: str, text: str, max_tokens: int
        ) -> tuple[str, int]:
    r = client.post(base + "/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": text}],
        "temperature": 0, "max_tokens": max_tokens})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


def one_round(base: str, prompts: list[str], concurrency: int, max_tokens: int
              ) -> tuple[float, list[str]]:
    with httpx.Client(trust_env=False, timeout=900.0) as client, \
            ThreadPoolExecutor(concurrency) as pool:
        model = client.get(base + "/v1/models").json()["data"][0]["id"]
        start = time.perf_counter()
        done = list(pool.map(lambda p: ask(client, base, model, p, max_tokens), prompts))
        elapsed = time.perf_counter() - start
    return sum(n for _, n in done) / elapsed, [text for text, _ in done]


def run_config(base: str, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for conc in args.concurrency:
        rng = random.Random(f"parallel-{conc}")
        rounds = [[prompt(rng) for _ in range(conc)] for _ in range(args.rounds + 1)]
        one_round(base, rounds[0], conc, args.max_tokens)  # warm-up
        rates, answers = [], []
        for prompts in rounds[1:]:
            wait_idle(args.idle_wait)
            rate, texts = one_round(base, prompts, conc, args.max_tokens)
            rates.append(rate)
            answers += texts
        results[str(conc)] = {"output_tok_per_s": median(rates), "rounds": rates,
                              "answers": answers}
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma list of {','.join(CONFIGS)}; one is always measured")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                   default=[16, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--idle-wait", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=300.0, help="server start-up limit, s")
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    names = ["one"] + [c for c in args.configs.split(",") if c != "one"]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        p.error(f"unknown config(s) {unknown}; known: {', '.join(CONFIGS)}")
    measured: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sous-parallel-bench-") as tmp:
        for name in names:
            proc, base = start_server(Path(tmp), name, args.timeout)
            try:
                measured[name] = run_config(base, args)
            finally:
                stop(proc)
    for cases in measured.values():
        for case, r in cases.items():
            one = measured["one"][case]
            r["ratio_vs_one"] = r["output_tok_per_s"] / one["output_tok_per_s"]
            r["identical"] = r["answers"] == one["answers"]
    for cases in measured.values():
        for r in cases.values():
            del r["answers"]
    report = {"machine": machine(), "max_tokens": args.max_tokens, "rounds": args.rounds,
              "configs": {c: CONFIGS[c] for c in names}, "results": measured}
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    ok = all(r["identical"] for cases in measured.values() for r in cases.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
