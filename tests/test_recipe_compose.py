"""The composer on recipe files the tests write themselves (not only the shipped one)."""

from __future__ import annotations

import copy
import json
import shlex

import pytest

from sous.recipes.catalog import load_recipe
from sous.recipes.compose import ChoiceError, ExcludedSelection, compose, parse_assignments
from sous.recipes.render import plan_to_dict, render_process, render_shell
from sous.recipes.schema import RecipeError, parse_recipe

ROUTER_VALUES = "cat > values.yaml <<'EOF'\npool:\n  epp: <EPP_HOST>\n  port: 9002\nEOF"


def toy_recipe() -> dict:
    """Two strategies: `pd` (prefill without ranks, decode with two ranks, a router) and
    `agg` (one role, two targets)."""
    pd_grid = {
        "model": "org/toy",
        "base": [
            {"role": "prefill", "launcher": "vllm serve",
             "args": {"--a": "--a 1", "--bare": "--bare", "--port": "--port 8000",
                      "--cfg": "--cfg '{\"x\": 1}'"},
             "envs": {"E1": "E1=one", "HOST": "HOST='<POD_IP>'"},
             "ranks": None, "scale": None, "varies": None},
            {"role": "decode", "launcher": "vllm serve",
             "args": {"--a": "--a 1", "--data-parallel-size": "--data-parallel-size 2",
                      "--addr": "--addr '<POD_IP>'"},
             "envs": {"E1": "E1=one"},
             "ranks": [
                 {"args": {"--data-parallel-rank": "--data-parallel-rank 0",
                           "--port": "--port 8200"}, "envs": {"DEV": "DEV=0"}},
                 {"args": {"--data-parallel-rank": "--data-parallel-rank 1",
                           "--port": "--port 8201", "--a": "--a 9"}, "envs": {"DEV": "DEV=1"}},
             ],
             "scale": "2 ranks", "varies": ["--data-parallel-rank", "--port", "DEV"]},
        ],
        "modes": {"cache": ["off", "on"], "spec": ["off", "ngram"]},
        "options": {"tools": ["off", "on"]},
        "option_base": {"tools": "on"},
        "deltas": {
            "cache=on": {"prefill": {"add_args": {"--a": "--a 2", "--new": "--new x"},
                                     "add_envs": {"E2": "E2=two"}}},
            "spec=ngram": {
                "prefill": {"add_args": {"--spec": "--spec '{\"method\": \"ngram\"}'"}},
                "decode": {"add_args": {"--spec": "--spec '{\"method\": \"ngram\"}'"}},
            },
            "tools=off": {
                "prefill": {"del_args": ["--bare"], "del_envs": ["E1"]},
                "decode": {"del_args": ["--a"], "del_envs": ["E1"]},
            },
        },
        "recommended": {"cache": "on", "spec": "ngram"},
        "excluded": [{"cache": "on", "tools": "off"}],
        "router": {"role": "router", "nodes": [
            {"node": "values.yaml", "cmd": ROUTER_VALUES},
            {"node": "helm", "cmd": "helm install r chart \\\n    --values values.yaml"},
        ]},
    }
    agg_grid = {
        "model": "org/toy",
        "base": [{"role": "main", "launcher": "python -m toy.serve",
                  "args": {"--max-model-len": "--max-model-len 8192", "--bare": "--bare"},
                  "envs": {}, "ranks": None, "scale": None, "varies": None}],
        "modes": {"cache": ["off", "on"]}, "options": {}, "option_base": {},
        "deltas": {"cache=on": {"main": {"del_args": ["--bare"], "add_envs": {"E": "E=1"}}}},
        "recommended": None, "excluded": [], "router": None,
    }
    throughput = copy.deepcopy(agg_grid)
    throughput["base"][0]["args"]["--max-num-seqs"] = "--max-num-seqs 8"
    throughput["recommended"] = {"cache": "on"}
    return {
        "name": "Toy", "model": "org/toy", "provider": "org",
        "badges": ["MoE", {"text": "fast", "hl": True}, "8,192 ctx"],
        "axes": [{"axis": "cache", "title": "Cache", "options": [
            {"label": "Off", "value": "off"}, {"label": "On (CPU)", "value": "on"}]}],
        "text": {"en": {"sub": "Toy <b>model</b> page", "tag": "A toy.", "strategyNote": "Note."},
                 "ko": {"sub": "토이 <b>모델</b> 페이지", "tag": "장난감.", "strategyNote": "노트."}},
        "strategies": [
            {"slug": "pd", "label": "P/D", "tag": "P / D", "nodes": "2", "variant": "FP8",
             "options": [{"target": "Latency", "npus": 2, "skus": ["RBLN-CR13"],
                          "verified": "2026-01-02", "modelImpl": "vllm", "note": None,
                          "grid": pd_grid}]},
            {"slug": "agg", "label": "Aggregated", "tag": None, "nodes": None, "variant": "FP8",
             "options": [
                 {"target": "Latency", "npus": 1, "skus": ["RBLN-CR13"], "grid": agg_grid},
                 {"target": "Throughput", "npus": 1, "skus": ["RBLN-CR13"], "grid": throughput},
             ]},
        ],
    }


@pytest.fixture
def toy():
    return parse_recipe(toy_recipe(), "toy.json")


def _by_label(plan):
    return {p.label: p for p in plan.processes}


def _args(process):
    return {a.flag: a.text for a in process.args}


def _envs(process):
    return {e.name: e.value for e in process.envs}


def test_base_composition_ranks_on_one_role_only(toy):
    plan = compose(toy, "pd", "Latency")
    assert [p.label for p in plan.processes] == ["prefill", "decode rank 0", "decode rank 1"]
    assert plan.deltas == ()
    assert plan.selection == {"cache": "off", "spec": "off", "tools": "on"}
    prefill, d0, d1 = plan.processes
    assert prefill.rank is None and d0.rank == 0 and d1.rank == 1
    assert list(_args(prefill)) == ["--a", "--bare", "--port", "--cfg"]
    # rank args are added after the role's; a rank's same-name flag replaces in place
    assert list(_args(d0)) == ["--a", "--data-parallel-size", "--addr", "--data-parallel-rank",
                               "--port"]
    assert _args(d1)["--a"] == "--a 9" and list(_args(d1))[0] == "--a"
    assert _envs(d0) == {"E1": "one", "DEV": "0"} and _envs(d1)["DEV"] == "1"


def test_delta_touching_one_role_and_add_args_replacing(toy):
    base = _by_label(compose(toy, "pd", "Latency"))
    plan = compose(toy, "pd", "Latency", sets={"cache": "on"})
    got = _by_label(plan)
    assert plan.deltas == ("cache=on",)
    # --a replaced in place (same position), --new appended, E2 appended
    assert list(_args(got["prefill"])) == ["--a", "--bare", "--port", "--cfg", "--new"]
    assert _args(got["prefill"])["--a"] == "--a 2"
    assert _envs(got["prefill"])["E2"] == "two"
    # the decode role is not named by the delta: untouched
    for label in ("decode rank 0", "decode rank 1"):
        assert got[label] == base[label]


def test_del_args_and_del_envs_then_ranks(toy):
    got = _by_label(compose(toy, "pd", "Latency", sets={"tools": "off"}))
    assert "--bare" not in _args(got["prefill"]) and "E1" not in _envs(got["prefill"])
    assert "--a" not in _args(got["decode rank 0"])
    # rank 1 sets --a itself; ranks come after the deltas, so it is there (appended)
    assert list(_args(got["decode rank 1"]))[-1] == "--a"
    assert "E1" not in _envs(got["decode rank 1"])


def test_recommended_then_set_overrides(toy):
    plan = compose(toy, "pd", "Latency", recommended=True)
    assert plan.selection == {"cache": "on", "spec": "ngram", "tools": "on"}
    assert plan.deltas == ("cache=on", "spec=ngram")
    plan = compose(toy, "pd", "Latency", recommended=True, sets={"spec": "off"})
    assert plan.selection["spec"] == "off" and plan.deltas == ("cache=on",)
    # no recommended selection on the page: --recommended is the base
    assert compose(toy, "agg", "Latency", recommended=True).deltas == ()


def test_excluded_selection_is_refused_naming_the_entry(toy):
    with pytest.raises(ExcludedSelection) as e:
        compose(toy, "pd", "Latency", sets={"cache": "on", "tools": "off"})
    assert e.value.index == 0 and "excluded[0]" in str(e.value)
    assert "cache=on" in str(e.value) and "tools=off" in str(e.value)
    with pytest.raises(ExcludedSelection):
        compose(toy, "pd", "Latency", recommended=True, sets={"tools": "off"})


def test_placeholders_left_without_var(toy):
    plan = compose(toy, "pd", "Latency")
    assert plan.placeholders_left == ("POD_IP", "EPP_HOST")
    prefill = plan.processes[0]
    assert prefill.env("HOST").value == "<POD_IP>"
    assert prefill.env("HOST").text == "HOST='<POD_IP>'"  # kept as published
    assert "<EPP_HOST>" in plan.router[0].cmd


def test_placeholders_filled_with_var(toy):
    plan = compose(toy, "pd", "Latency", variables={"POD_IP": "10.1.2.3", "EPP_HOST": "epp"})
    assert plan.placeholders_left == ()
    d0 = plan.processes[1]
    assert d0.arg("--addr").words == ("--addr", "10.1.2.3")
    assert plan.processes[0].env("HOST").value == "10.1.2.3"
    assert "epp: epp" in plan.router[0].cmd
    # a value with shell specials is quoted so the words stay exact
    plan = compose(toy, "pd", "Latency", variables={"POD_IP": "a b'c"})
    proc = plan.processes[1]
    assert shlex.split(proc.arg("--addr").text) == ["--addr", "a b'c"]
    assert shlex.split(proc.env("E1").text) == ["E1=one"]


def test_unknown_var_lists_placeholders(toy):
    with pytest.raises(ChoiceError) as e:
        compose(toy, "pd", "Latency", variables={"NOPE": "1"})
    assert e.value.choices == ["POD_IP", "EPP_HOST"]


def test_choice_errors_list_valid_choices(toy):
    with pytest.raises(ChoiceError) as e:
        compose(toy, "nope", "Latency")
    assert e.value.choices == ["pd", "agg"]
    with pytest.raises(ChoiceError) as e:
        compose(toy, "agg", None)
    assert e.value.choices == ["Latency", "Throughput"]
    with pytest.raises(ChoiceError) as e:
        compose(toy, "pd", "Throughput")
    assert e.value.choices == ["Latency"]
    with pytest.raises(ChoiceError) as e:
        compose(toy, "pd", None, sets={"colour": "red"})
    assert e.value.choices == ["cache", "spec", "tools"]
    with pytest.raises(ChoiceError) as e:
        compose(toy, "pd", None, sets={"spec": "eagle3"})
    assert e.value.choices == ["off", "ngram"]


def test_target_may_be_omitted_with_one_option(toy):
    assert compose(toy, "pd").target == "Latency"


def test_json_values_and_argv(toy):
    d = plan_to_dict(compose(toy, "pd", "Latency", recommended=True))
    assert set(d) == {"recipe", "model", "strategy", "target", "selection", "processes", "router"}
    prefill = d["processes"][0]
    assert prefill["rank"] is None and d["processes"][1]["rank"] == 0
    assert prefill["args"]["--cfg"] == {"x": 1}
    assert prefill["args"]["--spec"] == {"method": "ngram"}
    assert prefill["args"]["--a"] == 2 and prefill["args"]["--new"] == "x"
    assert prefill["args"]["--bare"] is True
    assert prefill["env"] == {"E1": "one", "HOST": "<POD_IP>", "E2": "two"}
    assert prefill["argv"][:3] == ["org/toy", "--a", "2"]
    assert d["router"]["nodes"][1]["node"] == "helm"
    assert json.loads(json.dumps(d)) == d


def bash_words(text: str, comments: bool = False) -> list[str]:
    """shlex with bash's line continuation (shlex keeps a backslash-newline as a newline)."""
    return shlex.split(text.replace(" \\\n", " "), comments=comments)


def test_shell_reparses_to_argv(toy):
    plan = compose(toy, "pd", "Latency", recommended=True, variables={"POD_IP": "x y"})
    for p in plan.processes:
        words = bash_words(render_process(p))
        envs = [f"{e.name}={e.value}" for e in p.envs]
        assert words == [*envs, *p.launcher_words, *p.argv]
    text = render_shell(plan)
    assert text.index("# decode rank 1") < text.index("# router") < text.index("helm install")
    plan = compose(toy, "agg", "Throughput")
    assert bash_words(render_shell(plan), comments=True) == [
        "python", "-m", "toy.serve", "org/toy", "--max-model-len", "8192", "--bare",
        "--max-num-seqs", "8"]


def test_render_one_argument_per_line(toy):
    text = render_process(compose(toy, "pd", "Latency").processes[0])
    lines = text.splitlines()
    assert lines[0] == "E1=one \\" and lines[1] == "HOST='<POD_IP>' \\"
    assert lines[2] == "vllm serve org/toy \\"
    assert lines[3].strip() == "--a 1 \\" and lines[-1].strip() == "--cfg '{\"x\": 1}'"


def test_missing_delta_for_chosen_value_is_an_error():
    data = toy_recipe()
    del data["strategies"][0]["options"][0]["grid"]["deltas"]["spec=ngram"]
    with pytest.raises(RecipeError, match="no delta for spec=ngram"):
        compose(parse_recipe(data), "pd", sets={"spec": "ngram"})


def test_recipe_file_by_path(tmp_path):
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(toy_recipe()))
    lr = load_recipe(str(path))
    assert lr.name == "toy" and lr.recipe.name == "Toy"
    assert compose(lr.recipe, "agg", "Latency", name=lr.name).recipe == "toy"


def test_parse_assignments():
    assert parse_assignments(["a=1", "b=x=y", "a=2"], "--set") == {"a": "2", "b": "x=y"}
    assert parse_assignments(["<POD_IP>=1.2.3.4"], "--var") == {"POD_IP": "1.2.3.4"}
    with pytest.raises(RecipeError, match="NAME=VALUE"):
        parse_assignments(["novalue"], "--set")
