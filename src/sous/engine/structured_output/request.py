"""Per-request structured-output state, attached to an engine `Request`."""

from __future__ import annotations

from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sous.engine.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from sous.engine.structured_output.backend_xgrammar import Key, XgrammarGrammar


@dataclass(eq=False)
class StructuredOutputRequest:
    """Owned by the engine thread. `compiled` resolves on the manager's worker thread; the
    matcher (`grammar`) is created from it on the engine thread when the request is admitted.

    `reasoning_ended`: None until first checked; while False the output is not constrained
    and the matcher is not advanced (set by the manager's reasoner hook, or directly by a
    reasoning integration through `StructuredOutputManager.mark_reasoning_ended`).

    Closing (`closing.py`): `closes` says whether the request finishes its JSON within its
    budget; `closing` holds the completion tokens being forced (None: sampling freely);
    `next_closing_check` is the remaining budget at which to search for a completion again
    (None: at the next constrained step).
    """

    params: StructuredOutputsParams
    key: Key
    compiled: Future[Any]
    grammar: XgrammarGrammar | None = None
    reasoning_ended: bool | None = None
    failed: bool = field(default=False)
    closes: bool = False
    closing: list[int] | None = None
    next_closing_check: int | None = None

    def compile_done(self) -> bool:
        return self.compiled.done()

    def compile_error(self) -> BaseException | None:
        """The compile exception, if compilation finished and failed (or was cancelled)."""
        if not self.compiled.done():
            return None
        if self.compiled.cancelled():
            return CancelledError("grammar compilation was cancelled")
        return self.compiled.exception()
