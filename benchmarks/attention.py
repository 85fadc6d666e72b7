"""Paged attention: the torch path (gather + SDPA) vs the C++ kernels, on this machine's CPU.

Prints one JSON object:

* `per_layer_us`: time of one layer-step (cache write + attention) with the bundled model's
  attention shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64, block size 16). Each
  repetition runs all 30 layers, each with its own cache tensor (so the context comes from
  memory as in a real step, not from a cache-hot buffer), and divides by 30. Cases: 16 and 64
  decodes of ~200 context tokens, one 512-token prefill, and a mixed step (16 decodes + a
  256-token chunk after 256 cached tokens). Medians (and minima) of `--repeat` repetitions,
  the two implementations interleaved.
* `model`: the bundled model through `sous.LLM` (float32, greedy), 16 prompts x 64 new tokens:
  wall time, generated tokens/s and mean decode step time per implementation (medians of
  `--model-repeat` runs), and whether both produced the same tokens.

Run on an idle machine (2 cores: anything else running changes the figures): it waits up to
`--idle-wait` seconds for the CPUs to be under 15 % busy. Implementations are switched with
`SOUS_ATTENTION` (see `sous.engine.attention`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import psutil
import torch

from sous.engine.attention import ATTENTION_ENV, AttentionMetadata, paged_attention

IMPLS = ("torch", "cpp")
LAYERS, HQ, HKV, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
CASES = {
    "decode_16x200": ([1] * 16, [200] * 16),
    "decode_64x200": ([1] * 64, [200] * 64),
    "prefill_512": ([512], [512]),
    "mixed_16x200+256on256": ([1] * 16 + [256], [200] * 16 + [512]),
}


def wait_idle(max_wait_s: float, busy_pct: float = 15.0) -> float:
    """Block until the CPUs are under `busy_pct` % busy (or `max_wait_s`); returns the last
    reading."""
    deadline = time.monotonic() + max_wait_s
    busy = psutil.cpu_percent(interval=1.0)
    while busy > busy_pct and time.monotonic() < deadline:
        busy = psutil.cpu_percent(interval=1.0)
    return busy


def _layer_step_case(qlens: list[int], slens: list[int], seed: int = 0):
    """Per-layer caches, block tables, inputs, and one step's metadata per implementation."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum((s + BLOCK - 1) // BLOCK for s in slens) + 1
    caches = [torch.randn((2, num_blocks, BLOCK, HKV, HEAD_DIM), generator=g)
              for _ in range(LAYERS)]
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range((s + BLOCK - 1) // BLOCK)] for s in slens]
    t = sum(qlens)
    qkv = torch.randn((t, HQ + 2 * HKV, HEAD_DIM), generator=g)
    q, k, v = qkv[:, :HQ], qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :]
    metas = {}
    for impl in IMPLS:
        os.environ[ATTENTION_ENV] = impl
        metas[impl] = AttentionMetadata.build(qlens, slens, tables, BLOCK, torch.device("cpu"))
    return caches, q, k, v, metas


def bench_layers(repeat: int) -> dict:
    out = {}
    for name, (qlens, slens) in CASES.items():
        caches, q, k, v, metas = _layer_step_case(qlens, slens)
        times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        with torch.inference_mode():
            for _ in range(repeat):
                for impl in IMPLS:
                    meta = metas[impl]
                    t0 = time.perf_counter()
                    for cache in caches:
                        paged_attention(q, k, v, cache, meta, HEAD_DIM**-0.5)
                    times[impl].append((time.perf_counter() - t0) / LAYERS * 1e6)
        row = {f"{impl}_us": round(statistics.median(ts), 1) for impl, ts in times.items()}
        row |= {f"{impl}_min_us": round(min(ts), 1) for impl, ts in times.items()}
        row["speedup"] = round(row["torch_us"] / row["cpp_us"], 2)
        out[name] = row
    return out


def bench_model(repeat: int, num_prompts: int, max_tokens: int) -> dict:
    from sous import LLM, SamplingParams

    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=256 << 20,
              max_num_seqs=num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [f"Write a story about topic number {i}: the " for i in range(num_prompts)]
    runs: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    tokens: dict[str, list[list[int]]] = {}
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    for _ in range(repeat):
        for impl in IMPLS:
            os.environ[ATTENTION_ENV] = impl
            t0 = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            runs[impl].append(time.perf_counter() - t0)
            tokens[impl] = [r.outputs[0].token_ids for r in res]
    out: dict = {"prompts": num_prompts, "new_tokens_each": max_tokens}
    for impl, ts in runs.items():
        wall = statistics.median(ts)
        out[impl] = {"wall_s": round(wall, 3),
                     "tokens_per_s": round(num_prompts * max_tokens / wall, 1),
                     "step_ms": round(wall / max_tokens * 1e3, 2)}
    out["speedup"] = round(out["torch"]["wall_s"] / out["cpp"]["wall_s"], 2)
    out["identical_tokens"] = tokens["torch"] == tokens["cpp"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=15, help="layer-step repetitions per case")
    p.add_argument("--model-repeat", type=int, default=3, help="LLM.generate runs per impl")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--skip-model", action="store_true", help="only the per-layer figures")
    p.add_argument("--idle-wait", type=float, default=60.0,
                   help="Seconds to wait at most for the machine to go idle before timing.")
    args = p.parse_args()
    from sous.engine.ops.build import load

    if load() is None:
        raise SystemExit("the sous_ops C++ extension does not build here: nothing to compare")
    result: dict = {"threads": torch.get_num_threads(),
                    "cpu_busy_pct_before": wait_idle(args.idle_wait)}
    result["per_layer_us"] = bench_layers(args.repeat)
    if not args.skip_model:
        wait_idle(args.idle_wait)
        result["model"] = bench_model(args.model_repeat, args.prompts, args.max_tokens)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
