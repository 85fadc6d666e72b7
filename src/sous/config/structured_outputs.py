"""`--structured-outputs-config`: engine-wide structured-output settings, vLLM's field names.

sous has one backend, xgrammar: `backend` accepts `auto` and `xgrammar` and refuses vLLM's
other backends by name. There is nothing to fall back to, so `disable_fallback` is accepted
and has no further effect. `disable_any_whitespace` and `disable_additional_properties` are
engine-wide defaults of the request options of the same names (a request can turn them on,
never off). `reasoning_parser` is the same setting as `--reasoning-parser`;
`reasoning_parser_plugin` (loading parser code from a file) is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

StructuredOutputsBackend = Literal["auto", "xgrammar"]
_OTHER_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")
_FLAG = "--structured-outputs-config"


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Engine-wide structured-output settings (see the module docstring)."""

    backend: StructuredOutputsBackend = "auto"
    """`auto` or `xgrammar` (the same here: sous implements only xgrammar)."""
    disable_fallback: bool = False
    """Accepted for vLLM compatibility: there is no other backend to fall back to."""
    disable_any_whitespace: bool = False
    """JSON output without free whitespace (`{"a": 1, "b": [1, 2]}`: one space after `:` and
    `,`, none elsewhere). When false, whitespace between JSON tokens is allowed but bounded
    (see `sous.engine.structured_output.backend_xgrammar.MAX_WHITESPACE_CNT`)."""
    disable_additional_properties: bool = False
    """JSON-schema objects without `additionalProperties` get `false`."""
    reasoning_parser: str = ""
    """Reasoning parser (as `--reasoning-parser`): output is constrained once reasoning ends."""
    reasoning_parser_plugin: str = ""
    """Not supported: sous runs only its built-in reasoning parsers."""
    enable_in_reasoning: bool = False
    """Constrain the reasoning too (from the first token) even with a reasoning parser."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> StructuredOutputsConfig:
        """Build from the flag's JSON object. ValueError naming the flag and the field for an
        unknown field, a value of the wrong type or an unsupported setting."""
        data = dict(data or {})
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{_FLAG}: unknown field(s) {unknown}; known: {known}")
        for f in dataclasses.fields(cls):
            if f.name not in data:
                continue
            want = bool if isinstance(f.default, bool) else str
            if not isinstance(data[f.name], want):
                raise ValueError(f"{_FLAG}: {f.name} must be a {want.__name__}, got "
                                 f"{data[f.name]!r}")
        config = cls(**data)
        if config.backend in _OTHER_BACKENDS:
            raise ValueError(f"{_FLAG}: backend {config.backend!r} is not supported: sous "
                             "implements structured outputs with xgrammar only ('auto' or "
                             "'xgrammar').")
        if config.backend not in ("auto", "xgrammar"):
            raise ValueError(f"{_FLAG}: backend must be 'auto' or 'xgrammar', got "
                             f"{config.backend!r}")
        if config.reasoning_parser_plugin:
            raise ValueError(f"{_FLAG}: reasoning_parser_plugin is not supported: sous runs "
                             "only its built-in reasoning parsers.")
        return config
