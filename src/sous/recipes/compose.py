"""Selection -> processes, exactly as `docs/recipe-format.md` describes.

A selection gives every axis of the chosen option's grid a value: modes start at `off`,
toggles at their `option_base`; `recommended=True` then applies the page's recommended
selection, and explicit `sets` override both. A selection matching an `excluded` entry is
refused. Composition: for each role, the base args/envs, then the delta of every chosen
non-base value in grid axis order (`del_*` first, then `add_*`, which replace a same-name
flag in place or append), then one process per rank (rank args/envs added to, or replacing
by name, the role's); a role without ranks is one process with rank None. `<PLACEHOLDER>`s
are filled from `variables` and left as they are otherwise.

Public API: `Arg`, `EnvVar`, `Process`, `RouterStep`, `Plan`, `ChoiceError`,
`ExcludedSelection`, `parse_assignments`, `pick_option`, `resolve_selection`,
`active_deltas`, `compose`, `placeholders_in`.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sous.recipes.schema import (
    Grid,
    Option,
    Recipe,
    RecipeError,
    RoleBase,
    RoleDelta,
    Strategy,
    env_name_of,
)

__all__ = [
    "Arg",
    "ChoiceError",
    "EnvVar",
    "ExcludedSelection",
    "Plan",
    "Process",
    "RouterStep",
    "active_deltas",
    "compose",
    "parse_assignments",
    "pick_option",
    "placeholders_in",
    "resolve_selection",
]

_PLACEHOLDER = re.compile(r"<([A-Z][A-Z0-9_]*)>")


class ChoiceError(RecipeError):
    """An unknown strategy, target, axis, value or placeholder; lists the valid choices."""

    def __init__(self, what: str, given: str | None, choices: Iterable[str], context: str = ""):
        self.what, self.given, self.choices = what, given, list(choices)
        where = f" {context}" if context else ""
        valid = ", ".join(self.choices) if self.choices else "(none)"
        head = f"missing {what}" if given is None else f"unknown {what} {given!r}"
        super().__init__(f"{head}{where} (valid: {valid})")


class ExcludedSelection(RecipeError):
    """The selection matches entry `index` of the grid's `excluded` list."""

    def __init__(self, index: int, entry: Mapping[str, str]):
        self.index, self.entry = index, dict(entry)
        text = ", ".join(f"{a}={v}" for a, v in entry.items())
        super().__init__(f"this selection is excluded by the recipe: excluded[{index}] = {{{text}}}")


# ----------------------------------------------------------------------------- values


def _decode_word(word: str) -> Any:
    """A JSON object, array or number decoded; any other word as it is."""
    if word[:1] not in "{[-0123456789" or not word:
        return word
    try:
        value = json.loads(word)
    except ValueError:
        return word
    return value if isinstance(value, dict | list | int | float) else word


def placeholders_in(text: str) -> list[str]:
    """Placeholder names (`POD_IP` for `<POD_IP>`) in text, in order of appearance."""
    return _PLACEHOLDER.findall(text)


def _fill(text: str, variables: Mapping[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: variables.get(m.group(1), m.group(0)), text)


@dataclass(frozen=True)
class Arg:
    """One argument: its flag, its shell words (placeholders filled) and shell text."""

    flag: str
    words: tuple[str, ...]
    text: str

    @classmethod
    def from_text(cls, flag: str, text: str, variables: Mapping[str, str]) -> Arg:
        words = tuple(shlex.split(text))
        filled = tuple(_fill(w, variables) for w in words)
        if filled != words:
            text = " ".join(shlex.quote(w) for w in filled)
        return cls(flag=flag, words=filled, text=text)

    @property
    def value(self) -> Any:
        """`True` for a bare flag; the (JSON-decoded) word after the flag; a list for more."""
        head, eq, inline = self.words[0].partition("=")
        rest = [inline, *self.words[1:]] if eq and head.startswith("--") else list(self.words[1:])
        if not rest:
            return True
        return _decode_word(rest[0]) if len(rest) == 1 else [_decode_word(w) for w in rest]


@dataclass(frozen=True)
class EnvVar:
    """One environment assignment: name, unquoted value, and `NAME=value` shell text."""

    name: str
    value: str
    text: str

    @classmethod
    def from_text(cls, text: str, variables: Mapping[str, str]) -> EnvVar:
        name = env_name_of(text)
        value = shlex.split(text)[0].partition("=")[2]
        filled = _fill(value, variables)
        if filled != value:
            text = f"{name}={shlex.quote(filled)}"
        return cls(name=name, value=filled, text=text)


@dataclass(frozen=True)
class Process:
    """One composed command: `envs launcher model args`."""

    role: str
    rank: int | None
    launcher: str
    model: str
    envs: tuple[EnvVar, ...]
    args: tuple[Arg, ...]

    @property
    def launcher_words(self) -> list[str]:
        return shlex.split(self.launcher)

    @property
    def argv(self) -> list[str]:
        """The exact token list after the launcher words: the model, then every arg's words."""
        return [self.model, *(w for a in self.args for w in a.words)]

    @property
    def label(self) -> str:
        return self.role if self.rank is None else f"{self.role} rank {self.rank}"

    def arg(self, flag: str) -> Arg | None:
        return next((a for a in self.args if a.flag == flag), None)

    def env(self, name: str) -> EnvVar | None:
        return next((e for e in self.envs if e.name == name), None)


@dataclass(frozen=True)
class RouterStep:
    """One router command, run after the servers."""

    node: str
    cmd: str


@dataclass(frozen=True)
class Plan:
    """The composed deployment of one selection."""

    recipe: str
    model: str
    strategy: str
    target: str
    selection: Mapping[str, str]
    deltas: tuple[str, ...]
    processes: tuple[Process, ...]
    router: tuple[RouterStep, ...] | None
    placeholders_left: tuple[str, ...]
    option: Option
    variant: str | None = None  # the checkpoint variant the strategy is for (e.g. FP8)

    def roles(self) -> list[str]:
        return list(dict.fromkeys(p.role for p in self.processes))


# ----------------------------------------------------------------------------- selection


def parse_assignments(pairs: Sequence[str], what: str) -> dict[str, str]:
    """`["A=1", "B=x"]` -> `{"A": "1", "B": "x"}` (later wins); RecipeError without `=`.
    For placeholders, `<POD_IP>=...` and `POD_IP=...` are the same."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key = key.strip()
        if what == "--var" and key.startswith("<") and key.endswith(">"):
            key = key[1:-1]
        if not eq or not key:
            raise RecipeError(f"{what} {pair!r}: expected NAME=VALUE")
        out[key] = value
    return out


def pick_option(recipe: Recipe, slug: str | None, target: str | None) -> tuple[Strategy, Option]:
    """The strategy and its option for a target; the target may be omitted when the strategy
    has one option (ChoiceError listing valid strategies or targets)."""
    slugs = [s.slug for s in recipe.strategies]
    strategy = recipe.strategy(slug) if slug else None
    if strategy is None:
        raise ChoiceError("strategy" if slug else "--strategy", slug, slugs)
    targets = [o.target for o in strategy.options]
    if target is None:
        if len(targets) == 1:
            return strategy, strategy.options[0]
        raise ChoiceError("--target", None, targets, f"(strategy {slug!r} has several)")
    option = strategy.option(target)
    if option is None:
        raise ChoiceError("target", target, targets, f"for strategy {slug!r}")
    return strategy, option


def resolve_selection(
    grid: Grid, sets: Mapping[str, str], recommended: bool = False
) -> dict[str, str]:
    """A value for every axis of the grid: base, then recommended (if asked), then `sets`;
    ChoiceError for an unknown axis or value, ExcludedSelection for an excluded one."""
    selection = grid.base_selection
    if recommended and grid.recommended:
        selection.update(grid.recommended)
    axes = grid.axes
    for axis, value in sets.items():
        if axis not in axes:
            raise ChoiceError("axis", axis, axes)
        if value not in axes[axis]:
            raise ChoiceError(f"value for {axis}", value, axes[axis])
        selection[axis] = value
    for index, entry in enumerate(grid.excluded):
        if all(selection.get(a) == v for a, v in entry.items()):
            raise ExcludedSelection(index, entry)
    return selection


def active_deltas(grid: Grid, selection: Mapping[str, str]) -> list[str]:
    """Delta keys of every chosen non-base value, in grid axis order (modes, then toggles);
    RecipeError when the recipe has no delta for a chosen value."""
    base = grid.base_selection
    keys = [f"{a}={selection[a]}" for a in grid.axes if selection[a] != base[a]]
    missing = [k for k in keys if k not in grid.deltas]
    if missing:
        raise RecipeError(f"the recipe has no delta for {', '.join(missing)}")
    return keys


# ----------------------------------------------------------------------------- composition


def _apply(args: dict[str, str], envs: dict[str, str], delta: RoleDelta) -> None:
    for flag in delta.del_args:
        args.pop(flag, None)
    for name in delta.del_envs:
        envs.pop(name, None)
    args.update(delta.add_args)  # an existing flag keeps its place, a new one is appended
    envs.update(delta.add_envs)


def _role_processes(
    base: RoleBase, deltas: Sequence[RoleDelta], model: str, variables: Mapping[str, str]
) -> list[Process]:
    args, envs = dict(base.args), dict(base.envs)
    for delta in deltas:
        _apply(args, envs, delta)
    ranks: list[tuple[int | None, dict[str, str], dict[str, str]]] = []
    if base.ranks is None:
        ranks.append((None, args, envs))
    for i, rank in enumerate(base.ranks or ()):
        ranks.append((i, {**args, **rank.args}, {**envs, **rank.envs}))
    return [
        Process(role=base.role, rank=i, launcher=base.launcher, model=model,
                envs=tuple(EnvVar.from_text(t, variables) for t in e.values()),
                args=tuple(Arg.from_text(f, t, variables) for f, t in a.items()))
        for i, a, e in ranks
    ]


def _grid_placeholders(grid: Grid) -> list[str]:
    texts = [grid.model]
    for b in grid.base:
        texts += [*b.args.values(), *b.envs.values()]
        for r in b.ranks or ():
            texts += [*r.args.values(), *r.envs.values()]
    for per_role in grid.deltas.values():
        for d in per_role.values():
            texts += [*d.add_args.values(), *d.add_envs.values()]
    texts += [n.cmd for n in grid.router.nodes] if grid.router else []
    return list(dict.fromkeys(p for t in texts for p in placeholders_in(t)))


def compose(
    recipe: Recipe,
    strategy: str | None,
    target: str | None = None,
    sets: Mapping[str, str] | None = None,
    recommended: bool = False,
    variables: Mapping[str, str] | None = None,
    name: str | None = None,
) -> Plan:
    """Compose the processes of one selection (ChoiceError / ExcludedSelection / RecipeError).

    `variables` fill `<NAME>` placeholders; a name that is no placeholder of this grid is a
    ChoiceError listing the grid's placeholders."""
    strat, option = pick_option(recipe, strategy, target)
    grid, variables = option.grid, dict(variables or {})
    known = _grid_placeholders(grid)
    for var in variables:
        if var not in known:
            raise ChoiceError("placeholder", var, known, "for --var")
    selection = resolve_selection(grid, sets or {}, recommended)
    keys = active_deltas(grid, selection)
    processes: list[Process] = []
    for base in grid.base:
        deltas = [grid.deltas[k][base.role] for k in keys if base.role in grid.deltas[k]]
        processes += _role_processes(base, deltas, _fill(grid.model, variables), variables)
    router = None
    if grid.router is not None:
        router = tuple(RouterStep(n.node, _fill(n.cmd, variables)) for n in grid.router.nodes)
    texts = [w for p in processes for w in [*p.argv, *(e.value for e in p.envs)]]
    texts += [s.cmd for s in router or ()]
    left = tuple(dict.fromkeys(x for t in texts for x in placeholders_in(t)))
    return Plan(recipe=name or recipe.name, model=_fill(grid.model, variables),
                strategy=strat.slug, target=option.target, selection=selection,
                deltas=tuple(keys), processes=tuple(processes), router=router,
                placeholders_left=left, option=option, variant=strat.variant or recipe.variant)
