"""P/D disaggregation over NIXL: KV transfer bandwidth and the TTFT it adds, against one
aggregated server, for prompts of several lengths. Prints JSON.

    python benchmarks/pd_transfer.py [--sizes 1024,4096,8000] [--repeats 3] [--long-context]
                                     [--output F]

Two `sous serve` processes (`--kv-transfer-config NixlConnector`, each its own side-channel
port, `--kv-cache-memory-bytes` room for the longest prompt a few times) serving the bundled
SmolLM2-135M, or with `--long-context` a random stand-in with its KV geometry and a 32k context
(`long_context_model`: the same bytes move per token; prompts up to 16k and more). Per size and
repeat, fresh completion prompts of seeded random token ids (every prefill a genuine miss),
greedy, `--max-tokens` tokens:

- `aggregated_ttft_s`: one streamed request to the prefill server alone (the baseline);
- `pd_ttft_s`: another prompt through the two legs as a router sends them: the prefill leg
  (`kv_transfer_params: {do_remote_decode: true}`, `max_tokens: 1`, not streamed) to the
  prefill server, then the request streamed to the decode server with the answer's
  `kv_transfer_params`; from sending the prefill leg to the first chunk carrying text;
- `added_ttft_s` = pd - aggregated, and `decode_leg_ttft_s`: the decode leg alone (the read,
  the last prompt token recomputed, the first token);
- `transfer_gb_per_s`: the decode server's `sous:kv_transfer_bytes_total` over
  `sous:kv_transfer_seconds_total` for that request (read start to seen done: includes up to
  one engine-loop poll), and `transfer_mib` the KV it moved.

Figures are medians over the repeats; `wait_idle` waits up to --idle-wait s for the 2-core
machine to calm down first. Exit status 1 if a request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]
from peer_engines import _wait_ready, free_port, wait_idle  # noqa: E402

from kv_offload import machine, median, stop  # noqa: E402

NIXL = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
KV_BYTES_PER_TOKEN = 23040
"""bf16 KV of SmolLM2-135M (30 layers x K, V x 3 heads x 64), and of the long-context stand-in."""


def long_context_model(work: Path) -> Path:
    """A random Llama with the bundled model's KV geometry (30 layers, 3 KV heads of 64) and a
    32k context, small elsewhere (3 query heads, vocabulary 1000): what moves per token is the
    same as for SmolLM2, prefill is cheaper, and prompts can be longer than its 8192."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from tiny_models import make_tiny_llama

    return make_tiny_llama(work, name="long-context", num_hidden_layers=30, hidden_size=192,
                           num_attention_heads=3, num_key_value_heads=3, intermediate_size=256,
                           max_position_embeddings=32768, dtype="bfloat16")


def start_server(name: str, work: Path, cache_bytes: int, timeout_s: float,
                 model: list[str]) -> tuple[subprocess.Popen, str]:
    log = work / f"{name}.log"
    port = free_port()
    env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    cmd = [sys.executable, "-m", "sous.cli", "serve", *model, "--port", str(port),
           "--kv-transfer-config", NIXL, "--kv-cache-memory-bytes", str(cache_bytes)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    _wait_ready(proc, base + "/v1/models", timeout_s, log)
    return proc, base


def counters(client: httpx.Client, base: str) -> dict[str, float]:
    out = {}
    for line in client.get(base + "/metrics").text.splitlines():
        if line.startswith("sous:kv_transfer"):
            name = line.split("{", 1)[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def stream_ttft(client: httpx.Client, base: str, body: dict, start: float) -> float:
    """Seconds from `start` to the first streamed chunk carrying text."""
    with client.stream("POST", base + "/v1/completions",
                       json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: HTTP {r.status_code}: {r.read()[:300]!r}")
        ttft = None
        for line in r.iter_lines():  # read to the end: the request is over when this returns
            if ttft is None and line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0].get("text"):
                    ttft = time.perf_counter() - start
    if ttft is not None:
        return ttft
    raise RuntimeError(f"{base}: no text streamed")


def one_size(client: httpx.Client, p: str, d: str, model: str, vocab: int, size: int,
             args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for rep in range(args.repeats):
        bodies = []
        for k in range(2):  # fresh prompts of seeded random token ids (no special tokens)
            rng = random.Random(size * 1000 + rep * 2 + k)
            bodies.append({"model": model, "temperature": 0, "max_tokens": args.max_tokens,
                           "ignore_eos": True,
                           "prompt": [rng.randrange(16, vocab) for _ in range(size)]})
        aggregated = stream_ttft(client, p, bodies[0], time.perf_counter())
        before = counters(client, d)
        start = time.perf_counter()
        leg = {**bodies[1], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        answer = client.post(p + "/v1/completions", json=leg)
        answer.raise_for_status()
        params = answer.json()["kv_transfer_params"]
        decode_start = time.perf_counter()
        pd = stream_ttft(client, d, {**bodies[1], "kv_transfer_params": params}, start)
        decode_leg = pd - (decode_start - start)
        after = counters(client, d)
        moved = after["sous:kv_transfer_bytes_total"] - before["sous:kv_transfer_bytes_total"]
        secs = after["sous:kv_transfer_seconds_total"] - before["sous:kv_transfer_seconds_total"]
        runs.append({"aggregated_ttft_s": round(aggregated, 4), "pd_ttft_s": round(pd, 4),
                     "decode_leg_ttft_s": round(decode_leg, 4),
                     "transfer_mib": round(moved / 2**20, 2),
                     "transfer_s": round(secs, 4),
                     "transfer_gb_per_s": round(moved / secs / 1e9, 3) if secs else None})
    agg = _median4([r["aggregated_ttft_s"] for r in runs])
    pd = _median4([r["pd_ttft_s"] for r in runs])
    rates = [r["transfer_gb_per_s"] for r in runs if r["transfer_gb_per_s"]]
    return {"prompt_tokens": size, "aggregated_ttft_s": agg, "pd_ttft_s": pd,
            "added_ttft_s": round(pd - agg, 4) if pd is not None and agg is not None else None,
            "decode_leg_ttft_s": _median4([r["decode_leg_ttft_s"] for r in runs]),
            "transfer_gb_per_s": _median4(rates), "transfer_mib": runs[0]["transfer_mib"],
            "runs": runs}


def _median4(values: list[float]) -> float | None:
    m = median(values)
    return None if m is None else round(m, 4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None,
                    help="prompt lengths in tokens (default 1024,4096,8000; with --long-context "
                         "1024,4096,16384)")
    ap.add_argument("--long-context", action="store_true",
                    help="serve a random stand-in with the bundled model's KV geometry and a 32k "
                         "context instead of the bundled model (8192 tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--idle-wait", type=float, default=60.0)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    default = "1024,4096,16384" if args.long_context else "1024,4096,8000"
    sizes = [int(s) for s in (args.sizes or default).split(",")]
    work = Path(tempfile.mkdtemp(prefix="sous-pd-"))
    cache_bytes = 3 * (max(sizes) + 64) * KV_BYTES_PER_TOKEN + 64 * 2**20
    model = [str(long_context_model(work)), "--dtype", "bfloat16"] if args.long_context else []
    out: dict[str, Any] = {"machine": machine(), "max_tokens": args.max_tokens,
                           "repeats": args.repeats, "long_context": args.long_context}
    procs = []
    status = 0
    try:
        out["busy_pct_before"] = wait_idle(args.idle_wait)
        p_proc, p = start_server("prefill", work, cache_bytes, args.ready_timeout, model)
        procs.append(p_proc)
        d_proc, d = start_server("decode", work, cache_bytes, args.ready_timeout, model)
        procs.append(d_proc)
        with httpx.Client(timeout=1800, trust_env=False) as client:
            card = client.get(p + "/v1/models").json()["data"][0]
            vocab = 1000 if args.long_context else 49152
            out["model"] = card["id"]
            stream_ttft(client, p, {"model": card["id"], "max_tokens": 4, "prompt": [20, 30, 40]},
                        time.perf_counter())
            results = [one_size(client, p, d, card["id"], vocab, size, args) for size in sizes]
        out["results"] = results
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["logs"] = str(work)
        status = 1
    finally:
        for proc in procs:
            stop(proc, signal.SIGINT, 60)
    text = json.dumps(out, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
