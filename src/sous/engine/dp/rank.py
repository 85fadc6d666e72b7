"""One data parallel engine rank: an `EngineCore` (behind `AsyncLLM`) in its own process,
serving the API server's `DPAsyncLLM` over one ZMQ DEALER socket (`sous.engine.dp.wire`).

Threads: the main thread runs the engine loop (`AsyncLLM.run_engine_loop`, as `sous serve`
does); a bridge thread runs an asyncio loop that turns messages into `AsyncLLM` calls and
streams outputs back. After the handshake only the bridge thread touches the socket.

The rank reaches the coordinator before it loads its model, so a wrong
--data-parallel-address fails in seconds. It exits when told to stop, when its engine loop
dies (after telling the API server), or when the API server has been silent for
`DEAD_AFTER_S` (it pings every `HEARTBEAT_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from dataclasses import replace
from typing import Any

import zmq
import zmq.asyncio

from sous.config.engine import EngineConfig
from sous.config.errors import ConfigError
from sous.engine.async_llm import AsyncLLM
from sous.engine.dp import wire
from sous.engine.dp.lockstep import StepSync, init_dp_group
from sous.engine.executor import thread_lock_for_progress_bars

logger = logging.getLogger(__name__)


def rank_main(config: EngineConfig, coordinator: str, reasoning_parser: str | None) -> None:
    """Entry point of a rank process (multiprocessing target): logs as `DP<rank>`, leaves
    Ctrl-C to its parent, exits 2 on a start-up ConfigError, 1 if its engine died."""
    rank = config.parallel.dp_rank
    logging.basicConfig(level=logging.INFO, force=True,
                        format=f"%(levelname)s %(asctime)s DP{rank} %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    thread_lock_for_progress_bars()
    try:
        code = run_rank(config, coordinator, reasoning_parser)
    except ConfigError as e:
        logger.error("data parallel rank %d: %s", rank, e)
        code = 2
    os._exit(code)  # no atexit hooks of a torch process half torn down: the parent reaps us


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """`config` for data parallel rank `rank` (of those this node runs)."""
    par = config.parallel
    return replace(config, parallel=replace(par, data_parallel_rank=rank,
                                            data_parallel_size_local=par.dp_size_local))


def start_local_ranks(config: EngineConfig, coordinator: str, reasoning_parser: str | None,
                      ) -> dict[int, multiprocessing.process.BaseProcess]:
    """Start ranks --data-parallel-start-rank .. + --data-parallel-size-local here."""
    par = config.parallel
    ctx = multiprocessing.get_context(par.worker_multiproc_method)
    procs = {}
    for rank in range(par.data_parallel_start_rank,
                      par.data_parallel_start_rank + par.dp_size_local):
        proc = ctx.Process(target=rank_main, name=f"sous-dp{rank}", daemon=True,
                           args=(rank_config(config, rank), coordinator, reasoning_parser))
        proc.start()
        procs[rank] = proc
    return procs


def handshake(sock: zmq.Socket, rank: int, coordinator: str, timeout_s: float,
              ) -> dict[str, Any]:
    """Say hello and return the welcome's settings; ConfigError naming the flags when no
    coordinator answers in `timeout_s` or it refuses this rank."""
    sock.send(wire.dumps(("hello", rank)))
    if not sock.poll(int(timeout_s * 1000)):
        raise ConfigError(
            f"--data-parallel-address / --data-parallel-rpc-port: data parallel rank {rank} "
            f"got no answer from the API server's coordinator at {coordinator} in "
            f"{timeout_s:g} s ({wire.CONNECT_TIMEOUT_ENV} sets the wait)")
    reply = wire.loads(sock.recv())
    if reply[0] == "refused":
        raise ConfigError(f"data parallel rank {rank}: the coordinator at {coordinator} "
                          f"refused it: {reply[1]}")
    return reply[1]


def run_rank(config: EngineConfig, coordinator: str, reasoning_parser: str | None) -> int:
    """Join the coordinator, load the engine, serve until stopped; the exit status."""
    rank = config.parallel.dp_rank
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, wire.identity(rank))
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(coordinator)
    try:
        welcome = handshake(sock, rank, coordinator, wire.connect_timeout_s())
        expert_parallel = config.parallel.expert_parallel_active
        if expert_parallel:
            if "group_port" not in welcome:
                raise ConfigError("--enable-expert-parallel: the API server at "
                                  f"{coordinator} runs without it; give every node the same "
                                  "parallel flags")
            host = coordinator.split("://", 1)[1].rsplit(":", 1)[0]
            init_dp_group(host, welcome["group_port"], rank, config.parallel.data_parallel_size)
        llm = AsyncLLM.from_config(config, start_thread=False)
        if expert_parallel:
            llm.core.step_sync = StepSync()
        if reasoning_parser:
            from sous.server.api_server import connect_reasoning_to_structured_output

            connect_reasoning_to_structured_output(llm.core, reasoning_parser)
        bridge = _Bridge(llm, sock, rank_info(llm, rank))
        bridge.start()
        try:
            llm.run_engine_loop()
        finally:
            bridge.finish(llm.dead_reason if llm.died else None)
            llm.shutdown()  # leaves the process group too
        return 1 if llm.died else 0
    finally:
        sock.close(linger=1000)
        ctx.term()


def rank_info(llm: AsyncLLM, rank: int) -> wire.RankInfo:
    core = llm.core
    return wire.RankInfo(
        rank=rank, pid=os.getpid(), served_model_name=llm.served_model_name,
        max_model_len=llm.max_model_len, max_num_seqs=llm.max_num_seqs,
        tokenizer=llm.tokenizer, vocab_size=core.vocab_size,
        eos_token_ids=tuple(sorted(core.eos_token_ids)),
        structured_outputs_config=core.config.structured_outputs_config,
        cache_info=llm.cache_info)


def _portable(error: BaseException) -> BaseException:
    """`error`, or a RuntimeError with its text when it does not survive pickling."""
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class _Bridge:
    """The rank's asyncio side, on its own thread: messages in, AsyncLLM calls, outputs out."""

    def __init__(self, llm: AsyncLLM, sock: zmq.Socket, info: wire.RankInfo) -> None:
        self.llm = llm
        self.info = info
        self._sync_sock = sock
        self._tasks: dict[str, asyncio.Task] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = asyncio.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"sous-dp{info.rank}-bridge")

    def start(self) -> None:
        self._thread.start()

    def finish(self, dead_reason: str | None) -> None:
        """From the engine thread once its loop has returned: tell the API server if the
        engine died, then end the bridge (waits a few seconds at most)."""
        loop = self._loop
        if loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the bridge loop has just closed
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(
                    self._end(dead_reason)))
        self._thread.join(timeout=5)

    def _run(self) -> None:
        from sous.engine.cpu_threads import unpin_current_thread

        unpin_current_thread()
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.sock = zmq.asyncio.Socket.from_socket(self._sync_sock)
        await self._send(("ready", self.info))
        beats = asyncio.create_task(self._heartbeat())
        receive = asyncio.create_task(self._receive())
        await self._done.wait()
        for task in (beats, receive, *self._tasks.values()):
            task.cancel()

    async def _end(self, dead_reason: str | None) -> None:
        if dead_reason is not None:
            await self._send(("dead", self.info.rank, dead_reason))
        self._done.set()

    async def _send(self, message: tuple[Any, ...]) -> None:
        await self.sock.send(wire.dumps(message))

    async def _receive(self) -> None:
        parent, last = os.getppid(), time.monotonic()
        while True:
            if not await self.sock.poll(int(wire.HEARTBEAT_S * 1000)):
                lost = os.getppid() != parent or time.monotonic() - last > wire.DEAD_AFTER_S
                if lost:
                    logger.error("The API server is gone (its process exited, or it has been "
                                 "silent for %.0f s): stopping.", wire.DEAD_AFTER_S)
                    self.llm.stop()
                    return
                continue
            last = time.monotonic()
            message = wire.loads(await self.sock.recv())
            kind = message[0]
            if kind == "stop":
                self.llm.stop()
                return
            if kind == "add":
                _, request_id, ids, params, prompt = message
                self._tasks[request_id] = asyncio.create_task(
                    self._serve(request_id, ids, params, prompt))
            elif kind == "abort":
                task = self._tasks.get(message[1])
                if task is not None:
                    task.cancel()  # generate() aborts the request and frees its blocks
            elif kind == "call":
                asyncio.create_task(self._call(message[1], message[2], message[3]))

    async def _serve(self, request_id: str, ids: list[int], params: Any,
                     prompt: str | None) -> None:
        try:
            async for out in self.llm.generate(ids, params, request_id, prompt):
                await self._send(("out", request_id, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self._send(("err", request_id, _portable(e)))
        finally:
            self._tasks.pop(request_id, None)

    async def _call(self, call_id: int, name: str, args: tuple[Any, ...]) -> None:
        try:
            value = getattr(self.llm, name)(*args)
            if asyncio.iscoroutine(value):
                value = await value
            reply: tuple[Any, ...] = ("reply", call_id, True, value)
        except Exception as e:
            reply = ("reply", call_id, False, _portable(e))
        await self._send(reply)

    async def _heartbeat(self) -> None:
        last: Any = None
        next_beat = 0.0
        while True:
            stats = self.llm.get_stats()
            now = time.monotonic()
            if stats is not last or now >= next_beat:
                await self._send(("stats", self.info.rank, stats))
                last, next_beat = stats, now + wire.HEARTBEAT_S
            await asyncio.sleep(0.05)
