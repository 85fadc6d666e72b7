"""The RDS storage plugin (`sous.kv_transfer.offload.rds_backend`) inside a real LMCache 0.5.6
engine on CPU, configured as the vendor recipes do (local CPU tier off, 0 bytes of it): store,
lookup and retrieve bit-exact; LRU eviction in a fixed-size file; a corrupted or truncated slot
is a miss, never wrong data; an unusable directory is one warning and a tier that stores
nothing. KV moves between small paged caches and memory objects through a minimal connector."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
torch = pytest.importorskip("torch")

L, H, D, BS, NB, CHUNK = 2, 2, 4, 16, 16, 16
CHUNK_BYTES = 2 * L * CHUNK * H * D * 4  # float32 KV_2LTD
SLOT = 4096 + 4096  # header + payload rounded up to 4096
MAX_CHUNKS = 4
RDS_LOGGER = "sous.kv_transfer.offload.rds_backend"
_names = itertools.count()


@pytest.fixture(scope="module")
def lmc():
    """LMCache's modules, imported once (the import takes seconds)."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata

    from sous.kv_transfer.offload.rds_backend import RDSBackend

    return {"Builder": LMCacheEngineBuilder, "Config": LMCacheEngineConfig,
            "Connector": GPUConnectorInterface, "Metadata": LMCacheMetadata, "RDS": RDSBackend}


class Harness:
    """One LMCache engine with the RDS plugin over `NB` paged blocks of `BS` tokens per layer."""

    def __init__(self, lmc: dict, path: Path) -> None:
        self.caches = [torch.zeros(2, NB, BS, H, D) for _ in range(L)]
        caches = self.caches

        class Conn(lmc["Connector"]):
            def get_shape(self, num_tokens):
                return torch.Size([2, L, num_tokens, H * D])

            def from_gpu(self, memory_obj, start, end, **kw):
                slots = kw["slot_mapping"][start:end]
                for layer, cache in enumerate(caches):
                    memory_obj.tensor[:, layer, :end - start] = cache.view(2, -1, H * D)[:, slots]

            def to_gpu(self, memory_obj, start, end, **kw):
                slots = kw["slot_mapping"][start:end]
                for layer, cache in enumerate(caches):
                    cache.view(2, -1, H * D)[:, slots] = memory_obj.tensor[:, layer, :end - start]

            def batched_from_gpu(self, objs, starts, ends, **kw):
                for obj, start, end in zip(objs, starts, ends, strict=True):
                    self.from_gpu(obj, start, end, **kw)

            def batched_to_gpu(self, objs=None, starts=None, ends=None, **kw):
                for obj, start, end in zip(objs, starts, ends, strict=True):
                    self.to_gpu(obj, start, end, **kw)

        config = lmc["Config"].from_defaults(
            chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0,
            storage_plugins=["RDSBackend"],
            extra_config={
                "storage_plugin.RDSBackend.module_path": "sous.kv_transfer.offload.rds_backend",
                "storage_plugin.RDSBackend.class_name": "RDSBackend",
                "storage_plugin.RDSBackend.path": str(path),
                "storage_plugin.RDSBackend.rds_max_chunks": MAX_CHUNKS})
        metadata = lmc["Metadata"](
            model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=torch.float32, kv_shape=(L, 2, CHUNK, H, D), chunk_size=CHUNK)
        self.builder = lmc["Builder"]
        self.name = f"rds-test-{next(_names)}"
        self.engine = self.builder.get_or_create(self.name, config, metadata, Conn(),
                                                 lambda t, r: None, lambda o, r: o)
        self.engine.post_init()
        self.backend = self.engine.storage_manager.storage_backends["RDSBackend"]
        self.file = path / "rds_rank0.bin"

    def store(self, tokens: torch.Tensor, slots: torch.Tensor) -> list[torch.Tensor]:
        """Fill the caches' `slots` with random KV, store them; the stored KV per layer."""
        for cache in self.caches:
            cache.view(2, -1, H * D)[:, slots] = torch.randn(2, len(slots), H * D)
        self.engine.store(tokens, slot_mapping=slots)
        return [cache.view(2, -1, H * D)[:, slots].clone() for cache in self.caches]

    def wait_stored(self, tokens: torch.Tensor, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.engine.lookup(tokens) < len(tokens):
            assert time.monotonic() < deadline, "the chunks never became visible"
            time.sleep(0.02)

    def retrieve(self, tokens: torch.Tensor, slots: torch.Tensor):
        """Zero the caches, retrieve; (mask, KV per layer at `slots`)."""
        for cache in self.caches:
            cache.zero_()
        mask = self.engine.retrieve(tokens, slot_mapping=slots)
        return mask, [cache.view(2, -1, H * D)[:, slots] for cache in self.caches]

    def close(self) -> None:
        self.builder.destroy(self.name)


@pytest.fixture
def harness(lmc, tmp_path: Path):
    made: list[Harness] = []

    def make(path: Path | None = None) -> Harness:
        made.append(Harness(lmc, path or tmp_path / "rds"))
        return made[-1]

    yield make
    for h in made:
        h.close()


@pytest.fixture(params=["tmp_path", "tmpfs"])
def rds_dir(request, tmp_path: Path):
    """The plugin's directory: pytest's tmp_path, and a tmpfs (/dev/shm) where there is one."""
    if request.param == "tmp_path":
        yield tmp_path / "rds"
        return
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    base = tempfile.mkdtemp(prefix="sous-rds-test-", dir="/dev/shm")
    yield Path(base) / "rds"
    shutil.rmtree(base, ignore_errors=True)


def test_recipe_config_store_lookup_retrieve_bit_exact(harness, lmc, rds_dir: Path) -> None:
    h = harness(rds_dir)
    manager = h.engine.storage_manager
    assert list(manager.storage_backends) == ["RDSBackend"]
    assert manager.allocator_backend is h.backend and isinstance(h.backend, lmc["RDS"])
    tokens, slots = torch.arange(100, 148), torch.arange(0, 48)
    stored = h.store(tokens, slots)
    h.wait_stored(tokens)
    assert h.engine.lookup(tokens) == 48
    assert h.engine.lookup(torch.arange(500, 548)) == 0
    mask, got = h.retrieve(tokens, slots)
    assert bool(mask.all())
    assert all(torch.equal(a, b) for a, b in zip(got, stored, strict=True))
    assert h.file.stat().st_size == MAX_CHUNKS * SLOT


def test_capacity_evicts_least_recently_used_in_a_fixed_file(harness) -> None:
    h = harness()
    old, new = torch.arange(100, 148), torch.arange(1000, 1048)
    h.store(old, torch.arange(0, 48))
    h.wait_stored(old)
    stored = h.store(new, torch.arange(48, 96))  # 3 more chunks, 4 slots: 2 old ones go
    h.wait_stored(new)
    assert h.engine.lookup(old) == 0
    assert h.file.stat().st_size == MAX_CHUNKS * SLOT
    mask, got = h.retrieve(new, torch.arange(48, 96))  # reused slots hold the new data
    assert bool(mask.all())
    assert all(torch.equal(a, b) for a, b in zip(got, stored, strict=True))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_slot_is_a_miss_never_wrong_data(harness, caplog, damage: str) -> None:
    h = harness()
    tokens, slots = torch.arange(100, 148), torch.arange(0, 48)
    stored = h.store(tokens, slots)
    h.wait_stored(tokens)
    if damage == "flip":  # slots are handed out lowest first: chunk 1 is in slot 1
        with open(h.file, "r+b") as f:
            f.seek(SLOT + 4096 + 100)
            byte = f.read(1)
            f.seek(SLOT + 4096 + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        os.truncate(h.file, SLOT + 4096 + 100)
    with caplog.at_level(logging.WARNING, logger=RDS_LOGGER):
        mask, got = h.retrieve(tokens, slots)
    assert mask.tolist() == [True] * CHUNK + [False] * 2 * CHUNK
    for a, b in zip(got, stored, strict=True):
        assert torch.equal(a[:, :CHUNK], b[:, :CHUNK])
        assert not a[:, CHUNK:].any()  # nothing written where the data was bad
    assert h.engine.lookup(tokens) == CHUNK  # the bad entry is dropped
    warnings = [r for r in caplog.records if r.name == RDS_LOGGER]
    assert len(warnings) == 1 and "corrupt or truncated" in warnings[0].getMessage()


def test_unusable_directory_warns_once_and_stores_nothing(harness, caplog, tmp_path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger=RDS_LOGGER):
        h = harness(blocker / "rds")
        for i in range(3):
            tokens = torch.arange(100 * i, 100 * i + 48)
            h.store(tokens, torch.arange(0, 48))
            assert h.engine.lookup(tokens) == 0
        mask, _ = h.retrieve(tokens, torch.arange(0, 48))
    assert not mask.any()
    warnings = [r for r in caplog.records if r.name == RDS_LOGGER]
    assert len(warnings) == 1 and "unusable" in warnings[0].getMessage()
