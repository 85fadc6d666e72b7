"""vLLM benchmark_serving-style figures from request timings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sous.bench.client import RequestResult

__all__ = ["distribution", "percentile", "summarize_level"]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(seconds: Sequence[float]) -> dict[str, float | None]:
    """{p50, p99, mean} in milliseconds (all None when there are no values)."""
    if not seconds:
        return {"p50": None, "p99": None, "mean": None}
    ms = [s * 1000.0 for s in seconds]
    return {"p50": round(percentile(ms, 50), 3), "p99": round(percentile(ms, 99), 3),
            "mean": round(sum(ms) / len(ms), 3)}


def summarize_level(concurrency: int, results: Sequence[RequestResult],
                    duration_s: float) -> dict[str, Any]:
    """One concurrency level's figures. Throughputs count completed requests only;
    TPOT = (e2e - ttft) / (output_tokens - 1); ITL = gaps between streamed text chunks."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    errors = sorted({r.error for r in results if r.error})
    duration = max(duration_s, 1e-9)
    return {
        "concurrency": concurrency,
        "num_requests": len(results),
        "duration_s": round(duration_s, 4),
        "completed": len(done),
        "failed": len(results) - len(done),
        "prompt_tokens": sum(prompt_tokens) if prompt_tokens else None,
        "output_tokens": out_tokens,
        "output_tok_per_s": round(out_tokens / duration, 3),
        "request_per_s": round(len(done) / duration, 4),
        "ttft_ms": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": distribution([gap for r in done for gap in r.itl_s]),
        "e2e_ms": distribution([r.e2e_s for r in done]),
        "errors": errors[:5],
    }
