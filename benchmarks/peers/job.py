"""The job an in-process peer runner gets from benchmarks/peers.py, and its result shape.

Plain Python with no dependency beyond the standard library, so the runners can import it
from any venv (`sys.path` gets this folder: they run as scripts from it).

Job (JSON file, written by peers.py): `{"t0": <time.time() when the runner was spawned>,
"model_dir": str, "max_tokens": int, "single_repeats": int, "kv_gib": float,
"single": [ids], "levels": {"16": [[ids, ...] per repeat], ...}}` where every `ids` is a
prompt's token ids with the chat template already applied.

Result (one JSON object on the runner's stdout): `{"ready_s", "single_stream_tok_per_s",
"single_runs", "levels": {"16": {"tok_per_s", "runs", "ttft_ms", "all_full_length"}},
"all_full_length", "peak_rss_mib", "sample_ids", ...}` -- the same shape as the HTTP engines' results.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Generate = Callable[[list[list[int]]], tuple[float, list[int], list[float] | None, list[int]]]
"""Runs a batch of prompts to completion: returns (wall seconds, new tokens per prompt,
TTFT seconds per prompt or None when the engine does not expose it, the first prompt's
new token ids)."""


def load_job(argv: list[str]) -> dict[str, Any]:
    """The job from the JSON file named by the runner's only argument."""
    if len(argv) != 2:
        raise SystemExit(f"usage: {argv[0]} JOB.json")
    return json.loads(Path(argv[1]).read_text())


def self_peak_rss_mib() -> float | None:
    """This process's VmHWM (Linux) in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _ms(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    xs = sorted(v * 1000 for v in values)
    pos = (len(xs) - 1) * 0.99
    lo = int(pos)
    p99 = xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)
    return {"p50": round(statistics.median(xs), 1), "p99": round(p99, 1),
            "mean": round(sum(xs) / len(xs), 1)}


def run_job(job: dict[str, Any], generate: Generate) -> dict[str, Any]:
    """Warm-up, single stream (median of `single_repeats` runs) and every level, timed with
    `generate`; `all_full_length` checks every prompt got exactly `max_tokens` tokens."""
    mt = int(job["max_tokens"])
    full = True
    _, _, _, sample_ids = generate([job["single"]])  # warm-up
    single = []
    for _ in range(int(job["single_repeats"])):
        wall, new, _, _ = generate([job["single"]])
        full &= new == [mt]
        single.append(new[0] / wall)
    levels: dict[str, Any] = {}
    for n, runs in job["levels"].items():
        rates, ttfts, lfull = [], [], True
        for prompts in runs:
            wall, new, ttft, _ = generate(prompts)
            lfull &= new == [mt] * len(prompts)
            rates.append(sum(new) / wall)
            ttfts.extend(ttft or [])
        full &= lfull
        levels[n] = {"tok_per_s": round(statistics.median(rates), 2),
                     "runs": [round(r, 2) for r in rates],
                     "ttft_ms": _ms(ttfts), "all_full_length": lfull,
                     "prompt_tokens_mean": round(statistics.mean(
                         len(ids) for prompts in runs for ids in prompts), 1)}
    return {"single_stream_tok_per_s": round(statistics.median(single), 2),
            "single_runs": [round(r, 2) for r in single], "levels": levels,
            "all_full_length": full, "peak_rss_mib": self_peak_rss_mib(),
            "sample_ids": sample_ids}


def emit(result: dict[str, Any]) -> None:
    """Print the result as the last line of stdout (peers.py reads that line)."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
