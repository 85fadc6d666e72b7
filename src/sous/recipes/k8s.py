"""Rendering a composed Plan as Kubernetes YAML (one `kind: List` document).

- One `apps/v1 Deployment` per role (`<recipe>-<role>`, 1 replica). Its pod template has one
  container per rank (`<role>-rank-<i>`; `<role>` for a role without ranks), all in one pod
  because the ranks of a role share its address (`<POD_IP>`). Each container runs the
  launcher words as `command`, the model and args as `args`, the process's env as `env`,
  exposes `--port`, and asks for its accelerators as the extended resource `resource`
  (default `rebellions.ai/npu`, the RBLN device plugin's generic name) in requests and limits.
- Accelerators per process: tensor x pipeline x data-parallel size, where a process that
  names its own `--data-parallel-rank` drives one data-parallel rank.
- `<POD_IP>` left unfilled becomes `$(POD_IP)`, which Kubernetes expands from an env
  `POD_IP` taken from `status.podIP` (downward API); other placeholders stay as they are.
- Pods carry `llm-d.ai/role: <role>` for prefill/decode roles and the router values'
  `inference_pool.match_labels`, so the router's pool and filters select them.
- The router's values file (the heredoc of a router step) becomes a ConfigMap
  `<recipe>-router-values`; the other router steps (`helm install`) are listed in the
  header comments, to run after applying.

Public API: `render_k8s`, `plan_to_k8s`, `devices_per_process`, `DEFAULT_RESOURCE`.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from sous.recipes.compose import Plan, Process, RouterStep

__all__ = ["DEFAULT_RESOURCE", "devices_per_process", "plan_to_k8s", "render_k8s"]

DEFAULT_RESOURCE = "rebellions.ai/npu"
DEFAULT_IMAGE = "<IMAGE>"
_HEREDOC = re.compile(r"\Acat\s+>\s*(\S+)\s+<<-?\s*'?(\w+)'?\n(.*)\n\2\s*\Z", re.S)
_PD_ROLES = ("prefill", "decode")


def _dns_name(*parts: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
    return name[:63].rstrip("-") or "sous"


def _int_arg(process: Process, flag: str, default: int) -> int:
    arg = process.arg(flag)
    value = arg.value if arg is not None else default
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def devices_per_process(process: Process) -> int:
    """Accelerators one process drives: TP x PP x (DP unless it names its DP rank)."""
    tp = _int_arg(process, "--tensor-parallel-size", 1)
    pp = _int_arg(process, "--pipeline-parallel-size", 1)
    dp = 1 if process.arg("--data-parallel-rank") else _int_arg(process, "--data-parallel-size", 1)
    return max(1, tp * pp * dp)


def _k8s_text(text: str, downward: bool) -> str:
    return text.replace("<POD_IP>", "$(POD_IP)") if downward else text


def _container(process: Process, image: str, resource: str, downward: bool) -> dict[str, Any]:
    name = process.role if process.rank is None else f"{process.role}-rank-{process.rank}"
    env: list[dict[str, Any]] = []
    if downward:
        env.append({"name": "POD_IP",
                    "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    env += [{"name": e.name, "value": _k8s_text(e.value, downward)} for e in process.envs]
    count = str(devices_per_process(process))
    container: dict[str, Any] = {
        "name": _dns_name(name),
        "image": image,
        "command": process.launcher_words,
        "args": [_k8s_text(w, downward) for w in process.argv],
        "env": env,
        "resources": {"requests": {resource: count}, "limits": {resource: count}},
    }
    port = _int_arg(process, "--port", 0)
    if port:
        container["ports"] = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    return container


def _router_values(router: tuple[RouterStep, ...] | None) -> tuple[dict[str, str], list[str]]:
    """(file name -> content of each heredoc step, the other steps' commands)."""
    files, others = {}, []
    for step in router or ():
        m = _HEREDOC.match(step.cmd.strip())
        if m:
            files[m.group(1)] = m.group(3) + "\n"
        else:
            others.append(step.cmd)
    return files, others


def _pool_labels(files: dict[str, str]) -> dict[str, str]:
    for content in files.values():
        try:
            values = yaml.safe_load(content)
        except yaml.YAMLError:
            continue
        pool = values.get("inference_pool") if isinstance(values, dict) else None
        labels = pool.get("match_labels") if isinstance(pool, dict) else None
        if isinstance(labels, dict):
            return {str(k): str(v) for k, v in labels.items()}
    return {}


def _deployment(plan: Plan, role: str, containers: list[dict[str, Any]],
                extra_labels: dict[str, str]) -> dict[str, Any]:
    name = _dns_name(plan.recipe, role)
    selector = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": _dns_name(plan.recipe)}
    labels = {**selector, **extra_labels}
    if role in _PD_ROLES:
        labels["llm-d.ai/role"] = role
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels,
                     "annotations": {"sous.recipe/strategy": plan.strategy,
                                     "sous.recipe/target": plan.target}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": labels},
                         "spec": {"containers": containers}},
        },
    }


def plan_to_k8s(plan: Plan, image: str = DEFAULT_IMAGE, resource: str = DEFAULT_RESOURCE,
                pod_ip_from_downward_api: bool = True) -> dict[str, Any]:
    """The plan as one `v1 List` of Deployments (one per role) and the router ConfigMap."""
    downward = pod_ip_from_downward_api and "POD_IP" in plan.placeholders_left
    files, _ = _router_values(plan.router)
    pool_labels = _pool_labels(files)
    items = []
    for role in plan.roles():
        containers = [_container(p, image, resource, downward)
                      for p in plan.processes if p.role == role]
        items.append(_deployment(plan, role, containers, pool_labels))
    if files:
        items.append({"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": {"name": _dns_name(plan.recipe, "router-values"),
                                   "labels": {"app.kubernetes.io/part-of": _dns_name(plan.recipe)}},
                      "data": files})
    return {"apiVersion": "v1", "kind": "List", "items": items}


def _header(plan: Plan, image: str, others: list[str]) -> list[str]:
    out = [f"# {plan.recipe}: {plan.strategy} ({plan.target})",
           "# selection: " + " ".join(f"{a}={v}" for a, v in plan.selection.items())]
    if image == DEFAULT_IMAGE:
        out.append("# set the container image with --image (left as <IMAGE>)")
    left = [p for p in plan.placeholders_left if p != "POD_IP"]
    if left:
        out.append("# placeholders left for deploy time: " + ", ".join(f"<{p}>" for p in left))
    if others:
        out.append("# after `kubectl apply`, run the router steps (values from the ConfigMap):")
        out += ["#   " + line for cmd in others for line in cmd.splitlines()]
    return out


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (JSON flag values, the router values file) as literal blocks;
    no YAML anchors/aliases."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def render_k8s(plan: Plan, image: str = DEFAULT_IMAGE, resource: str = DEFAULT_RESOURCE,
               pod_ip_from_downward_api: bool = True) -> str:
    """YAML text (header comments, then one document) of `plan_to_k8s`."""
    doc = plan_to_k8s(plan, image, resource, pod_ip_from_downward_api)
    _, others = _router_values(plan.router)
    body = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
    return "\n".join(_header(plan, image, others)) + "\n" + body
