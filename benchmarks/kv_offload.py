"""TTFT of a re-asked ~4k-token prompt after it was evicted from the device KV cache: offload
off vs LMCache's CPU, disk and Redis tiers (`sous serve --kv-transfer-config`). Prints JSON.

    python benchmarks/kv_offload.py [--modes off,cpu,disk,redis] [--repeats 5]
                                    [--prompt-tokens 4096] [--output F]

Per mode, one `sous serve` (bundled SmolLM2-135M, free port, PYTHONHASHSEED=0, its own temp
folder; Redis mode: a `redis-server --save '' --appendonly no` of its own on a free port),
with a device KV cache of `--cache-factor` (1.3) x one prompt's blocks
(`--num-gpu-blocks-override`), so that `--evictors` (2) other prompts push a prompt out of it
(one is not always enough: the first blocks of a prompt are freed last). Tiers are chosen
with LMCache's variables: `off` no `--kv-transfer-config`; `cpu` LMCACHE_LOCAL_CPU=True,
--cpu-gb; `disk` LMCACHE_LOCAL_CPU=False (--staging-gb of CPU staging buffer),
LMCACHE_LOCAL_DISK=<temp dir>, --disk-gb; `redis` LMCACHE_LOCAL_CPU=False,
LMCACHE_REMOTE_URL=redis://127.0.0.1:<port>. All with LMCACHE_CHUNK_SIZE=--chunk-size.

After one full-length warm-up request, each repeat takes a fresh prompt of seeded random
words, `--prompt-tokens` tokens with the chat template (so every repeat's first ask is a
genuine miss; the prompts are the same in every mode), and sends, one at a time, streamed,
greedy, `--max-tokens` tokens: (1) the prompt: `recompute` TTFT, the baseline; (2) the
evictors, each a fresh prompt of the same length; (3) the prompt again: `reask` TTFT, with
`usage.prompt_tokens_details.cached_tokens` (device prefix cache + offload tiers).
TTFT: request sent -> first streamed chunk carrying text.

Reading it: per mode `reask_ttft_s` and `recompute_ttft_s` are medians over the repeats and
`speedup_vs_recompute` is their ratio (both measured in the same server, same run);
`all_misses_ttft_s`: the median over the first asks and the evictors together (all genuine
misses of the same length: 1 + --evictors samples a repeat, a steadier recompute figure).
`reask_cached_tokens` should be ~all of `prompt_tokens` with a tier (what the tier served)
and only the chat template's shared first block (16) with `off`, which shows the prompt
really was evicted from the device cache (`off`'s re-ask is a recompute). The disk tier's
files are read back through the OS page cache here (no cache drop), so it is a best case.
Figures on a 2-core machine are noisy: `wait_idle` waits up to --idle-wait s for it to calm
down before each mode (`busy_pct_before`). Exit status 1 if any mode failed (its `error`
and the end of its server log are in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from sous.bench.client import Target, first_model, make_client, stream_request
from sous.bench.prompts import WORDS
from sous.bench.stats import percentile

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from peer_engines import _wait_ready, free_port, wait_idle  # noqa: E402
from report import machine_info  # noqa: E402

MODES = ("off", "cpu", "disk", "redis")
BLOCK = 16
"""sous' KV block size (tokens), the unit of `--num-gpu-blocks-override`."""
CONNECTOR = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if not modes or unknown:
        raise argparse.ArgumentTypeError(f"modes are {','.join(MODES)}; got {text!r}")
    return modes


def median(values: list[float]) -> float | None:
    return percentile(values, 50) if values else None


# --- prompts --------------------------------------------------------------------------------

class PromptMaker:
    """Prompts of seeded random words, exactly (or just under) `tokens` tokens once wrapped in
    the bundled model's chat template, counted with its tokenizer."""

    def __init__(self, tokens: int) -> None:
        from sous.models.bundled import bundled_gguf_path
        from sous.models.gguf_tokenizer import load_tokenizer

        self.tok = load_tokenizer(bundled_gguf_path())
        self.tokens = tokens

    def count(self, text: str) -> int:
        chat = self.tok.apply_chat_template([{"role": "user", "content": text}],
                                            tokenize=False, add_generation_prompt=True)
        return len(self.tok.encode(chat, add_special_tokens=False))

    def make(self, seed: int, tag: str) -> tuple[str, int]:
        """The prompt and its token count; longest prefix of the word list that fits."""
        rng = random.Random(seed)
        words = [rng.choice(WORDS) for _ in range(self.tokens + 64)]
        head = f"Notes {tag}:"
        lo, hi = 0, len(words)
        while lo < hi:  # largest n with count(head + n words) <= tokens
            mid = (lo + hi + 1) // 2
            if self.count(" ".join([head, *words[:mid]])) <= self.tokens:
                lo = mid
            else:
                hi = mid - 1
        text = " ".join([head, *words[:lo]])
        return text, self.count(text)


# --- one streamed request -------------------------------------------------------------------

async def ask(client: aiohttp.ClientSession, target: Target, prompt: str) -> dict[str, Any]:
    """One streamed request: TTFT (s) to the first chunk carrying text, prompt and cached
    tokens from the usage."""
    result = await stream_request(client, target, prompt)
    if not result.ok or result.ttft_s is None or result.prompt_tokens is None:
        raise RuntimeError(f"request failed: {result.error or 'no token or no usage'}")
    return {"ttft_s": round(result.ttft_s, 4), "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens}


async def measure(mode: str, base_url: str, args: argparse.Namespace,
                  prompts: list[dict[str, Any]], warmup: str | None) -> list[dict[str, Any]]:
    """The repeats against a running server: ask, evict, re-ask."""
    runs = []
    async with make_client(base_url, None, 1, args.timeout) as client:
        model = await first_model(client, base_url)
        target = Target(base_url, model, "chat", args.max_tokens, ignore_eos=True,
                        temperature=0.0)
        if warmup is not None:
            await ask(client, target, warmup)
        for i, p in enumerate(prompts):
            first = await ask(client, target, p["prompt"])
            evictors = [await ask(client, target, e) for e in p["evictors"]]
            again = await ask(client, target, p["prompt"])
            runs.append({"repeat": i, "prompt_tokens": first["prompt_tokens"],
                         "recompute_ttft_s": first["ttft_s"],
                         "first_cached_tokens": first["cached_tokens"],
                         "evictor_ttft_s": [e["ttft_s"] for e in evictors],
                         "evictor_cached_tokens": [e["cached_tokens"] for e in evictors],
                         "reask_ttft_s": again["ttft_s"],
                         "reask_cached_tokens": again["cached_tokens"]})
            print(f"kv_offload: {mode} repeat {i}: recompute {first['ttft_s']:.3f} s, "
                  f"re-ask {again['ttft_s']:.3f} s, cached {again['cached_tokens']}",
                  file=sys.stderr, flush=True)
    return runs


# --- servers --------------------------------------------------------------------------------

def redis_command(port: int, *words: str) -> bytes:
    """One RESP command to the Redis on `port`; the raw reply."""
    cmd = f"*{len(words)}\r\n" + "".join(f"${len(w)}\r\n{w}\r\n" for w in words)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(cmd.encode())
        return s.recv(65536)


def start_redis(port: int, log: Path) -> subprocess.Popen:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited {proc.returncode}: {log.read_text()[-1500:]}")
        with contextlib.suppress(OSError):
            if redis_command(port, "PING").startswith(b"+PONG"):
                return proc
        time.sleep(0.2)
    stop(proc, signal.SIGTERM)
    raise RuntimeError(f"redis-server not answering: {log.read_text()[-1500:]}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int | None:
    """`sig` (a clean shutdown), wait, then SIGKILL its process group; the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            return None
    return proc.returncode


def mode_env(mode: str, args: argparse.Namespace, work: Path,
             redis_port: int | None) -> dict[str, str]:
    """The LMCACHE_* variables of a mode (none for `off`)."""
    if mode == "off":
        return {}
    env = {"LMCACHE_CHUNK_SIZE": str(args.chunk_size)}
    if mode == "cpu":
        return env | {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": str(args.cpu_gb)}
    env |= {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": str(args.staging_gb)}
    if mode == "disk":
        disk = work / "disk"
        disk.mkdir()
        return env | {"LMCACHE_LOCAL_DISK": str(disk),
                      "LMCACHE_MAX_LOCAL_DISK_SIZE": str(args.disk_gb)}
    return env | {"LMCACHE_REMOTE_URL": f"redis://127.0.0.1:{redis_port}"}


def log_findings(text: str) -> dict[str, Any]:
    """What a server log says that matters here: its thread line, problems."""
    lines = text.splitlines()
    threads = next((ln.split("sous.engine.cpu_threads: ", 1)[1] for ln in lines
                    if "sous.engine.cpu_threads: " in ln), None)
    offload = next((ln.split("connector: ", 1)[1] for ln in lines
                    if "KV offload (" in ln), None)
    problems = [ln[:300] for ln in lines
                if any(k in ln for k in ("Traceback", "ERROR", "Error", "WARNING"))
                and "Could not load 'builtin' from vLLM" not in ln]
    return {"server_threads": threads, "offload_tiers": offload,
            "tracebacks": text.count("Traceback"), "problems": problems[:12],
            "num_problems": len(problems)}


def run_mode(mode: str, args: argparse.Namespace, prompts: list[dict[str, Any]],
             warmup: str | None) -> dict[str, Any]:
    """One server (and Redis) for `mode`, the repeats, the clean shutdown."""
    work = Path(tempfile.mkdtemp(prefix=f"sous-kvoffload-{mode}-"))
    log = work / "server.log"
    prompt_blocks = math.ceil((args.prompt_tokens + args.max_tokens) / BLOCK)
    blocks = math.ceil(args.cache_factor * prompt_blocks)
    max_len = args.prompt_tokens + args.max_tokens + BLOCK
    server_args = ["--num-gpu-blocks-override", str(blocks), "--max-model-len", str(max_len),
                   *args.server_arg]
    if mode != "off":
        server_args += ["--kv-transfer-config", CONNECTOR]
    out: dict[str, Any] = {"server_args": server_args, "log": str(log)}
    redis = server = None
    redis_port = free_port() if mode == "redis" else None
    try:
        if redis_port is not None:
            redis = start_redis(redis_port, work / "redis.log")
        env = mode_env(mode, args, work, redis_port)
        out["env"] = env
        out["busy_pct_before"] = wait_idle(args.idle_wait)
        port = free_port()
        cmd = [sys.executable, "-m", "sous.cli", "serve", "--port", str(port), *server_args]
        server_env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
        server_env |= {"PYTHONHASHSEED": "0", **env}
        server = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                  env=server_env, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        out["ready_s"] = round(_wait_ready(server, f"{base}/v1/models", args.ready_timeout,
                                           log), 2)
        runs = asyncio.run(measure(mode, base, args, prompts, warmup))
        reask = median([r["reask_ttft_s"] for r in runs])
        recompute = median([r["recompute_ttft_s"] for r in runs])
        misses = median([t for r in runs for t in (r["recompute_ttft_s"], *r["evictor_ttft_s"])])
        out |= {"reask_ttft_s": round(reask, 4), "recompute_ttft_s": round(recompute, 4),
                "speedup_vs_recompute": round(recompute / reask, 2),
                "all_misses_ttft_s": round(misses, 4),
                "reask_cached_tokens": [r["reask_cached_tokens"] for r in runs],
                "prompt_tokens": [r["prompt_tokens"] for r in runs], "runs": runs}
        if redis_port is not None:
            keys = redis_command(redis_port, "DBSIZE").strip().lstrip(b":")
            out["redis_keys"] = int(keys) if keys.isdigit() else keys.decode(errors="replace")
        if mode == "disk":
            files = [f for f in (work / "disk").rglob("*") if f.is_file()]
            out["disk_files"] = len(files)
            out["disk_mib"] = round(sum(f.stat().st_size for f in files) / 2**20, 1)
    except Exception as e:  # the server misbehaved: say what happened, go on with the rest
        out["error"] = f"{type(e).__name__}: {e}"
        with contextlib.suppress(OSError):
            out["log_tail"] = log.read_text(errors="replace")[-3000:]
    finally:
        if server is not None:
            out["exit_code"] = stop(server, signal.SIGINT, args.shutdown_wait)
        if redis is not None:
            stop(redis, signal.SIGTERM, 10)
        shutil.rmtree(work / "disk", ignore_errors=True)
    with contextlib.suppress(OSError):
        out |= log_findings(log.read_text(errors="replace"))
    return out


def machine() -> dict[str, Any]:
    import torch

    return {**machine_info(), "cpu_count": os.cpu_count(),
            "affinity_cpus": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--modes", type=_modes, default=list(MODES),
                   help="comma list of off,cpu,disk,redis, run in order")
    p.add_argument("--repeats", type=int, default=5, help="prompts per mode (median)")
    p.add_argument("--prompt-tokens", type=int, default=4096,
                   help="tokens per prompt, chat template included")
    p.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    p.add_argument("--evictors", type=int, default=2,
                   help="other prompts sent between the ask and the re-ask")
    p.add_argument("--cache-factor", type=float, default=1.3,
                   help="device KV cache size in prompts (--num-gpu-blocks-override)")
    p.add_argument("--chunk-size", type=int, default=256, help="LMCACHE_CHUNK_SIZE")
    p.add_argument("--cpu-gb", type=float, default=4.0, help="cpu: LMCACHE_MAX_LOCAL_CPU_SIZE")
    p.add_argument("--staging-gb", type=float, default=0.5,
                   help="disk, redis: LMCACHE_MAX_LOCAL_CPU_SIZE (staging buffer)")
    p.add_argument("--disk-gb", type=float, default=4.0, help="disk: LMCACHE_MAX_LOCAL_DISK_SIZE")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one full-length request per server before the repeats")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra `sous serve` argument (repeat), e.g. --server-arg=--dtype=float32")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--shutdown-wait", type=float, default=60.0,
                   help="seconds after SIGINT before the server is killed")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    p.add_argument("--idle-wait", type=float, default=30.0,
                   help="seconds to wait at most for the machine to go idle before a mode")
    p.add_argument("--output", default=None, help="also write the JSON to this file")
    args = p.parse_args(argv)

    maker = PromptMaker(args.prompt_tokens)
    prompts = []
    for r in range(args.repeats):
        base_seed = args.seed * 100_000 + r * 100
        text, tokens = maker.make(base_seed, f"r{r}")
        evictors = [maker.make(base_seed + 1 + k, f"r{r}e{k}")[0] for k in range(args.evictors)]
        prompts.append({"prompt": text, "tokens": tokens, "evictors": evictors})
    warmup = maker.make(args.seed * 100_000 - 1, "warm-up")[0] if args.warmup else None

    report: dict[str, Any] = {
        "settings": {"modes": args.modes, "repeats": args.repeats,
                     "prompt_tokens": args.prompt_tokens,
                     "prompt_tokens_tokenizer": [p["tokens"] for p in prompts],
                     "max_tokens": args.max_tokens, "evictors": args.evictors,
                     "cache_factor": args.cache_factor,
                     "num_gpu_blocks": math.ceil(args.cache_factor * math.ceil(
                         (args.prompt_tokens + args.max_tokens) / BLOCK)),
                     "chunk_size": args.chunk_size, "cpu_gb": args.cpu_gb,
                     "staging_gb": args.staging_gb, "disk_gb": args.disk_gb,
                     "warmup": args.warmup, "seed": args.seed, "server_arg": args.server_arg,
                     "greedy": True, "streamed": True, "model": "bundled SmolLM2-135M"},
        "machine": machine(),
        "modes": {},
    }
    for mode in args.modes:
        print(f"kv_offload: mode {mode} ...", file=sys.stderr, flush=True)
        report["modes"][mode] = run_mode(mode, args, prompts, warmup)
    report["summary"] = {
        mode: {k: r.get(k) for k in ("reask_ttft_s", "recompute_ttft_s", "speedup_vs_recompute",
                                     "reask_cached_tokens", "error")}
        for mode, r in report["modes"].items()}
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    return 1 if any("error" in r for r in report["modes"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
