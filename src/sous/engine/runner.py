"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

Owns the KV cache tensors and the per-request random generators. Reads scheduled requests,
never mutates them.

Fault isolation: one request must not take the step (and the engine loop) down with it.
Per-request set-up (its seeded generator) is guarded per request; if the batched forward or
sampling raises, the step's requests are re-run one by one (each writes the same KV slots
with the same values) and only those that fail on their own are reported in
`ModelRunnerOutput.failed`. A device fault (a CUDA error: the context is unusable
afterwards) is the engine's, not a request's: it is re-raised and ends the engine loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from sous.engine.attention import AttentionMetadata
from sous.engine.outputs import Logprob
from sous.engine.sampler import SamplingBatch, sample
from sous.engine.scheduler import ScheduledRequest, SchedulerOutput
from sous.engine.structured_output.bitmask import GrammarOutput

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    """Requests whose part of the step raised (id -> error): they produced nothing, their
    new KV slots are not valid, and the caller must finish them (aborted)."""

    def merge(self, other: ModelRunnerOutput) -> None:
        self.sampled_token_ids.update(other.sampled_token_ids)
        self.logprobs.update(other.logprobs)
        self.failed.update(other.failed)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.generators: dict[str, torch.Generator] = {}
        self.copy_slots = model.kv_cache_spec().copy_slots
        torch.manual_seed(seed)

    def remove_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)

    def _generator(self, s: ScheduledRequest) -> torch.Generator | None:
        seed = s.request.sampling_params.seed
        if seed is None or s.request.sampling_params.greedy:
            return None
        rid = s.request.request_id
        if rid not in self.generators:
            self.generators[rid] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[rid]

    def _set_up(self, scheduled: list[ScheduledRequest], result: ModelRunnerOutput,
                ) -> list[ScheduledRequest]:
        """Per-request set-up (seeded generators); a request whose set-up raises is failed
        and left out of the step. Returns the requests that go ahead."""
        ready = []
        for s in scheduled:
            try:
                self._generator(s)
            except Exception as e:  # e.g. a seed torch cannot take
                _fail(result, s, e, "set-up")
                continue
            ready.append(s)
        return ready

    def _sampling_batch(self, rows: list[ScheduledRequest]) -> SamplingBatch:
        banned = []
        for s in rows:
            r = s.request
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                eos = [] if p.ignore_eos else sorted(r.eos_token_ids)
                banned.append(eos + list(p.stop_token_ids))
            else:
                banned.append([])
        return SamplingBatch(
            params=[s.request.sampling_params for s in rows],
            generators=[self._generator(s) for s in rows],
            prompt_token_ids=[s.request.prompt_token_ids for s in rows],
            output_token_ids=[s.request.output_token_ids for s in rows],
            stop_ids_for_min_tokens=banned,
        )

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step; requests that fail on their own are in `failed` (see the module
        docstring). Raises only for faults of the engine, not of one request."""
        for op in out.kv_cache_copy_ops:
            self.copy_slots(self.kv_caches, op.src_block_id, op.dst_block_id, op.num_tokens)
        result = ModelRunnerOutput()
        scheduled = self._set_up(out.scheduled, result)
        if not scheduled:
            return result
        states = self._generator_states(scheduled)
        try:
            result.merge(self._execute(scheduled, out.grammar))
            return result
        except Exception as e:
            if is_device_fault(e):
                raise
            if len(scheduled) == 1:
                _fail(result, scheduled[0], e, "step")
                return result
            logger.warning("A step of %d requests failed (%s: %s); re-running them one by one "
                           "to find the failing request.", len(scheduled), type(e).__name__, e)
        for rid, state in states.items():  # seeded rows sample again from the same state
            self.generators[rid].set_state(state)
        for s in scheduled:
            try:
                result.merge(self._execute([s], out.grammar))
            except Exception as e:
                if is_device_fault(e):
                    raise
                _fail(result, s, e, "step")
        return result

    def _generator_states(self, scheduled: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
        """The state of every seeded generator of the step (restored before a re-run)."""
        return {s.request.request_id: self.generators[s.request.request_id].get_state()
                for s in scheduled if s.request.request_id in self.generators}

    def _execute(self, scheduled: list[ScheduledRequest],
                 grammar: GrammarOutput | None) -> ModelRunnerOutput:
        """One forward pass and sampling over `scheduled`."""
        input_ids: list[int] = []
        for s in scheduled:
            input_ids.extend(s.input_token_ids)
        meta = AttentionMetadata.build(
            query_lens=[s.num_scheduled_tokens for s in scheduled],
            seq_lens=[s.num_computed_tokens + s.num_scheduled_tokens for s in scheduled],
            block_tables=[s.block_ids for s in scheduled],
            block_size=self.block_size,
            device=self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, meta.positions, self.kv_caches, meta)
        sample_rows = [i for i, s in enumerate(scheduled) if s.samples]
        result = ModelRunnerOutput()
        if not sample_rows:
            return result
        if len(sample_rows) == len(scheduled):
            last = meta.logits_indices
        else:
            last = meta.logits_indices[torch.tensor(sample_rows, device=self.device)]
        logits = self.model.compute_logits(hidden[last])
        rows = [scheduled[i] for i in sample_rows]
        if grammar is not None:
            grammar.apply(logits, [s.request.request_id for s in rows])
        batch = self._sampling_batch(rows)
        sampler_out = sample(logits, batch)
        sampled = sampler_out.sampled.tolist()
        for s, token in zip(rows, sampled, strict=True):
            result.sampled_token_ids[s.request.request_id] = [token]
        if sampler_out.logprobs is not None:
            self._collect_logprobs(rows, sampled, sampler_out.logprobs, result)
        return result

    @staticmethod
    def _collect_logprobs(rows, sampled, logprobs, result: ModelRunnerOutput) -> None:
        sampled_lp, rank, top_ids, top_lp = (t.tolist() for t in logprobs)
        for i, s in enumerate(rows):
            k = s.request.sampling_params.logprobs
            if k is None:
                continue
            entry = {sampled[i]: Logprob(sampled_lp[i], rank[i])}
            for j in range(k):
                entry.setdefault(top_ids[i][j], Logprob(top_lp[i][j], j + 1))
            result.logprobs[s.request.request_id] = [entry]


def _fail(result: ModelRunnerOutput, s: ScheduledRequest, e: Exception, where: str) -> None:
    rid = s.request.request_id
    logger.error("Request %s failed in its %s: %s: %s", rid, where, type(e).__name__, e,
                 exc_info=e)
    result.failed[rid] = f"{type(e).__name__}: {e}"


def is_device_fault(e: BaseException) -> bool:
    """True for errors that leave the device unusable (CUDA errors), whoever caused them."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    return isinstance(e, RuntimeError) and "CUDA error" in str(e)
