"""What `sous recipe list` and `sous recipe show` print: a recipe page as text.

`list_table`: one row per recipe (name, model, badges, context, strategies). `show_text`:
the page copy in the chosen language (`text.<lang>`, HTML tags stripped), the facts (provider,
the variant the commands are for and the published `variants`, ...), then every
strategy with its targets, NPUs, SKUs, verified date, the offered axes with their allowed
values (`*` marks the base value) and the recommended selection.

Public API: `context_length`, `list_table`, `show_text`, `plain`.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

from sous.recipes.catalog import LoadedRecipe
from sous.recipes.schema import Grid, Option, Recipe, Strategy

__all__ = ["context_length", "list_table", "plain", "show_text"]


def plain(fragment: str | None) -> str:
    """Page HTML -> text: tags dropped, entities decoded, whitespace collapsed."""
    text = html.unescape(re.sub(r"<[^>]+>", "", fragment or ""))
    return " ".join(text.split())


def context_length(recipe: Recipe) -> int | None:
    """The largest `--max-model-len` of any strategy's base commands (None if none sets it)."""
    lengths = []
    for s in recipe.strategies:
        for o in s.options:
            for b in o.grid.base:
                text = b.args.get("--max-model-len", "")
                digits = text.split()[-1] if text.split() else ""
                if digits.isdigit():
                    lengths.append(int(digits))
    return max(lengths) if lengths else None


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines) + "\n"


def list_table(recipes: Sequence[LoadedRecipe]) -> str:
    """The `sous recipe list` table."""
    rows = [("NAME", "MODEL", "BADGES", "CONTEXT", "STRATEGIES")]
    for lr in recipes:
        r = lr.recipe
        ctx = context_length(r)
        rows.append((lr.name, r.model, ", ".join(r.badge_texts()),
                     f"{ctx:,}" if ctx else "-", ", ".join(s.slug for s in r.strategies)))
    return _table(rows)


def _axis_lines(recipe: Recipe, grid: Grid) -> list[str]:
    base = grid.base_selection
    out = []
    for axis, values in grid.axes.items():
        title, labels = recipe.axis_labels(axis)
        shown = [f"{v}{'*' if v == base[axis] else ''}"
                 + (f" ({labels[v]})" if labels.get(v, v) != v else "") for v in values]
        out.append(f"      {axis} - {title}: {', '.join(shown)}")
    return out


def _grid_lines(recipe: Recipe, grid: Grid) -> list[str]:
    out = ["    axes (* = base):", *_axis_lines(recipe, grid)]
    rec = grid.recommended
    out.append("    recommended: " + (" ".join(f"{a}={v}" for a, v in rec.items())
                                       if rec else "(none)"))
    if grid.excluded:
        for i, entry in enumerate(grid.excluded):
            out.append(f"    excluded[{i}]: " + " ".join(f"{a}={v}" for a, v in entry.items()))
    roles = ", ".join(f"{b.role} ({b.scale or 'one process'})" for b in grid.base)
    out.append(f"    roles: {roles}" + ("; router after the servers" if grid.router else ""))
    return out


def _same_grid_choices(options: Sequence[Option]) -> bool:
    keys = {(repr(o.grid.modes), repr(o.grid.options), repr(o.grid.option_base),
             repr(o.grid.recommended), repr(o.grid.excluded), o.grid.roles,
             o.grid.router is None) for o in options}
    return len(keys) == 1


def _strategy_lines(recipe: Recipe, s: Strategy) -> list[str]:
    nodes = f", {s.nodes} nodes" if s.nodes else ""
    out = [f"  {s.slug}: {s.label}" + (f" ({s.tag})" if s.tag else "") + nodes
           + (f", variant {s.variant}" if s.variant else "")]
    for o in s.options:
        impl = f", model impl {o.modelImpl}" if o.modelImpl else ""
        out.append(f"    {o.target:<10}  {o.npus or '?'} NPUs  {', '.join(o.skus) or '-'}  "
                   f"verified {o.verified or '-'}{impl}" + (f"  note: {plain(o.note)}"
                                                           if o.note else ""))
    if _same_grid_choices(s.options):
        out += _grid_lines(recipe, s.options[0].grid)
    else:
        for o in s.options:
            out.append(f"    [{o.target}]")
            out += ["  " + line for line in _grid_lines(recipe, o.grid)]
    return out


def show_text(lr: LoadedRecipe, lang: str = "en") -> str:
    """The `sous recipe show` text; `lang` picks `text.<lang>` (ValueError if missing)."""
    r = lr.recipe
    if r.text and lang not in r.text:
        raise ValueError(f"no page text in {lang!r} (available: {', '.join(r.text)})")
    copy = r.text.get(lang)
    out = [f"{r.name} ({r.model}) - recipe {lr.name}"]
    if copy is not None:
        out += [plain(t) for t in (copy.sub, copy.tag) if t]
    out.append("badges: " + ", ".join(r.badge_texts()))
    variant = r.variant
    if r.variants:
        variant = f"{r.variant or '-'} (published variants: {', '.join(r.variants)})"
    facts = [("provider", r.provider), ("variant", variant), ("hf", r.hf),
             ("install", r.installLine)]
    out += [f"{k}: {v}" for k, v in facts if v]
    ctx = context_length(r)
    if ctx:
        out.append(f"context: {ctx:,} tokens")
    out += ["", "strategies:"]
    for s in r.strategies:
        out += _strategy_lines(r, s)
    if copy is not None and copy.strategyNote:
        out += ["", plain(copy.strategyNote)]
    return "\n".join(out) + "\n"
