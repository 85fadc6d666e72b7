"""Helpers for building command-line flags from config dataclasses: value parsers that
raise ValueError with a readable reason, and field docstring / type introspection."""

from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any

__all__ = [
    "at_least",
    "class_doc",
    "field_docs",
    "human_readable_int",
    "parse_float",
    "parse_int",
    "parse_json_object",
    "parse_max_model_len",
    "unwrap_optional",
]


def human_readable_int(value: str) -> int:
    """Parse an integer with an optional size suffix, as vLLM does: lowercase k/m/g/t are
    decimal (`25.6k` = 25600), uppercase K/M/G/T are binary (`32K` = 32768, `1M` = 1048576,
    no decimals). sous also accepts the IEC forms `Ki/Mi/Gi/Ti` and `KiB/MiB/GiB/TiB`
    (binary)."""
    text = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(?:([kmgt])|([KMGT])(?:i|iB)?)", text)
    if m is None:
        return parse_int(text)
    number, dec, binary = m.groups()
    if dec:
        return int(float(number) * 1000 ** ("kmgt".index(dec) + 1))
    if "." in number:
        raise ValueError(f"decimals are not allowed with binary suffixes; did you mean "
                         f"{number}{binary.lower()}?")
    return int(number) * 1024 ** ("KMGT".index(binary) + 1)


def parse_int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError("expected an integer") from None


def parse_float(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError("expected a number") from None


def parse_max_model_len(value: str) -> int | None:
    """vLLM's `-1`/`auto`: sous uses the model's context length (the default)."""
    return None if value.strip().lower() in ("auto", "-1") else human_readable_int(value)


def parse_json_object(value: str) -> dict[str, Any]:
    obj = json.loads(value)
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    return obj



def at_least(n: int) -> Callable[[Any], str | None]:
    return lambda v: None if v is None or v >= n else f"must be >= {n}"


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings of a dataclass's fields: the string literal right after each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:], strict=False):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs[prev.target.id] = inspect.cleandoc(node.value.value)
    return docs


def class_doc(cls: type) -> str | None:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    doc = ast.get_docstring(tree.body[0])  # type: ignore[arg-type]
    return doc.split("\n\n")[0] if doc else None


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported field type {tp!r}")
        return args[0], True
    return tp, False

