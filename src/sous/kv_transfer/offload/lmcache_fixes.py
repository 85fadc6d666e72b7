"""Narrow workarounds for LMCache 0.5.6 as sous runs it (each noted in the README).

- `RedisConnector.close()` awaits `pq_executor.shutdown()`, a blocking call that schedules
  work on the very event loop it is running on: engine shutdown with a Redis tier hangs
  forever. `patch_redis_close` makes it await the executor's async shutdown instead.
- While a remote tier is down LMCache logs a warning per chunk put and get. `quiet_lmcache_logs`
  drops those records (and three start-up warnings that do not apply to sous: that vLLM's
  hash is missing, said better by `check_hash_seed`; that no controller is connected; that
  `remote_url` is deprecated); `RemoteWatch` says once per outage that the tier is down,
  and once that it is back.
- A remote get that fails (a truncated value, a dropped connection) makes LMCache cancel its
  sibling gets; each job worker of its `AsyncPQExecutor` then dies on `set_result` of a
  cancelled future, and after four such failures every Redis call (lookups included) waits
  forever, the engine with it. `patch_job_executor` hands workers futures that ignore a
  result arriving after cancellation.
- `LocalDiskBackend.read_file` ignores how many bytes `readinto` read and returns quietly
  when the file is gone: a truncated or deleted chunk file is served as whatever the buffer
  held (wrong output, counted as cached). `patch_disk_reads` makes a file shorter than the
  chunk (or missing) an error, which LMCache's read path turns into a miss, and drops the
  entry from the index.
- `destroy_engine` bounds the engine's teardown so a stuck tier cannot hang a shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)

_REMOTE_LOGGERS = ("lmcache.v1.storage_backend.remote_backend",
                   "lmcache.v1.storage_backend.connector")
_NOT_FOR_SOUS = ("Could not load '%s' from vLLM", "Controller message sender is not",
                 "remote_url is deprecated")


def patch_redis_close() -> None:
    from lmcache.v1.storage_backend.connector import redis_connector

    cls = redis_connector.RedisConnector
    if getattr(cls.close, "_sous_patched", False):
        return

    async def close(self: redis_connector.RedisConnector) -> None:
        await self.pq_executor.shutdown_async(wait=True)
        await self.connection.close()

    close._sous_patched = True  # type: ignore[attr-defined]
    cls.close = close  # type: ignore[method-assign]


def patch_disk_reads() -> None:
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    original = LocalDiskBackend.read_file
    if getattr(original, "_sous_patched", False):
        return

    def read_file(self: Any, key: Any, buffer: Any, path: str) -> None:
        want = memoryview(buffer).nbytes
        try:
            have = os.path.getsize(path)
        except OSError:
            have = -1
        if have < want:
            with self.disk_lock:
                self.dict.pop(key, None)
            raise OSError(f"{path}: {max(have, 0)} of {want} bytes on disk")
        original(self, key, buffer, path)

    read_file._sous_patched = True  # type: ignore[attr-defined]
    LocalDiskBackend.read_file = read_file  # type: ignore[method-assign]


class _TolerantFuture(asyncio.Future):  # type: ignore[type-arg]
    """A future whose late result (after it was cancelled) is dropped, not raised."""

    def set_result(self, result: Any) -> None:
        if not self.done():
            super().set_result(result)

    def set_exception(self, exception: BaseException | type[BaseException]) -> None:
        if not self.done():
            super().set_exception(exception)


def patch_job_executor() -> None:
    from lmcache.v1.storage_backend.job_executor import pq_executor

    cls = pq_executor.AsyncPQExecutor
    if getattr(cls.submit_job, "_sous_patched", False):
        return

    async def submit_job(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        priority = kwargs.pop("priority", 0)
        done = _TolerantFuture(loop=self.loop)
        await self._queue.put((priority, next(self._counter), fn, args, kwargs, done))
        return await done

    submit_job._sous_patched = True  # type: ignore[attr-defined]
    cls.submit_job = submit_job  # type: ignore[method-assign]


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(_REMOTE_LOGGERS):
            return False
        return not str(record.msg).startswith(_NOT_FOR_SOUS)


def quiet_lmcache_logs() -> None:
    """Filter every LMCache logger, present and future (they do not propagate, so each has
    its own handler; some modules are imported only when the engine is built)."""
    import lmcache.logging as lmcache_logging

    for name, item in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("lmcache") and isinstance(item, logging.Logger):
            _add_quiet(item)
    original = lmcache_logging.init_logger
    if getattr(original, "_sous_patched", False):
        return

    def init_logger(name: str) -> logging.Logger:
        return _add_quiet(original(name))

    init_logger._sous_patched = True  # type: ignore[attr-defined]
    lmcache_logging.init_logger = init_logger


def _add_quiet(item: logging.Logger) -> logging.Logger:
    if not any(isinstance(f, _Quiet) for f in item.filters):
        item.addFilter(_Quiet())
    return item


def check_hash_seed(config: Any) -> None:
    """LMCache without vLLM keys chunks with Python's `hash`, salted per process unless
    PYTHONHASHSEED is set: then a disk, Redis or plugin tier never hits across processes."""
    shared = config.local_disk or config.remote_url or config.storage_plugins
    if os.environ.get("PYTHONHASHSEED") in (None, "random") and shared:
        logger.warning("KV offload: PYTHONHASHSEED is not set, so chunk keys differ in every "
                       "process: a restarted or second server never hits the disk, remote or "
                       "plugin tier. Set PYTHONHASHSEED (e.g. 0), the same value in every "
                       "server that shares a tier.")


class RemoteWatch:
    """Pings a Redis tier every `interval_s` on a daemon thread; logs one warning when it
    stops answering and one line when it answers again."""

    def __init__(self, url: str, interval_s: float = 2.0) -> None:
        import redis

        self.url = url
        self.client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        self.up = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,),
                                        name="sous-remote-watch", daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.client.ping()
                up = True
            except Exception as e:
                up, error = False, e
            if up != self.up:
                if up:
                    logger.warning("KV offload: remote tier %s answers again; using it.",
                                   self.url)
                else:
                    logger.warning("KV offload: remote tier %s is down (%s); serving without "
                                   "it until it is back.", self.url, error)
                self.up = up

    def close(self) -> None:
        self._stop.set()


def destroy_engine(instance_id: str, timeout_s: float = 10.0) -> None:
    """`LMCacheEngineBuilder.destroy(instance_id)`, given at most `timeout_s`."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    thread = threading.Thread(target=LMCacheEngineBuilder.destroy, args=(instance_id,),
                              name="sous-lmcache-close", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("KV offload: LMCache did not close within %.0f s; leaving it.",
                       timeout_s)
