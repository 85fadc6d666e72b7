"""StructuredOutputManager: compiles grammars off the step loop and builds each step's bitmask.

Flow (vLLM v1's): `init_request` validates the constraint, submits the compile to a worker
thread (one future per distinct spec, cached) and parks the request in `WAITING_FOR_FSM`; the
scheduler asks `ready()` (the manager is its wait gate) and admits the request once the
grammar is compiled, creating its matcher; the rest of the batch runs meanwhile. After
scheduling, `grammar_output` fills one bitmask row per structured request that samples this
step; after the step, `advance` feeds the accepted tokens to each matcher.

Budget: a JSON-constrained request finishes its document within `max_tokens` when it can
(see `closing.py`): near the end of the budget `grammar_output` forces a completion.

Configuration (`--structured-outputs-config`): `disable_any_whitespace` and
`disable_additional_properties` turn the request options of the same names on for every
request; `reasoning_parser` sets the reasoner, `enable_in_reasoning` its mode.

Reasoning: with a reasoner set (`set_reasoner`) and `enable_in_reasoning` false, a request is
constrained only once its reasoning has ended (`is_reasoning_end(prompt)` at the start, then
`is_reasoning_end(all_token_ids)` after each step; the step that ends reasoning does not
advance the matcher). Without a reasoner, output is constrained from the first token.

Threading: every method except `validate` and `compile_future` (any thread) is called on the
engine thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sous.config.structured_outputs import StructuredOutputsConfig
from sous.engine.request import Request, RequestStatus
from sous.engine.structured_output.bitmask import GrammarOutput
from sous.engine.structured_output.closing import CLOSING_MARGIN, force_row, next_check
from sous.engine.structured_output.params import StructuredOutputKind, StructuredOutputsParams
from sous.engine.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from sous.engine.structured_output.backend_xgrammar import Key, XgrammarBackend

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256
_CLOSING_KINDS = (StructuredOutputKind.JSON.value, StructuredOutputKind.JSON_OBJECT.value)


class ReasoningEndDetector(Protocol):
    """What the manager needs from a reasoning parser."""

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool: ...


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_num_seqs: int, compile_threads: int = 2,
                 config: StructuredOutputsConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_num_seqs = max_num_seqs
        self.compile_threads = compile_threads
        self.config = config or StructuredOutputsConfig()
        self.reasoner: ReasoningEndDetector | None = None
        self.enable_in_reasoning = self.config.enable_in_reasoning
        if self.config.reasoning_parser:
            self.reasoner = _reasoner(self.config.reasoning_parser, tokenizer)
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._compiled_lock = threading.Lock()
        self._executor: cf.ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[Key, cf.Future] = OrderedDict()
        self._validated: OrderedDict[Key, None] = OrderedDict()
        self._pending: dict[str, Request] = {}
        self._bitmask: torch.Tensor | None = None

    # ---- hooks -------------------------------------------------------------------------------
    def set_reasoner(self, reasoner: ReasoningEndDetector | None,
                     enable_in_reasoning: bool | None = None) -> None:
        """Constrain only after reasoning ends (unless `enable_in_reasoning`; None keeps the
        configured `enable_in_reasoning`)."""
        self.reasoner = reasoner
        if enable_in_reasoning is not None:
            self.enable_in_reasoning = enable_in_reasoning

    @staticmethod
    def mark_reasoning_ended(request: Request) -> None:
        """For a reasoning integration that detects the end itself: constrain from the next
        token on."""
        so = request.structured_output_request
        if so is not None:
            so.reasoning_ended = True

    # ---- requests ----------------------------------------------------------------------------
    def effective(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """`params` with the configured defaults applied (a copy when they change it)."""
        ws = self.config.disable_any_whitespace and not params.disable_any_whitespace
        ap = self.config.disable_additional_properties and not params.disable_additional_properties
        if not (ws or ap):
            return params
        return dataclasses.replace(
            params, disable_any_whitespace=params.disable_any_whitespace or ws,
            disable_additional_properties=params.disable_additional_properties or ap)

    def validate(self, params: StructuredOutputsParams) -> Key:
        """Parse the constraint (no compile); ValueError if invalid. Thread-safe."""
        key = self.effective(params).key()
        if key in self._validated:
            return key
        from sous.engine.structured_output.backend_xgrammar import validate
        validate(params)
        self._validated[key] = None
        while len(self._validated) > _CACHE_SIZE:
            self._validated.popitem(last=False)
        return key

    def init_request(self, request: Request) -> None:
        """Start compiling `request`'s grammar (if it has one) and park it in WAITING_FOR_FSM."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        key = self.validate(params)
        so = StructuredOutputRequest(self.effective(params), key, self._submit(key))
        sp = request.sampling_params
        so.closes = key[0] in _CLOSING_KINDS and sp.min_tokens == 0 and not sp.ignore_eos
        request.structured_output_request = so
        request.status = RequestStatus.WAITING_FOR_FSM
        self._pending[request.request_id] = request

    def compile_future(self, params: StructuredOutputsParams) -> cf.Future:
        """Validate `params` (ValueError) and start (or share) its compile: the future resolves
        to the compiled grammar or raises ValueError naming the problem. Thread-safe: the
        server awaits it to answer a 400 before generating; `init_request` shares it."""
        return self._submit(self.validate(params))

    def _submit(self, key: Key) -> cf.Future:
        """The cached compile of `key`, or a new one. A compile that failed with a ValueError
        stays cached (it fails the same way again); other failures are retried."""
        with self._compiled_lock:
            fut = self._compiled.get(key)
            if fut is not None and not (fut.done() and _retry(fut)):
                self._compiled.move_to_end(key)
                return fut
            if self._executor is None:
                self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="sous-grammar")
            fut = self._executor.submit(self._compile, key)
            self._compiled[key] = fut
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
            return fut

    def _compile(self, key: Key) -> Any:
        return self._get_backend().compile(key)

    def _get_backend(self) -> XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                from sous.engine.structured_output.backend_xgrammar import XgrammarBackend
                self._backend = XgrammarBackend(self.tokenizer, self.vocab_size,
                                                self.stop_token_ids, self.compile_threads)
            return self._backend

    def ready(self, request: Request) -> bool:
        """Scheduler wait gate: False while the request's grammar is compiling (or failed);
        once compiled, creates the matcher and moves the request to WAITING."""
        if request.status != RequestStatus.WAITING_FOR_FSM:
            return True
        so = request.structured_output_request
        if so is None or not so.compile_done() or so.compile_error() is not None:
            return False
        so.grammar = self._get_backend().new_grammar(so.compiled.result())
        request.status = RequestStatus.WAITING
        self._pending.pop(request.request_id, None)
        return True

    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait_pending(self, timeout: float) -> None:
        """Block until some pending compile finishes or `timeout` seconds pass."""
        futures = {r.structured_output_request.compiled for r in self._pending.values()
                   if r.structured_output_request is not None}
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def take_failed(self) -> list[tuple[Request, str]]:
        """Pending requests whose compile failed, with the error; forgets finished ones."""
        failed = []
        for rid, request in list(self._pending.items()):
            so = request.structured_output_request
            err = so.compile_error() if so is not None else None
            if request.is_finished() or err is not None:
                del self._pending[rid]
            if err is not None and not request.is_finished():
                failed.append((request, str(err) if isinstance(err, ValueError)
                               else f"Failed to compile the grammar: {err}"))
        return failed

    # ---- per step ----------------------------------------------------------------------------
    def _constrained(self, request: Request) -> bool:
        """Whether `request`'s next token is constrained (reasoning over, grammar live)."""
        so = request.structured_output_request
        if so is None or so.grammar is None:
            return False
        if self.reasoner is not None and not self.enable_in_reasoning:
            if so.reasoning_ended is None:
                so.reasoning_ended = self.reasoner.is_reasoning_end(request.prompt_token_ids)
            return so.reasoning_ended
        return True

    def grammar_output(self, scheduled: list[Request]) -> GrammarOutput | None:
        """Bitmask rows for the scheduled requests (their `num_computed_tokens` already
        counting this step) that sample a constrained token this step; None when there are
        none. The tensor is reused: valid until the next call."""
        rows = [r for r in scheduled
                if r.num_computed_tokens >= r.num_tokens and self._constrained(r)]
        if not rows:
            return None
        backend = self._get_backend()
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = backend.allocate_bitmask(max(self.max_num_seqs, len(rows)))
        bitmask = self._bitmask[:len(rows)]
        bitmask.fill_(-1)
        for i, request in enumerate(rows):
            grammar = request.structured_output_request.grammar
            if grammar.is_terminated():
                continue
            forced = self._closing_token(request)
            if forced is None:
                grammar.fill_bitmask(self._bitmask, i)
            else:
                force_row(bitmask, i, forced)
        return GrammarOutput([r.request_id for r in rows], bitmask, self.vocab_size)

    def _closing_token(self, request: Request) -> int | None:
        """The token to force so that `request`'s JSON finishes within its budget, or None
        (sample freely). Searches for a completion only at the checkpoints `next_check`
        schedules; forces it once the remaining budget is within CLOSING_MARGIN of it."""
        so = request.structured_output_request
        closer = self._get_backend().closer
        if not so.closes or closer is None:
            return None
        if so.closing:
            return so.closing[0]
        remaining = request.max_tokens - request.num_output_tokens
        if so.next_closing_check is not None and remaining > so.next_closing_check:
            return None
        plan = closer.completion(so.grammar.matcher)
        if plan is None or len(plan) > remaining:
            so.next_closing_check = remaining - 1  # cannot finish now: look again next step
            return None
        if remaining <= len(plan) + CLOSING_MARGIN:
            so.closing = plan
            return plan[0]
        so.next_closing_check = next_check(remaining, len(plan))
        return None

    def _should_advance(self, request: Request) -> bool:
        so = request.structured_output_request
        if so is None or so.grammar is None:
            return False
        if self.reasoner is None or self.enable_in_reasoning or so.reasoning_ended:
            return True
        if self.reasoner.is_reasoning_end(request.all_token_ids):
            so.reasoning_ended = True
        return False

    def advance(self, produced: list[tuple[Request, list[int]]]) -> list[tuple[Request, str]]:
        """Feed each unfinished request's new tokens to its matcher. Returns the requests whose
        grammar rejected a token, with the error (the caller fails them)."""
        rejected = []
        for request, tokens in produced:
            if not tokens or request.is_finished() or not self._should_advance(request):
                continue
            so = request.structured_output_request
            grammar = so.grammar
            if so.closing is not None:
                forced, so.closing = so.closing[:len(tokens)], so.closing[len(tokens):]
                if forced != tokens:
                    so.closing = None
            if not grammar.accept_tokens(tokens):
                logger.error("Failed to advance FSM for request %s for tokens %s.",
                             request.request_id, tokens)
                rejected.append((request, f"Failed to advance FSM for tokens {tokens}."))
        return rejected

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _retry(fut: cf.Future) -> bool:
    """Whether a finished compile should be submitted again (cancelled, or failed with
    something other than the ValueError of a grammar that cannot compile)."""
    if fut.cancelled():
        return True
    err = fut.exception()
    return err is not None and not isinstance(err, ValueError)


def _reasoner(name: str, tokenizer: Any) -> ReasoningEndDetector | None:
    """The reasoning-end detector of the reasoning parser `name` (`reasoning_parser` of
    `--structured-outputs-config`, for offline `LLM` use; the server sets its own too)."""
    from sous.server import reasoning
    from sous.server.reasoning.token_end import reasoning_end_detector

    return reasoning_end_detector(reasoning.get(name), tokenizer)
