"""The xgrammar backend: request validation (grammar parsing, tokenizer-free), compilation
against the model's vocabulary, and the per-request matcher.

`validate` is cheap and thread-safe (any thread may call it). `XgrammarBackend.compile` runs
on the structured-output manager's worker thread; `XgrammarGrammar` is used by the engine
thread only.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import torch
import xgrammar as xgr

from sous.engine.structured_output.closing import Closer
from sous.engine.structured_output.params import (
    StructuredOutputKind,
    StructuredOutputsParams,
    grammar_is_likely_lark,
)

logger = logging.getLogger(__name__)

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")

Key = tuple[str, str, bool]

MAX_WHITESPACE_CNT = 16
"""Most whitespace characters allowed in one gap between JSON tokens (when free whitespace is
allowed): enough for pretty-printed JSON a few levels deep, while a small model at a high
temperature can no longer spend its whole `max_tokens` on newlines inside one gap."""


def _clean(err: BaseException) -> str:
    """xgrammar's message without its log prefix (`[hh:mm:ss] file.cc:NN: `)."""
    return _XGR_PREFIX.sub("", str(err)).strip()


_STRING_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
_ARRAY_UNSUPPORTED = ("uniqueItems", "contains", "minContains", "maxContains")


def _types(schema: dict[str, Any]) -> set[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    return {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _unsupported_here(schema: dict[str, Any]) -> str | None:
    types = _types(schema)
    has_length = "minLength" in schema or "maxLength" in schema
    if types & {"integer", "number"} and "multipleOf" in schema:
        return "multipleOf"
    if "array" in types and any(k in schema for k in _ARRAY_UNSUPPORTED):
        return next(k for k in _ARRAY_UNSUPPORTED if k in schema)
    if "string" in types and "format" in schema and schema["format"] not in _STRING_FORMATS:
        return f"string format {schema['format']!r}"
    if "string" in types and ("pattern" in schema or "format" in schema) and has_length:
        return "pattern or format together with minLength/maxLength"
    if "object" in types and "propertyNames" in schema and (
            "properties" in schema or "patternProperties" in schema):
        return "propertyNames together with properties"
    pattern_props = schema.get("patternProperties")
    if "object" in types and isinstance(pattern_props, dict) and (
            "properties" in schema or len(pattern_props) > 1):
        return "patternProperties together with properties"
    return None


def unsupported_json_feature(schema: Any) -> str | None:
    """The first JSON-schema feature xgrammar would silently ignore (vLLM's
    `has_xgrammar_unsupported_json_features`), or None."""
    if isinstance(schema, list):
        return next((f for f in map(unsupported_json_feature, schema) if f), None)
    if not isinstance(schema, dict):
        return None
    return _unsupported_here(schema) or unsupported_json_feature(list(schema.values()))


def validate(params: StructuredOutputsParams) -> Key:
    """Check that the constraint parses; returns its compile key. Raises ValueError with a
    message naming what is wrong (the server sends it as a 400)."""
    key = params.key()
    kind, spec, _ = key
    try:
        if kind == StructuredOutputKind.REGEX.value:
            xgr.Grammar.from_regex(spec)
        elif kind in (StructuredOutputKind.JSON.value, StructuredOutputKind.JSON_OBJECT.value):
            feature = unsupported_json_feature(json.loads(spec))
            if feature is not None:
                raise ValueError("The provided JSON schema contains features not supported by "
                                 f"xgrammar: {feature}.")
            xgr.Grammar.from_json_schema(spec)
        elif grammar_is_likely_lark(spec):
            xgr.Grammar.from_lark(spec)
        else:
            xgr.Grammar.from_ebnf(spec)
    except RuntimeError as e:
        what = {"regex": "regex", "json": "json schema", "json_object": "json schema",
                "choice": "choices"}.get(kind, "grammar specification")
        raise ValueError(f"Failed to transform {what} into a grammar: {_clean(e)}") from None
    return key


class XgrammarGrammar:
    """One request's matcher. `accept_tokens` ignores tokens after termination (EOS)."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self.num_processed_tokens = 0

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance over `tokens`; False if the grammar rejects one (state then undefined)."""
        for token in tokens:
            if self.matcher.is_terminated():
                return True
            if not self.matcher.accept_token(token):
                return False
            self.num_processed_tokens += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32, CPU)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


class XgrammarBackend:
    """A grammar compiler for one tokenizer. `vocab_size` is the model's logits width (the
    tokenizer's vocabulary is padded to it; padded ids are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 max_threads: int = 2) -> None:
        if len(tokenizer) > vocab_size:
            logger.warning("Tokenizer has %d tokens but the model's vocabulary is %d: tokens "
                           "above it are never generated.", len(tokenizer), vocab_size)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self.closer = Closer(tokenizer, info, self.stop_token_ids[0]) \
            if self.stop_token_ids else None

    def compile(self, key: Key) -> xgr.CompiledGrammar:
        """Compile against the vocabulary. Raises ValueError naming the problem when xgrammar
        fails or when no token can start the output (the grammar accepts nothing)."""
        kind, spec, any_whitespace = key
        try:
            compiled = self._compile(kind, spec, any_whitespace)
        except RuntimeError as e:
            raise ValueError(f"Failed to compile the grammar: {_clean(e)}") from None
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids or None)
        bitmask = self.allocate_bitmask(1)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise ValueError("Failed to compile the grammar: it accepts no output (no token of "
                             "the model's vocabulary can start it, and it cannot be empty).")
        return compiled

    def _compile(self, kind: str, spec: str, any_whitespace: bool) -> xgr.CompiledGrammar:
        if kind in (StructuredOutputKind.JSON.value, StructuredOutputKind.JSON_OBJECT.value):
            return self.compiler.compile_json_schema(
                spec, any_whitespace=any_whitespace,
                max_whitespace_cnt=MAX_WHITESPACE_CNT if any_whitespace else None)
        if kind == StructuredOutputKind.REGEX.value:
            return self.compiler.compile_regex(spec)
        if grammar_is_likely_lark(spec):
            return self.compiler.compile_grammar(xgr.Grammar.from_lark(spec))
        return self.compiler.compile_grammar(spec)

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(compiled, self.stop_token_ids)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)
