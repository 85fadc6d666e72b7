"""The recipe schema: the shipped files validate, broken files name the path of the problem."""

from __future__ import annotations

import json
import re

import pytest

from sous.recipes.archs import find_arch
from sous.recipes.catalog import (
    RecipeNotFound,
    catalog_dir,
    list_recipes,
    load_recipe,
    load_recipe_file,
    shipped_names,
)
from sous.recipes.schema import RecipeError, flag_of, parse_recipe


def shipped_data() -> dict:
    return json.loads((catalog_dir() / "minimax-m2.7.json").read_text())


def test_shipped_recipes_are_package_data_and_valid():
    assert "minimax-m2.7" in shipped_names()
    recipes = list_recipes()
    lr = next(r for r in recipes if r.name == "minimax-m2.7")
    r = lr.recipe
    assert r.name == "MiniMax-M2.7" and r.model == "MiniMaxAI/MiniMax-M2.7"
    assert [s.slug for s in r.strategies] == [
        "aggregated-data-expert-parallel", "aggregated-pipeline-parallel",
        "prefill-decode-disaggregated"]
    pd = r.strategy("prefill-decode-disaggregated")
    assert pd.nodes == 2  # "2" in the file
    assert pd.option("Latency").grid.roles == ("prefill", "decode")
    assert len(pd.option("Latency").grid.base[1].ranks) == 4
    assert r.badge_texts()[3] == "vllm-rbln"


def test_axk2_is_shipped():
    lr = load_recipe("ax-k2")
    r = lr.recipe
    assert lr.path == catalog_dir() / "ax-k2.json"
    assert r.name == "A.X-K2" and r.model == "skt/A.X-K2" and r.provider == "skt"
    assert r.variant == "NVFP4" and r.variants == ("FP8", "NVFP4")
    assert [s.slug for s in r.strategies] == [
        "aggregated-data-expert-parallel", "aggregated-pipeline-parallel",
        "prefill-decode-disaggregated"]
    assert [[o.target for o in s.options] for s in r.strategies] == [
        ["Latency"], ["Throughput"], ["Latency"]]
    pd = r.strategy("prefill-decode-disaggregated")
    assert pd.nodes == 2 and pd.variant == "NVFP4"
    grid = pd.option("Latency").grid
    assert grid.model == "skt/A.X-K2-NVFP4" and grid.roles == ("prefill", "decode")
    assert [len(b.ranks) for b in grid.base] == [1, 8]
    assert grid.modes["spec_decode"] == ("off", "eagle3")


@pytest.mark.parametrize("name", shipped_names())
def test_every_shipped_recipe(name):
    """Each shipped recipe: a lower-case file stem, the same model family in every grid with
    architecture numbers for the fit check, and a checkpoint suffix (`-NVFP4`) that agrees
    with the variant its strategy is for."""
    assert re.fullmatch(r"[a-z0-9][a-z0-9.-]*", name)
    r = load_recipe(name).recipe
    arch, _ = find_arch(r.model)
    for s in r.strategies:
        for o in s.options:
            found, fmt = find_arch(o.grid.model)
            assert found == arch
            assert fmt in (None, s.variant or r.variant)
    assert r.variants is None or r.variant in r.variants


def test_variants_are_strings():
    data = shipped_data()
    data["variants"] = [{"name": "FP8"}]
    assert "variants[0]" in _errors(data)


def test_load_by_stem_or_path(tmp_path):
    by_stem = load_recipe("minimax-m2.7")
    copy = tmp_path / "mine.json"
    copy.write_text(json.dumps(shipped_data()))
    by_path = load_recipe(str(copy))
    assert by_path.name == "mine" and by_path.recipe == by_stem.recipe
    with pytest.raises(RecipeNotFound) as e:
        load_recipe("no-such-recipe")
    assert "minimax-m2.7" in e.value.choices
    with pytest.raises(RecipeNotFound):
        load_recipe(str(tmp_path / "missing.json"))


def test_not_json_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(RecipeError, match="bad.json: not JSON"):
        load_recipe_file(bad)


def _errors(data) -> str:
    with pytest.raises(RecipeError) as e:
        parse_recipe(data, "f.json")
    return str(e.value)


def test_errors_name_the_path_in_the_file():
    data = shipped_data()
    grid0 = data["strategies"][0]["options"][0]["grid"]
    grid0["base"][0]["args"]["--x"] = "--y 1"
    data["strategies"][1]["options"][0]["target"] = "Fast"
    data["strategies"][2]["options"][1]["grid"]["deltas"]["lmcache=cpu"]["router"] = {}
    msg = _errors(data)
    assert msg.startswith("f.json: not a valid recipe")
    assert "strategies[0].options[0].grid.base[0].args" in msg and "'--x'" in msg
    assert "strategies[1].options[0].target" in msg
    assert "strategies[2].options[1].grid" in msg and "no such role" in msg


@pytest.mark.parametrize("mutate, needle", [
    (lambda g: g["deltas"].update({"spec_decode=mtp": {}}), "spec_decode=mtp"),
    (lambda g: g["deltas"].update({"tool_calling=on": {}}), "base value"),
    (lambda g: g["modes"].update({"lmcache": ["cpu", "rds"]}), "no 'off'"),
    (lambda g: g["option_base"].update({"tool_calling": "maybe"}), "option_base"),
    (lambda g: g.update({"recommended": {"lmcache": "disk"}}), "recommended"),
    (lambda g: g.update({"excluded": [{"nope": "1"}]}), "excluded[0]"),
    (lambda g: g["base"][0]["envs"].update({"A": "B=1"}), "envs['A']"),
    (lambda g: g.update({"surprise": 1}), "surprise"),
])
def test_grid_cross_checks(mutate, needle):
    data = shipped_data()
    mutate(data["strategies"][0]["options"][0]["grid"])
    msg = _errors(data)
    assert "strategies[0].options[0].grid" in msg and needle in msg


def test_duplicate_slugs_and_targets():
    data = shipped_data()
    data["strategies"][1]["slug"] = data["strategies"][0]["slug"]
    assert "slugs are not unique" in _errors(data)
    data = shipped_data()
    data["strategies"][0]["options"][1]["target"] = "Latency"
    assert "targets are not unique" in _errors(data)


def test_flag_of():
    assert flag_of("--block-size 4096") == "--block-size"
    assert flag_of("--block-size=4096") == "--block-size"
    assert flag_of("--x '{\n \"a\": 1\n}'") == "--x"
    with pytest.raises(ValueError):
        flag_of("block-size 4")
