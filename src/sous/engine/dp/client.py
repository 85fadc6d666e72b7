"""DPAsyncLLM: `AsyncLLM`'s interface over data parallel engine ranks in other processes.

The API server's process binds the coordinator (a ZMQ ROUTER at
--data-parallel-address:--data-parallel-rpc-port), starts its local ranks
(`sous.engine.dp.rank.rank_main`) and waits until every rank, local or `--headless` on
another machine, is ready. Each request goes to the rank with the lowest load, measured as
the requests it holds (counted here, so exact between stats) plus three times its waiting
queue, then its KV cache usage (vLLM weighs waiting requests 4:1 over running ones).

Threads: the main thread runs `run_engine_loop` (the only user of the ROUTER socket):
it forwards what other threads queue (through an inproc PUSH socket per thread), hands
outputs to the consumers (one wake-up of their loop per batch), pings the ranks and watches
them. A rank that exits or goes silent for `DEAD_AFTER_S` kills the engine: every request
gets EngineDeadError, /health answers 503 and `sous serve` exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import Future
from typing import Any

import zmq

from sous.config.engine import EngineConfig
from sous.config.errors import ConfigError
from sous.engine.async_llm import Outbox, OutputCollector
from sous.engine.dp import wire
from sous.engine.dp.rank import start_local_ranks
from sous.engine.dp.wire import free_port
from sous.engine.errors import EngineDeadError
from sous.engine.outputs import RequestOutput
from sous.engine.sampling_params import SamplingParams
from sous.engine.scheduler import SchedulerStats

logger = logging.getLogger(__name__)


def coordinator_address(config: EngineConfig) -> tuple[str, int | None]:
    """(host, port) the coordinator binds; port None: any free one (every rank local)."""
    par = config.parallel
    host = par.data_parallel_address or "127.0.0.1"
    if par.data_parallel_rpc_port is not None:
        return host, par.data_parallel_rpc_port
    return host, None if par.dp_size_local == par.data_parallel_size else wire.DEFAULT_RPC_PORT


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """One snapshot for all ranks: counts summed, KV usage averaged."""
    connector: dict[str, float] = {}
    for s in stats:
        for k, v in s.kv_connector_stats.items():
            connector[k] = connector.get(k, 0) + v
    return SchedulerStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / max(len(stats), 1),
        num_preemptions=sum(s.num_preemptions for s in stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_kv_load_failures=sum(s.num_kv_load_failures for s in stats),
        kv_connector_stats=connector)


class DPAsyncLLM:
    """The engine of a data parallel API server (see the module docstring)."""

    core = None
    """No engine core in this process (the ranks have them)."""

    def __init__(self, config: EngineConfig, reasoning_parser: str | None = None) -> None:
        self.config = config
        self.size = config.parallel.data_parallel_size
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.LINGER, 0)
        host, port = coordinator_address(config)
        try:
            if port is None:
                port = self._router.bind_to_random_port(f"tcp://{host}")
            else:
                self._router.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._router.close()
            raise ConfigError(f"--data-parallel-address {host} --data-parallel-rpc-port {port}: "
                              f"the coordinator cannot listen there ({e})") from None
        self.address = f"tcp://{host}:{port}"
        self._welcome_settings: dict[str, Any] = {}
        """What every rank is told when it joins: the process group's port (expert
        parallel ranks rendezvous there, rank 0 hosting the store)."""
        if config.parallel.enable_expert_parallel:
            self._welcome_settings["group_port"] = free_port(host)
        self._pull = self._ctx.socket(zmq.PULL)
        self._inproc = f"inproc://sous-dp-out-{id(self)}"
        self._pull.bind(self._inproc)
        self._local = threading.local()
        self._procs = start_local_ranks(config, self.address, reasoning_parser)
        self._last_seen: dict[int, float] = {}
        self._stats: dict[int, SchedulerStats] = {}
        self._inflight: dict[int, int] = dict.fromkeys(range(self.size), 0)
        self._collectors: dict[str, tuple[OutputCollector, int]] = {}
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._outbox = Outbox()
        self._closed: str | None = None
        self._error: str | None = None
        self._stopped = False
        self._ended = False
        """The loop has returned: calls fail at once instead of waiting for it."""
        self._loop_running = threading.Event()
        try:
            infos = self._wait_ready(config.engine_ready_timeout_s)
        except BaseException:
            self._stop_ranks()
            self._close_sockets()
            raise
        self._adopt(infos)

    # ---- start-up ------------------------------------------------------------------------
    def _wait_ready(self, timeout_s: float) -> dict[int, wire.RankInfo]:
        """Answer hellos and collect every rank's ready info; ConfigError when a local rank
        exits first, EngineStartTimeout-like ConfigError after `timeout_s`."""
        infos: dict[int, wire.RankInfo] = {}
        deadline = time.monotonic() + timeout_s
        remote = self.size - len(self._procs)
        logger.info("Data parallel: %d rank(s) here%s; coordinator %s", len(self._procs),
                    f", waiting for {remote} from other nodes (--headless)" if remote else "",
                    self.address)
        while len(infos) < self.size:
            for rank, proc in self._procs.items():
                if not proc.is_alive():
                    raise ConfigError(f"data parallel rank {rank} exited with code "
                                      f"{proc.exitcode} while starting (its error is above)")
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.size)) - set(infos))
                raise ConfigError(f"data parallel ranks {missing} were not ready within "
                                  f"{timeout_s:g} s (VLLM_ENGINE_READY_TIMEOUT_S)")
            try:
                self._ping(infos)  # ranks already up must not take the wait for silence
            except EngineDeadError as e:
                raise ConfigError(f"while starting: {e}") from None
            if not self._router.poll(200):
                continue
            ident, frame = self._router.recv_multipart()
            message = wire.loads(frame)
            if message[0] == "hello":
                self._welcome(ident, message[1], infos)
            elif message[0] == "ready":
                info: wire.RankInfo = message[1]
                infos[info.rank] = info
                self._last_seen[info.rank] = time.monotonic()
                logger.info("Data parallel rank %d ready (pid %d)", info.rank, info.pid)
        return infos

    def _welcome(self, ident: bytes, rank: int, infos: dict[int, wire.RankInfo]) -> None:
        if not 0 <= rank < self.size:
            why = f"rank {rank} is outside --data-parallel-size {self.size}"
        elif rank in infos or ident != wire.identity(rank):
            why = f"rank {rank} has already joined"
        else:
            self._router.send_multipart([ident, wire.dumps(("welcome", self._welcome_settings))])
            return
        logger.error("Data parallel: refused a rank: %s", why)
        self._router.send_multipart([ident, wire.dumps(("refused", why))])

    def _adopt(self, infos: dict[int, wire.RankInfo]) -> None:
        from sous.config.structured_outputs import StructuredOutputsConfig
        from sous.engine.structured_output.manager import StructuredOutputManager

        first = infos[min(infos)]
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self.max_num_seqs = first.max_num_seqs
        self.served_model_name = first.served_model_name
        self.cache_info = first.cache_info
        self.structured_output_manager = StructuredOutputManager(
            first.tokenizer, first.vocab_size, list(first.eos_token_ids), first.max_num_seqs,
            config=StructuredOutputsConfig.from_dict(first.structured_outputs_config))
        """Compiles constraints here only to answer 400 before a request reaches a rank."""

    # ---- API (any thread / the server's event loop) ----------------------------------------
    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str, prompt: str | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """As `AsyncLLM.generate`, on the least loaded rank."""
        if request_id in self._collectors:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if self._closed is not None:
            raise EngineDeadError(self._closed)
        rank = self._pick_rank()
        collector = OutputCollector(asyncio.get_running_loop(), sampling_params.output_kind)
        self._collectors[request_id] = (collector, rank)
        self._inflight[rank] += 1
        finished = False
        try:
            self._push(rank, ("add", request_id, prompt_token_ids, sampling_params, prompt))
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        except ValueError:
            finished = True  # rejected by the rank: nothing to abort
            raise
        finally:
            self._collectors.pop(request_id, None)
            self._inflight[rank] -= 1
            if not finished:
                self._push(rank, ("abort", request_id))

    def _pick_rank(self) -> int:
        def load(rank: int) -> tuple[float, float, int]:
            stats = self._stats.get(rank)
            waiting = stats.num_waiting if stats else 0
            usage = stats.kv_cache_usage if stats else 0.0
            return self._inflight[rank] + 3 * waiting, usage, rank

        return min(range(self.size), key=load)

    async def abort(self, request_id: str) -> None:
        entry = self._collectors.get(request_id)
        if entry is not None:
            self._push(entry[1], ("abort", request_id))

    async def abort_all(self) -> int:
        """Abort every rank's unfinished requests (each gets a last "abort" output)."""
        counts = await asyncio.gather(*(self._call(r, "abort_all") for r in range(self.size)))
        return sum(counts)

    async def reset_prefix_cache(self) -> bool:
        done = await asyncio.gather(*(self._call(r, "reset_prefix_cache")
                                      for r in range(self.size)))
        return all(done)

    def get_stats(self) -> SchedulerStats:
        """All ranks' latest snapshots in one (counts summed, KV usage averaged)."""
        return sum_stats([self._stats[r] for r in sorted(self._stats)])

    def get_engine_stats(self) -> dict[int, SchedulerStats]:
        """Each rank's latest snapshot, by rank."""
        return dict(self._stats)

    def is_healthy(self) -> bool:
        """No rank lost and not stopped (true before the loop starts, as AsyncLLM's)."""
        return self._error is None and not self._stopped

    @property
    def died(self) -> bool:
        return self._error is not None

    @property
    def dead_reason(self) -> str | None:
        return self._closed

    def close_to_new(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason

    def stop(self) -> None:
        """Ask the loop to return; it stops the ranks on its way out. Does not wait."""
        self._stopped = True
        with contextlib.suppress(zmq.ZMQError):
            self._push(-1, ("wake",))

    def shutdown(self) -> None:
        """Stop the ranks (they finish their current step), then release the sockets."""
        self.stop()
        self._stop_ranks()
        self._close_sockets()

    # ---- messages to the loop ------------------------------------------------------------
    def _push(self, rank: int, message: tuple[Any, ...]) -> None:
        """Queue `message` for rank `rank` (-1: for the loop itself); any thread."""
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._local.push = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._inproc)
        sock.send_multipart([str(rank).encode(), wire.dumps(message)])

    def _call(self, rank: int, name: str, *args: Any) -> asyncio.Future:
        call_id = next(self._call_ids)
        fut: Future = Future()
        self._calls[call_id] = fut
        if self._ended:
            fut.set_exception(EngineDeadError(self._closed or "The engine has stopped."))
        else:
            self._push(rank, ("call", call_id, name, args))
        return asyncio.wrap_future(fut)

    # ---- the loop (main thread) --------------------------------------------------------------
    def run_engine_loop(self) -> None:
        """Relay messages until `stop()` or a rank is lost; blocks. However it ends, requests
        still waiting get EngineDeadError."""
        self._loop_running.set()
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        reason = "The server is shutting down."
        next_ping = 0.0
        try:
            while not self._stopped:
                ready = dict(poller.poll(int(wire.HEARTBEAT_S * 1000)))
                if self._pull in ready:
                    self._forward()
                if self._router in ready:
                    self._receive()
                self._outbox.flush()
                if time.monotonic() >= next_ping:
                    self._ping()
                    next_ping = time.monotonic() + wire.HEARTBEAT_S
                lost = self._lost_rank()
                if lost is not None:
                    raise EngineDeadError(lost)
        except BaseException as e:
            if not isinstance(e, KeyboardInterrupt):
                logger.error("Data parallel engine stopped: %s", e)
                self._error = str(e)
                reason = f"The engine has stopped: {e}"
            raise_it = isinstance(e, KeyboardInterrupt)
            self._end(reason)
            if raise_it:
                raise
            return
        self._end(reason)

    def _forward(self) -> None:
        while True:
            try:
                rank, frame = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            target = int(rank)
            if target < 0:
                continue  # a wake-up
            try:
                self._router.send_multipart([wire.identity(target), frame])
            except zmq.ZMQError as e:  # EHOSTUNREACH: the rank is gone
                raise self._unreachable(target, e) from None

    def _receive(self) -> None:
        now = time.monotonic()
        while True:
            try:
                ident, frame = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = wire.loads(frame)
            kind = message[0]
            if kind in ("out", "err"):
                entry = self._collectors.get(message[1])
                if entry is not None:
                    self._outbox.items.append((entry[0], message[2]))
            elif kind == "stats":
                self._stats[message[1]] = message[2]
                self._last_seen[message[1]] = now
            elif kind == "reply":
                fut = self._calls.pop(message[1], None)
                if fut is not None:
                    fut.set_result(message[3]) if message[2] else fut.set_exception(message[3])
            elif kind == "dead":
                raise EngineDeadError(f"data parallel rank {message[1]} died: {message[2]}")
            elif kind == "hello":  # a rank restarted or a stray one: it may not join now
                self._router.send_multipart([ident, wire.dumps(
                    ("refused", "the API server is already serving"))])

    def _ping(self, ranks: Iterable[int] | None = None) -> None:
        """Ping `ranks` (default: all); EngineDeadError for one whose connection is gone (a
        remote rank's process died: ZMQ dropped its peer)."""
        for rank in range(self.size) if ranks is None else ranks:
            try:
                self._router.send_multipart([wire.identity(rank), wire.dumps(("ping",))])
            except zmq.ZMQError as e:
                raise self._unreachable(rank, e) from None

    def _unreachable(self, rank: int, error: zmq.ZMQError,
                     grace_s: float = 1.0) -> EngineDeadError:
        """The error for a rank ZMQ cannot reach: its exit code when it is a process of this
        node that exits within `grace_s` (its socket closes before it can be reaped)."""
        proc = self._procs.get(rank)
        deadline = time.monotonic() + grace_s
        while proc is not None and time.monotonic() < deadline:
            if not proc.is_alive():
                return EngineDeadError(f"data parallel rank {rank} exited with code "
                                       f"{proc.exitcode}")
            time.sleep(0.02)
        return EngineDeadError(f"data parallel rank {rank} is unreachable ({error})")

    def _lost_rank(self) -> str | None:
        """Why a rank is lost (its process exited, or it has been silent), or None."""
        for rank, proc in self._procs.items():
            if not proc.is_alive():
                return f"data parallel rank {rank} exited with code {proc.exitcode}"
        now = time.monotonic()
        for rank, seen in self._last_seen.items():
            if now - seen > wire.DEAD_AFTER_S:
                return f"data parallel rank {rank} has been silent for {now - seen:.0f} s"
        return None

    def _end(self, reason: str) -> None:
        """Accept nothing more; fail calls and requests still waiting."""
        self._ended = True
        self._loop_running.clear()
        if self._closed is None or self._error is not None:
            self._closed = reason
        error = EngineDeadError(self._closed)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)
        self._calls.clear()
        self._outbox.flush()
        for collector, _ in list(self._collectors.values()):
            collector.put_threadsafe(error)

    def _stop_ranks(self) -> None:
        for rank in range(self.size):
            with contextlib.suppress(zmq.ZMQError):
                self._router.send_multipart([wire.identity(rank), wire.dumps(("stop",))])
        for proc in self._procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    def _close_sockets(self) -> None:
        """Close every socket of the context, the other threads' PUSH sockets included."""
        self._ctx.destroy(linger=0)
