"""sous in-process (the offline `LLM`), as the `sous-offline` row of benchmarks/peers.py.

    python benchmarks/peers/sous_run.py JOB.json      (the project's venv; see job.py)

The engine of the `sous` row with its defaults (the bundled GGUF kept quantised) and a KV
cache of `kv_gib`, without the HTTP server and the load generator: the same conditions as the
in-process OpenVINO rows, so the two rows side by side show what serving over HTTP costs on
the machine's cores. Every batch goes to one `LLM.generate` call (continuous batching inside).
TTFT per prompt: its first token's time minus its arrival. `ready_s` = spawn -> engine built.
Prints one JSON line.
"""

from __future__ import annotations

import sys
import time

from job import emit, load_job, run_job


def main() -> None:
    job = load_job(sys.argv)
    import torch

    from sous import LLM, SamplingParams

    llm = LLM(model=job["model_dir"], kv_cache_memory_bytes=int(job["kv_gib"] * (1 << 30)))
    ready_s = time.time() - job["t0"]
    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]), ignore_eos=True)

    def generate(batch: list[list[int]]) -> tuple[float, list[int], list[float], list[int]]:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params,
                            use_tqdm=False)
        wall = time.perf_counter() - start
        ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
        return (wall, [len(o.outputs[0].token_ids) for o in outs], ttft,
                list(outs[0].outputs[0].token_ids))

    result = run_job(job, generate)
    result.update(ready_s=round(ready_s, 2), threads=torch.get_num_threads(),
                  batching="continuous (offline LLM.generate per batch)")
    emit(result)


if __name__ == "__main__":
    main()
