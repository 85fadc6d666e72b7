"""AsyncLLM: the asyncio face of the engine. The step loop runs on its own thread.

Contract: `generate()` yields RequestOutputs for one request in its `output_kind`; the last has
`finished=True`. If the consumer stops early (closes the generator or is cancelled), the request
is aborted and its KV blocks are freed. All EngineCore calls happen on the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from sous.config.engine import EngineConfig
from sous.engine.core import EngineCore
from sous.engine.outputs import RequestOutput
from sous.engine.sampling_params import RequestOutputKind, SamplingParams
from sous.engine.scheduler import SchedulerStats

logger = logging.getLogger(__name__)

EngineStats = SchedulerStats


class EngineDeadError(RuntimeError):
    pass


def merge_delta(pending: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Fold a newer DELTA output into one not yet consumed (the consumer fell behind)."""
    by_index = {c.index: c for c in pending.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            pending.outputs.append(c)
            by_index[c.index] = c
            continue
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason = c.finish_reason
        old.stop_reason = c.stop_reason
    pending.finished = new.finished
    pending.num_cached_tokens = new.num_cached_tokens
    pending.metrics = new.metrics
    return pending


class _Collector:
    """Hands outputs from the engine thread to one asyncio consumer, merging deltas."""

    def __init__(self, loop: asyncio.AbstractEventLoop, kind: RequestOutputKind) -> None:
        self.loop = loop
        self.kind = kind
        self.pending: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        # RuntimeError: the consumer's loop is closed, so nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.put, item)

    def put(self, item: RequestOutput | BaseException) -> None:
        if (isinstance(item, RequestOutput) and isinstance(self.pending, RequestOutput)
                and self.kind == RequestOutputKind.DELTA):
            self.pending = merge_delta(self.pending, item)
        elif not isinstance(self.pending, BaseException):
            self.pending = item
        self.ready.set()

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        item, self.pending = self.pending, None
        self.ready.clear()
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item


def _deliver(items: list[tuple[_Collector, RequestOutput | BaseException]]) -> None:
    for collector, item in items:
        collector.put(item)


class _Outbox:
    """One step's outputs, handed to each consumer loop in one `call_soon_threadsafe`: one
    wake-up of the server thread per step instead of one per request (on few cores every
    wake-up steals time from the torch threads of the step)."""

    def __init__(self) -> None:
        self.items: list[tuple[_Collector, RequestOutput | BaseException]] = []

    def sink(self, collector: _Collector) -> Callable[[RequestOutput | BaseException], None]:
        return lambda item: self.items.append((collector, item))

    def flush(self) -> None:
        if not self.items:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for collector, item in self.items:
            by_loop.setdefault(collector.loop, []).append((collector, item))
        self.items = []
        for loop, items in by_loop.items():
            # RuntimeError: that loop is closed, so nobody is listening.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, items)


class AsyncLLM:
    """`start_thread=False` leaves the step loop to the caller: it must call
    `run_engine_loop()` (blocking) on some thread, e.g. the main thread while uvicorn serves
    from another (`sous serve` does this: torch ops measured markedly faster on the main
    thread than on a secondary one on this CPU)."""

    def __init__(self, core: EngineCore, start_thread: bool = True) -> None:
        self.core = core
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.served_model_name = core.loaded.served_model_name
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._collectors: dict[str, _Collector] = {}
        self._outbox = _Outbox()
        """Filled by the engine thread during a step, flushed after it."""
        self._error: BaseException | None = None
        self._stopped = False
        self._loop_running = threading.Event()
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self.run_engine_loop, name="sous-engine",
                                            daemon=True)
            self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, start_thread: bool = True) -> AsyncLLM:
        return cls(EngineCore(config), start_thread=start_thread)

    # ---- API ------------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if self._error is not None:
            raise EngineDeadError(f"The engine has stopped: {self._error!r}")
        self.core.validate(prompt_token_ids, sampling_params)
        if request_id in self._collectors:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        collector = _Collector(asyncio.get_running_loop(), sampling_params.output_kind)
        self._collectors[request_id] = collector
        self._inbox.put(("add", (request_id, prompt_token_ids, sampling_params,
                                 self._outbox.sink(collector), prompt)))
        finished = False
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", [request_id]))

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", [request_id]))

    def get_stats(self) -> EngineStats:
        return self.core.stats()

    def is_healthy(self) -> bool:
        return self._error is None and not self._stopped and (
            self._loop_running.is_set() or self._thread is None)

    async def reset_prefix_cache(self) -> bool:
        return await asyncio.wrap_future(self._call(self.core.reset_prefix_cache))

    def shutdown(self) -> None:
        """Stop the step loop (whichever thread runs it) and release the engine."""
        self._stopped = True
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.core.shutdown()

    # ---- engine thread ---------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._inbox.put(("call", (fn, fut)))
        return fut

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            request_id, ids, params, sink, prompt = payload
            try:
                self.core.add_request(request_id, ids, params, sink, prompt)
            except Exception as e:  # validated already; anything else goes to the caller
                sink(e)
        elif kind == "abort":
            self.core.abort(payload)
        elif kind == "call":
            fn, fut = payload
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

    def run_engine_loop(self) -> None:
        """Step the engine until `shutdown()`; blocks. KeyboardInterrupt propagates."""
        self._loop_running.set()
        try:
            while not self._stopped:
                block = not self.core.has_unfinished_requests()
                try:
                    while True:
                        kind, payload = self._inbox.get(block=block)
                        block = False
                        if kind == "stop":
                            return
                        self._handle(kind, payload)
                except queue.Empty:
                    pass
                if self.core.has_unfinished_requests():
                    self.core.step()
                self._outbox.flush()
        except KeyboardInterrupt:
            self._stopped = True
            raise
        except BaseException as e:  # a dead engine must not leave clients hanging
            logger.exception("Engine loop died")
            self._error = e
            for collector in list(self._collectors.values()):
                collector.put_threadsafe(EngineDeadError(f"The engine has stopped: {e!r}"))
        finally:
            self._loop_running.clear()
