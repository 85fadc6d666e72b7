"""`StructuredOutputsParams`: what a request constrains its output to, with vLLM's names.

Exactly one constraint is set: `json` (a JSON schema, dict or string), `regex`, `choice` (list
of literal strings), `grammar` (EBNF, or Lark converted by xgrammar), `json_object` (any JSON
object). `structural_tag` is recognised and rejected as not supported yet. Options:
`disable_any_whitespace` (compact JSON), `disable_additional_properties` (objects without
`additionalProperties` get `false`). `whitespace_pattern` is not supported by the xgrammar
backend and is rejected.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any


class StructuredOutputKind(enum.Enum):
    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"
    CHOICE = "choice"


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        count = sum(getattr(self, name) is not None for name in _CONSTRAINTS)
        if count > 1:
            raise ValueError("You can only use one kind of structured outputs constraint "
                             f"but multiple are specified: {self._shown()}")
        if count < 1:
            raise ValueError("You must use one kind of structured outputs constraint "
                             f"but none are specified: {self._shown()}")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported yet.")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the "
                             "xgrammar backend.")
        if self.json_object is False:
            raise ValueError("structured_outputs.json_object must be true when given.")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        if self.regex is not None and "\x00" in self.regex:
            raise ValueError("structured_outputs.regex must not contain a NUL character ('\\x00')")

    def _shown(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _CONSTRAINTS}

    @property
    def kind(self) -> StructuredOutputKind:
        if self.json is not None:
            return StructuredOutputKind.JSON
        if self.json_object:
            return StructuredOutputKind.JSON_OBJECT
        if self.regex is not None:
            return StructuredOutputKind.REGEX
        if self.choice is not None:
            return StructuredOutputKind.CHOICE
        return StructuredOutputKind.GRAMMAR

    def spec(self) -> str:
        """The constraint as one string (JSON schemas re-serialised, property order kept;
        choices as their EBNF alternation)."""
        kind = self.kind
        if kind is StructuredOutputKind.JSON:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"Invalid JSON grammar specification: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema object.")
            if self.disable_additional_properties:
                schema = without_additional_properties(schema)
            return json.dumps(schema, ensure_ascii=False)
        if kind is StructuredOutputKind.JSON_OBJECT:
            return '{"type": "object"}'
        if kind is StructuredOutputKind.REGEX:
            return self.regex or ""
        if kind is StructuredOutputKind.CHOICE:
            return choice_as_grammar(self.choice or [])
        return self.grammar or ""

    def key(self) -> tuple[str, str, bool]:
        """Compile-cache key: (kind, canonical spec, any whitespace)."""
        return self.kind.value, self.spec(), not self.disable_any_whitespace


def choice_as_grammar(choice: list[str]) -> str:
    """EBNF alternation of the quoted literals (vLLM's `choice_as_grammar`)."""
    escaped = (re.sub(r'(["\\])', r"\\\1", c) for c in choice)
    return "root ::= " + " | ".join(f'"{c}"' for c in escaped)


def grammar_is_likely_lark(grammar: str) -> bool:
    """True unless some line defines a rule with EBNF's `::=`."""
    return not any("::=" in line for line in grammar.splitlines())


def without_additional_properties(schema: Any) -> Any:
    """A copy of `schema` where every object schema lacking `additionalProperties` gets
    `false` (vLLM's `disable_additional_properties`)."""
    if isinstance(schema, list):
        return [without_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: without_additional_properties(v) for k, v in schema.items()}
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
