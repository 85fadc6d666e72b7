"""Scaling a composed plan down to this machine for `sous recipe launch`.

A recipe sizes its ranks for a rack of accelerators (`--data-parallel-size 8`, eight decode
ranks); the stand-in model on a laptop needs far fewer to show the same topology. `scale_plan`
keeps at most `max_ranks` ranks per role (ranks 0 .. max_ranks-1) and lowers every
`--data-parallel-size` and `--pipeline-parallel-size` above it to `max_ranks`, returning one
note per change so the launch says exactly what it scaled.
"""

from __future__ import annotations

import dataclasses
import os

from sous.recipes.compose import Arg, Plan, Process

SCALED_FLAGS = ("--data-parallel-size", "--pipeline-parallel-size")


def default_max_ranks(cpu_count: int | None = None) -> int:
    """Ranks per role by default: half the CPUs, at least 2 (a P/D router needs two decode
    ranks to choose between)."""
    return max(2, (cpu_count or os.cpu_count() or 2) // 2)


def _scaled_arg(arg: Arg, max_ranks: int) -> tuple[Arg, str | None]:
    if arg.flag not in SCALED_FLAGS or len(arg.words) != 2 or not arg.words[1].isdigit():
        return arg, None
    size = int(arg.words[1])
    if size <= max_ranks:
        return arg, None
    words = (arg.flag, str(max_ranks))
    return (dataclasses.replace(arg, words=words, text=" ".join(words)),
            f"{arg.flag} {size} -> {max_ranks}")


def _scaled_process(process: Process, max_ranks: int) -> tuple[Process, list[str]]:
    args, notes = [], []
    for arg in process.args:
        new, note = _scaled_arg(arg, max_ranks)
        args.append(new)
        if note:
            notes.append(note)
    return dataclasses.replace(process, args=tuple(args)), notes


def scale_plan(plan: Plan, max_ranks: int) -> tuple[Plan, list[str]]:
    """`plan` with at most `max_ranks` ranks per role and parallel sizes capped (module
    docstring), and the notes saying what changed ("" entries never)."""
    if max_ranks < 1:
        raise ValueError(f"--max-ranks {max_ranks}: must be at least 1")
    kept: list[Process] = []
    notes: list[str] = []
    counts: dict[str, int] = {}
    for process in plan.processes:
        counts[process.role] = counts.get(process.role, 0) + 1
        if process.rank is not None and process.rank >= max_ranks:
            continue
        scaled, changed = _scaled_process(process, max_ranks)
        kept.append(scaled)
        for note in changed:
            notes.append(f"{process.label}: {note} (--max-ranks {max_ranks})")
    for role, count in counts.items():
        here = sum(1 for p in kept if p.role == role)
        if here < count:
            notes.append(f"{role}: {count} ranks in the recipe, {here} here "
                         f"(--max-ranks {max_ranks})")
    return dataclasses.replace(plan, processes=tuple(kept)), notes
