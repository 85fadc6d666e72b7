"""Executors: how the engine core reaches its Worker.

`UniProcExecutor` calls the Worker in the engine's own process (the default).
`MultiprocExecutor` (`--distributed-executor-backend mp`) runs the Worker in a child process,
started with VLLM_WORKER_MULTIPROC_METHOD (fork or spawn), and talks to it over a ZMQ PAIR
socket on an ipc:// path with pickled `(method, args)` calls and `(ok, result)` replies. A
worker that dies makes the next call raise `WorkerDiedError` within a second, never hang.

Both expose the same calls: `load_model() -> ModelInfo`, `initialize_kv_cache(num_blocks,
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
import traceback
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
    def load_model(self) -> ModelInfo: ...

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class UniProcExecutor:
    """The Worker in this process; `worker` is reachable for in-process inspection."""

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


def _worker_main(config: EngineConfig, address: str) -> None:
    """The worker process: serve calls on `address` until `shutdown` (or the parent goes).
    Ctrl-C is the engine's to handle: the worker ignores SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(address)
    worker = Worker(config)
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


class MultiprocExecutor:
    """The Worker in a child process (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        method = config.parallel.worker_multiproc_method
        self._dir = tempfile.mkdtemp(prefix="sous-worker-")
        address = f"ipc://{os.path.join(self._dir, 'worker.sock')}"
        self._proc = multiprocessing.get_context(method).Process(
            target=_worker_main, args=(config, address), name="sous-worker", daemon=True)
        self._proc.start()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.bind(address)
        logger.info("Worker process %d started (%s)", self._proc.pid, method)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _call(self, method: str, *args: Any) -> Any:
        if not self._proc.is_alive():
            raise WorkerDiedError(f"the worker process exited ({self._proc.exitcode})")
        self._sock.send(pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL))
        while not self._sock.poll(1000):
            if not self._proc.is_alive():
                raise WorkerDiedError(
                    f"the worker process exited ({self._proc.exitcode}) during {method}")
        ok, value = pickle.loads(self._sock.recv())
        if not ok:
            raise value
        return value

    def load_model(self) -> ModelInfo:
        return self._call("load_model")

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self._call("initialize_kv_cache", num_blocks, max_model_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", scheduler_output)

    def shutdown(self) -> None:
        with contextlib.suppress(WorkerDiedError, zmq.ZMQError):
            if self._proc.is_alive():
                self._sock.send(pickle.dumps(("shutdown", ())))
                if self._sock.poll(5000):
                    self._sock.recv()
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def make_executor(config: EngineConfig, loaded: LoadedModel | None = None) -> Executor:
    """The executor `config.parallel.distributed_executor_backend` names (`uni` default)."""
    backend = getattr(config.parallel, "distributed_executor_backend", None) or "uni"
    if backend == "mp":
        if loaded is not None:
            raise ValueError("a preloaded model runs in this process: use the uni backend")
        return MultiprocExecutor(config)
    return UniProcExecutor(config, loaded)
