"""Every composition the recipe page can show, precomputed with the composer and fit check.

For each recipe, strategy, target and every selection of the option's grid (the product of
its axes' values), `compose` + `render_process` / `render_shell` give the commands and
`check_plan` the memory fit; the page (`static/page.js`) only looks these up by key. A
selection's key is `axis=value` joined by `&`, in grid axis order (modes, then toggles).

Bundle shape (JSON; texts and fits are interned in per-recipe tables and named by index):
`{"version": 1, "recipes": [recipe]}` with recipe = `{"id", "name", "model", "provider",
"hf", "badges": [{"text", "hl"}], "context", "variant", "installLine", "client",
"text": {lang: {"sub", "tag", "strategyNote"}}, "axisLabels": {axis: {"title", "values"}},
"strategies": [{"slug", "label", "tag", "nodes", "variant", "options": [option]}],
"texts": [str], "fits": [fit], "compositions": [composition]}`;
option = `{"target", "npus", "skus", "verified", "modelImpl", "note", "axes": [{"axis",
"kind": "mode"|"option", "values", "base"}], "recommended": selection|null, "initial":
selection, "excluded": [partial selection], "roles": [{"role", "scale"}], "selections":
{key: int (composition) | {"x": excluded index} | {"e": text}}}`;
composition = `{"processes": [{"label", "role", "rank", "text"}], "router": [{"node",
"text"}]|null, "script": [text], "fit": int, "placeholders": [str]}` where the script
pieces concatenate to exactly `render_shell(plan)`; fit = `{"rows": [...]}` (the
`check_to_dict` rows plus `model_max_position`) or `{"error": str}`.

Public API: `MAX_SELECTIONS`, `selection_key`, `all_selections`, `build_recipe`,
`build_bundle`, `bundle_js`, `DATA_GLOBAL`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sous.recipes.catalog import LoadedRecipe
from sous.recipes.check import check_plan, check_to_dict
from sous.recipes.compose import ExcludedSelection, Plan, compose, resolve_selection
from sous.recipes.page import context_length
from sous.recipes.render import render_process, render_shell
from sous.recipes.schema import Grid, Option, Recipe, RecipeError, Strategy

__all__ = [
    "DATA_GLOBAL",
    "MAX_SELECTIONS",
    "all_selections",
    "build_bundle",
    "build_recipe",
    "bundle_js",
    "selection_key",
]

MAX_SELECTIONS = 20_000
"""Most selections one option's grid may have; a larger grid is a RecipeError."""
DATA_GLOBAL = "SOUS_RECIPE_DATA"
"""The global that `data.js` assigns the bundle to."""


class _Table:
    """Interns values (by their JSON text) and hands out their index."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._index: dict[str, int] = {}

    def add(self, value: Any) -> int:
        key = json.dumps(value, sort_keys=True, ensure_ascii=False)
        if key not in self._index:
            self._index[key] = len(self.items)
            self.items.append(value)
        return self._index[key]


def selection_key(grid: Grid, selection: Mapping[str, str]) -> str:
    """`axis=value&...` in grid axis order; `selection` must give every axis."""
    return "&".join(f"{axis}={selection[axis]}" for axis in grid.axes)


def all_selections(grid: Grid) -> Iterator[dict[str, str]]:
    """Every full selection of the grid (excluded ones too), in axis-value product order;
    RecipeError when there are more than MAX_SELECTIONS."""
    axes = grid.axes
    count = 1
    for values in axes.values():
        count *= len(values)
    if count > MAX_SELECTIONS:
        raise RecipeError(f"the grid has {count} selections, more than the page shows "
                          f"({MAX_SELECTIONS})")
    for combo in itertools.product(*axes.values()):
        yield dict(zip(axes, combo, strict=True))


def _script_pieces(script: str, parts: Sequence[str]) -> list[str]:
    """`script` cut at each of `parts` (found in order): the gaps and the parts, so that
    `"".join(pieces) == script`."""
    pieces, pos = [], 0
    for part in parts:
        at = script.index(part, pos)
        if at > pos:
            pieces.append(script[pos:at])
        pieces.append(part)
        pos = at + len(part)
    if pos < len(script):
        pieces.append(script[pos:])
    assert "".join(pieces) == script
    return pieces


def _fit(plan: Plan) -> dict[str, Any]:
    try:
        rows = check_plan(plan)
    except RecipeError as e:
        return {"error": str(e)}
    out = check_to_dict(rows)
    for entry, row in zip(out, rows, strict=True):
        entry["model_max_position"] = row.report.inputs.arch.max_position
    return {"rows": out}


def _composition(plan: Plan, texts: _Table, fits: _Table) -> dict[str, Any]:
    procs = [(p, render_process(p)) for p in plan.processes]
    router = [(s, s.cmd) for s in plan.router] if plan.router is not None else None
    parts = [t for _, t in procs] + [t for _, t in router or ()]
    script = _script_pieces(render_shell(plan), parts)
    return {
        "processes": [{"label": p.label, "role": p.role, "rank": p.rank, "text": texts.add(t)}
                      for p, t in procs],
        "router": None if router is None else [{"node": s.node, "text": texts.add(t)}
                                               for s, t in router],
        "script": [texts.add(piece) for piece in script],
        "fit": fits.add(_fit(plan)),
        "placeholders": list(plan.placeholders_left),
    }


def _display_values(recipe: Recipe, axis: str, values: Sequence[str]) -> list[str]:
    """The grid's values of an axis in the page's order (its `axes` entry), then the rest."""
    _, labels = recipe.axis_labels(axis)
    return [v for v in labels if v in values] + [v for v in values if v not in labels]


def _allowed(grid: Grid, sets: Mapping[str, str], recommended: bool) -> dict[str, str] | None:
    try:
        return resolve_selection(grid, sets, recommended)
    except ExcludedSelection:
        return None


def _initial(grid: Grid) -> dict[str, str]:
    """Recommended if allowed, else base if allowed, else the first allowed selection."""
    first = _allowed(grid, {}, True) or _allowed(grid, {}, False)
    if first is not None:
        return first
    for sel in all_selections(grid):
        if _allowed(grid, sel, False) is not None:
            return sel
    raise RecipeError("every selection of the grid is excluded")


def _option(lr: LoadedRecipe, strat: Strategy, option: Option, tables: dict[str, _Table],
            compositions: list[dict[str, Any]]) -> dict[str, Any]:
    grid, base = option.grid, option.grid.base_selection
    selections: dict[str, Any] = {}
    for sel in all_selections(grid):
        key = selection_key(grid, sel)
        try:
            plan = compose(lr.recipe, strat.slug, option.target, sets=sel, name=lr.name)
        except ExcludedSelection as e:
            selections[key] = {"x": e.index}
            continue
        except RecipeError as e:
            selections[key] = {"e": tables["texts"].add(str(e))}
            continue
        compositions.append(_composition(plan, tables["texts"], tables["fits"]))
        selections[key] = len(compositions) - 1
    axes = [{"axis": a, "kind": "mode" if a in grid.modes else "option",
             "values": _display_values(lr.recipe, a, vs), "base": base[a]}
            for a, vs in grid.axes.items()]
    return {
        "target": option.target, "npus": option.npus, "skus": list(option.skus),
        "verified": option.verified, "modelImpl": option.modelImpl, "note": option.note,
        "axes": axes,
        "recommended": _allowed(grid, {}, True) if grid.recommended else None,
        "initial": _initial(grid),
        "excluded": [dict(e) for e in grid.excluded],
        "roles": [{"role": b.role, "scale": b.scale} for b in grid.base],
        "selections": selections,
    }


def _header(lr: LoadedRecipe) -> dict[str, Any]:
    r = lr.recipe
    badges = [{"text": b, "hl": False} if isinstance(b, str) else {"text": b.text, "hl": b.hl}
              for b in r.badges]
    labels = {}
    for a in r.axes:
        labels.setdefault(a.axis, {"title": a.title,
                                   "values": {c.value: c.label for c in a.options}})
    return {
        "id": lr.name, "name": r.name, "model": r.model, "provider": r.provider, "hf": r.hf,
        "badges": badges, "context": context_length(r), "variant": r.variant,
        "installLine": r.installLine, "client": r.client,
        "text": {lang: t.model_dump(include={"sub", "tag", "strategyNote"})
                 for lang, t in r.text.items()},
        "axisLabels": labels,
    }


def build_recipe(lr: LoadedRecipe) -> dict[str, Any]:
    """The page data of one recipe (the `recipe` shape in the module docstring)."""
    tables = {"texts": _Table(), "fits": _Table()}
    compositions: list[dict[str, Any]] = []
    strategies = []
    for s in lr.recipe.strategies:
        options = [_option(lr, s, o, tables, compositions) for o in s.options]
        strategies.append({"slug": s.slug, "label": s.label, "tag": s.tag, "nodes": s.nodes,
                           "variant": s.variant or lr.recipe.variant, "options": options})
    return {**_header(lr), "strategies": strategies, "texts": tables["texts"].items,
            "fits": tables["fits"].items, "compositions": compositions}


def build_bundle(recipes: Sequence[LoadedRecipe]) -> dict[str, Any]:
    """The page data of several recipes; RecipeError when two share an id (file stem)."""
    ids = [lr.name for lr in recipes]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise RecipeError(f"two recipes named {', '.join(dupes)}: rename one file")
    return {"version": 1, "recipes": [build_recipe(lr) for lr in recipes]}


def bundle_js(bundle: Mapping[str, Any]) -> str:
    """`data.js`: assigns the bundle to `window.SOUS_RECIPE_DATA` (loadable from file://)."""
    text = json.dumps(bundle, ensure_ascii=False, separators=(",", ":")).replace("</", "<\\/")
    return f"window.{DATA_GLOBAL} = {text};\n"
