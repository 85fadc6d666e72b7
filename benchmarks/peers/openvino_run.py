"""OpenVINO GenAI, in-process, as a peer of benchmarks/peers.py.

    .peers/ov-venv/bin/python benchmarks/peers/openvino_run.py JOB.json     (see job.py)

Runs the job on `openvino_genai.ContinuousBatchingPipeline` (CPU, KV cache `cache_size` =
the job's `kv_gib`, other scheduler settings default) over the OpenVINO IR folder
`model_dir` (optimum-cli export of .peers/smollm2-hf). Prompts go in as token ids (the chat
template was applied once, by peers.py), greedy, `max_new_tokens = min_new_tokens =
max_tokens`, `ignore_eos`. Each batch is added with `add_request` and driven with `step()`,
so TTFT is measured as for the HTTP engines: from the batch's submission to the step after
which a request's first token can be read. `ready_s` = spawn -> pipeline built.
Prints one JSON line.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time

from job import emit, load_job, run_job


def main() -> None:
    job = load_job(sys.argv)
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    sched = ov_genai.SchedulerConfig()
    sched.cache_size = max(1, math.ceil(float(job["kv_gib"])))  # GB
    pipe = ov_genai.ContinuousBatchingPipeline(job["model_dir"], sched, "CPU")
    ready_s = time.time() - job["t0"]
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = cfg.min_new_tokens = int(job["max_tokens"])
    cfg.ignore_eos, cfg.do_sample = True, False
    ids = itertools.count()

    def generate(batch: list[list[int]]) -> tuple[float, list[int], list[float], list[int]]:
        start = time.perf_counter()
        handles = [pipe.add_request(next(ids), ov.Tensor(np.array([x], dtype=np.int64)), cfg)
                   for x in batch]
        ttft: list[float | None] = [None] * len(batch)
        counts, first_ids = [0] * len(batch), []
        while pipe.has_non_finished_requests():
            pipe.step()
            now = time.perf_counter()
            for i, handle in enumerate(handles):
                if handle.can_read():
                    for out in handle.read().values():
                        counts[i] += len(out.generated_ids)
                        if i == 0:
                            first_ids.extend(out.generated_ids)
                    if ttft[i] is None:
                        ttft[i] = now - start
        wall = time.perf_counter() - start
        return wall, counts, [t for t in ttft if t is not None], first_ids

    result = run_job(job, generate)
    lines = (line.partition(":") for line in sched.to_string().splitlines())
    result.update(ready_s=round(ready_s, 2), weights=os.path.basename(job["model_dir"]),
                  openvino_genai=ov_genai.get_version(),
                  scheduler={k.strip(): v.strip() for k, sep, v in lines if sep})
    emit(result)


if __name__ == "__main__":
    main()
