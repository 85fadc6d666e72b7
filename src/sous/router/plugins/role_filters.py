"""`prefill-filter` and `decode-filter`: keep endpoints by their `llm-d.ai/role` label, as llm-d.

decode-filter keeps decode, prefill-decode, both, encode-prefill-decode and unlabelled
endpoints; prefill-filter keeps prefill, encode-prefill, prefill-decode, both and
encode-prefill-decode (unlabelled ones are dropped)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sous.router.framework import CycleState, Endpoint, RouterRequest
from sous.router.plugins.registry import register

PREFILL = "prefill-filter"
DECODE = "decode-filter"
PREFILL_ROLES = frozenset({"prefill", "encode-prefill", "prefill-decode", "both",
                           "encode-prefill-decode"})
DECODE_ROLES = frozenset({"decode", "prefill-decode", "both", "encode-prefill-decode"})


@dataclass(frozen=True)
class Parameters:
    pass


class RoleFilter:
    def __init__(self, name: str, roles: frozenset[str], keep_unlabelled: bool) -> None:
        self.name = name
        self.roles = roles
        self.keep_unlabelled = keep_unlabelled

    def filter(self, request: RouterRequest, state: CycleState,
               endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        return [e for e in endpoints
                if e.role in self.roles or (e.role is None and self.keep_unlabelled)]


register(PREFILL, Parameters, lambda name, _: RoleFilter(name, PREFILL_ROLES, False))
register(DECODE, Parameters, lambda name, _: RoleFilter(name, DECODE_ROLES, True))
