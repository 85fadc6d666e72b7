"""The share of sous' CPU time spent in attention, from a torch.profiler trace.

    SOUS_ATTENTION=torch|cpp python benchmarks/peers/attn_profile.py [--prompts 16]
        [--max-tokens 32] [--dtype auto]

Runs the bundled model in this process (`sous.LLM`, greedy, `ignore_eos`) on `--prompts`
prompts of the benchmark workload (`sous.bench.prompts`) for `--max-tokens` tokens each,
once untimed (warm-up), then once under torch.profiler. Every call of the attention entry
point (`paged_attention`, cache write + attention, as imported by the model modules) is
wrapped, by monkeypatching from here, in `record_function("sous::attention")`.

Prints one JSON line: `{"attention": <backend>, "attention_cpu_ms", "total_cpu_ms",
"attention_share", "calls", "wall_s", "dtype"}`, where attention_cpu_ms is the wrapped calls'
inclusive CPU time, total_cpu_ms the sum of every profiled op's self CPU time and
attention_share attention_cpu_ms over the profiled run's wall time (sous' C++ matmuls and
layer ops are not torch ops, so the op total misses most of the step).
The backend is read from SOUS_ATTENTION when the engine starts, hence one process each.
`benchmarks/peers.py` runs it with `SOUS_FUSED_LAYERS=0`: attention calls made from inside the
C++ layer stack (`sous.models.llama_stack`, the default for GGUF weights) cannot be wrapped.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Any

LABEL = "sous::attention"


def _wrap_attention() -> None:
    """Replace `paged_attention` in sous.engine.attention and in every loaded sous.models
    module that imported it by name with a `record_function` wrapper."""
    import torch

    import sous.engine.attention as attention
    import sous.models.llama  # noqa: F401  (the bundled model's module)

    original = attention.paged_attention

    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(LABEL):
            return original(*args, **kwargs)

    attention.paged_attention = traced
    for name, module in list(sys.modules.items()):
        if name.startswith("sous.models.") and getattr(module, "paged_attention", None) \
                is original:
            module.paged_attention = traced


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sous import LLM, SamplingParams
    from sous.bench.prompts import make_prompts
    from sous.engine.attention import attention_backend

    _wrap_attention()
    llm = LLM(dtype=args.dtype, max_num_seqs=args.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    tok = llm.get_tokenizer()

    def chats(seed: int) -> list[str]:  # a fresh prompt set: no prefix-cache hits
        return [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                        add_generation_prompt=True)
                for t in make_prompts(args.prompts, seed=seed)]

    llm.generate(chats(0), params, use_tqdm=False)  # warm-up (and any lazy build)
    timed = chats(1)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(timed, params, use_tqdm=False)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    attn = [e for e in events if e.key == LABEL]
    attn_us = sum(e.cpu_time_total for e in attn)
    print(json.dumps({
        "attention": attention_backend(torch.device("cpu")),
        "attention_cpu_ms": round(attn_us / 1000, 1),
        "total_cpu_ms": round(total_us / 1000, 1),
        "attention_share": round(attn_us / (wall * 1e6), 4) if wall > 0 else None,
        "calls": sum(e.count for e in attn),
        "wall_s": round(wall, 2),
        "dtype": args.dtype,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
    }))


if __name__ == "__main__":
    main()
