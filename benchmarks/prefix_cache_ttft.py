"""TTFT of a repeated ~1,500-token shared-prefix chat: the second request (prefix-cache hit)
versus the first (miss), on `sous serve` with the bundled model. Prints JSON.

Each trial uses a fresh system prompt (so the first request is a real miss), then asks a
different question on the same conversation prefix. Medians over --trials.

`--sub-block`: the recipes' large blocks instead. Two servers with `--block-size 1024
--max-num-batched-tokens 128` and a shared prefix covering ~70% of one block, one with
`VLLM_RBLN_SUB_BLOCK_CACHE=1` (sub-blocks of 128 tokens reused), one with `=0` (only full
blocks, so nothing of the prefix is reused); the hit TTFT of both, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from serve_vs_transformers import free_port, start_server
from sous.bench.client import Target, make_client, stream_request

WORDS = ["river", "stone", "bridge", "lantern", "harbor", "meadow", "copper", "violet", "winter", "engine", "garden", "signal", "orchard", "canyon", "pepper", "marble", "falcon", "timber", "velvet", "anchor"]


def shared_prefix(trial: int, num_words: int) -> str:
    words = [WORDS[(i * 7 + trial * 3) % len(WORDS)] for i in range(num_words)]
    return f"Session {trial}. Reference notes: " + " ".join(words)


async def measure(base_url: str, model: str, trials: int, num_words: int) -> dict:
    target = Target(base_url=base_url, model=model, endpoint="chat", max_tokens=8)
    misses, hits, cached = [], [], []
    async with make_client(base_url, None, 1) as client:
        for trial in range(trials):
            system = shared_prefix(trial, num_words)
            for i, question in enumerate(["Summarise the notes.", "List three words."]):
                body_prompt = f"{system}\n\nQuestion: {question}"
                result = await stream_request(client, target, body_prompt)
                if not result.ok or result.ttft_s is None:
                    raise SystemExit(f"request failed: {result.error}")
                (misses if i == 0 else hits).append(result.ttft_s * 1000)
                if i == 1:
                    cached.append(result.prompt_tokens)
    miss, hit = statistics.median(misses), statistics.median(hits)
    return {"ttft_miss_ms": round(miss, 1), "ttft_hit_ms": round(hit, 1),
            "speedup": round(miss / hit, 2), "prompt_tokens": cached[0],
            "miss_runs_ms": [round(x, 1) for x in misses],
            "hit_runs_ms": [round(x, 1) for x in hits]}


def run_server_and_measure(args: argparse.Namespace, words: int) -> tuple[dict, float]:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="sous-prefix-")) / "server.log"
    proc, ready_s = start_server(args, port, log)
    try:
        base = f"http://127.0.0.1:{port}"
        return asyncio.run(measure(base, "SmolLM2-135M-Instruct", args.trials, words)), ready_s
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def sub_block_comparison(args: argparse.Namespace) -> dict:
    args.server_arg = [*args.server_arg, "--block-size", "1024",
                       "--max-num-batched-tokens", "128"]
    runs = {}
    for mode, env in (("sub_block_on", "1"), ("sub_block_off", "0")):
        os.environ["VLLM_RBLN_SUB_BLOCK_CACHE"] = env
        runs[mode], _ = run_server_and_measure(args, args.words)
    on, off = runs["sub_block_on"]["ttft_hit_ms"], runs["sub_block_off"]["ttft_hit_ms"]
    return {"block_size": 1024, "sub_block_size": 128, **runs,
            "hit_speedup_on_vs_off": round(off / on, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--words", type=int, default=1400, help="prefix length in words (~tokens)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model", default=None)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--server-arg", action="append", default=[])
    p.add_argument("--sub-block", action="store_true",
                   help="block 1024, prefix ~70%% of a block: sub-block caching on vs off")
    args = p.parse_args(argv)
    if args.sub_block:
        if args.words == 1400:
            args.words = 690
        out = sub_block_comparison(args)
    else:
        out, ready_s = run_server_and_measure(args, args.words)
        out["ready_s"] = round(ready_s, 1)
    out.update({"server_args": args.server_arg, "dtype": args.dtype})
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
