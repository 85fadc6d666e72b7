"""CPU threads: how many OpenMP threads the worker runs and which CPU each one is pinned to.

The variables are vLLM-CPU's (vllm/v1/worker/cpu_worker.py), parsed by `parse_cpu_threads_env`
(a pure function of the environment and the CPUs this process may run on) into
`ParallelConfig.cpu_threads`; a malformed value is a ValueError naming the variable, so
`sous serve` exits 2 with one line.

* `VLLM_CPU_OMP_THREADS_BIND`: `auto` (default), `nobind`, or a CPU list per rank: `0-3`,
  `0,2,4-7`; ranks separated by `|` (`0-3|4-7`: rank 0 on CPUs 0-3, rank 1 on 4-7; with data
  parallel the list is sliced by local DP rank, `world_size` entries per DP rank).
* `VLLM_CPU_NUM_OF_RESERVED_CPU`: in `auto` mode, how many CPUs (the highest-numbered ones) of
  the allowed set are left out of the OpenMP set for the front end. Default 0: sous' front
  end (HTTP, tokenization, scheduling) is light and runs between the steps.
* `OMP_NUM_THREADS`: caps the thread count of a binding (the first CPUs of the list are kept);
  with `nobind` it simply sets `torch.set_num_threads`.

sous' `auto` on Linux: every CPU the process may run on (`os.sched_getaffinity`) minus the
reserved ones, one OpenMP thread per CPU, each pinned to its own CPU. Off Linux nothing is
bound. `nobind` leaves torch's thread settings alone (unless OMP_NUM_THREADS is set).

Binding (`apply_cpu_threads`, once when the Worker starts, before the model loads) calls
`torch.set_num_threads(n)` and then pins thread t of the calling thread's OpenMP pool to CPU t
(the `sous_ops` C++ helper `pin_omp_threads`); torch's thread count is not changed afterwards.
OpenMP pools belong to the thread that starts the parallel regions, so a Worker whose steps run
on another thread re-pins that thread's pool there (`CpuBinding.follow_current_thread`).
Threads started later by a pinned thread inherit its single CPU: a front-end thread calls
`unpin_current_thread` to run on the CPUs the binding leaves free (all of them if none).
Without the C++ extension the whole process (every current thread) is bound to the CPU set
instead, with one warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BIND_ENV",
    "OMP_ENV",
    "RESERVED_ENV",
    "CpuBinding",
    "CpuThreadsEnv",
    "allowed_cpus",
    "apply_cpu_threads",
    "format_cpus",
    "parse_cpu_list",
    "parse_cpu_threads_env",
    "resolve_cpus",
    "unpin_current_thread",
]

logger = logging.getLogger(__name__)

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
OMP_ENV = "OMP_NUM_THREADS"
ENV_VARS = (BIND_ENV, RESERVED_ENV, OMP_ENV)


@dataclass(frozen=True)
class CpuThreadsEnv:
    """The CPU-thread variables, parsed (see the module docstring)."""

    bind: Literal["auto", "nobind", "list"] = "auto"
    rank_cpus: tuple[tuple[int, ...], ...] = ()
    """`list` mode: the CPUs of each rank, in the order given."""
    reserved: int = 0
    """VLLM_CPU_NUM_OF_RESERVED_CPU (used in `auto` mode)."""
    omp_num_threads: int | None = None
    """OMP_NUM_THREADS when set: the most threads a binding uses."""
    spec: str = "auto"
    """VLLM_CPU_OMP_THREADS_BIND as given (for messages)."""


@dataclass
class CpuBinding:
    """A binding in effect: OpenMP thread t of `thread_id`'s pool runs on `cpus[t]`."""

    cpus: tuple[int, ...]
    per_thread: bool
    """True: each OpenMP thread pinned to its own CPU; False: the process bound to the set."""
    thread_id: int
    """`threading.get_ident()` of the thread whose pool is pinned (the pool's master)."""
    native_id: int
    """Its OS thread id (`threading.get_native_id()`)."""

    def follow_current_thread(self) -> None:
        """Re-pin for the calling thread when it is not the pinned master (its steps run on
        their own OpenMP pool), and give the previous master back the process' CPUs. Mutates
        self; no-op on the master itself."""
        if threading.get_ident() == self.thread_id:
            return
        import torch

        torch.set_num_threads(len(self.cpus))
        self.per_thread = _pin(self.cpus, warn=False)
        if self.per_thread:
            with contextlib.suppress(OSError):  # that thread may have ended
                os.sched_setaffinity(self.native_id, allowed_cpus())
        self.thread_id, self.native_id = threading.get_ident(), threading.get_native_id()
        logger.debug("CPU threads: OpenMP pool of thread %d pinned to CPUs %s",
                     self.native_id, format_cpus(self.cpus))


_process_cpus: frozenset[int] | None = None
"""The CPUs the process could run on before the first binding pinned any of its threads."""
_active: CpuBinding | None = None
_fallback_warned = False


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on: its affinity before any binding (the calling thread's
    affinity is narrowed by a binding); empty where the OS has no affinity API."""
    if _process_cpus is not None:
        return _process_cpus
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    return frozenset(os.sched_getaffinity(0))


def format_cpus(cpus: Iterable[int]) -> str:
    """`[0, 1, 2, 5]` -> `"0-2,5"` (Linux cpulist format), in the order given (a set: sorted)."""
    out: list[str] = []
    ordered = sorted(cpus) if isinstance(cpus, set | frozenset) else list(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def parse_cpu_list(text: str, name: str = BIND_ENV, spec: str | None = None) -> tuple[int, ...]:
    """`"0,2,4-7"` -> (0, 2, 4, 5, 6, 7) in the order given; ValueError naming `name` for a
    malformed item, a reversed range or a CPU listed twice."""
    spec = text if spec is None else spec
    cpus: list[int] = []
    for item in text.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not (lo.strip().isdigit() and (not sep or hi.strip().isdigit())):
            raise ValueError(f"{name}={spec!r}: {item.strip()!r} is not a CPU or a range "
                             "of CPUs (expected e.g. 0-3 or 0,2,4-7)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{name}={spec!r}: range {item.strip()!r} runs backwards")
        cpus.extend(range(first, last + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{name}={spec!r}: a CPU is listed twice")
    return tuple(cpus)


def _count(environ: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    first = raw.split(",")[0].strip()  # OMP_NUM_THREADS may list nested levels: 4,2
    if not first.isdigit() or int(first) < minimum:
        raise ValueError(f"{name}={raw!r}: expected an integer >= {minimum}")
    return int(first)


def parse_cpu_threads_env(environ: Mapping[str, str],
                          allowed: Iterable[int] | None = None) -> CpuThreadsEnv:
    """The variables in `environ`, checked against `allowed` (the CPUs this process may run
    on; `allowed_cpus()` when None). ValueError naming the variable when one is malformed, lists
    a CPU outside `allowed`, or reserves every CPU."""
    allowed = frozenset(allowed_cpus() if allowed is None else allowed)
    reserved = _count(environ, RESERVED_ENV, 0) or 0
    if allowed and reserved >= len(allowed):
        raise ValueError(f"{RESERVED_ENV}={reserved}: must be less than the {len(allowed)} "
                         f"CPUs this process may run on ({format_cpus(allowed)})")
    omp = _count(environ, OMP_ENV, 1)
    spec = environ.get(BIND_ENV, "").strip() or "auto"
    if spec in ("auto", "nobind"):
        return CpuThreadsEnv(bind=spec, reserved=reserved, omp_num_threads=omp, spec=spec)
    ranks = tuple(parse_cpu_list(part, BIND_ENV, spec) for part in spec.split("|"))
    outside = sorted({c for cpus in ranks for c in cpus} - allowed) if allowed else []
    if outside:
        raise ValueError(f"{BIND_ENV}={spec!r}: CPU {format_cpus(outside)} is not one this "
                         f"process may run on ({format_cpus(allowed)})")
    return CpuThreadsEnv(bind="list", rank_cpus=ranks, reserved=reserved,
                         omp_num_threads=omp, spec=spec)


def resolve_cpus(env: CpuThreadsEnv, allowed: Iterable[int], rank: int = 0,
                 world_size: int = 1, local_dp_rank: int | None = None,
                 platform: str = sys.platform, local_dp_size: int = 1,
                 ) -> tuple[int, ...] | None:
    """The CPUs rank `rank` binds its OpenMP threads to, one thread per CPU (capped by
    OMP_NUM_THREADS); None: bind nothing (`nobind`). In `auto` mode the `local_dp_size` data
    parallel ranks on this node, times the `world_size` workers (pipeline stages) of each,
    split the CPUs into equal contiguous shares (worker `rank` of rank `local_dp_rank` takes
    its share). ValueError naming VLLM_CPU_OMP_THREADS_BIND when the
    list has no entry for this rank. Off Linux nothing is bound (no per-thread affinity
    API)."""
    if env.bind == "nobind" or not platform.startswith("linux"):
        return None
    if env.bind == "auto":
        ordered = sorted(allowed)
        if env.reserved >= len(ordered):
            raise ValueError(f"{RESERVED_ENV}={env.reserved}: must be less than the "
                             f"{len(ordered)} CPUs this process may run on")
        cpus = tuple(ordered[:len(ordered) - env.reserved])
        parts = local_dp_size * world_size
        if parts > 1:
            share = len(cpus) // parts
            if share == 0:
                raise ValueError(f"{parts} engine ranks ({local_dp_size} data parallel x "
                                 f"{world_size} pipeline) need at least one CPU each; this "
                                 f"process may run on {format_cpus(cpus)}")
            first = ((local_dp_rank or 0) * world_size + rank) * share
            cpus = cpus[first:first + share]
    else:
        entries = env.rank_cpus
        first = 0 if local_dp_rank is None else local_dp_rank * world_size
        needed = first + world_size
        if len(entries) < needed or rank >= world_size:
            raise ValueError(f"{BIND_ENV}={env.spec!r}: {len(entries)} CPU list(s) for "
                             f"{needed} ranks (one per rank, separated by |)")
        cpus = entries[first + rank]
    return cpus[:env.omp_num_threads] if env.omp_num_threads else cpus


def _ops_pinner() -> Callable[[list[list[int]]], list[list[int]]] | None:
    """`sous_ops.pin_omp_threads`, or None when the extension is unavailable (or skipped with
    SOUS_ATTENTION=torch)."""
    if os.environ.get("SOUS_ATTENTION", "").strip().lower() == "torch":
        return None
    from sous.engine.ops.build import load

    mod = load()
    return getattr(mod, "pin_omp_threads", None) if mod is not None else None


def _pin(cpus: tuple[int, ...], warn: bool = True) -> bool:
    """Pin OpenMP thread t of the calling thread's pool to `cpus[t]`; True when done per
    thread, False when the process (every current thread) was bound to the set instead."""
    global _fallback_warned
    pin = _ops_pinner()
    if pin is not None:
        placed = pin([[c] for c in cpus])
        if all(p == [c] for p, c in zip(placed, cpus, strict=True)):
            return True
        why = f"the OpenMP runtime placed its threads on {placed}"
    else:
        why = "the sous_ops C++ extension is unavailable"
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # the thread may have ended meanwhile
            os.sched_setaffinity(int(tid), cpus)
    if warn and not _fallback_warned:
        _fallback_warned = True
        logger.warning("CPU threads: no per-thread pinning (%s); the process is bound to "
                       "CPUs %s instead", why, format_cpus(cpus))
    return False


def apply_cpu_threads(env: CpuThreadsEnv, rank: int = 0, world_size: int = 1,
                      local_dp_rank: int | None = None, local_dp_size: int = 1,
                      ) -> CpuBinding | None:
    """Apply `env` for this rank in the calling thread (module docstring) and log one line.
    Returns the binding, or None when nothing is bound. Mutates process state: torch's thread
    count, the affinity of the calling thread and of its OpenMP pool (or of the process)."""
    global _process_cpus, _active
    import torch

    allowed = allowed_cpus()
    cpus = resolve_cpus(env, allowed, rank, world_size, local_dp_rank,
                        local_dp_size=local_dp_size)
    if cpus is None and env.bind == "list":
        logger.warning("CPU threads: %s=%s is ignored: binding needs Linux", BIND_ENV, env.spec)
    if cpus is None:
        if env.omp_num_threads:
            torch.set_num_threads(env.omp_num_threads)
        elif local_dp_size * world_size > 1:  # unbound ranks must not oversubscribe either
            torch.set_num_threads(max(1, len(allowed) // (local_dp_size * world_size)))
        logger.info("CPU threads: %d OpenMP thread(s), not bound (%s=%s%s)",
                    torch.get_num_threads(), BIND_ENV, env.spec,
                    f", {OMP_ENV}={env.omp_num_threads}" if env.omp_num_threads else "")
        return None
    if _process_cpus is None:
        _process_cpus = allowed
    torch.set_num_threads(len(cpus))
    per_thread = _pin(cpus)
    _active = CpuBinding(cpus, per_thread, threading.get_ident(), threading.get_native_id())
    source = f"{BIND_ENV}={env.spec}" + (f", {env.reserved} reserved" if env.bind == "auto"
                                         else "")
    logger.info("CPU threads: %d OpenMP thread(s) on CPUs %s, %s (%s%s)", len(cpus),
                format_cpus(cpus), "one pinned per CPU" if per_thread else "process-bound",
                source, f", {OMP_ENV}={env.omp_num_threads}" if env.omp_num_threads else "")
    return _active


def unpin_current_thread() -> None:
    """Let the calling thread (a front-end thread started by a pinned one) run on the CPUs the
    binding leaves free, or on every allowed CPU when it uses them all. No-op when nothing is
    bound in this process."""
    if _active is None or _process_cpus is None:
        return
    free = _process_cpus - set(_active.cpus)
    try:
        os.sched_setaffinity(0, free or _process_cpus)
    except OSError as e:
        logger.debug("CPU threads: could not unpin thread %d: %s", threading.get_native_id(), e)
