"""The recipe page's data (`sous.recipes.web`): every precomputed composition equals what
`sous recipe plan` / `sous recipe check` print for the same selection; excluded selections are
marked, not composed; the server and the static output carry the same bundle."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sous.recipes.catalog import load_recipe, load_recipe_file
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


@pytest.fixture(scope="module")
def shipped():
    lr = load_recipe(SHIPPED)
    return lr, build_recipe(lr)


def test_every_selection_equals_plan_output(shipped, capsys):
    """All 540 selections of the shipped recipe: the script pieces join to exactly the
    `plan --format shell` output, and each process block is in it under its label."""
    lr, data = shipped
    texts, checked = data["texts"], 0
    for s in lr.recipe.strategies:
        (page_s,) = [x for x in data["strategies"] if x["slug"] == s.slug]
        for o, page_o in zip(s.options, page_s["options"], strict=True):
            assert page_o["target"] == o.target
            assert len(page_o["selections"]) == 3 * 3 * 3 * 2 * 2
            for sel in all_selections(o.grid):
                entry = page_o["selections"][selection_key(o.grid, sel)]
                comp = data["compositions"][entry]
                code, out, _ = cli(capsys, "plan", SHIPPED, "--strategy", s.slug,
                                   "--target", o.target, *sets(sel))
                assert code == 0
                assert "".join(texts[i] for i in comp["script"]) == out
                for proc in comp["processes"]:
                    assert f"# {proc['label']}\n{texts[proc['text']]}\n" in out
                for step in comp["router"] or ():
                    assert texts[step["text"]] in out
                checked += 1
    assert checked == 540


def test_processes_and_router_of_one_selection(shipped):
    lr, data = shipped
    (pd,) = [s for s in data["strategies"] if s["slug"] == "prefill-decode-disaggregated"]
    lat = pd["options"][0]
    assert lat["target"] == "Latency" and lat["recommended"] == lat["initial"]
    key = "&".join(f"{a['axis']}={lat['initial'][a['axis']]}" for a in lat["axes"])
    assert key == ("lmcache=rds&prefix_caching=on_sub_block&spec_decode=eagle3"
                   "&reasoning_parser=on&tool_calling=on")
    comp = data["compositions"][lat["selections"][key]]
    assert [p["label"] for p in comp["processes"]] == [
        "prefill rank 0", "decode rank 0", "decode rank 1", "decode rank 2", "decode rank 3"]
    assert [s["node"] for s in comp["router"]] and comp["placeholders"] == ["EPP_HOST", "POD_IP"]
    assert "--data-parallel-rank 2" in data["texts"][comp["processes"][3]["text"]]
    axes = {a["axis"]: a for a in lat["axes"]}
    assert axes["prefix_caching"]["values"] == ["on", "on_sub_block", "off"]  # the page's order
    assert axes["tool_calling"]["kind"] == "option" and axes["tool_calling"]["base"] == "on"
    assert axes["lmcache"]["kind"] == "mode" and axes["lmcache"]["base"] == "off"
    (pp,) = [s for s in data["strategies"] if s["slug"] == "aggregated-pipeline-parallel"]
    assert pp["options"][0]["recommended"] is None
    assert pp["options"][0]["initial"] == lr.recipe.strategies[1].options[0].grid.base_selection


def test_fit_equals_check_output(shipped, capsys):
    """The fit shown for a selection is `sous recipe check --format json` of that selection."""
    lr, data = shipped
    for s, page_s in zip(lr.recipe.strategies, data["strategies"], strict=True):
        for o, page_o in zip(s.options, page_s["options"], strict=True):
            for sel in (page_o["initial"], {**page_o["initial"], "spec_decode": "off"}):
                comp = data["compositions"][page_o["selections"][selection_key(o.grid, sel)]]
                code, out, _ = cli(capsys, "check", SHIPPED, "--strategy", s.slug,
                                   "--target", o.target, "--format", "json", *sets(sel))
                assert code == 0
                rows = data["fits"][comp["fit"]]["rows"]
                assert [{k: v for k, v in r.items() if k != "model_max_position"}
                        for r in rows] == json.loads(out)
                assert all(r["model_max_position"] == 204800 for r in rows)
    (pd,) = [s for s in data["strategies"] if s["slug"] == "prefill-decode-disaggregated"]
    rec = pd["options"][0]["selections"][
        "lmcache=rds&prefix_caching=on_sub_block&spec_decode=eagle3&reasoning_parser=on"
        "&tool_calling=on"]
    decode = data["fits"][data["compositions"][rec]["fit"]]["rows"][1]
    assert decode["processes"] == ["decode ranks 0-3"]
    assert decode["kv_bytes_per_token"] == 126976 and decode["verdict"] == "fits"


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
    assert [r["id"] for r in bundle["recipes"]] == [SHIPPED, "minimax-m2.7-excl"]
    assert bundle == json.loads(json.dumps(build_bundle(
        [load_recipe(SHIPPED), load_recipe_file(tmp_path / "minimax-m2.7-excl.json")])))
    assert bundle["recipes"][0]["text"]["ko"]["sub"].startswith("MiniMax-M2.7 — mixture")
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
