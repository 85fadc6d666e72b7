"""`sous recipe launch`: the composed topology on this machine, with a small stand-in model.

Each composed `vllm serve` process runs as `python -m sous.cli serve` with the stand-in
model (default: the bundled SmolLM2-135M-Instruct) served under the recipe's model name, so
the recipe's client example works. Every port of the plan (`--port`, whose vLLM default
8000 is made explicit, `--data-parallel-rpc-port`, `*_PORT` envs, `tcp://host:PORT`
endpoints and `kv@host:PORT@` topics) is remapped, consistently, to a free loopback port;
placeholders are filled with 127.0.0.1. Each server's KV cache gets an equal share of the
machine (`VLLM_CPU_KVCACHE_SPACE`, see `kv_cache_share_gib`; `--kv-cache-gib` sets it) unless
the recipe sizes it, so N servers never each claim the whole machine. `--max-model-len`
belongs to the recipe's model, not the stand-in: it is replaced by `--stand-in-max-model-len`
or removed (the stand-in's own maximum), and the summary says so.

Flags `sous serve` does not support yet (its `NOT_SUPPORTED_YET` table) or does not know
stop the launch with a list of them, per process (exit 2); `--drop-unsupported` removes
them instead and prints each dropped flag. A router step (the recipe's `router-values.yaml`
heredoc for the llm-d router, then `helm install`) runs as `sous route` with that file as
written, over every server with its role (`prefill`, `decode`) on a free port; it is the
endpoint to talk to. Each process logs to `<log-dir>/<role>[-rank-N].log`. After every
process answers `/health`, one chat request goes to each (unless `--no-probe`; the router's
goes through the whole topology); then the processes run until Ctrl-C, `--duration` seconds,
or one of them exits (then the others are stopped and the exit is reported).

Public API: `add_launch_parser`, `run_launch`, `LaunchSpec`, `build_launch`,
`kv_cache_share_gib`, `unsupported_flags`, `PortMap`, `router_values`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sous.recipes.compose import Arg, EnvVar, Plan, Process
from sous.recipes.k8s import devices_per_process
from sous.recipes.schema import RecipeError

__all__ = ["LaunchSpec", "PortMap", "add_launch_parser", "build_launch", "kv_cache_share_gib",
           "router_values", "run_launch", "unsupported_flags"]

_PORT_FLAGS = ("--port", "--data-parallel-rpc-port")
_URL_PORT = re.compile(r"(tcp://[^\s:/\"']+:)(\d+)")
_TOPIC_PORT = re.compile(r"(kv@[^\s:@\"']+:)(\d+)(@)")
_MODEL_FLAGS = ("--max-model-len",)
_CHECKPOINT_FLAGS = ("--revision", "--code-revision", "--tokenizer-revision")
"""Pin the recipe's checkpoint on the Hub; the stand-in is a local model: dropped."""


def add_launch_parser(sub: Any, selection_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register `launch` on the `sous recipe` subparsers."""
    p = sub.add_parser("launch", help="run the composed processes here with a stand-in model")
    p.add_argument("name", metavar="NAME", help="recipe name (file stem) or path")
    selection_args(p)
    p.add_argument("--stand-in", metavar="MODEL", default=None,
                   help="model folder or GGUF file to serve in place of the recipe's model "
                   "(default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--stand-in-max-model-len", type=int, default=None, metavar="N",
                   help="--max-model-len for the stand-in (default: its own maximum)")
    p.add_argument("--drop-unsupported", action="store_true",
                   help="run without the flags sous serve does not support yet (listed)")
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="stop everything after this many seconds (default: until Ctrl-C)")
    p.add_argument("--log-dir", default=None, help="folder for one log file per process")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="SECONDS")
    p.add_argument("--max-ranks", type=int, default=None, metavar="N",
                   help="at most N ranks per role, and --data-parallel-size / "
                        "--pipeline-parallel-size capped at N (default: half the CPUs, at "
                        "least 2); the launch prints what it scaled")
    p.add_argument("--kv-cache-gib", type=_positive_gib, default=None, metavar="GIB",
                   help="KV cache GiB of each engine worker (data parallel rank, pipeline "
                        "stage), set as VLLM_CPU_KVCACHE_SPACE where the recipe does not size "
                        "it; LMCache's CPU pool is capped at it too (default: half of this "
                        "machine's available memory shared by all workers, at most 4)")
    p.add_argument("--no-probe", action="store_true",
                   help="do not send a chat request to each server once it is up")


def _positive_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return value


# ----------------------------------------------------------------------------- ports


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PortMap:
    """Recipe port -> local port, allocated on first use (the same recipe port maps to
    the same local port everywhere, so cross references stay consistent)."""

    allocate: Callable[[], int] = free_port
    mapping: dict[int, int] = dataclasses.field(default_factory=dict)

    def __call__(self, port: int) -> int:
        if port not in self.mapping:
            self.mapping[port] = self.allocate()
        return self.mapping[port]

    def ranked(self, port: int, dp_rank: int) -> int:
        """The port to pass a server of data parallel rank `dp_rank` that adds its rank to
        it (KV events, the NIXL side channel): the rank lands on `port + dp_rank`'s map."""
        return self(port + dp_rank) - dp_rank

    def in_text(self, text: str, dp_rank: int = 0) -> str:
        """`tcp://host:PORT` (offset by `dp_rank`, see `ranked`) and `kv@host:PORT@` topics."""
        text = _URL_PORT.sub(lambda m: f"{m.group(1)}{self.ranked(int(m.group(2)), dp_rank)}",
                             text)
        return _TOPIC_PORT.sub(lambda m: f"{m.group(1)}{self(int(m.group(2)))}{m.group(3)}", text)


_RANKED_FLAGS = ("--kv-events-config",)
_RANKED_ENVS = ("VLLM_NIXL_SIDE_CHANNEL_PORT",)
"""Ports a server offsets by its --data-parallel-rank, as vLLM does."""


def _dp_rank(args: Sequence[Arg]) -> int:
    return next((int(a.words[1]) for a in args if a.flag == "--data-parallel-rank"
                 and len(a.words) == 2 and a.words[1].isdigit()), 0)


def _remap_arg(arg: Arg, ports: PortMap, dp_rank: int = 0) -> Arg:
    if arg.flag in _PORT_FLAGS and len(arg.words) == 2 and arg.words[1].isdigit():
        words = (arg.flag, str(ports(int(arg.words[1]))))
    else:
        rank = dp_rank if arg.flag in _RANKED_FLAGS else 0
        words = tuple(ports.in_text(w, rank) for w in arg.words)
    return dataclasses.replace(arg, words=words, text=" ".join(words))


def _remap_env(env: EnvVar, ports: PortMap, dp_rank: int = 0) -> EnvVar:
    value = env.value
    if env.name.endswith("_PORT") and value.isdigit():
        rank = dp_rank if env.name in _RANKED_ENVS else 0
        value = str(ports.ranked(int(value), rank))
    else:
        value = ports.in_text(value)
    return dataclasses.replace(env, value=value, text=f"{env.name}={value}")


# ----------------------------------------------------------------------------- flags


def unsupported_flags(argv: Sequence[str]) -> list[tuple[str, str]]:
    """(flag, why) for each flag of a `serve` argv that sous does not support yet or does
    not know, from `sous.config.engine_args` (its parser and `NOT_SUPPORTED_YET` table)."""
    from sous.config.engine_args import NOT_SUPPORTED_YET, make_serve_parser

    parser = make_serve_parser()
    try:
        values, extras = parser.parse_known_args(list(argv))
    except SystemExit:
        raise RecipeError(f"sous serve cannot parse: {' '.join(argv)}") from None
    found = vars(values)
    out = [(row.flag, row.reason) for row in NOT_SUPPORTED_YET if row.refuses(found)]
    out += [(x.partition("=")[0], "unknown to sous serve") for x in extras if x.startswith("-")]
    return out


@dataclass(frozen=True)
class LaunchSpec:
    """One process to start: its label, full command, added env, port and log file."""

    label: str
    command: tuple[str, ...]
    env: dict[str, str]
    port: int
    log: Path
    dropped: tuple[tuple[str, str], ...]
    notes: tuple[str, ...]
    entry: bool = False
    """The process clients talk to (the router, when the plan has one)."""


def stand_in_has_experts(stand_in: str | None) -> bool:
    """Whether the stand-in model has routed experts (a folder whose config.json says so; the
    bundled model and GGUF files are dense)."""
    if stand_in is None:
        return False
    config = Path(stand_in).expanduser() / "config.json"
    try:
        values = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return any(int(values.get(k) or 0) > 0
               for k in ("n_routed_experts", "num_local_experts", "num_experts"))


def _stand_in_args(process: Process, stand_in_len: int | None, stand_in: str | None = None,
                   ) -> tuple[list[Arg], list[str]]:
    args, notes = [], []
    dense = not stand_in_has_experts(stand_in)
    for arg in process.args:
        if arg.flag == "--enable-expert-parallel" and dense:
            notes.append(f"{arg.text}: the stand-in model is dense, it has no experts to split "
                         "(removed; a MoE --stand-in keeps it)")
            continue
        if arg.flag in _CHECKPOINT_FLAGS:
            notes.append(f"{arg.text} pins {process.model}'s checkpoint: removed (stand-in)")
            continue
        if arg.flag in _MODEL_FLAGS:
            if stand_in_len is None:
                notes.append(f"{arg.text} is for {process.model}: removed (stand-in's maximum)")
                continue
            notes.append(f"{arg.text} is for {process.model}: "
                         f"{arg.flag} {stand_in_len} for the stand-in")
            arg = Arg(arg.flag, (arg.flag, str(stand_in_len)), f"{arg.flag} {stand_in_len}")
        args.append(arg)
    if process.arg("--port") is None:
        args.append(Arg("--port", ("--port", "8000"), "--port 8000"))  # vLLM's default
    if process.arg("--served-model-name") is None:
        name = process.model
        args.append(Arg("--served-model-name", ("--served-model-name", name),
                        f"--served-model-name {name}"))
    return args, notes


def kv_cache_share_gib(num_servers: int, available_bytes: int | None = None) -> float:
    """KV cache GiB for each of `num_servers` on this machine: half the memory available
    now (the rest is for weights, activations and everything else), split evenly, at most
    vLLM-CPU's default of 4 GiB, at least 0.05 GiB; rounded down to 0.01 GiB."""
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    share = available_bytes / 2 / max(num_servers, 1) / 2**30
    return max(0.05, min(4.0, int(share * 100) / 100))


def _kv_budget_env(process: Process, envs: list[EnvVar], share_gib: float, why: str
                   ) -> tuple[dict[str, str], list[str]]:
    """The process's environment, plus VLLM_CPU_KVCACHE_SPACE=`share_gib` unless the recipe
    sizes the KV cache itself; and the note saying so (and `why` that size)."""
    env = {e.name: e.value for e in envs}
    if "VLLM_CPU_KVCACHE_SPACE" in env or process.arg("--kv-cache-memory-bytes") is not None:
        return env, []
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{share_gib:g}"
    return env, [f"VLLM_CPU_KVCACHE_SPACE={share_gib:g} (KV cache GiB: {why})"]


def _lmcache_cpu_cap(env: dict[str, str], share_gib: float) -> list[str]:
    """Cap the recipe's LMCACHE_MAX_LOCAL_CPU_SIZE (LMCache fills a pool that large in every
    engine worker: each pipeline stage has its own) at `share_gib` in `env`; the note."""
    raw = env.get("LMCACHE_MAX_LOCAL_CPU_SIZE")
    try:
        size = float(raw) if raw is not None else None
    except ValueError:
        return []  # the server reports it, naming the variable
    if size is None or size <= share_gib:
        return []
    env["LMCACHE_MAX_LOCAL_CPU_SIZE"] = f"{share_gib:g}"
    return [f"LMCACHE_MAX_LOCAL_CPU_SIZE={raw} -> {share_gib:g} (LMCache's CPU pool, filled "
            "in each engine worker: capped at this machine's KV cache share)"]


def build_launch(plan: Plan, stand_in: str | None, log_dir: Path, ports: PortMap,
                 drop_unsupported: bool, stand_in_len: int | None = None,
                 kv_share_gib: float | None = None,
                 ) -> tuple[list[LaunchSpec], dict[str, list[tuple[str, str]]]]:
    """The processes to start, and per process label the unsupported flags that block
    the launch (empty when none, or when they are dropped). Each engine worker (a data
    parallel rank, a pipeline stage) gets an equal KV cache share (`kv_share_gib`, as
    `--kv-cache-gib` gives it; default `kv_cache_share_gib` over all of them). With a
    router, its config file is written to `log_dir` and `sous route` comes last."""
    specs, blocking, roles = [], {}, []
    why = "--kv-cache-gib"
    if kv_share_gib is None:
        kv_share_gib = kv_cache_share_gib(sum(devices_per_process(p) for p in plan.processes))
        why = ("half of this machine's available memory, shared by the engine workers, "
               "at most 4")
    for process in plan.processes:
        if process.launcher_words != ["vllm", "serve"]:
            raise RecipeError(f"{process.label}: launcher {process.launcher!r} is not "
                              "`vllm serve`; sous can only stand in for vllm serve")
        args, notes = _stand_in_args(process, stand_in_len, stand_in)
        dp_rank = _dp_rank(args)
        args = [_remap_arg(a, ports, dp_rank) for a in args]
        bad = unsupported_flags([w for a in args for w in a.words])
        bad_flags = {f for f, _ in bad}
        if bad and not drop_unsupported:
            blocking[process.label] = bad
        elif bad:
            args = [a for a in args if a.flag not in bad_flags]
        env, kv_notes = _kv_budget_env(
            process, [_remap_env(e, ports, dp_rank) for e in process.envs], kv_share_gib, why)
        kv_notes += _lmcache_cpu_cap(env, kv_share_gib)
        port = int(next(a.words[1] for a in args if a.flag == "--port"))
        name = process.role if process.rank is None else f"{process.role}-rank-{process.rank}"
        words = [w for a in args for w in a.words]
        command = (sys.executable, "-m", "sous.cli", "serve",
                   *([stand_in] if stand_in else []), *words)
        specs.append(LaunchSpec(label=process.label, command=command, env=env, port=port,
                                log=log_dir / f"{name}.log",
                                dropped=tuple(bad) if drop_unsupported else (),
                                notes=tuple(notes + kv_notes)))
        roles.append(process.role)
    if plan.router and not blocking:  # its config file is written only for a launch
        specs.append(_router_spec(plan, list(zip(roles, specs, strict=True)), stand_in, log_dir,
                                  ports.allocate()))
    return specs, blocking


_HEREDOC = re.compile(r"cat\s+>\s*(\S+)\s+<<-?\s*['\"]?(\w+)['\"]?\n(.*?)\n\2\s*$", re.S)


def router_values(plan: Plan) -> tuple[str, str]:
    """(file name, text) of the router config the recipe's router steps write."""
    for step in plan.router or ():
        match = _HEREDOC.match(step.cmd.strip())
        if match:
            return match.group(1), match.group(3) + "\n"
    raise RecipeError("router: no `cat > FILE <<EOF` step with the router config; "
                      "sous route needs it")


def _router_spec(plan: Plan, servers: list[tuple[str, LaunchSpec]], stand_in: str | None,
                 log_dir: Path, port: int) -> LaunchSpec:
    name, text = router_values(plan)
    config = log_dir / Path(name).name
    config.write_text(text, encoding="utf-8")
    endpoints = [w for role, spec in servers
                 for w in ("--endpoint", f"{role}=http://127.0.0.1:{spec.port}")]
    command = (sys.executable, "-m", "sous.cli", "route", "--config", str(config),
               *endpoints, "--port", str(port), *(["--tokenizer", stand_in] if stand_in else []))
    note = (f"the recipe's {name} as written ({config}); `helm install` of the llm-d router is "
            "replaced by sous route over the servers above")
    return LaunchSpec(label="router", command=command, env={}, port=port,
                      log=log_dir / "router.log", dropped=(), notes=(note,), entry=True)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _report_blocking(blocking: dict[str, list[tuple[str, str]]]) -> None:
    _say("sous recipe launch: error: sous serve does not support these flags yet:")
    for label, bad in blocking.items():
        _say(f"  {label}:")
        for flag, why in bad:
            _say(f"    {flag}: {why}")
    _say("Nothing was started. --drop-unsupported runs the topology without them "
         "(the features they turn on are then absent).")


def run_launch(args: argparse.Namespace, plan: Plan) -> int:
    """Start the plan's processes (see the module docstring); returns the exit status."""
    from sous.recipes.supervise import supervise

    if plan.placeholders_left:
        raise RecipeError("internal: placeholders left in a launch plan")
    from sous.recipes.scale import default_max_ranks, scale_plan

    try:
        plan, scaled = scale_plan(
            plan, default_max_ranks() if args.max_ranks is None else args.max_ranks)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    for note in scaled:
        _say(f"NOTE scaled to this machine: {note}")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="sous-launch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    specs, blocking = build_launch(plan, args.stand_in, log_dir, PortMap(),
                                   args.drop_unsupported, args.stand_in_max_model_len,
                                   args.kv_cache_gib)
    if blocking:
        _report_blocking(blocking)
        return 2
    for spec in specs:
        for flag, why in spec.dropped:
            _say(f"WARNING {spec.label}: DROPPED {flag} ({why})")
        for note in spec.notes:
            _say(f"NOTE {spec.label}: {note}")
    return supervise(specs, duration=args.duration, ready_timeout=args.ready_timeout,
                     probe=not args.no_probe)
