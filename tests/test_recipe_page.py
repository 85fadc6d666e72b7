"""The recipe page's data (`sous.recipes.web`): every precomputed composition of every shipped
recipe equals what `sous recipe plan` / `sous recipe check` print for the same selection;
excluded selections are marked, not composed; the server and the static output carry the same
bundle."""

from __future__ import annotations

import copy
import json
import math
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sous.recipes.archs import find_arch
from sous.recipes.catalog import list_recipes, load_recipe, load_recipe_file, shipped_names
from sous.recipes.cli import main
from sous.recipes.schema import RecipeError
from sous.recipes.web import bundle as bundle_module
from sous.recipes.web.bundle import (
    DATA_GLOBAL,
    all_selections,
    build_bundle,
    build_recipe,
    bundle_js,
    selection_key,
)
from sous.recipes.web.server import STATIC_FILES, make_server, write_static
from test_recipe_compose import toy_recipe

SHIPPED = "minimax-m2.7"
EXCLUDED = [{"lmcache": "rds", "spec_decode": "suffix"},
            {"prefix_caching": "on_sub_block", "tool_calling": "off"}]


def excluded_recipe(tmp_dir: Path) -> Path:
    """The shipped recipe with two `excluded` entries in the pipeline-parallel grid, saved as
    `minimax-m2.7-excl.json` (the shipped file has none)."""
    data = json.loads(load_recipe(SHIPPED).path.read_text())
    data = copy.deepcopy(data)
    (strat,) = [s for s in data["strategies"] if s["slug"] == "aggregated-pipeline-parallel"]
    strat["options"][0]["grid"]["excluded"] = EXCLUDED
    path = tmp_dir / "minimax-m2.7-excl.json"
    path.write_text(json.dumps(data, ensure_ascii=False))
    return path


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def sets(selection: dict[str, str]) -> list[str]:
    return ["--set", *(f"{a}={v}" for a, v in selection.items())]


@pytest.fixture(scope="module", params=shipped_names())
def shipped(request):
    lr = load_recipe(request.param)
    return lr, build_recipe(lr)


# Selections per shipped recipe (every option's grid, all of them allowed).
SELECTION_COUNTS = {"minimax-m2.7": 5 * 3 * 3 * 3 * 2 * 2, "ax-k2": 3 * 3 * 3 * 2 * 2 * 2}


def test_every_selection_equals_plan_output(shipped, capsys):
    """Every selection of each shipped recipe (540 of MiniMax-M2.7, 216 of A.X-K2): the script
    pieces join to exactly the `plan --format shell` output, and each process block is in it
    under its label."""
    lr, data = shipped
    texts, checked = data["texts"], 0
    for s in lr.recipe.strategies:
        (page_s,) = [x for x in data["strategies"] if x["slug"] == s.slug]
        for o, page_o in zip(s.options, page_s["options"], strict=True):
            assert page_o["target"] == o.target
            assert len(page_o["selections"]) == math.prod(len(v) for v in o.grid.axes.values())
            for sel in all_selections(o.grid):
                entry = page_o["selections"][selection_key(o.grid, sel)]
                comp = data["compositions"][entry]
                code, out, _ = cli(capsys, "plan", lr.name, "--strategy", s.slug,
                                   "--target", o.target, *sets(sel))
                assert code == 0
                assert "".join(texts[i] for i in comp["script"]) == out
                for proc in comp["processes"]:
                    assert f"# {proc['label']}\n{texts[proc['text']]}\n" in out
                for step in comp["router"] or ():
                    assert texts[step["text"]] in out
                checked += 1
    assert checked == len(data["compositions"]) == SELECTION_COUNTS.get(lr.name, checked)


def test_processes_and_router_of_one_selection(shipped):
    lr, data = shipped
    (pd,) = [s for s in data["strategies"] if s["slug"] == "prefill-decode-disaggregated"]
    lat = pd["options"][0]
    assert lat["target"] == "Latency" and lat["recommended"] == lat["initial"]
    key = "&".join(f"{a['axis']}={lat['initial'][a['axis']]}" for a in lat["axes"])
    assert key == ("lmcache=rds&prefix_caching=on_sub_block&spec_decode=eagle3"
                   "&reasoning_parser=on&tool_calling=on")
    comp = data["compositions"][lat["selections"][key]]
    decode_ranks = len(lr.recipe.strategy(pd["slug"]).options[0].grid.base[1].ranks)
    assert decode_ranks == {"minimax-m2.7": 4, "ax-k2": 8}.get(lr.name, decode_ranks)
    assert [p["label"] for p in comp["processes"]] == [
        "prefill rank 0", *(f"decode rank {i}" for i in range(decode_ranks))]
    assert [s["node"] for s in comp["router"]] and comp["placeholders"] == ["EPP_HOST", "POD_IP"]
    assert "--data-parallel-rank 2" in data["texts"][comp["processes"][3]["text"]]
    axes = {a["axis"]: a for a in lat["axes"]}
    assert axes["prefix_caching"]["values"] == ["on", "on_sub_block", "off"]  # the page's order
    assert axes["tool_calling"]["kind"] == "option" and axes["tool_calling"]["base"] == "on"
    assert axes["lmcache"]["kind"] == "mode" and axes["lmcache"]["base"] == "off"
    (pp,) = [s for s in data["strategies"] if s["slug"] == "aggregated-pipeline-parallel"]
    assert pp["options"][0]["recommended"] is None
    assert pp["options"][0]["initial"] == lr.recipe.strategies[1].options[0].grid.base_selection


# The decode row of the recommended P/D selection: its label, KV bytes per token and, where
# pinned, its verdict (A.X-K2's is left to the fit model's tests).
DECODE_FITS = {"minimax-m2.7": ("decode ranks 0-3", 126976, "fits"),
               "ax-k2": ("decode ranks 0-7", 85888, None)}


def test_fit_equals_check_output(shipped, capsys):
    """The fit shown for a selection is `sous recipe check --format json` of that selection
    (exit status 1 when a process does not fit)."""
    lr, data = shipped
    for s, page_s in zip(lr.recipe.strategies, data["strategies"], strict=True):
        for o, page_o in zip(s.options, page_s["options"], strict=True):
            arch, _ = find_arch(o.grid.model)
            for sel in (page_o["initial"], {**page_o["initial"], "spec_decode": "off"}):
                comp = data["compositions"][page_o["selections"][selection_key(o.grid, sel)]]
                code, out, _ = cli(capsys, "check", lr.name, "--strategy", s.slug,
                                   "--target", o.target, "--format", "json", *sets(sel))
                rows = data["fits"][comp["fit"]]["rows"]
                assert code == (1 if any(r["verdict"] == "does not fit" for r in rows) else 0)
                assert [{k: v for k, v in r.items() if k != "model_max_position"}
                        for r in rows] == json.loads(out)
                assert all(r["model_max_position"] == arch.max_position for r in rows)
    (pd,) = [s for s in data["strategies"] if s["slug"] == "prefill-decode-disaggregated"]
    rec = pd["options"][0]["selections"][
        "lmcache=rds&prefix_caching=on_sub_block&spec_decode=eagle3&reasoning_parser=on"
        "&tool_calling=on"]
    decode = data["fits"][data["compositions"][rec]["fit"]]["rows"][1]
    if lr.name in DECODE_FITS:
        label, per_token, verdict = DECODE_FITS[lr.name]
        assert decode["processes"] == [label] and decode["kv_bytes_per_token"] == per_token
        assert verdict is None or decode["verdict"] == verdict


def test_excluded_selections_are_marked(tmp_path, capsys):
    path = excluded_recipe(tmp_path)
    lr = load_recipe_file(path)
    data = build_recipe(lr)
    (pp,) = [s for s in data["strategies"] if s["slug"] == "aggregated-pipeline-parallel"]
    opt = pp["options"][0]
    assert opt["excluded"] == EXCLUDED
    grid = lr.recipe.strategies[1].options[0].grid
    marked = 0
    for sel in all_selections(grid):
        entry = opt["selections"][selection_key(grid, sel)]
        hits = [i for i, e in enumerate(EXCLUDED) if all(sel[a] == v for a, v in e.items())]
        code, _, err = cli(capsys, "plan", str(path), "--strategy", pp["slug"], *sets(sel))
        if hits:
            assert entry == {"x": hits[0]} and code == 2 and f"excluded[{hits[0]}]" in err
            marked += 1
        else:
            assert isinstance(entry, int) and code == 0
    assert marked == 12 + 18 - 2  # 108 / 9, 108 / 6, minus both at once
    assert pp["options"][0]["initial"] == grid.base_selection


def test_toy_recipe_without_fit_numbers(tmp_path):
    """A model sous has no architecture numbers for: commands, and a fit error to show."""
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(toy_recipe()))
    data = build_recipe(load_recipe_file(path))
    assert data["compositions"]
    fit = data["fits"][data["compositions"][0]["fit"]]
    assert "no architecture numbers for model 'org/toy'" in fit["error"]


def test_bundle_js_and_static_output(tmp_path, capsys):
    code, out, _ = cli(capsys, "page", "--out", str(tmp_path / "site"),
                       "--recipe", str(excluded_recipe(tmp_path)))
    assert code == 0 and (tmp_path / "site" / "index.html").as_uri() in out
    names = sorted(p.name for p in (tmp_path / "site").iterdir())
    assert names == sorted([*STATIC_FILES, "data.js"])
    text = (tmp_path / "site" / "data.js").read_text()
    prefix = f"window.{DATA_GLOBAL} = "
    assert text.startswith(prefix) and text.endswith(";\n")
    bundle = json.loads(text[len(prefix):-2])
    assert [r["id"] for r in bundle["recipes"]] == [*shipped_names(), "minimax-m2.7-excl"]
    assert {"ax-k2", SHIPPED} <= set(shipped_names())
    assert bundle == json.loads(json.dumps(build_bundle(
        [*list_recipes(), load_recipe_file(tmp_path / "minimax-m2.7-excl.json")])))
    by_id = {r["id"]: r for r in bundle["recipes"]}
    assert by_id[SHIPPED]["text"]["ko"]["sub"].startswith("MiniMax-M2.7 — mixture")
    assert by_id["ax-k2"]["text"]["ko"]["sub"].startswith("A.X-K2 — mixture")
    assert by_id["ax-k2"]["name"] == "A.X-K2" and by_id["ax-k2"]["context"] == 262144
    assert "</script" not in bundle_js({"recipes": [{"x": "</script>"}]})


def test_page_cli_errors(tmp_path, capsys):
    code, _, err = cli(capsys, "page", "--out", str(tmp_path), "--recipe", "nope/none.json")
    assert code == 2 and "unknown recipe 'nope/none.json'" in err
    dup = tmp_path / f"{SHIPPED}.json"
    dup.write_text(load_recipe(SHIPPED).path.read_text())
    code, _, err = cli(capsys, "page", "--out", str(tmp_path / "o"), "--recipe", str(dup))
    assert code == 2 and "two recipes named minimax-m2.7" in err


def test_grid_size_is_bounded(monkeypatch):
    monkeypatch.setattr(bundle_module, "MAX_SELECTIONS", 100)
    with pytest.raises(RecipeError, match=r"the grid has 108 selections, more than the page "
                                          r"shows \(100\)"):
        build_recipe(load_recipe(SHIPPED))


def test_page_port_in_use(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = cli(capsys, "page", "--port", str(port))
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err


def test_server_serves_page_and_data(tmp_path):
    recipes = [load_recipe(SHIPPED)]
    server = make_server(recipes, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        written = {p.name: p.read_bytes() for p in write_static(tmp_path, recipes)}
        for name in ["", "index.html", *STATIC_FILES, "data.js"]:
            with urllib.request.urlopen(f"{base}/{name}") as resp:
                assert resp.status == 200
                assert resp.read() == written[name or "index.html"]
        with urllib.request.urlopen(f"{base}/data.json") as resp:
            assert resp.headers["Content-Type"] == "application/json; charset=utf-8"
            assert json.loads(resp.read()) == json.loads(json.dumps(build_bundle(recipes)))
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{base}/../etc/passwd")
        assert e.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_page_command_serves(tmp_path):
    """`sous recipe page --port 0` prints its URL and serves the page until stopped."""
    sous = str(Path(sys.executable).with_name("sous"))
    proc = subprocess.Popen([sous, "recipe", "page", "--host", "127.0.0.1", "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("recipe page on http://127.0.0.1:") and "Ctrl-C" in line
        url = line.split()[3]
        with urllib.request.urlopen(url + "data.js", timeout=10) as resp:
            assert resp.read().startswith(f"window.{DATA_GLOBAL} = ".encode())
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert b'<script src="views.js"' in resp.read()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
