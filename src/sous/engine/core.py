"""EngineCore: scheduler + KV cache manager + output processor, and the model behind an
executor; stepped by a caller.

Not thread-safe: exactly one thread (the offline `LLM` caller, or `AsyncLLM`'s engine thread)
calls its methods.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
import uuid
from collections import deque
from dataclasses import replace
from typing import Any

import torch

from sous.config.engine import EngineConfig
from sous.config.errors import ConfigError
from sous.config.structured_outputs import StructuredOutputsConfig
from sous.engine.dp.lockstep import StepSync
from sous.engine.executor import make_executor
from sous.engine.kv_cache.hashing import warn_if_hashes_unshared
from sous.engine.kv_cache.manager import KVCacheManager
from sous.engine.kv_cache.sizing import (
    activation_bytes_estimate,
    budget_source,
    check_max_model_len_fits,
    num_kv_blocks,
)
from sous.engine.kv_cache.sub_block import resolve_sub_block_size
from sous.engine.output_processor import OutputProcessor, Sink
from sous.engine.request import Request, RequestStatus
from sous.engine.runner import ModelRunner
from sous.engine.sampling_params import SamplingParams
from sous.engine.scheduler import Scheduler, SchedulerStats
from sous.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from sous.engine.spec_decode.metrics import SpecDecodingLogger, SpecDecodingStats
from sous.engine.structured_output.manager import StructuredOutputManager
from sous.engine.validation import (
    INT64_MAX,
    INT64_MIN,
    RequestValidationError,
    check_prompt_token_ids,
    check_token_ids_param,
    resolve_max_tokens,
)
from sous.engine.worker import ModelInfo
from sous.kv_transfer.base import KVConnectorRole, add_counts
from sous.kv_transfer.events import KVEventsConfig, ZmqEventPublisher
from sous.kv_transfer.factory import check_placement, make_connector
from sous.models.loader import LoadedModel

logger = logging.getLogger(__name__)


def _wrap_int64(value: int) -> int:
    """`value` wrapped into the int64 range (torch seeds a generator the same either way)."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN if value > INT64_MAX else value


def resolve_max_model_len(requested: int | None, native: int) -> int:
    if requested is None:
        return native
    if requested > native:
        raise ConfigError(
            f"--max-model-len {requested} is greater than the model's context length "
            f"(max_position_embeddings={native} in its config): use at most {native}, or auto.")
    return requested


def with_engine_id(config: EngineConfig) -> EngineConfig:
    """`config` with a KV connector's `engine_id` set (a fresh UUID unless given, as vLLM):
    the connector's scheduler and worker sides find each other by it."""
    transfer = config.kv_transfer_config
    if transfer is None or transfer.get("engine_id"):
        return config
    return replace(config, kv_transfer_config={**transfer, "engine_id": uuid.uuid4().hex})


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, the model, the tokenizer: ~250k tracked objects
    for the bundled model, a 130 ms full collection here) out of the cyclic collector's
    reach, as vLLM's engine process does once it is up: collections during serving then scan
    only what serving allocates. No collection first: at this point one frees nothing and
    would add its 130 ms to start-up. Then hand the C heap's free pages back to the kernel
    (glibc's `malloc_trim`: loading leaves ~30 MB of freed temporaries resident for the
    bundled model). For processes that only serve (`sous serve`); a library caller's heap is
    left alone."""
    gc.freeze()
    _trim_c_heap()


def _trim_c_heap() -> None:
    """glibc's `malloc_trim(0)`; nothing where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


class EngineCore:
    """The engine core: scheduler, KV cache manager, structured output and output
    processing here; the model behind an executor (`execute_model(SchedulerOutput)`), in
    this process or a worker process (`--distributed-executor-backend mp`)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        check_placement(config)
        config = with_engine_id(config)
        self.config = config
        start = time.monotonic()
        self.executor = make_executor(config, loaded)
        info = self.executor.load_model()
        self.model_info = info
        self.device = torch.device(info.device)
        self.tokenizer = info.tokenizer
        self.served_model_name = info.served_model_name
        self.max_model_len = resolve_max_model_len(
            config.model.max_model_len, info.max_position_embeddings)
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.vocab_size = info.hf_config.vocab_size
        self.num_blocks = self._size_kv_cache(config, info)
        self.executor.initialize_kv_cache(self.num_blocks, self.max_model_len)
        spec, cache = info.kv_cache_spec, config.cache
        token_bytes = _bytes_per_token(info)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %d B/token, %s) on %s, "
            "from %s; max_model_len %d; engine ready in %.1f s",
            self.num_blocks, cache.block_size, (self.num_blocks - 1) * cache.block_size,
            self.num_blocks * token_bytes * cache.block_size / 2**30, token_bytes,
            str(spec.dtype).removeprefix("torch."), self.device,
            budget_source(cache, self.device), self.max_model_len, time.monotonic() - start)
        self.publisher = self._make_publisher(config)
        sub_block_size = resolve_sub_block_size(cache.block_size,
                                                config.scheduler.max_num_batched_tokens,
                                                cache.enable_prefix_caching,
                                                cache.enable_sub_block_cache)
        self.kv_cache_manager = KVCacheManager(self.num_blocks, cache.block_size,
                                               cache.enable_prefix_caching,
                                               cache.prefix_caching_hash_algo,
                                               enable_kv_events=self.publisher is not None,
                                               sub_block_size=sub_block_size)
        sched_config = replace(config.scheduler, max_model_len=self.max_model_len)
        self.scheduler = Scheduler(sched_config, self.kv_cache_manager)
        if config.kv_transfer_config is not None:
            self.scheduler.connector = make_connector(config, KVConnectorRole.SCHEDULER,
                                                      spec, info)
        self.structured_output_manager = StructuredOutputManager(
            self.tokenizer, self.vocab_size, sorted(self.eos_token_ids),
            config.scheduler.max_num_seqs,
            config=StructuredOutputsConfig.from_dict(config.structured_outputs_config))
        self.scheduler.gates.append(self.structured_output_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self.batch_queue: deque[tuple[SchedulerOutput, list[Request], Any]] = deque()
        """Batches in flight, oldest first: (batch, its requests, the executor's handle)."""
        self.spec_logger: SpecDecodingLogger | None = None
        self.step_sync: StepSync | None = None
        """Expert parallel: every step is agreed with the other data parallel ranks."""
        spec = info.speculative_config
        if spec is not None:
            assert spec.num_speculative_tokens is not None
            self.scheduler.spec_decoding = SpecDecodingStats(spec.num_speculative_tokens)
            self.scheduler.spec_disable_batch_size = spec.disable_by_batch_size
            self.scheduler.num_lookahead_tokens = spec.num_lookahead_tokens
            self.spec_logger = SpecDecodingLogger(spec.num_speculative_tokens)
            logger.info("Speculative decoding: %s, up to %d draft tokens per step",
                        spec.method, spec.num_speculative_tokens)

    def _size_kv_cache(self, config: EngineConfig, info: ModelInfo) -> int:
        """Blocks for the KV budget; ConfigError if one max_model_len sequence cannot fit."""
        hf, cache = info.hf_config, config.cache
        act = activation_bytes_estimate(hf.hidden_size, hf.vocab_size,
                                        config.scheduler.max_num_batched_tokens,
                                        config.scheduler.max_num_seqs)
        num_blocks = num_kv_blocks(cache, _bytes_per_token(info) * cache.block_size,
                                   self.device, act)
        check_max_model_len_fits(num_blocks, cache.block_size, self.max_model_len,
                                 budget_source(cache, self.device))
        return num_blocks

    @property
    def cache_info(self) -> dict[str, str]:
        """Labels of `vllm:cache_config_info` (vLLM's CacheConfig fields routers read)."""
        cache = self.config.cache
        return {"block_size": str(cache.block_size), "num_gpu_blocks": str(self.num_blocks),
                "cache_dtype": cache.kv_cache_dtype,
                "enable_prefix_caching": str(cache.enable_prefix_caching)}

    @property
    def runner(self) -> ModelRunner:
        """The model runner, when the worker runs in this process (for inspection)."""
        worker = getattr(self.executor, "worker", None)
        if worker is None:
            raise AttributeError("the model runner lives in a worker process")
        return worker.runner

    @property
    def loaded(self) -> LoadedModel:
        """The loaded model, when the worker runs in this process (for inspection)."""
        worker = getattr(self.executor, "worker", None)
        if worker is None or worker.loaded is None:
            raise AttributeError("the model lives in a worker process")
        return worker.loaded

    @staticmethod
    def _make_publisher(config: EngineConfig) -> ZmqEventPublisher | None:
        events = KVEventsConfig.from_dict(config.kv_events_config or {})
        if not events.enable_kv_cache_events or events.publisher == "null":
            return None
        if not config.cache.enable_prefix_caching:
            logger.warning("--kv-events-config: KV events describe the prefix cache, which "
                           "is disabled (--no-enable-prefix-caching): none will be published.")
            return None
        warn_if_hashes_unshared("KV events (--kv-events-config)")
        return ZmqEventPublisher(events, dp_rank=config.parallel.dp_rank)

    def _publish_events(self) -> None:
        if self.publisher is not None:
            events = self.kv_cache_manager.take_events()
            if self.scheduler.connector is not None:
                events += self.scheduler.connector.take_events()
            self.publisher.publish(events)

    # ---- requests -------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model (the rules of `sous.engine.validation`, shared
        with the server); returns the resolved max_tokens. Raises RequestValidationError.
        Caller's thread: the one that steps the engine (it may touch the grammar cache)."""
        vocab = self.vocab_size
        check_prompt_token_ids(prompt_token_ids, vocab)
        check_token_ids_param("stop_token_ids", params.stop_token_ids, vocab)
        if params.logprobs is not None and params.logprobs > vocab:
            raise RequestValidationError(
                f"logprobs must be at most the vocabulary size {vocab}, got {params.logprobs}.",
                "logprobs")
        max_tokens = resolve_max_tokens(len(prompt_token_ids), params.max_tokens,
                                        self.max_model_len)
        if params.structured_outputs is not None:
            self.structured_output_manager.validate(params.structured_outputs)
        return max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    sink: Sink, prompt: str | None = None) -> None:
        """Validate and queue a user request (n > 1: n child requests "{i}_{request_id}"
        seeded `seed + i`); raises (adding nothing) if it is invalid or its id is in use."""
        max_tokens = self.validate(prompt_token_ids, params)
        if request_id in self.output_processor.parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        children = []
        for i in range(params.n):
            child_params = params
            child_id = request_id
            if params.n > 1:
                seed = None if params.seed is None else _wrap_int64(params.seed + i)
                child_params = params.clone(n=1, seed=seed)
                child_id = f"{i}_{request_id}"
            kv_params = (params.extra_args or {}).get("kv_transfer_params")
            children.append(Request(child_id, list(prompt_token_ids), child_params,
                                    self.eos_token_ids, max_tokens,
                                    kv_transfer_params=dict(kv_params) if kv_params else None))
        self.output_processor.add_request(request_id, prompt, children, sink)
        for child in children:
            self.structured_output_manager.init_request(child)
            self.scheduler.add_request(child)

    def abort(self, request_ids: list[str], final_output: bool = False) -> None:
        """Abort user requests (parent ids): frees their KV blocks. `final_output`: first hand
        each one's sink a last output (finish_reason "abort" on its unfinished sequences), as
        for a server-side abort; otherwise (the client left) no further output."""
        if final_output:
            self._fail([(r, "aborted") for rid in request_ids
                        for c in self.output_processor.child_ids(rid)
                        if (r := self.scheduler.requests.get(c)) is not None], log=False)
        child_ids = [c for rid in request_ids for c in self.output_processor.child_ids(rid)]
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self.output_processor.remove(rid)

    def unfinished_request_ids(self) -> list[str]:
        """The user (parent) request ids with output still to come."""
        return list(self.output_processor.parents)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or batches in flight whose output is still to come."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> int:
        """One schedule -> forward -> update cycle. Returns the number of tokens computed.

        A request whose part of the step fails (the runner isolates it) is finished as
        aborted, with a final output; the other requests of the step are unaffected.

        With an executor that takes several batches at once (pipeline parallel), a step
        submits a new batch while the queue has room and otherwise finishes the oldest one
        in flight (vLLM's batch queue); it returns the tokens of the batch it handled."""
        so = self.structured_output_manager
        self._fail(so.take_failed())
        if self.max_concurrent_batches > 1:
            return self._step_with_batch_queue()
        batch = self._schedule()
        if batch is None:
            return 0
        out, scheduled = batch
        self._update(out, scheduled, self.executor.execute_model(out))
        return out.total_num_scheduled_tokens

    def _step_with_batch_queue(self) -> int:
        queue = self.batch_queue
        if len(queue) < self.max_concurrent_batches:
            batch = self._schedule(idle_wait=not queue, max_num_reqs=self._micro_batch_size())
            if batch is not None:
                out, scheduled = batch
                queue.append((out, scheduled, self.executor.submit(out)))
                if len(queue) < self.max_concurrent_batches:
                    return out.total_num_scheduled_tokens
        if not queue:
            return 0
        out, scheduled, handle = queue.popleft()
        self._update(out, scheduled, self.executor.wait(handle))
        return out.total_num_scheduled_tokens

    def _micro_batch_size(self) -> int:
        """Requests per batch when several are in flight: an equal share of the unfinished
        ones, so that every pipeline stage has a batch to run."""
        sched = self.scheduler
        return max(1, -(-(len(sched.running) + len(sched.waiting))
                        // self.max_concurrent_batches))

    def _schedule(self, idle_wait: bool = True, max_num_reqs: int | None = None,
                  ) -> tuple[SchedulerOutput, list[Request]] | None:
        """The next batch (of at most `max_num_reqs` requests) and its requests, or None when
        there is nothing to run (then, with `idle_wait`, up to 50 ms for a grammar still
        compiling)."""
        so = self.structured_output_manager
        out = self.scheduler.schedule(max_num_reqs)
        if self.step_sync is not None:  # expert parallel: a forward pass if any rank runs one
            out.forward_required = self.step_sync.any_rank_runs(
                out.total_num_scheduled_tokens > 0)
        if out.is_empty and not self.scheduler.has_pending_kv_transfers() and not (
                out.forward_required):
            if idle_wait and so.has_pending():
                so.wait_pending(timeout=0.05)
            return None
        scheduled = self.scheduler.scheduled_requests(out)
        out.grammar = so.grammar_output(scheduled)
        return out, scheduled

    def _update(self, out: SchedulerOutput, scheduled: list[Request],
                runner_out: ModelRunnerOutput) -> None:
        """Apply a finished batch: KV transfers, failures, sampled tokens, stops, events."""
        so = self.structured_output_manager
        failed = self._finish_transfers(out, runner_out)
        failed += self._rewind_failed_loads(out, runner_out.kv_load_errors)
        for request in scheduled:
            error = runner_out.failed.get(request.request_id)
            if error is not None:  # nothing of theirs is kept
                n = out.num_scheduled_tokens[request.request_id]
                self.kv_cache_manager.discard_unwritten(request, request.num_computed_tokens - n)
                failed.append((request, error))
                del out.num_scheduled_tokens[request.request_id]
        produced = self.scheduler.update_from_output(out, runner_out.sampled_token_ids,
                                                     runner_out.spec_token_ids)
        rejected = [r for r, _ in so.advance(produced)]
        for request in rejected:
            request.status = RequestStatus.FINISHED_ABORTED
        stopped = self.output_processor.process(produced, runner_out.logprobs) + rejected
        if stopped:
            self.scheduler.finish_requests([r.request_id for r in stopped],
                                           RequestStatus.FINISHED_STOPPED)
        self._fail(failed)
        self._publish_events()
        if self.spec_logger is not None and self.scheduler.spec_decoding is not None:
            self.spec_logger.maybe_log(self.scheduler.spec_decoding)

    def has_pending_kv_transfers(self) -> bool:
        """KV moves in flight with no request to run (e.g. blocks kept for a P/D reader):
        the caller keeps stepping, at a polling pace, until they are over."""
        return self.scheduler.has_pending_kv_transfers()

    def _finish_transfers(self, out: SchedulerOutput, runner_out: ModelRunnerOutput
                          ) -> list[tuple[Request, str]]:
        """Apply what the connector's worker side finished: kept blocks released, async
        loads landed (or fell short: recompute, or fail by `kv_load_failure_policy`)."""
        sched = self.scheduler
        connector = sched.connector
        if connector is None:
            return []
        connector.update_connector_output(runner_out.finished_sending,
                                          runner_out.finished_recving)
        add_counts(sched.kv_connector_stats, runner_out.kv_connector_stats)
        for rid in runner_out.finished_sending:
            sched.free_delayed(rid)
        errors = {rid: n for rid, n in runner_out.kv_load_errors.items()
                  if rid not in out.num_scheduled_tokens}
        for rid in errors:
            del runner_out.kv_load_errors[rid]
        fail = connector.config.kv_load_failure_policy == "fail"
        failed = [(entry[0], "its KV cache load failed (kv_load_failure_policy: fail)")
                  for rid in errors if fail and (entry := sched.recving.get(rid)) is not None]
        sched.finish_recving(runner_out.finished_recving, errors)
        return failed

    def _rewind_failed_loads(self, out: SchedulerOutput, errors: dict[str, int]
                             ) -> list[tuple[Request, str]]:
        """Requests whose KV load came up short sat the step out: rewind them to their valid
        tokens to recompute the rest, or (`kv_load_failure_policy` fail) fail them."""
        failed = []
        connector = self.scheduler.connector
        for rid, num_valid in errors.items():
            request = self.scheduler.requests[rid]
            self.scheduler.rewind(request, num_valid)
            del out.num_scheduled_tokens[rid]
            if connector is not None and connector.config.kv_load_failure_policy == "fail":
                failed.append((request, "its KV cache load failed "
                                        "(kv_load_failure_policy: fail)"))
        return failed

    def _fail(self, failed: list[tuple[Request, str]], log: bool = True) -> None:
        """Finish (as aborted, with a final output) requests that cannot run, e.g. whose
        grammar failed to compile or whose step raised."""
        for request, error in failed:
            if log:
                logger.error("Request %s failed: %s", request.request_id, error)
            request.status = RequestStatus.FINISHED_ABORTED
            self.output_processor.process([(request, [])], {})
        if failed:
            ids = [r.request_id for r, _ in failed]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> bool:
        ok = self.kv_cache_manager.reset_prefix_cache()
        self._publish_events()
        return ok

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
        if self.scheduler.connector is not None:  # its side only: the worker's is gone
            self.scheduler.connector.shutdown()
        if self.step_sync is not None:
            self.step_sync.close()
        if self.publisher is not None:
            self.publisher.close()


def _bytes_per_token(info: ModelInfo) -> int:
    """KV bytes per token: the model's layers and a drafter's own."""
    draft = info.draft_kv_cache_spec
    return info.kv_cache_spec.bytes_per_token + (0 if draft is None else draft.bytes_per_token)
