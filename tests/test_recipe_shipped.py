"""Every strategy x target x (base, recommended, each single axis value) of every shipped
recipe: compose succeeds (or is refused as excluded), the shell output re-parses to the JSON
argv, the flags/envs of each delta are present or absent as the recipe says, the Kubernetes
output has one container per process, and the fit check reads every process."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from sous.recipes.catalog import load_recipe, shipped_names
from sous.recipes.check import CheckOverrides, check_plan, inputs_for_process
from sous.recipes.compose import ExcludedSelection, compose
from sous.recipes.k8s import devices_per_process, plan_to_k8s, render_k8s
from sous.recipes.render import plan_to_dict, render_process, render_shell

RECIPES = {name: load_recipe(name) for name in shipped_names()}
RECIPE = RECIPES["minimax-m2.7"]
AXK2 = RECIPES["ax-k2"]


def _cases():
    for name, lr in RECIPES.items():
        for s in lr.recipe.strategies:
            for o in s.options:
                grid, at = o.grid, f"{name}-{s.slug}-{o.target}"
                yield pytest.param(name, s.slug, o.target, "base", {}, id=f"{at}-base")
                yield pytest.param(name, s.slug, o.target, "recommended", {},
                                   id=f"{at}-recommended")
                for axis, values in grid.axes.items():
                    for value in values:
                        yield pytest.param(name, s.slug, o.target, "set", {axis: value},
                                           id=f"{at}-{axis}={value}")


def test_every_shipped_recipe_is_covered():
    assert {"ax-k2", "minimax-m2.7"} <= set(RECIPES)
    names = {p.values[0] for p in _cases()}
    assert names == set(RECIPES)


def _bash_words(text: str) -> list[str]:
    return shlex.split(text.replace(" \\\n", " "))


def _excluded(grid, selection) -> bool:
    return any(all(selection.get(a) == v for a, v in e.items()) for e in grid.excluded)


def _check_delta(plan, base_plan, key, grid):
    """Each role named by the delta has its adds and lacks its dels (unless a rank sets the
    flag itself); roles not named are identical to the base."""
    roles = {b.role: b for b in grid.base}
    delta = grid.deltas[key]
    base_by = {p.label: p for p in base_plan.processes}
    for p in plan.processes:
        rank_args, rank_envs = {}, {}
        ranks = roles[p.role].ranks
        if ranks is not None:
            rank_args, rank_envs = ranks[p.rank].args, ranks[p.rank].envs
        d = delta.get(p.role)
        if d is None:
            assert p == base_by[p.label]
            continue
        for flag, text in d.add_args.items():
            want = rank_args.get(flag, text)
            assert p.arg(flag) is not None and p.arg(flag).text == want
        for flag in d.del_args:
            assert (p.arg(flag) is None) == (flag not in rank_args)
        for name, text in d.add_envs.items():
            assert p.env(name) is not None and p.env(name).text == rank_envs.get(name, text)
        for name in d.del_envs:
            assert (p.env(name) is None) == (name not in rank_envs)


def _check_k8s(plan, grid):
    """One Deployment per role, one container per process (its argv, its devices), and a
    ConfigMap exactly when the grid has a router."""
    doc = yaml.safe_load(render_k8s(plan))
    deployments = [i for i in doc["items"] if i["kind"] == "Deployment"]
    assert [d["metadata"]["labels"]["app.kubernetes.io/part-of"] for d in deployments] == \
        [plan.recipe.replace(".", "-")] * len(grid.base)
    containers = [c for d in deployments for c in d["spec"]["template"]["spec"]["containers"]]
    assert len(containers) == len(plan.processes)
    for c, p in zip(containers, plan.processes, strict=True):
        assert c["args"] == [w.replace("<POD_IP>", "$(POD_IP)") for w in p.argv]
        assert c["resources"]["limits"] == {"rebellions.ai/npu": str(devices_per_process(p))}
    assert any(i["kind"] == "ConfigMap" for i in doc["items"]) == (grid.router is not None)


def _check_fit(plan):
    """The fit check reads every process (identical ranks share a row), finds the model's
    architecture and takes the weight format the strategy is for."""
    rows = check_plan(plan)
    over = CheckOverrides()
    assert {r.report.inputs for r in rows} == {inputs_for_process(p, plan, over)
                                               for p in plan.processes}
    for r in rows:
        assert r.report.inputs.weight_format == plan.variant
        assert r.report.verdict in ("fits", "partial", "does not fit")


@pytest.mark.parametrize("name, slug, target, kind, sets", list(_cases()))
def test_every_selection(name, slug, target, kind, sets):
    lr = RECIPES[name]
    option = lr.recipe.strategy(slug).option(target)
    grid = option.grid
    selection = {**grid.base_selection, **((grid.recommended or {}) if kind == "recommended"
                                          else {}), **sets}
    if _excluded(grid, selection):
        with pytest.raises(ExcludedSelection):
            compose(lr.recipe, slug, target, sets=sets, recommended=kind == "recommended")
        return
    plan = compose(lr.recipe, slug, target, sets=sets, recommended=kind == "recommended",
                   name=lr.name)
    assert plan.selection == selection and set(plan.selection) == set(grid.axes)
    # one process per rank (or per role without ranks)
    assert len(plan.processes) == sum(len(b.ranks) if b.ranks else 1 for b in grid.base)
    doc = plan_to_dict(plan)
    for p, pd in zip(plan.processes, doc["processes"], strict=True):
        assert _bash_words(render_process(p)) == [
            *(f"{k}={v}" for k, v in pd["env"].items()), *shlex.split(pd["launcher"]),
            *pd["argv"]]
        assert pd["argv"][0] == grid.model
        assert isinstance(pd["args"]["--block-size"], int)
    base_plan = compose(lr.recipe, slug, target)
    for key in plan.deltas:
        _check_delta(plan, base_plan, key, grid)
    if kind == "base" or (kind == "set" and all(grid.base_selection[a] == v
                                                for a, v in sets.items())):
        assert plan.processes == base_plan.processes
    text = render_shell(plan)
    assert (text.find("# router") > text.rfind("vllm serve")) == (grid.router is not None)
    _check_k8s(plan, grid)
    _check_fit(plan)


def test_json_shape_of_pd_recommended():
    plan = compose(RECIPE.recipe, "prefill-decode-disaggregated", "Latency", recommended=True,
                   name=RECIPE.name)
    doc = json.loads(json.dumps(plan_to_dict(plan)))
    assert doc["recipe"] == "minimax-m2.7" and doc["model"] == "MiniMaxAI/MiniMax-M2.7"
    assert [(p["role"], p["rank"]) for p in doc["processes"]] == [
        ("prefill", 0), ("decode", 0), ("decode", 1), ("decode", 2), ("decode", 3)]
    prefill, d0 = doc["processes"][0], doc["processes"][1]
    assert prefill["args"]["--kv-transfer-config"]["kv_connector"] == "MultiConnector"
    assert prefill["args"]["--block-size"] == 4096
    assert prefill["args"]["--gpu-memory-utilization"] == 0.8
    assert prefill["args"]["--trust-remote-code"] is True
    assert prefill["args"]["--speculative-config"]["method"] == "eagle3"
    assert prefill["env"]["LMCACHE_CHUNK_SIZE"] == "4096"
    assert "LMCACHE_CHUNK_SIZE" not in d0["env"]  # the lmcache delta leaves decode alone
    assert d0["args"]["--data-parallel-rank"] == 0 and d0["args"]["--port"] == 8200
    assert d0["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "<POD_IP>"
    assert "--no-enable-prefix-caching" not in d0["args"]
    assert [n["node"] for n in doc["router"]["nodes"]] == ["router-values.yaml", "helm"]
    agg = plan_to_dict(compose(RECIPE.recipe, "aggregated-pipeline-parallel"))
    assert agg["router"] is None and agg["processes"][0]["rank"] is None
    assert agg["target"] == "Throughput"


def test_json_shape_of_axk2_pd_recommended():
    """A.X-K2's P/D strategy: one Latency option (no --target needed), a pipeline-parallel
    prefill and eight decode ranks, a pinned checkpoint --revision kept as text."""
    plan = compose(AXK2.recipe, "prefill-decode-disaggregated", recommended=True,
                   name=AXK2.name)
    doc = json.loads(json.dumps(plan_to_dict(plan)))
    assert doc["recipe"] == "ax-k2" and doc["model"] == "skt/A.X-K2-NVFP4"
    assert doc["target"] == "Latency" and plan.variant == "NVFP4"
    assert [(p["role"], p["rank"]) for p in doc["processes"]] == [
        ("prefill", 0), *(("decode", i) for i in range(8))]
    prefill, d7 = doc["processes"][0], doc["processes"][8]
    assert prefill["args"]["--pipeline-parallel-size"] == 8
    assert prefill["args"]["--block-size"] == 2048 and prefill["args"]["--max-num-seqs"] == 8
    assert prefill["args"]["--revision"] == "9e2e804e80f8d1b3afba5d7938173cec1ed46b49"
    assert prefill["args"]["--reasoning-parser"] == "deepseek_v3"
    assert prefill["args"]["--tool-call-parser"] == "hermes"
    assert "--kv-cache-dtype" not in prefill["args"]  # the model's own dtype
    assert prefill["args"]["--gpu-memory-utilization"] == 0.85
    assert prefill["args"]["--speculative-config"] == {
        "method": "eagle3", "model": "skt/A.X-K2-EAGLE3",
        "revision": "24958e91737d760908f73a8af4b6e06080fc5c1d", "num_speculative_tokens": 3}
    assert prefill["env"]["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    assert prefill["env"]["LMCACHE_CHUNK_SIZE"] == "2048"
    assert "LMCACHE_CHUNK_SIZE" not in d7["env"]  # the lmcache delta leaves decode alone
    assert d7["args"]["--data-parallel-size"] == 8 and d7["args"]["--data-parallel-rank"] == 7
    assert d7["args"]["--port"] == 8207 and d7["env"]["RBLN_VISIBLE_DEVICES"] == "7"
    assert d7["args"]["--kv-events-config"]["topic"] == "kv@<POD_IP>:8207@skt/A.X-K2-NVFP4"
    assert d7["args"]["--speculative-config"]["method"] == "eagle3"
    values = yaml.safe_load(doc["router"]["nodes"][0]["cmd"].split("\n", 1)[1].rsplit("\n", 1)[0])
    assert values["inference_pool"]["target_ports"] == list(range(8000, 8008))
    agg = plan_to_dict(compose(AXK2.recipe, "aggregated-data-expert-parallel"))
    assert agg["target"] == "Latency" and agg["router"] is None
    assert agg["processes"][0]["args"]["--data-parallel-size"] == 8


@pytest.mark.parametrize("name", list(RECIPES))
def test_shell_runs_under_bash(tmp_path, name):
    """The rendered command, with the launcher swapped for a script that dumps its argv and
    environment, gives bash exactly the composed words and env values (the first two
    processes of the recipe's strategy with the most roles, last target, recommended)."""
    recipe = RECIPES[name].recipe
    strat = max(recipe.strategies, key=lambda s: len(s.options[-1].grid.base))
    plan = compose(recipe, strat.slug, strat.options[-1].target, recommended=True)
    if plan.placeholders_left:
        plan = compose(recipe, strat.slug, strat.options[-1].target, recommended=True,
                       variables={p: "10.0.0.7" for p in plan.placeholders_left})
    dump = tmp_path / "dump.py"
    dump.write_text("import json, os, sys\nprint(json.dumps([sys.argv[1:], dict(os.environ)]))\n")
    for p in plan.processes[:2]:
        fake = dataclasses.replace(p, launcher=f"{shlex.quote(sys.executable)} {dump}")
        out = subprocess.run(["bash", "-c", render_process(fake)], capture_output=True,
                             text=True, check=True, env={"PATH": os.environ["PATH"]})
        argv, env = json.loads(out.stdout)
        assert argv == p.argv
        assert {e.name: env[e.name] for e in p.envs} == {e.name: e.value for e in p.envs}


@pytest.mark.parametrize("name, prefix, decode_ranks, prefill_devices", [
    ("minimax-m2.7", "minimax-m2-7", 4, "4"),
    ("ax-k2", "ax-k2", 8, "8"),
])
def test_k8s_output_parses_into_workloads(name, prefix, decode_ranks, prefill_devices):
    lr = RECIPES[name]
    plan = compose(lr.recipe, "prefill-decode-disaggregated", "Latency", recommended=True,
                   name=lr.name)
    text = render_k8s(plan, image="registry/vllm-rbln:1", resource="rebellions.ai/REBEL")
    doc = yaml.safe_load(text)
    assert doc["kind"] == "List"
    kinds = [(i["kind"], i["metadata"]["name"]) for i in doc["items"]]
    assert kinds == [("Deployment", f"{prefix}-prefill"), ("Deployment", f"{prefix}-decode"),
                     ("ConfigMap", f"{prefix}-router-values")]
    prefill, decode, cm = doc["items"]
    assert prefill["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"] == "prefill"
    assert prefill["spec"]["template"]["metadata"]["labels"]["llm-d.ai/guide"] == \
        "pd-disaggregation"
    containers = decode["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == [f"decode-rank-{i}" for i in range(decode_ranks)]
    by_rank = [p for p in plan.processes if p.role == "decode"]
    for c, p in zip(containers, by_rank, strict=True):
        assert c["image"] == "registry/vllm-rbln:1" and c["command"] == ["vllm", "serve"]
        assert c["args"] == [w.replace("<POD_IP>", "$(POD_IP)") for w in p.argv]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["RBLN_VISIBLE_DEVICES"] == str(p.rank)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
        assert c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert c["resources"]["limits"] == {"rebellions.ai/REBEL": "1"}
        assert c["ports"][0]["containerPort"] == 8200 + p.rank
    pc = prefill["spec"]["template"]["spec"]["containers"]
    assert len(pc) == 1 and pc[0]["resources"]["limits"]["rebellions.ai/REBEL"] == prefill_devices
    values = yaml.safe_load(cm["data"]["router-values.yaml"])
    assert values["inference_pool"]["failure_mode"] == "FailOpen"
    assert "helm install router" in text  # the remaining router step, as a comment


@pytest.mark.parametrize("name, slug, target, devices", [
    ("minimax-m2.7", "aggregated-data-expert-parallel", "Throughput", 4),
    ("minimax-m2.7", "aggregated-pipeline-parallel", "Throughput", 4),
    ("ax-k2", "aggregated-data-expert-parallel", "Latency", 8),
    ("ax-k2", "aggregated-pipeline-parallel", "Throughput", 8),
])
def test_k8s_aggregated_has_no_configmap_and_devices_from_layout(name, slug, target, devices):
    lr = RECIPES[name]
    plan = compose(lr.recipe, slug, target, name=lr.name)
    assert devices_per_process(plan.processes[0]) == devices
    doc = plan_to_k8s(plan)
    assert [i["kind"] for i in doc["items"]] == ["Deployment"]
    assert doc["items"][0]["metadata"]["name"] == f"{name.replace('.', '-')}-main"
    (c,) = doc["items"][0]["spec"]["template"]["spec"]["containers"]
    assert c["name"] == "main"
    assert c["resources"]["requests"] == {"rebellions.ai/npu": str(devices)}
    assert all(e["name"] != "POD_IP" for e in c["env"])
