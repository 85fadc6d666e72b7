"""`RDSBackend`: LMCache storage plugin reproducing RBLN Direct Storage on a plain file.

- One file per rank, `<dir>/rds_rank<worker_id>.bin`, recreated empty at start (in-memory index:
  a restart starts cold) and sized once (ftruncate) to `capacity` fixed slots: a 4096-byte
  header (key string, payload length, shapes/dtypes/format, crc32 of header and payload), then
  one full chunk's bytes rounded up to 4096. `<dir>`: extra_config `storage_plugin.<name>.path`,
  else `config.local_disk`, else `~/.cache/sous/rds`. `capacity`: `storage_plugin.<name>.
  rds_max_chunks`, else `max_local_disk_size` GiB / slot size, else `DEFAULT_CHUNKS`.
- Puts run on one writer thread; `contains` is true only once a slot is fully written. When
  full, the least recently used entry (a `get` is a use) is discarded. pin/unpin are no-ops.
  O_DIRECT where the filesystem takes it, buffered I/O otherwise.
- Failures never raise and log one warning per episode (until that operation succeeds again):
  an unusable directory disables the tier, a failed or short write is not indexed, a read
  error is a miss, a header/crc mismatch is a miss that drops the entry.
- Memory objects come from LMCache's LocalCPUBackend when there is one. With the local CPU tier
  off (`max_local_cpu_size=0`, as the recipes set) LMCache 0.5.6 has no allocator at all and
  StorageManager raises KeyError('LocalCPUBackend'): this backend then allocates (a plain CPU
  tensor per object, freed once released) and `install_allocator_fallback` makes it the
  StorageManager's allocator.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from lmcache.utils import CacheEngineKey, get_size_bytes
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_management import MemoryAllocatorInterface, MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import (
    AllocatorBackendInterface,
    StoragePluginInterface,
)

logger = logging.getLogger(__name__)

ALIGN = 4096
"""Slot, header and I/O alignment (bytes)."""
DEFAULT_CHUNKS = 64
"""Capacity when neither `rds_max_chunks` nor `max_local_disk_size` is given."""
MAX_PENDING_WRITES = 16
"""Chunks queued for the writer beyond which puts are dropped (bounds the host memory held)."""
_MAGIC = b"SOUSRDS1"
_FIXED = struct.Struct("<8sIQI")  # magic, meta length, payload length, crc32


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def install_allocator_fallback() -> None:
    """Make StorageManager take an RDSBackend as its allocator when there is no LocalCPUBackend
    (LMCache 0.5.6 indexes `storage_backends["LocalCPUBackend"]` unconditionally). Idempotent."""
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    original = StorageManager._get_allocator_backend
    if getattr(original, "_sous_rds", False):
        return

    def _get_allocator_backend(self: Any, config: Any) -> AllocatorBackendInterface:
        if not self.enable_pd and not {"LocalCPUBackend", "MaruBackend"} & set(
                self.storage_backends):
            for backend in self.storage_backends.values():
                if isinstance(backend, RDSBackend):
                    return backend
        return original(self, config)

    _get_allocator_backend._sous_rds = True  # type: ignore[attr-defined]
    StorageManager._get_allocator_backend = _get_allocator_backend  # type: ignore[method-assign]


class RDSBackend(StoragePluginInterface, AllocatorBackendInterface):
    """Fixed-slot single-file KV chunk store; the contracts are in the module docstring."""

    def __init__(self, dst_device: str = "cpu", config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        assert config is not None and metadata is not None
        self._lock = threading.Lock()
        self._index: OrderedDict[CacheEngineKey, int] = OrderedDict()  # least recent first
        self._free: list[int] = []  # popped from the end: the lowest slot first
        self._pending: set[CacheEngineKey] = set()
        self._failing: set[str] = set()
        self._closing = False
        self._heap = AdHocMemoryAllocator("cpu")
        self._tls = threading.local()
        self._fd: int | None = None
        self.direct = False
        extra, name = config.extra_config or {}, "RDSBackend"
        for plugin in config.storage_plugins or []:
            if extra.get(f"storage_plugin.{plugin}.class_name") == type(self).__name__:
                name = plugin
        chunk = get_size_bytes(metadata.get_shapes(), metadata.get_dtypes())
        self.slot_bytes = ALIGN + _align(chunk)
        if extra.get(f"storage_plugin.{name}.rds_max_chunks"):
            self.capacity = max(1, int(extra[f"storage_plugin.{name}.rds_max_chunks"]))
        elif (config.max_local_disk_size or 0) > 0:
            self.capacity = max(1, int(config.max_local_disk_size * 1024**3) // self.slot_bytes)
        else:
            self.capacity = DEFAULT_CHUNKS
        directory = extra.get(f"storage_plugin.{name}.path") or (
            str(config.local_disk).split(",")[0].removeprefix("file://")
            if config.local_disk else Path.home() / ".cache" / "sous" / "rds")
        self.path = Path(directory).expanduser() / f"rds_rank{metadata.worker_id}.bin"
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sous-rds-writer")
        install_allocator_fallback()
        if metadata.role == "scheduler":
            return  # the index lives in the worker; a scheduler must not truncate its file
        try:
            self._open()
        except OSError as e:
            logger.warning("RDS KV tier %s is unusable (%s): serving without it.", self.path, e)
            return
        self._free = list(range(self.capacity - 1, -1, -1))

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags, fd = os.O_RDWR | os.O_CREAT | os.O_TRUNC, -1
        try:  # some filesystems take O_DIRECT at open and fail the first write: probe it
            fd = os.open(self.path, flags | os.O_DIRECT)
            os.pwrite(fd, mmap.mmap(-1, ALIGN), 0)
            self.direct = True
        except (OSError, AttributeError):
            if fd >= 0:
                os.close(fd)
            fd = os.open(self.path, flags)
        try:
            os.ftruncate(fd, self.capacity * self.slot_bytes)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd

    def _fail(self, kind: str, msg: str, *args: Any) -> None:
        """Log `msg` unless a `kind` failure episode is already running."""
        with self._lock:
            if kind in self._failing:
                return
            self._failing.add(kind)
        logger.warning(msg, *args)

    def _ok(self, *kinds: str) -> None:
        if not self._failing.isdisjoint(kinds):
            with self._lock:
                self._failing.difference_update(kinds)

    def _buffer(self) -> mmap.mmap:
        """This thread's page-aligned (O_DIRECT-able) bounce buffer of one slot."""
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            buf = self._tls.buf = mmap.mmap(-1, self.slot_bytes)
        return buf

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        """True iff `key`'s chunk is fully written (the index only: data is checked on get)."""
        with self._lock:
            return key in self._index

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._pending

    def pin(self, key: CacheEngineKey) -> bool:
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        return True

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        with self._lock:
            slot = self._index.pop(key, None)
            if slot is not None:
                self._free.append(slot)
        return slot is not None

    def _drop(self, key: CacheEngineKey, slot: int) -> None:
        """A bad slot: forget `key` if it still maps to `slot` (else it was evicted and reused
        while being read, which is no fault) and warn once per episode."""
        with self._lock:
            bad = self._index.get(key) == slot
            if bad:
                del self._index[key]
                self._free.append(slot)
        if bad:
            self._fail("corrupt", "RDS KV tier %s: slot %d does not hold the chunk it should "
                       "(corrupt or truncated): treated as a miss.", self.path, slot)

    def batched_submit_put_task(
        self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj], transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future] | None:
        """Queue each chunk not already stored or queued for the writer thread; never blocks.
        Holds a reference on each queued object until it is written."""
        if self._fd is None or self._closing:
            return None
        futures = []
        for key, obj in zip(keys, objs, strict=False):
            with self._lock:
                if key in self._index or key in self._pending:
                    continue
                full = len(self._pending) >= MAX_PENDING_WRITES
                if not full:
                    self._pending.add(key)
            if full:
                self._fail("behind", "RDS KV tier %s: writer is %d chunks behind; dropping "
                           "puts until it catches up.", self.path, MAX_PENDING_WRITES)
                break
            obj.ref_count_up()
            futures.append(self._writer.submit(self._write, key, obj, on_complete_callback))
        return futures

    def _write(self, key: CacheEngineKey, obj: MemoryObj,
               callback: Callable[[CacheEngineKey], None] | None) -> bool:
        slot: int | None = None
        stored = False
        try:
            if self._closing or self._fd is None:
                return False
            payload = obj.byte_array.cast("B")
            size = len(payload)
            meta = json.dumps({
                "key": key.to_string(), "fmt": obj.meta.fmt.value,
                "shapes": [list(s) for s in (obj.meta.shapes or [obj.meta.shape])],
                "dtypes": [str(d) for d in (obj.meta.dtypes or [obj.meta.dtype])],
            }).encode()
            if ALIGN + size > self.slot_bytes or _FIXED.size + len(meta) > ALIGN:
                self._fail("size", "RDS KV tier %s: a %d-byte chunk does not fit a %d-byte "
                           "slot; not stored.", self.path, size, self.slot_bytes)
                return False
            with self._lock:
                slot = self._free.pop() if self._free else self._index.popitem(last=False)[1]
            buf = self._buffer()
            buf[:_FIXED.size + len(meta)] = _FIXED.pack(
                _MAGIC, len(meta), size, zlib.crc32(payload, zlib.crc32(meta))) + meta
            memoryview(buf)[ALIGN:ALIGN + size] = payload
            length = ALIGN + _align(size)
            written = os.pwrite(self._fd, memoryview(buf)[:length], slot * self.slot_bytes)
            if written != length:
                raise OSError(f"short write: {written} of {length} bytes")
            stored = True
        except Exception as e:
            self._fail("write", "RDS KV tier %s: write failed (%s); chunks are not stored "
                       "until writes succeed again.", self.path, e)
            return False
        finally:
            with self._lock:
                self._pending.discard(key)
                if stored:
                    self._index[key] = slot  # type: ignore[assignment]
                elif slot is not None:
                    self._free.append(slot)
                if not self._pending:
                    self._failing.discard("behind")
            obj.ref_count_down()
        self._ok("write")
        if callback is not None:
            try:
                callback(key)
            except Exception:
                logger.exception("RDS KV tier: put completion callback failed")
        return True

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        """`key`'s chunk, verified, in a new memory object; None on a miss."""
        with self._lock:
            slot, fd = self._index.get(key), self._fd
            if slot is None or fd is None:
                return None
            self._index.move_to_end(key)
        buf, base = self._buffer(), slot * self.slot_bytes
        try:
            if os.preadv(fd, [memoryview(buf)[:ALIGN]], base) != ALIGN:
                return self._drop(key, slot)
            magic, meta_len, size, crc = _FIXED.unpack_from(buf, 0)
            if magic != _MAGIC or _FIXED.size + meta_len > ALIGN or ALIGN + size > len(buf):
                return self._drop(key, slot)
            meta_bytes = bytes(buf[_FIXED.size:_FIXED.size + meta_len])
            length = _align(size)
            if os.preadv(fd, [memoryview(buf)[ALIGN:ALIGN + length]], base + ALIGN) != length:
                return self._drop(key, slot)
        except OSError as e:
            self._fail("read", "RDS KV tier %s: read failed (%s); treated as a miss.",
                       self.path, e)
            return None
        payload = memoryview(buf)[ALIGN:ALIGN + size]
        try:
            meta = json.loads(meta_bytes)
            shapes = [torch.Size(s) for s in meta["shapes"]]
            dtypes = [getattr(torch, d.removeprefix("torch.")) for d in meta["dtypes"]]
            fmt = MemoryFormat(meta["fmt"])
            valid = (zlib.crc32(payload, zlib.crc32(meta_bytes)) == crc
                     and meta["key"] == key.to_string() and get_size_bytes(shapes, dtypes) == size)
        except (ValueError, KeyError, TypeError, AttributeError):
            valid = False
        if not valid:
            return self._drop(key, slot)
        obj = self.get_allocator_backend().allocate(shapes, dtypes, fmt)
        if obj is not None:
            obj.byte_array.cast("B")[:] = payload
            self._ok("read", "corrupt")
        return obj

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """The chunks of `keys` up to the first miss; None from there on."""
        out: list[MemoryObj | None] = []
        for key in keys:
            out.append(self.get_blocking(key) if not out or out[-1] is not None else None)
        return out

    def get_allocator_backend(self) -> AllocatorBackendInterface:
        """LMCache's LocalCPUBackend when there is one, else this backend."""
        return self.local_cpu_backend if self.local_cpu_backend is not None else self

    def initialize_allocator(self, config: Any, metadata: Any) -> MemoryAllocatorInterface:
        return self._heap

    def get_memory_allocator(self) -> MemoryAllocatorInterface:
        return self._heap

    def allocate(self, shapes: Any, dtypes: Any, fmt: MemoryFormat | None = None,
                 eviction: bool = True, busy_loop: bool = True) -> MemoryObj | None:
        """A new CPU memory object; never None. `fmt` None: LocalCPUBackend's default."""
        if fmt is None:
            layerwise, blending = self.config.use_layerwise, self.config.enable_blending
            fmt = (MemoryFormat.KV_2LTD if not layerwise else
                   MemoryFormat.KV_2TD if blending else MemoryFormat.KV_T2D)
        return self._heap.allocate(shapes, dtypes, fmt)

    def batched_allocate(self, shapes: Any, dtypes: Any, batch_size: int,
                         fmt: MemoryFormat | None = None, eviction: bool = True,
                         busy_loop: bool = True) -> list[MemoryObj] | None:
        return [self.allocate(shapes, dtypes, fmt) for _ in range(batch_size)]  # type: ignore

    def calculate_chunk_budget(self) -> int:
        return max(self.capacity, MAX_PENDING_WRITES)

    def close(self) -> None:
        """Drop queued writes, finish the one in progress, close the file (left on disk)."""
        self._closing = True
        self._writer.shutdown(wait=True)
        with self._lock:
            fd, self._fd = self._fd, None
            self._index.clear()
        if fd is not None:
            os.close(fd)
