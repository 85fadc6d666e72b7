"""OutputProcessor: detokenises new tokens, applies stop strings and builds RequestOutputs.

A user request with `n > 1` is a *parent* of n child engine requests (`"{i}_{parent_id}"`);
outputs carry `CompletionOutput.index = i`. Outputs are handed to the parent's `sink` in the
parent's `output_kind`. The processor never touches the KV cache: requests it finishes by stop
string are returned to the caller, who must finish them in the scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from sous.engine.detokenizer import IncrementalDetokenizer
from sous.engine.outputs import CompletionOutput, Logprob, RequestOutput
from sous.engine.request import Request, RequestStatus
from sous.engine.sampling_params import RequestOutputKind

Sink = Callable[[RequestOutput], None]


@dataclass
class _Child:
    request: Request
    index: int
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_final: bool = False

    def has_news(self) -> bool:
        return self.sent_tokens < self.request.num_output_tokens or (
            self.request.is_finished() and not self.sent_final)


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    sink: Sink
    children: list[_Child] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    def finished(self) -> bool:
        return all(c.request.is_finished() for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.children: dict[str, tuple[_Parent, _Child]] = {}
        """Engine request id -> (its user request, its output state)."""

    def add_request(self, request_id: str, prompt: str | None, children: list[Request],
                    sink: Sink) -> None:
        params = children[0].sampling_params
        parent = _Parent(request_id, prompt, children[0].prompt_token_ids, params.output_kind, sink)
        for i, child in enumerate(children):
            want_lp = child.sampling_params.logprobs is not None
            detok = IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids,
                                           child.sampling_params)
            state = _Child(child, i, detok, [] if want_lp else None, 0.0 if want_lp else None)
            parent.children.append(state)
            self.children[child.request_id] = (parent, state)
        self.parents[request_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def remove(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        if parent:
            for c in parent.children:
                self.children.pop(c.request.request_id, None)

    def process(
        self,
        produced: list[tuple[Request, list[int]]],
        logprobs: dict[str, list[dict[int, Logprob]]],
    ) -> list[Request]:
        """Handle one step's new tokens. Returns requests that hit a stop string (the caller
        finishes them in the scheduler; their status is already FINISHED_STOPPED)."""
        stopped: list[Request] = []
        touched: dict[str, _Parent] = {}
        now = time.monotonic()
        for request, new_tokens in produced:
            entry = self.children.get(request.request_id)
            if entry is None:
                continue
            parent, child = entry
            if parent.first_token_time is None:
                parent.first_token_time = now
            if self._add_tokens(child, new_tokens, logprobs.get(request.request_id)):
                stopped.append(request)
            touched[parent.request_id] = parent
        for parent in touched.values():
            self._emit(parent)
        return stopped

    def _add_tokens(self, child: _Child, new_tokens: list[int],
                    new_logprobs: list[dict[int, Logprob]] | None) -> bool:
        """Detokenize `new_tokens` (several per step with speculative decoding); True when a
        stop string finished a request the scheduler still runs. Tokens after the one that
        completes a stop string are removed from the request. A stop string wins over the
        finish the scheduler already applied for the same token (length cap, EOS, stop token
        id), as in vLLM: the text is cut there, so the finish reason is "stop" with the string
        as stop_reason."""
        request = child.request
        lps = new_logprobs if child.logprobs is not None else None
        for j, token in enumerate(new_tokens):
            if lps is not None and j < len(lps):
                child.logprobs.append(lps[j])  # type: ignore[union-attr]
                child.cumulative_logprob += lps[j][token].logprob  # type: ignore[operator]
            stop = child.detok.add_token(token)
            if stop is None:
                continue
            if extra := len(new_tokens) - j - 1:  # the step's tokens after it are dropped
                del request.output_token_ids[-extra:], request.all_token_ids[-extra:]
            was_finished = request.is_finished()
            if request.status != RequestStatus.FINISHED_ABORTED:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = stop
            return not was_finished
        return False

    def _completion(self, child: _Child, kind: RequestOutputKind) -> CompletionOutput:
        request = child.request
        finished = request.is_finished()
        if kind == RequestOutputKind.DELTA:
            text = child.detok.pending_text(finished)
            tokens = request.output_token_ids[child.sent_tokens:]
            lps = child.logprobs[child.sent_logprobs:] if child.logprobs is not None else None
        else:
            child.detok.pending_text(finished)
            text = child.detok.output_text[:child.detok.sent_offset]
            tokens = list(request.output_token_ids)
            lps = list(child.logprobs) if child.logprobs is not None else None
        child.sent_tokens = request.num_output_tokens
        child.sent_logprobs = len(child.logprobs or ())
        return CompletionOutput(
            index=child.index, text=text, token_ids=list(tokens),
            cumulative_logprob=child.cumulative_logprob, logprobs=lps,
            finish_reason=request.status.finish_reason, stop_reason=request.stop_reason)

    def _emit(self, parent: _Parent) -> None:
        finished = parent.finished()
        kind = parent.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return
        children = parent.children
        if kind == RequestOutputKind.DELTA:
            children = [c for c in children if c.has_news()]
        outputs = []
        for c in children:
            outputs.append(self._completion(c, kind))
            c.sent_final = c.request.is_finished()
        first = parent.children[0].request
        metrics = {"arrival_time": parent.arrival_time}
        if parent.first_token_time is not None:
            metrics["first_token_time"] = parent.first_token_time
        parent.sink(RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, outputs=outputs, finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0), metrics=metrics,
            num_external_computed_tokens=first.num_external_computed_tokens,
            kv_transfer_params=first.kv_transfer_params_out if finished else None))
        if finished:
            self.remove(parent.request_id)
