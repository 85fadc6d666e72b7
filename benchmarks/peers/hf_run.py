"""Hugging Face transformers, in-process, as a peer of benchmarks/peers.py.

    python benchmarks/peers/hf_run.py JOB.json      (the project's venv; see job.py)

Loads the float32 HF folder `model_dir` (exported from the bundled GGUF by export_hf.py),
then runs the job with greedy `generate`, `min_new_tokens = max_new_tokens = max_tokens`,
batch 1 for the single stream and batch N with left padding for each level. No TTFT (one
`generate` call per batch). `ready_s` = spawn -> model loaded. Prints one JSON line.
"""

from __future__ import annotations

import os
import sys
import time

from job import emit, load_job, run_job


def main() -> None:
    job = load_job(sys.argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    model.eval()
    ready_s = time.time() - job["t0"]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    mt = int(job["max_tokens"])

    def generate(batch: list[list[int]]) -> tuple[float, list[int], None, list[int]]:
        width = max(len(ids) for ids in batch)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch])
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=mt,
                                 min_new_tokens=mt, do_sample=False, pad_token_id=pad)
        wall = time.perf_counter() - start
        return wall, [out.shape[1] - width] * len(batch), None, out[0, width:].tolist()

    result = run_job(job, generate)
    result.update(ready_s=round(ready_s, 2), dtype="float32", threads=torch.get_num_threads(),
                  batching="static batch per level, left padding")
    emit(result)


if __name__ == "__main__":
    main()
