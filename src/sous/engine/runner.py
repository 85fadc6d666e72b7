"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

Owns the KV cache tensors and the per-request random generators. Reads scheduled requests,
never mutates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sous.engine.attention import AttentionMetadata
from sous.engine.outputs import Logprob
from sous.engine.sampler import SamplingBatch, sample
from sous.engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)


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
        for op in out.kv_cache_copy_ops:
            self.copy_slots(self.kv_caches, op.src_block_id, op.dst_block_id, op.num_tokens)
        scheduled = out.scheduled
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
        if out.grammar is not None:
            out.grammar.apply(logits, [s.request.request_id for s in rows])
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
