"""Executors: how the engine core reaches its Worker.

`UniProcExecutor` calls the Worker in the engine's own process (the default).
`MultiprocExecutor` (`--distributed-executor-backend mp`) runs the Worker in a child process,
started with VLLM_WORKER_MULTIPROC_METHOD (fork or spawn), and talks to it over a ZMQ PAIR
socket on an ipc:// path with pickled `(method, args)` calls and `(ok, result)` replies. A
worker that dies makes the next call raise `WorkerDiedError` within a second, never hang.

`PipelineExecutor` (`--pipeline-parallel-size N`, `sous.engine.pp.executor`) runs one
`WorkerProc` per pipeline stage and lets the engine keep N batches in flight.

All expose the same calls: `load_model() -> ModelInfo`, `initialize_kv_cache(num_blocks,
max_model_len)`, `execute_model(SchedulerOutput) -> ModelRunnerOutput`, `shutdown()`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any, Protocol

import zmq

from sous.config.engine import EngineConfig
from sous.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from sous.engine.worker import ModelInfo, Worker
from sous.models.loader import LoadedModel

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """The worker process exited; the engine cannot continue."""


class Executor(Protocol):
    max_concurrent_batches: int
    """Batches the engine may have in flight (`submit` before the previous is `wait`ed);
    only an executor with more than one implements `submit` and `wait`."""

    def load_model(self) -> ModelInfo: ...

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class UniProcExecutor:
    """The Worker in this process; `worker` is reachable for in-process inspection."""

    max_concurrent_batches = 1

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.worker = Worker(config, loaded)

    def load_model(self) -> ModelInfo:
        return self.worker.load_model()

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.worker.initialize_kv_cache(num_blocks, max_model_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()


def thread_lock_for_progress_bars() -> None:
    """Give tqdm a thread lock in this (child) process: its default lock holds a named
    semaphore, which a child that exits without running its finalizers leaves behind (the
    parent's resource tracker then warns of "leaked semaphore objects" at shutdown)."""
    import threading

    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())


def _worker_main(config: EngineConfig, address: str, worker_kwargs: dict[str, Any],
                 name: str, log_level: int | None) -> None:
    """The worker process: serve calls on `address` until `shutdown` (or the parent goes).
    Logs as its parent does (`log_level`; None: not configured), each line naming it. Ctrl-C
    is the engine's to handle: the worker ignores SIGINT."""
    if log_level is not None:
        logging.basicConfig(level=log_level, force=True,
                            format=f"%(levelname)s %(asctime)s {name} %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    thread_lock_for_progress_bars()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(address)
    worker = Worker(config, **worker_kwargs)
    try:
        while True:
            method, args = pickle.loads(sock.recv())
            try:
                result = (True, getattr(worker, method)(*args))
            except Exception as e:
                logger.error("worker: %s failed:\n%s", method, traceback.format_exc())
                result = (False, e)
            sock.send(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
            if method == "shutdown":
                return
    finally:
        sock.close(linger=0)
        ctx.term()


def encode_call(method: str, *args: Any) -> bytes:
    """A call as a worker process reads it (pickle it once, send it to several workers)."""
    return pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)


class WorkerProc:
    """One Worker in a child process (started with VLLM_WORKER_MULTIPROC_METHOD) and the ZMQ
    PAIR socket to it. Calls are answered in the order they were sent."""

    def __init__(self, config: EngineConfig, name: str = "sous-worker",
                 worker_kwargs: dict[str, Any] | None = None) -> None:
        method = config.parallel.worker_multiproc_method
        self.name = name
        self._dir = tempfile.mkdtemp(prefix=f"{name}-")
        address = f"ipc://{os.path.join(self._dir, 'worker.sock')}"
        root = logging.getLogger()
        log_level = root.getEffectiveLevel() if root.handlers else None
        self._proc = multiprocessing.get_context(method).Process(
            target=_worker_main, args=(config, address, worker_kwargs or {}, name, log_level),
            name=name, daemon=True)
        self._proc.start()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.bind(address)
        logger.info("Worker process %d started (%s): %s", self._proc.pid, method, name)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def check_alive(self, during: str = "") -> None:
        """WorkerDiedError if the process has exited."""
        if not self._proc.is_alive():
            when = f" during {during}" if during else ""
            raise WorkerDiedError(f"the worker process exited ({self._proc.exitcode}){when}: "
                                  f"{self.name}")

    def send(self, call: bytes) -> None:
        self.check_alive()
        self._sock.send(call)

    def recv(self, method: str, peers: Sequence[WorkerProc] = ()) -> Any:
        """The reply to the oldest unanswered call (`method`): its result, or its exception
        raised here. WorkerDiedError within a second once this process, or one of `peers`
        (workers this one depends on), has exited."""
        while not self._sock.poll(1000):
            for proc in (self, *peers):
                proc.check_alive(method)
        ok, value = pickle.loads(self._sock.recv())
        if not ok:
            self._blame_dead_peer(method, peers, value)
            raise value
        return value

    @staticmethod
    def _blame_dead_peer(method: str, peers: Sequence[WorkerProc], error: BaseException,
                         grace_s: float = 1.0) -> None:
        """WorkerDiedError (caused by `error`) if one of `peers` exits within `grace_s`: a
        worker whose peer was killed fails first with a broken link, which hides the cause."""
        deadline = time.monotonic() + grace_s if peers else 0.0
        while True:
            for proc in peers:
                try:
                    proc.check_alive(method)
                except WorkerDiedError as died:
                    raise died from error
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def call(self, method: str, *args: Any) -> Any:
        self.send(encode_call(method, *args))
        return self.recv(method)

    def shutdown(self, wait_s: float = 5.0) -> None:
        """Ask the worker to shut down (at most `wait_s` for its answer), then make sure the
        process is gone."""
        with contextlib.suppress(WorkerDiedError, zmq.ZMQError):
            if wait_s > 0 and self._proc.is_alive():
                self._sock.send(encode_call("shutdown"))
                if self._sock.poll(int(wait_s * 1000)):
                    self._sock.recv()
        self._proc.join(timeout=wait_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class MultiprocExecutor:
    """The Worker in a child process (see the module docstring)."""

    max_concurrent_batches = 1

    def __init__(self, config: EngineConfig) -> None:
        self._worker = WorkerProc(config)

    @property
    def pid(self) -> int | None:
        return self._worker.pid

    def load_model(self) -> ModelInfo:
        return self._worker.call("load_model")

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self._worker.call("initialize_kv_cache", num_blocks, max_model_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._worker.call("execute_model", scheduler_output)

    def shutdown(self) -> None:
        self._worker.shutdown()


def make_executor(config: EngineConfig, loaded: LoadedModel | None = None) -> Executor:
    """The executor `config.parallel.distributed_executor_backend` names (`uni` default);
    with --pipeline-parallel-size > 1 one worker process per stage."""
    if config.parallel.pipeline_parallel_size > 1:
        if loaded is not None:
            raise ValueError("a preloaded model is one process: pipeline stages load their own")
        from sous.engine.pp.executor import PipelineExecutor

        return PipelineExecutor(config)
    backend = getattr(config.parallel, "distributed_executor_backend", None) or "uni"
    if backend == "mp":
        if loaded is not None:
            raise ValueError("a preloaded model runs in this process: use the uni backend")
        return MultiprocExecutor(config)
    return UniProcExecutor(config, loaded)
