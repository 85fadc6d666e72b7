"""The shipped recipes (package data under `sous/recipes/catalog/`) and loading by name or path.

A recipe is named by its file stem (`minimax-m2.7`) or given as a path to a JSON file
(anything that contains a path separator, ends in `.json` or exists on disk).

Public API: `LoadedRecipe`, `RecipeNotFound`, `catalog_dir`, `shipped_names`,
`list_recipes`, `load_recipe`, `load_recipe_file`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from sous.recipes.schema import Recipe, RecipeError, parse_recipe

__all__ = [
    "LoadedRecipe",
    "RecipeNotFound",
    "catalog_dir",
    "list_recipes",
    "load_recipe",
    "load_recipe_file",
    "shipped_names",
]


class RecipeNotFound(RecipeError):
    """No shipped recipe of that name and no such file; `choices` are the shipped names."""

    def __init__(self, name: str, choices: list[str]):
        self.name, self.choices = name, choices
        super().__init__(f"unknown recipe {name!r} (shipped recipes: {', '.join(choices)}; "
                         "or give a path to a recipe JSON file)")


@dataclass(frozen=True)
class LoadedRecipe:
    """A validated recipe and where it came from; `name` is the file stem."""

    name: str
    path: Path
    recipe: Recipe


def catalog_dir() -> Path:
    """The folder of the shipped recipe files."""
    return Path(str(resources.files("sous.recipes") / "catalog"))


def shipped_names() -> list[str]:
    """Stems of the shipped recipes, sorted."""
    return sorted(p.stem for p in catalog_dir().glob("*.json"))


def load_recipe_file(path: str | os.PathLike[str]) -> LoadedRecipe:
    """Read and validate one recipe file (RecipeError naming the file on any problem)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise RecipeError(f"{path}: cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path}: not JSON: {e}") from None
    return LoadedRecipe(name=path.stem, path=path, recipe=parse_recipe(data, str(path)))


def _looks_like_path(name: str) -> bool:
    return os.sep in name or "/" in name or name.endswith(".json") or Path(name).is_file()


def load_recipe(name: str) -> LoadedRecipe:
    """A shipped recipe by stem, or a recipe file by path (RecipeNotFound / RecipeError)."""
    if _looks_like_path(name):
        if not Path(name).is_file():
            raise RecipeNotFound(name, shipped_names())
        return load_recipe_file(name)
    path = catalog_dir() / f"{name}.json"
    if not path.is_file():
        raise RecipeNotFound(name, shipped_names())
    return load_recipe_file(path)


def list_recipes() -> list[LoadedRecipe]:
    """Every shipped recipe, loaded and validated, in name order."""
    return [load_recipe_file(catalog_dir() / f"{n}.json") for n in shipped_names()]
