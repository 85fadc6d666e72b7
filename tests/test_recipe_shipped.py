"""Every strategy x target x (base, recommended, each single axis value) of the shipped recipe:
compose succeeds (or is refused as excluded), the shell output re-parses to the JSON argv,
and the flags/envs of each delta are present or absent as the recipe says."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from sous.recipes.catalog import load_recipe
from sous.recipes.compose import ExcludedSelection, compose
from sous.recipes.k8s import devices_per_process, plan_to_k8s, render_k8s
from sous.recipes.render import plan_to_dict, render_process, render_shell

RECIPE = load_recipe("minimax-m2.7")


def _cases():
    for s in RECIPE.recipe.strategies:
        for o in s.options:
            grid = o.grid
            yield pytest.param(s.slug, o.target, "base", {}, id=f"{s.slug}-{o.target}-base")
            yield pytest.param(s.slug, o.target, "recommended", {},
                               id=f"{s.slug}-{o.target}-recommended")
            for axis, values in grid.axes.items():
                for value in values:
                    yield pytest.param(s.slug, o.target, "set", {axis: value},
                                       id=f"{s.slug}-{o.target}-{axis}={value}")


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


@pytest.mark.parametrize("slug, target, kind, sets", list(_cases()))
def test_every_selection(slug, target, kind, sets):
    option = RECIPE.recipe.strategy(slug).option(target)
    grid = option.grid
    selection = {**grid.base_selection, **((grid.recommended or {}) if kind == "recommended"
                                          else {}), **sets}
    if _excluded(grid, selection):
        with pytest.raises(ExcludedSelection):
            compose(RECIPE.recipe, slug, target, sets=sets, recommended=kind == "recommended")
        return
    plan = compose(RECIPE.recipe, slug, target, sets=sets, recommended=kind == "recommended",
                   name=RECIPE.name)
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
    base_plan = compose(RECIPE.recipe, slug, target)
    for key in plan.deltas:
        _check_delta(plan, base_plan, key, grid)
    if kind == "base" or (kind == "set" and all(grid.base_selection[a] == v
                                                for a, v in sets.items())):
        assert plan.processes == base_plan.processes
    text = render_shell(plan)
    assert (text.find("# router") > text.rfind("vllm serve")) == (grid.router is not None)


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


def test_shell_runs_under_bash(tmp_path):
    """The rendered command, with the launcher swapped for a script that dumps its argv and
    environment, gives bash exactly the composed words and env values."""
    plan = compose(RECIPE.recipe, "prefill-decode-disaggregated", "Throughput",
                   recommended=True, variables={"POD_IP": "10.0.0.7"})
    dump = tmp_path / "dump.py"
    dump.write_text("import json, os, sys\nprint(json.dumps([sys.argv[1:], dict(os.environ)]))\n")
    for p in plan.processes[:2]:
        fake = dataclasses.replace(p, launcher=f"{shlex.quote(sys.executable)} {dump}")
        out = subprocess.run(["bash", "-c", render_process(fake)], capture_output=True,
                             text=True, check=True, env={"PATH": os.environ["PATH"]})
        argv, env = json.loads(out.stdout)
        assert argv == p.argv
        assert {e.name: env[e.name] for e in p.envs} == {e.name: e.value for e in p.envs}


def test_k8s_output_parses_into_workloads():
    plan = compose(RECIPE.recipe, "prefill-decode-disaggregated", "Latency", recommended=True,
                   name=RECIPE.name)
    text = render_k8s(plan, image="registry/vllm-rbln:1", resource="rebellions.ai/REBEL")
    doc = yaml.safe_load(text)
    assert doc["kind"] == "List"
    kinds = [(i["kind"], i["metadata"]["name"]) for i in doc["items"]]
    assert kinds == [("Deployment", "minimax-m2-7-prefill"), ("Deployment", "minimax-m2-7-decode"),
                     ("ConfigMap", "minimax-m2-7-router-values")]
    prefill, decode, cm = doc["items"]
    assert prefill["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"] == "prefill"
    assert prefill["spec"]["template"]["metadata"]["labels"]["llm-d.ai/guide"] == \
        "pd-disaggregation"
    containers = decode["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == [f"decode-rank-{i}" for i in range(4)]
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
    assert len(pc) == 1 and pc[0]["resources"]["limits"]["rebellions.ai/REBEL"] == "4"
    values = yaml.safe_load(cm["data"]["router-values.yaml"])
    assert values["inference_pool"]["failure_mode"] == "FailOpen"
    assert "helm install router" in text  # the remaining router step, as a comment


def test_k8s_aggregated_has_no_configmap_and_devices_from_layout():
    plan = compose(RECIPE.recipe, "aggregated-data-expert-parallel", "Throughput",
                   name=RECIPE.name)
    assert devices_per_process(plan.processes[0]) == 4
    doc = plan_to_k8s(plan)
    assert [i["kind"] for i in doc["items"]] == ["Deployment"]
    (c,) = doc["items"][0]["spec"]["template"]["spec"]["containers"]
    assert c["name"] == "main" and c["resources"]["requests"] == {"rebellions.ai/npu": "4"}
    assert all(e["name"] != "POD_IP" for e in c["env"])
