"""AsyncLLM: the asyncio face of the engine. The step loop runs on its own thread.

Contract: `generate()` yields RequestOutputs for one request in its `output_kind`; the last has
`finished=True`. If the consumer stops early (closes the generator or is cancelled), the request
is aborted and its KV blocks are freed.

Threading: every EngineCore call happens on the engine thread (the one running
`run_engine_loop`). Other threads only put messages in its inbox (`add`, `abort`, `call`)
and read `get_stats()`, an immutable snapshot the engine thread publishes after every loop
iteration. Invalid requests are rejected by `EngineCore.add_request` on the engine thread and
the error comes back as the request's first item. Once the loop has ended (it died, or was
stopped) no message is accepted: calls raise EngineDeadError at once, and work queued or
running when it ended is failed with EngineDeadError, so nobody waits forever.
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

import torch

from sous.config.engine import EngineConfig
from sous.engine.core import EngineCore
from sous.engine.cpu_threads import allowed_cpus
from sous.engine.dp.lockstep import IDLE_POLL_S
from sous.engine.errors import EngineDeadError
from sous.engine.outputs import RequestOutput
from sous.engine.sampling_params import RequestOutputKind, SamplingParams
from sous.engine.scheduler import SchedulerStats

logger = logging.getLogger(__name__)

KV_TRANSFER_POLL_S = 0.002
"""Engine loop period while it only waits on KV transfers (P/D reads, kept blocks)."""
FRONT_END_WAIT_S = 0.05
"""Longest the engine thread waits for the server's event loop to pass a step's outputs on
(`AsyncLLM._flush_outputs`)."""

EngineStats = SchedulerStats
__all__ = ["AsyncLLM", "EngineDeadError", "EngineStats", "merge_delta"]


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


class OutputCollector:
    """Hands outputs from the engine thread to one asyncio consumer, merging deltas. An error
    is raised to the consumer after any output still pending."""

    def __init__(self, loop: asyncio.AbstractEventLoop, kind: RequestOutputKind) -> None:
        self.loop = loop
        self.kind = kind
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        # RuntimeError: the consumer's loop is closed, so nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.put, item)

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            if self.error is None and not (self.pending is not None and self.pending.finished):
                self.error = item
        elif self.pending is not None and self.kind == RequestOutputKind.DELTA:
            self.pending = merge_delta(self.pending, item)
        else:
            self.pending = item
        self.ready.set()

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        item, self.pending = self.pending, None
        if item is not None:
            if self.error is None:
                self.ready.clear()
            return item
        assert self.error is not None
        raise self.error


def _deliver(items: list[tuple[OutputCollector, RequestOutput | BaseException]],
             done: threading.Event | None) -> None:
    for collector, item in items:
        collector.put(item)
    if done is not None:  # set once the consumers woken above have run (two loop turns on)
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, done.set)


class Outbox:
    """One step's outputs, handed to each consumer loop in one `call_soon_threadsafe`: one
    wake-up of the server thread per step instead of one per request (on few cores every
    wake-up steals time from the torch threads of the step)."""

    def __init__(self) -> None:
        self.items: list[tuple[OutputCollector, RequestOutput | BaseException]] = []

    def sink(self, collector: OutputCollector) -> Callable[[RequestOutput | BaseException], None]:
        return lambda item: self.items.append((collector, item))

    def flush(self, done: threading.Event | None = None) -> None:
        """Hand the outputs over. `done` is set once a consumer loop has run the consumers
        they wake (at once if none is listening)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for collector, item in self.items:
            by_loop.setdefault(collector.loop, []).append((collector, item))
        self.items = []
        handed = False
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items, None if handed else done)
                handed = True
            except RuntimeError:  # that loop is closed, so nobody is listening
                pass
        if done is not None and not handed:
            done.set()


class AsyncLLM:
    """`start_thread=False` leaves the step loop to the caller: it must call
    `run_engine_loop()` (blocking) on some thread, e.g. the main thread while uvicorn serves
    from another (`sous serve` does this: torch ops measured markedly faster on the main
    thread than on a secondary one on this CPU)."""

    def __init__(self, core: EngineCore, start_thread: bool = True) -> None:
        self.core = core
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.max_num_seqs = core.config.scheduler.max_num_seqs
        self.served_model_name = core.served_model_name
        self.cache_info = core.cache_info
        self.structured_output_manager = core.structured_output_manager
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._lock = threading.Lock()
        """Orders inbox puts against the loop's end: nothing is queued once `_ended`."""
        self._closed: str | None = None
        """Why no new request is accepted (None: accepting)."""
        self._ended = False
        """The loop has returned: no message is accepted."""
        self._collectors: dict[str, OutputCollector] = {}
        self._outbox = Outbox()
        """Filled by the engine thread during a step, flushed after it."""
        self._stats = core.stats()
        """The engine thread's latest snapshot (replaced, never mutated)."""
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

    # ---- API (any thread / the server's event loop) ----------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request. Raises EngineDeadError when the engine is not running,
        ValueError (from the engine thread, as the first item) when the request is invalid."""
        if request_id in self._collectors:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        collector = OutputCollector(asyncio.get_running_loop(), sampling_params.output_kind)
        self._collectors[request_id] = collector
        finished = False
        try:
            self._submit("add", (request_id, prompt_token_ids, sampling_params,
                                 self._outbox.sink(collector), prompt))
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        except ValueError:
            finished = True  # rejected by the engine: nothing to abort
            raise
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                self._submit_quietly("abort", [request_id])

    async def abort(self, request_id: str) -> None:
        """Stop a request; no further output (the client went away)."""
        self._submit_quietly("abort", [request_id])

    async def abort_all(self) -> int:
        """Abort every unfinished request, giving each consumer a last output with
        finish_reason "abort" (a server-side abort, e.g. at shutdown). Returns how many."""
        def run() -> int:
            ids = self.core.unfinished_request_ids()
            self.core.abort(ids, final_output=True)
            return len(ids)

        return await asyncio.wrap_future(self._call(run))

    def get_stats(self) -> EngineStats:
        """The engine's counters as of its latest loop iteration (a snapshot)."""
        return self._stats

    def get_engine_stats(self) -> dict[int, EngineStats]:
        """`get_stats()` per engine (one here: engine 0)."""
        return {0: self._stats}

    def is_healthy(self) -> bool:
        return self._error is None and not self._stopped and (
            self._loop_running.is_set() or self._thread is None)

    @property
    def died(self) -> bool:
        """True once the step loop has ended on an error (not on stop or a signal)."""
        return self._error is not None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine takes no new work (it died, or is shutting down); None if it does."""
        return self._closed

    def close_to_new(self, reason: str) -> None:
        """Refuse new requests from now on (EngineDeadError(reason)); running ones go on."""
        with self._lock:
            if self._closed is None:
                self._closed = reason

    async def reset_prefix_cache(self) -> bool:
        return await asyncio.wrap_future(self._call(self.core.reset_prefix_cache))

    def stop(self) -> None:
        """Ask the step loop to return (after its current iteration); requests still there
        get EngineDeadError. Does not wait."""
        self._stopped = True
        with self._lock:
            self._inbox.put(("stop", None))

    def shutdown(self) -> None:
        """Stop the step loop (whichever thread runs it) and release the engine."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.core.shutdown()

    # ---- messages to the engine thread -------------------------------------------------------
    def _submit(self, kind: str, payload: Any) -> None:
        """Queue a message for the engine thread; EngineDeadError if it cannot be served
        (the loop has ended, or new requests are refused). Aborts are always accepted."""
        with self._lock:
            if kind == "abort" and self._ended:
                return
            if self._ended or (kind == "add" and self._closed is not None):
                raise EngineDeadError(self._closed or "The engine has stopped.")
            self._inbox.put((kind, payload))

    def _submit_quietly(self, kind: str, payload: Any) -> None:
        with contextlib.suppress(EngineDeadError):
            self._submit(kind, payload)

    def _call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` on the engine thread; its result (or EngineDeadError) in a Future."""
        fut: Future = Future()
        try:
            self._submit("call", (fn, fut))
        except EngineDeadError as e:
            fut.set_exception(e)
        return fut

    # ---- engine thread ---------------------------------------------------------------------
    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            request_id, ids, params, sink, prompt = payload
            try:
                self.core.add_request(request_id, ids, params, sink, prompt)
            except Exception as e:  # invalid: the error is the request's first item
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
        """Step the engine until `stop()`; blocks. KeyboardInterrupt propagates. However it
        ends, pending and running requests are failed with EngineDeadError."""
        self._loop_running.set()
        reason = "The server is shutting down."
        wait_front_end = self._front_end_shares_cpus()
        try:
            idle = False
            while not self._stopped:
                timeout = self._wait_timeout(idle)
                try:
                    while True:
                        kind, payload = self._inbox.get(block=timeout != 0, timeout=timeout)
                        timeout = 0
                        if kind == "stop":
                            return
                        self._handle(kind, payload)
                except queue.Empty:
                    pass
                idle = False
                if (self.core.step_sync is not None or self.core.has_unfinished_requests()
                        or self.core.has_pending_kv_transfers()):
                    idle = self.core.step() == 0
                self._flush_outputs(wait_front_end)
                self._stats = self.core.stats()
        except KeyboardInterrupt:
            self._stopped = True
            raise
        except BaseException as e:  # a dead engine must not leave clients hanging
            logger.exception("Engine loop died")
            self._error = e
            reason = f"The engine has stopped: {e!r}"
        finally:
            self._loop_running.clear()
            self._end(reason)

    def _front_end_shares_cpus(self) -> bool:
        """Whether the step's threads occupy every CPU this process may use (vLLM-CPU's
        default binding), so that the server's event loop can only run on a core the next
        step needs."""
        if self.core.device.type != "cpu":
            return False
        return torch.get_num_threads() >= len(allowed_cpus())

    def _flush_outputs(self, wait_front_end: bool) -> None:
        """Hand the step's outputs to their consumers. With `wait_front_end` and outputs for
        several requests, wait (at most `FRONT_END_WAIT_S`) until the event loop has run
        their consumers before the next step starts: that work then runs between steps
        instead of preempting a step thread, which on a full machine holds up the other step
        threads at every barrier of the step. One request's output is left to overlap."""
        if wait_front_end and len(self._outbox.items) > 1:
            done = threading.Event()
            self._outbox.flush(done)
            done.wait(FRONT_END_WAIT_S)
        else:
            self._outbox.flush()

    def _wait_timeout(self, idle: bool) -> float | None:
        """How long the loop waits for new work: forever with nothing to do, not at all
        while requests run, `KV_TRANSFER_POLL_S` while only KV transfers are pending (the
        last step ran nothing)."""
        if not self.core.has_unfinished_requests() and not self.core.has_pending_kv_transfers():
            return None if self.core.step_sync is None else IDLE_POLL_S
        return KV_TRANSFER_POLL_S if idle else 0

    def _end(self, reason: str) -> None:
        """Accept nothing more; fail what is queued and what is running."""
        with self._lock:
            self._ended = True
            if self._closed is None or self._error is not None:
                self._closed = reason
        error = EngineDeadError(self._closed)
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "call":
                payload[1].set_exception(error)
        self._outbox.flush()
        for collector in list(self._collectors.values()):
            collector.put_threadsafe(error)
