"""`sous bench serve`: throughput, TTFT, TPOT and ITL of any OpenAI-compatible server
at several concurrencies; JSON on stdout (and in `--output FILE`).

Workload: a fixed, seeded set of "Write a long essay about ..." prompts (about 95 prompt
tokens with SmolLM2's chat template), streamed, greedy (temperature 0), `--max-tokens`
tokens each (`ignore_eos` on by default). One warm-up request precedes the sweep. Each
concurrency level gets fresh prompts (no prefix-cache hits across levels).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from sous.bench.client import (
    Target,
    first_model,
    make_client,
    normalize_base_url,
    run_concurrent,
    stream_request,
)
from sous.bench.prompts import make_prompts
from sous.bench.stats import summarize_level

__all__ = ["build_parser", "main", "run_bench"]


def _concurrency_list(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return levels


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def build_parser(prog: str = "sous bench serve") -> argparse.ArgumentParser:
    """The `sous bench serve` argument parser."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="Server URL, with or without /v1.")
    p.add_argument("--model", default=None, help="Model name (default: first of /v1/models).")
    p.add_argument("--api-key", default=None,
                   help="Bearer token (default: $OPENAI_API_KEY, else $VLLM_API_KEY).")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions or /v1/completions.")
    p.add_argument("--concurrency", type=_concurrency_list, default=[1, 4, 16, 64],
                   help="Comma-separated concurrency levels, run in order.")
    p.add_argument("--num-prompts", type=_positive_int, default=None,
                   help="Requests per level (default: max(concurrency, 16)).")
    p.add_argument("--max-tokens", type=_positive_int, default=128,
                   help="Output tokens per request.")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="Send vLLM's `ignore_eos` so every request yields --max-tokens.")
    p.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the prompt set.")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="Send one warm-up request before the sweep.")
    p.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout, s.")
    p.add_argument("--output", default=None, help="Also write the JSON to this file.")
    return p


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the warm-up and the sweep described by parsed `args`; returns the report."""
    base_url = normalize_base_url(args.base_url)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("VLLM_API_KEY")
    levels: list[int] = args.concurrency
    sizes = [args.num_prompts or max(c, 16) for c in levels]
    prompts = make_prompts(1 + sum(sizes), seed=args.seed)
    async with make_client(base_url, api_key, max(levels), args.timeout) as client:
        model = args.model or await first_model(client, base_url)
        target = Target(base_url, model, args.endpoint, args.max_tokens, args.ignore_eos,
                        args.temperature)
        report: dict[str, Any] = {
            "base_url": base_url, "model": model, "endpoint": args.endpoint,
            "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
            "temperature": args.temperature, "seed": args.seed, "warmup": None,
            "results": [],
        }
        if args.warmup:
            warm = await stream_request(client, target, prompts[0])
            report["warmup"] = {"ok": warm.ok, "e2e_ms": round(warm.e2e_s * 1000, 3),
                                "output_tokens": warm.output_tokens, "error": warm.error}
        start = 1
        for concurrency, size in zip(levels, sizes, strict=True):
            batch = prompts[start:start + size]
            start += size
            print(f"sous bench serve: concurrency {concurrency}, {size} requests ...",
                  file=sys.stderr, flush=True)
            results, duration = await run_concurrent(client, target, batch, concurrency)
            report["results"].append(summarize_level(concurrency, results, duration))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: prints the JSON report; exit status 1 if any request failed."""
    args = build_parser().parse_args(argv)
    try:
        report = asyncio.run(run_bench(args))
    except Exception as e:  # no server, no model: say so plainly
        print(f"sous bench serve: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    failed = sum(level["failed"] for level in report["results"])
    warm_failed = report["warmup"] is not None and not report["warmup"]["ok"]
    return 1 if failed or warm_failed else 0
