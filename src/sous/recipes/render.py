"""Rendering a composed Plan as shell commands or JSON (Kubernetes is in `k8s.py`).

Shell: a commented header, then one block per process — its env assignments, the launcher,
the model and the args, one per line joined with ` \\` — then the router commands as they
are. Every process block re-parses with `shlex.split(..., comments=True)` to its env words,
launcher words and `argv`. JSON: the shape documented in `plan_to_dict`.

Public API: `render_process`, `render_shell`, `plan_to_dict`, `render_json`.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from sous.recipes.compose import Plan, Process

__all__ = ["plan_to_dict", "render_json", "render_process", "render_shell"]

_INDENT = "    "


def render_process(process: Process) -> str:
    """One runnable command: envs (one per line), `launcher model`, then one arg per line."""
    lines = [e.text for e in process.envs]
    lines.append(f"{process.launcher} {shlex.quote(process.model)}")
    lines += [_INDENT + a.text for a in process.args]
    return " \\\n".join(lines)


def _header(plan: Plan) -> list[str]:
    option = plan.option
    out = [f"# {plan.recipe}: {plan.strategy} ({plan.target})"]
    hw = ", ".join(option.skus) or "?"
    out.append(f"# {option.npus or '?'} x {hw}, verified {option.verified or '-'}")
    out.append("# selection: " + " ".join(f"{a}={v}" for a, v in plan.selection.items()))
    if plan.placeholders_left:
        names = ", ".join(f"<{p}>" for p in plan.placeholders_left)
        fill = " ".join(f"--var {p}=..." for p in plan.placeholders_left)
        out.append(f"# placeholders left for deploy time: {names} (fill with {fill})")
    if len(plan.processes) > 1:
        out.append("# each server command runs in its own shell (or pod); start them all")
    return out


def render_shell(plan: Plan) -> str:
    """The whole plan as shell text: header, server commands, then router commands."""
    blocks = ["\n".join(_header(plan))]
    for process in plan.processes:
        blocks.append(f"# {process.label}\n{render_process(process)}")
    if plan.router:
        steps = "\n\n".join(step.cmd for step in plan.router)
        blocks.append(f"# router (after the servers are up)\n{steps}")
    return "\n\n".join(blocks) + "\n"


def _process_dict(process: Process) -> dict[str, Any]:
    return {
        "role": process.role,
        "rank": process.rank,
        "launcher": process.launcher,
        "model": process.model,
        "env": {e.name: e.value for e in process.envs},
        "args": {a.flag: a.value for a in process.args},
        "argv": process.argv,
    }


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """`{"recipe", "model", "strategy", "target", "selection": {axis: value}, "processes":
    [{"role", "rank", "launcher", "model", "env", "args", "argv"}], "router": {"nodes":
    [{"node", "cmd"}]} or None}`; an arg's value is True for a bare flag, else its word,
    decoded when it is a JSON object, array or number."""
    router = None
    if plan.router is not None:
        router = {"nodes": [{"node": s.node, "cmd": s.cmd} for s in plan.router]}
    return {
        "recipe": plan.recipe,
        "model": plan.model,
        "strategy": plan.strategy,
        "target": plan.target,
        "selection": dict(plan.selection),
        "processes": [_process_dict(p) for p in plan.processes],
        "router": router,
    }


def render_json(plan: Plan) -> str:
    return json.dumps(plan_to_dict(plan), indent=2, ensure_ascii=False) + "\n"
