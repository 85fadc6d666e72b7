"""Pydantic models of the vendor recipe format (`docs/recipe-format.md`).

A recipe file is one vendor page's data: a model, several strategies, one option per
optimisation target, each option with a `grid` from which the commands are composed.
The models are frozen. Page-level fields the composer does not read (`attn`, `features`,
option `label`, ...) are kept as they are (extra fields allowed); the fields the composer
reads are checked strictly, including the cross references inside a grid (roles named by
deltas, `axis=value` keys, recommended and excluded selections, flag texts that start with
their flag). `parse_recipe` turns any failure into `RecipeError`, whose message names the
path inside the file of every problem, e.g. `strategies[2].options[0].grid.deltas`.

Public API: `Recipe`, `Strategy`, `Option`, `Grid`, `RoleBase`, `RankOverride`, `RoleDelta`,
`Router`, `RouterNode`, `Axis`, `AxisChoice`, `Badge`, `PageText`, `RecipeError`,
`parse_recipe`, `flag_of`, `env_name_of`.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "Axis",
    "AxisChoice",
    "Badge",
    "Grid",
    "Option",
    "PageText",
    "RankOverride",
    "Recipe",
    "RecipeError",
    "RoleBase",
    "RoleDelta",
    "Router",
    "RouterNode",
    "Strategy",
    "env_name_of",
    "flag_of",
    "parse_recipe",
]

Target = Literal["Latency", "Throughput"]


class RecipeError(ValueError):
    """A recipe that cannot be read or is not valid; the message names the file and paths."""


def flag_of(text: str) -> str:
    """The flag name of an argument text (`"--block-size 4096"` and `"--block-size=4096"`
    -> `"--block-size"`);
    ValueError when the text is not shell-parsable or does not start with a `-` flag."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"not a shell-quoted argument ({e}): {text!r}") from None
    if not words or not words[0].startswith("-"):
        raise ValueError(f"argument text does not start with a flag: {text!r}")
    return words[0].partition("=")[0] if words[0].startswith("--") else words[0]


def env_name_of(text: str) -> str:
    """The variable name of an env text (`"A=1"` -> `"A"`); ValueError when it is not a
    single shell word of the form NAME=value."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"not a shell-quoted assignment ({e}): {text!r}") from None
    name, eq, _ = words[0].partition("=") if len(words) == 1 else ("", "", "")
    if not eq or not name.replace("_", "a").isalnum() or name[0].isdigit():
        raise ValueError(f"env text is not one NAME=value word: {text!r}")
    return name


def _check_args(args: dict[str, str]) -> dict[str, str]:
    for key, text in args.items():
        if flag_of(text) != key:
            raise ValueError(f"args[{key!r}]: the text starts with {flag_of(text)!r}, not the key")
    return args


def _check_envs(envs: dict[str, str]) -> dict[str, str]:
    for key, text in envs.items():
        if env_name_of(text) != key:
            raise ValueError(f"envs[{key!r}]: the text assigns {env_name_of(text)!r}, not the key")
    return envs


ArgMap = Annotated[dict[str, str], AfterValidator(_check_args)]
"""flag -> the flag's full text, checked by `_check_args`."""
EnvMap = Annotated[dict[str, str], AfterValidator(_check_envs)]
"""name -> `NAME=value`, checked by `_check_envs`."""


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")


class Badge(_Open):
    """A highlighted badge (`{"text": ..., "hl": true}`); plain badges are strings."""

    text: str
    hl: bool = False


class AxisChoice(_Open):
    """One value of an option axis with its page label."""

    value: str
    label: str


class Axis(_Open):
    """An option axis the page can show (`lmcache`, `spec_decode`, ...)."""

    axis: str
    title: str
    options: tuple[AxisChoice, ...]


class PageText(_Open):
    """Page copy in one language (HTML fragments)."""

    sub: str | None = None
    tag: str | None = None
    strategyNote: str | None = None  # noqa: N815 - the file's field name


class RankOverride(_Strict):
    """Per-rank args/envs; added to, or replacing by name, the role's."""

    args: ArgMap = Field(default_factory=dict)
    envs: EnvMap = Field(default_factory=dict)


class RoleBase(_Strict):
    """The base command of one role (`main`, `prefill`, `decode`)."""

    role: str
    launcher: str
    args: ArgMap = Field(default_factory=dict)
    envs: EnvMap = Field(default_factory=dict)
    ranks: tuple[RankOverride, ...] | None = None
    scale: str | None = None
    varies: tuple[str, ...] | None = None

    @field_validator("launcher")
    @classmethod
    def _launcher_words(cls, v: str) -> str:
        if not shlex.split(v):
            raise ValueError("launcher is empty")
        return v


class RoleDelta(_Strict):
    """What one chosen value does to one role."""

    del_args: tuple[str, ...] = ()
    del_envs: tuple[str, ...] = ()
    add_args: ArgMap = Field(default_factory=dict)
    add_envs: EnvMap = Field(default_factory=dict)


class RouterNode(_Strict):
    """One router step: a label and a shell command (heredoc or `helm install`)."""

    node: str
    cmd: str


class Router(_Strict):
    """Commands run after the servers."""

    role: str = "router"
    nodes: tuple[RouterNode, ...]


class Grid(_Strict):
    """Everything the commands of one option are composed from."""

    model: str
    base: tuple[RoleBase, ...]
    modes: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    options: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    option_base: dict[str, str] = Field(default_factory=dict)
    deltas: dict[str, dict[str, RoleDelta]] = Field(default_factory=dict)
    recommended: dict[str, str] | None = None
    excluded: tuple[dict[str, str], ...] = ()
    router: Router | None = None

    @property
    def axes(self) -> dict[str, tuple[str, ...]]:
        """Every axis of the grid (modes, then toggles) -> its allowed values."""
        return {**self.modes, **self.options}

    @property
    def base_selection(self) -> dict[str, str]:
        """The selection the base commands stand for (`off` for modes, option_base)."""
        return {**{a: "off" for a in self.modes}, **self.option_base}

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(b.role for b in self.base)

    @model_validator(mode="after")
    def _cross_check(self) -> Grid:
        problems = [*self._check_axes(), *self._check_deltas(), *self._check_selections()]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _check_axes(self) -> list[str]:
        out = [] if self.base else ["base: no roles"]
        if len(set(self.roles)) != len(self.roles):
            out.append(f"base: roles are not unique: {list(self.roles)}")
        for axis in set(self.modes) & set(self.options):
            out.append(f"axis {axis!r} is both a mode and an option")
        for axis, values in self.modes.items():
            if "off" not in values:
                out.append(f"modes[{axis!r}]: has no 'off' (the base value): {list(values)}")
        if set(self.option_base) != set(self.options):
            out.append(f"option_base names {sorted(self.option_base)} but options are "
                       f"{sorted(self.options)}")
        for axis, value in self.option_base.items():
            if axis in self.options and value not in self.options[axis]:
                out.append(f"option_base[{axis!r}]={value!r} is not one of "
                           f"{list(self.options[axis])}")
        return out

    def _check_deltas(self) -> list[str]:
        out, axes, base = [], self.axes, self.base_selection
        for key, per_role in self.deltas.items():
            axis, eq, value = key.partition("=")
            if not eq or axis not in axes or value not in axes[axis]:
                out.append(f"deltas[{key!r}]: not an `axis=value` of this grid")
            elif value == base[axis]:
                out.append(f"deltas[{key!r}]: {value!r} is the base value of {axis!r}")
            for role in per_role:
                if role not in self.roles:
                    out.append(f"deltas[{key!r}][{role!r}]: no such role "
                               f"(roles: {', '.join(self.roles)})")
        return out

    def _check_selections(self) -> list[str]:
        out, axes = [], self.axes
        named = [("recommended", self.recommended or {})]
        named += [(f"excluded[{i}]", sel) for i, sel in enumerate(self.excluded)]
        for where, sel in named:
            for axis, value in sel.items():
                if axis not in axes or value not in axes[axis]:
                    out.append(f"{where}: {axis}={value} is not an axis value of this grid")
        return out


class Option(_Open):
    """One optimisation target of a strategy."""

    target: Target
    npus: int | None = None
    skus: tuple[str, ...] = ()
    verified: str | None = None
    modelImpl: str | None = None  # noqa: N815 - the file's field name
    note: str | None = None
    grid: Grid


class Strategy(_Open):
    """One deployment strategy (aggregated DP+EP, PP, P/D disaggregated, ...)."""

    slug: str
    label: str
    tag: str | None = None
    nodes: int | None = None
    variant: str | None = None
    options: tuple[Option, ...]

    @field_validator("nodes", mode="before")
    @classmethod
    def _nodes_number(cls, v: Any) -> Any:
        return int(v) if isinstance(v, str) and v.strip().isdigit() else v

    @model_validator(mode="after")
    def _targets_unique(self) -> Strategy:
        targets = [o.target for o in self.options]
        if not targets:
            raise ValueError("options: a strategy needs at least one option")
        if len(set(targets)) != len(targets):
            raise ValueError(f"options: targets are not unique: {targets}")
        return self

    def option(self, target: str) -> Option | None:
        return next((o for o in self.options if o.target == target), None)


class Recipe(_Open):
    """A whole recipe file."""

    name: str
    model: str
    provider: str | None = None
    hf: str | None = None
    badges: tuple[str | Badge, ...] = ()
    client: str | None = None
    installLine: str | None = None  # noqa: N815 - the file's field name
    variant: str | None = None
    variants: tuple[str, ...] | None = None  # the published checkpoint variants
    axes: tuple[Axis, ...] = ()
    text: dict[str, PageText] = Field(default_factory=dict)
    strategies: tuple[Strategy, ...]

    @model_validator(mode="after")
    def _slugs_unique(self) -> Recipe:
        slugs = [s.slug for s in self.strategies]
        if not slugs:
            raise ValueError("strategies: a recipe needs at least one strategy")
        if len(set(slugs)) != len(slugs):
            raise ValueError(f"strategies: slugs are not unique: {slugs}")
        return self

    def strategy(self, slug: str) -> Strategy | None:
        return next((s for s in self.strategies if s.slug == slug), None)

    def badge_texts(self) -> list[str]:
        return [b if isinstance(b, str) else b.text for b in self.badges]

    def axis_labels(self, axis: str) -> tuple[str, dict[str, str]]:
        """(title, value -> label) of an axis from the page's `axes` (first entry wins);
        the axis name and raw values when the page has no labels for it."""
        for a in self.axes:
            if a.axis == axis:
                return a.title, {c.value: c.label for c in a.options}
        return axis, {}


def _format_loc(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier():
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out or "(top level)"


def parse_recipe(data: Any, source: str = "<recipe>") -> Recipe:
    """Validate decoded JSON as a Recipe; RecipeError naming `source` and, for every
    problem, its path in the file (e.g. `strategies[0].options[1].grid.base[0].args`)."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        lines = [f"  {_format_loc(err['loc'])}: {err['msg']}" for err in e.errors()]
        raise RecipeError(f"{source}: not a valid recipe:\n" + "\n".join(lines)) from None
