"""The offload connector (`LMCacheConnectorV1`, `RBLNLMCacheConnectorV1`) on LMCache's
storage engine: chunks of `chunk_size` tokens keyed as LMCache keys them, kept in its tiers
(local CPU, local disk, remote Redis, storage plugins such as RDS).

Scheduler side (engine thread): a waiting request's prompt is looked up once; the longest
run of stored chunks beyond the local prefix cache is reported as matched, and the request is
admitted with those tokens counted as computed. `build_connector_meta` plans, per step, the
loads of requests admitted this step and the saves of prompt chunks completed this step.

Worker side (same process, `ModelRunner`): `start_load_kv` retrieves the planned chunks into
the request's blocks before the forward pass (skipping tokens the device cache already
holds); a load that comes up short is reported by `get_load_errors` and the engine recomputes
from the last valid token. `wait_for_save` copies the completed chunks out after the forward
pass; LMCache writes them to disk and Redis in its own thread.

Both sides share one LMCache engine: the worker side builds it, the scheduler side finds it
by name, so both must live in one process (the `uni` executor). With pipeline stages every
stage process builds an engine for its own layers and the scheduler side looks up through
them (`stage_lookup`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sous.config.errors import ConfigError
from sous.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
    cache_planes,
)
from sous.kv_transfer.config import KVTransferConfig
from sous.kv_transfer.offload.lmcache_config import (
    describe_tiers,
    load_lmcache_config,
    prepare_lmcache_environment,
    tier_media,
)
from sous.kv_transfer.offload.lmcache_fixes import (
    RemoteWatch,
    check_hash_seed,
    destroy_engine,
    patch_disk_reads,
    patch_job_executor,
    patch_redis_close,
    quiet_lmcache_logs,
)
from sous.kv_transfer.offload.stage_lookup import (
    StageLookupClient,
    StageLookupServer,
    event_tuple,
)

if TYPE_CHECKING:
    from sous.engine.request import Request
    from sous.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class TransferSpec:
    """Tokens [0, len(token_ids)) of a request; chunks before `num_skip` are not moved, and
    tokens before `num_local` keep their device KV (slot -1) when loading."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_skip: int
    num_local: int = 0
    num_expected: int = 0
    """Loads: the tokens the scheduler counted as computed once the load is done."""


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)

    def has_loads(self) -> bool:
        return bool(self.loads)


class LMCacheOffloadConnector(KVConnectorBase):
    """See the module docstring."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole,
                 context: KVConnectorContext) -> None:
        super().__init__(config, role, context)
        prepare_lmcache_environment()
        self.instance_id = f"sous-{config.engine_id or 'offload'}"
        self.engine: Any = None
        self.stages: StageLookupClient | None = None
        """Pipeline stages: the scheduler side's way to their engines."""
        self.lookup_server: StageLookupServer | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._find_engines(config, context)
        self._lookups: dict[str, tuple[int, int]] = {}
        """Waiting request -> (LMCache hit tokens, local prefix-cache hit tokens)."""
        self._saved: dict[str, int] = {}
        """Running request -> prompt tokens stored (or planned to be) in LMCache."""
        self._blocks: dict[str, list[int]] = {}
        self._loads: list[TransferSpec] = []
        self._load_errors: dict[str, int] = {}
        self._load_warned = False
        self.watch: RemoteWatch | None = None

    # ---- scheduler side ------------------------------------------------------------------
    def _find_engines(self, config: KVTransferConfig, context: KVConnectorContext) -> None:
        """The engine the worker side built in this process, or (pipeline stages) a client
        of the stages' engines."""
        if context.world_size > 1:
            lmcache_config = load_lmcache_config()
            self.stages = StageLookupClient(context.world_size)
        else:
            from lmcache.v1.cache_engine import LMCacheEngineBuilder

            self.engine = LMCacheEngineBuilder.get(self.instance_id)
            if self.engine is None:
                raise ConfigError(f"--kv-transfer-config {config.kv_connector}: the offload "
                                  "connector runs in the engine's process; drop "
                                  "--distributed-executor-backend mp")
            lmcache_config = self.engine.config
        self.chunk_size = lmcache_config.chunk_size
        self.save_unfull_chunk = bool(lmcache_config.save_unfull_chunk)
        self.media = tier_media(lmcache_config)

    def _lookup(self, token_ids: list[int], rid: str) -> int:
        if self.stages is not None:
            return self.stages.lookup(token_ids, rid)
        return int(self.engine.lookup(tokens=token_ids, lookup_id=rid, pin=False))

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        hit = self._lookups[rid][0] if rid in self._lookups else self._lookup(
            list(request.all_token_ids), rid)
        self._lookups[rid] = (hit, num_computed_tokens)
        return max(min(hit, request.num_tokens - 1) - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        hit, local = self._lookups.pop(rid, (0, 0))
        self._saved[rid] = hit
        self._blocks[rid] = list(block_ids)
        if num_external_tokens > 0:
            self._loads.append(TransferSpec(
                rid, list(request.all_token_ids[:hit]), list(block_ids),
                num_skip=local // self.chunk_size * self.chunk_size, num_local=local,
                num_expected=local + num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             requests: list[Request]) -> KVConnectorMetadata:
        self._track_blocks(scheduler_output)
        meta = OffloadMetadata(loads=self._loads)
        self._loads = []
        for request in requests:
            rid = request.request_id
            end = min(request.num_computed_tokens, request.num_prompt_tokens)
            if not (self.save_unfull_chunk and end == request.num_prompt_tokens):
                end = end // self.chunk_size * self.chunk_size
            saved = self._saved.get(rid, 0)
            if end > saved:
                meta.saves.append(TransferSpec(rid, list(request.all_token_ids[:end]),
                                               list(self._blocks.get(rid, ())), num_skip=saved))
                self._saved[rid] = end
        return meta

    def _track_blocks(self, out: SchedulerOutput) -> None:
        for new in out.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids)
        cached = out.scheduled_cached_reqs
        for rid, resumed, new_ids in zip(cached.req_ids, cached.resumed_from_preemption,
                                         cached.new_block_ids, strict=True):
            if resumed:
                self._blocks[rid] = list(new_ids)
            else:
                self._blocks.setdefault(rid, []).extend(new_ids)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._saved.pop(rid, None)
        self._blocks.pop(rid, None)
        return False, None

    def take_events(self) -> list[list[Any]]:
        """LMCache's stored-chunk events as `BlockStored`, one per tier written (block size =
        chunk size; hashes as unsigned 64-bit, LMCache's are signed; LMCache 0.5.6 lists one
        token past the chunk, trimmed here)."""
        events = (self.stages.events() if self.stages is not None
                  else [event_tuple(e) for e in self.engine.get_kv_events()])
        return [["BlockStored", [_u64(h) for h in hashes],
                 None if parent is None else _u64(parent), tokens[:block_size], block_size,
                 lora_id, medium]
                for hashes, parent, tokens, block_size, lora_id in events
                for medium in self.media]

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_size: int) -> None:
        quiet_lmcache_logs()
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.metadata import LMCacheMetadata

        from sous.kv_transfer.offload.paged_kv_io import PagedKVIO

        config = load_lmcache_config()
        patch_redis_close()
        patch_job_executor()
        patch_disk_reads()
        check_hash_seed(config)
        if self.context.enable_kv_events:
            config.enable_kv_events = True
        ctx = self.context
        kv_size, num_slots = cache_planes(kv_caches[0])
        hidden = kv_caches[0].numel() // (kv_size * num_slots)
        metadata = LMCacheMetadata(
            model_name=ctx.model_name, world_size=ctx.world_size,
            local_world_size=ctx.world_size, worker_id=ctx.rank, local_worker_id=ctx.rank,
            kv_dtype=kv_caches[0].dtype, kv_shape=(len(kv_caches), kv_size, config.chunk_size,
                                                   1, hidden),
            use_mla=kv_size == 1, chunk_size=config.chunk_size)
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        io = PagedKVIO(kv_caches, kv_size, hidden)
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.instance_id, config, metadata, io, lambda t, r: None, lambda o, r: o)
        self.engine.post_init()
        if config.remote_url and config.remote_url.startswith(("redis://", "rediss://")):
            self.watch = RemoteWatch(config.remote_url)
        if ctx.world_size > 1:  # a pipeline stage: the scheduler looks up through us
            self.lookup_server = StageLookupServer(self.engine, ctx.rank)
        chunk_bytes = config.chunk_size * hidden * kv_size * len(kv_caches) \
            * kv_caches[0].element_size()
        logger.info("KV offload (LMCache %s, chunks of %d tokens = %.1f MiB): %s",
                    self.config.kv_connector, config.chunk_size, chunk_bytes / 2**20,
                    "; ".join(describe_tiers(config, chunk_bytes)) or "no tier")

    def _slots(self, spec: TransferSpec, num_tokens: int) -> torch.Tensor:
        blocks = torch.tensor(spec.block_ids, dtype=torch.long)
        pos = torch.arange(num_tokens, dtype=torch.long)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def start_load_kv(self) -> None:
        meta = self._metadata
        assert isinstance(meta, OffloadMetadata)
        self._load_errors = {}
        for spec in meta.loads:
            n = len(spec.token_ids)
            slots = self._slots(spec, n)
            slots[:spec.num_local] = -1
            mask = torch.ones(n, dtype=torch.bool)
            mask[:spec.num_skip] = False
            try:
                got = self.engine.retrieve(spec.token_ids, mask, slot_mapping=slots,
                                           req_id=spec.req_id)
                loaded = spec.num_skip + _leading_true(got[spec.num_skip:])
            except Exception as e:  # a tier failing mid-load is a miss, not a crash
                logger.debug("LMCache retrieve failed: %s", e)
                loaded = spec.num_skip
            if loaded < spec.num_expected:
                self._load_errors[spec.req_id] = max(spec.num_local, loaded)
                if not self._load_warned:
                    logger.warning("KV offload: a load came up short (%d of %d tokens); "
                                   "recomputing the rest (further misses logged at debug).",
                                   loaded, spec.num_expected)
                    self._load_warned = True
            else:
                self._load_warned = False

    def get_load_errors(self) -> dict[str, int]:
        return dict(self._load_errors)

    def wait_for_save(self, skip_req_ids: Iterable[str] = ()) -> None:
        meta = self._metadata
        assert isinstance(meta, OffloadMetadata)
        skip = set(skip_req_ids)
        for spec in meta.saves:
            if spec.req_id in skip:
                continue
            n = len(spec.token_ids)
            mask = torch.ones(n, dtype=torch.bool)
            mask[:spec.num_skip] = False
            try:
                self.engine.store(spec.token_ids, mask, slot_mapping=self._slots(spec, n),
                                  req_id=spec.req_id)
            except Exception as e:
                logger.debug("LMCache store failed: %s", e)

    def shutdown(self) -> None:
        if self.watch is not None:
            self.watch.close()
        if self.stages is not None:
            self.stages.close()
        if self.lookup_server is not None:
            self.lookup_server.close()
        if self.role is KVConnectorRole.WORKER and self.engine is not None:
            destroy_engine(self.instance_id)
            self.engine = None


def _leading_true(mask: torch.Tensor) -> int:
    """Length of the run of True at the start of `mask`."""
    if bool(mask.all()):
        return int(mask.numel())
    return int(torch.argmin(mask.to(torch.uint8)))


def _u64(h: int | bytes) -> int:
    return int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h & (2**64 - 1)
