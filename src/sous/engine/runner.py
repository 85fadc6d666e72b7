"""ModelRunner: applies each SchedulerOutput to its persistent input batch, runs one forward
pass over the paged KV cache and samples.

Owns the KV cache tensors, the InputBatch and every request's worker-side state (tokens,
generator). It appends the tokens it samples to that state itself; the scheduler sends a
request's token ids only once, with the new request. It never sees a scheduler `Request`.

Fault isolation: one request must not take the step (and the engine loop) down with it.
Per-request set-up (its seeded generator) is guarded per request; if the batched forward or
sampling raises, the step's requests are re-run one by one (each writes the same KV slots
with the same values; nothing is appended before a run succeeds) and only those that fail
on their own are reported in `ModelRunnerOutput.failed`. A device fault (a CUDA error: the
context is unusable afterwards) is the engine's, not a request's: it is re-raised.

Seams for the features built on it:
- `SchedulerOutput.scheduled_spec_decode_tokens`: logits at the last 1 + n positions of such
  a request (`StepInputs.logits_indices`), verified by `rejection_sample` (speculative
  sampling: greedy requests get exactly their argmax run);
- `aux_hidden_state_layers`: the model also returns those layers' hidden states (EAGLE-3);
- `proposer` (`sous.engine.spec_decode.proposer`): after sampling, drafts tokens for the
  next step (`ModelRunnerOutput.spec_token_ids`), from the step's `TargetStep` (its hidden
  states) when it `uses_target_step`; a proposer that raises costs that step's drafts only;
- `connector`: a KV connector's worker side (`sous.kv_transfer.base`): loads before the
  forward pass (a request whose load comes up short sits the step out, reported in
  `ModelRunnerOutput.kv_load_errors`) and saves after it;
- `kv_hooks`: per-layer calls before attention reads a layer's KV and after it writes it
  (a connector that moves KV layer by layer), carried to attention in the metadata;
- `pp`: a pipeline stage's `StageLink` (`sous.engine.pp`): the forward pass starts from the
  previous stage's hidden states and, before the last stage, hands its own to the next stage
  and samples nothing; such a stage learns sampled tokens through `append_sampled`.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np
import torch

from sous.engine.attention import AttentionMetadata
from sous.engine.input_batch import CachedRequestState, InputBatch
from sous.engine.kv_cache.manager import cdiv
from sous.engine.outputs import Logprob
from sous.engine.sampler import sample
from sous.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from sous.engine.spec_decode.proposer import Proposer, TargetStep
from sous.engine.spec_decode.rejection_sampler import parse_output, rejection_sample
from sous.engine.step_inputs import StepInputs, build_step_inputs
from sous.kv_transfer.base import KVConnectorBase

logger = logging.getLogger(__name__)


class KVLayerHooks(Protocol):
    """A KV connector's worker side, called by attention for each layer of a step (the
    layer is known by its cache tensor, one of the runner's `kv_caches`)."""

    def wait_for_layer_load(self, kv_cache: torch.Tensor) -> None:
        """Before the layer reads its cache: block until its loaded KV is in place."""

    def save_kv_layer(self, kv_cache: torch.Tensor) -> None:
        """After the layer wrote the step's new rows: start saving them."""


class ModelRunner:
    """See the module docstring. `max_num_reqs` rows of `max_model_len` tokens each."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        seed: int = 0,
        max_num_reqs: int = 256,
        max_model_len: int = 2048,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        max_spec_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = sorted(eos_token_ids)
        self.copy_slots = model.kv_cache_spec().copy_slots
        self.max_spec_tokens = max_spec_tokens
        row_len = max_model_len + max_spec_tokens + num_lookahead_tokens
        self.input_batch = InputBatch(max_num_reqs, row_len, cdiv(row_len, block_size))
        self.requests: dict[str, CachedRequestState] = {}
        self.proposer: Proposer | None = None
        self.connector: KVConnectorBase | None = None
        self.kv_hooks: KVLayerHooks | None = None
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.pp: Any = None
        """A pipeline stage's `StageLink` (None: the whole model runs here)."""
        self.lockstep = False
        """Expert and pipeline parallel: every forward pass is matched by the other ranks'
        (a failed step is the engine's, never re-run request by request)."""
        self._target_step: TargetStep | None = None
        """The last batched forward pass, for a proposer that `uses_target_step`."""
        torch.manual_seed(seed)

    # ---------------------------------------------------------------- request states
    def _update_states(self, so: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Apply one SchedulerOutput's diffs to the request states and the input batch. A
        new request whose set-up fails (e.g. a seed torch cannot take) goes to `failed`."""
        batch = self.input_batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            batch.remove(rid)
        if so.finished_req_ids and self.proposer is not None:
            self.proposer.finish(so.finished_req_ids)
        for rid in so.preempted_req_ids:
            batch.remove(rid)
        for new in so.scheduled_new_reqs:
            p = new.sampling_params
            batch.remove(new.req_id)
            try:
                generator = None
                if p.seed is not None and not p.greedy:
                    generator = torch.Generator(device=self.device).manual_seed(p.seed)
            except Exception as e:
                _fail(result, new.req_id, e, "set-up")
                continue
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids), p,
                                       list(new.block_ids), new.num_computed_tokens,
                                       list(new.output_token_ids), generator)
            self.requests[new.req_id] = state
            batch.add(state)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            self._update_cached(rid, cached.resumed_from_preemption[i],
                                cached.new_block_ids[i], cached.num_computed_tokens[i])
        batch.condense()

    def _update_cached(self, rid: str, resumed: bool, new_block_ids: list[int],
                       num_computed_tokens: int) -> None:
        state = self.requests[rid]
        state.num_computed_tokens = num_computed_tokens
        if resumed:
            state.block_ids = list(new_block_ids)
        else:
            state.block_ids.extend(new_block_ids)
        batch = self.input_batch
        row = batch.req_id_to_index.get(rid)
        if row is None:
            batch.add(state)
            return
        if resumed:
            batch.set_block_ids(row, state.block_ids)
        else:
            batch.append_block_ids(row, new_block_ids)
        batch.num_computed_tokens[row] = num_computed_tokens

    # ---------------------------------------------------------------- the step
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step; requests that fail on their own are in `failed` (see the module
        docstring). Raises only for faults of the engine, not of one request."""
        result = ModelRunnerOutput()
        self._update_states(so, result)
        for op in so.kv_cache_copy_ops:
            self.copy_slots(self.kv_caches, op.src_block_id, op.dst_block_id, op.num_tokens)
        req_ids = [r for r in so.num_scheduled_tokens if r in self.requests]
        connector = self.connector
        if connector is None:
            return self._run(req_ids, so, result)
        assert so.kv_connector_metadata is not None
        connector.bind_connector_metadata(so.kv_connector_metadata)
        try:
            connector.start_load_kv()
            result.kv_load_errors = connector.get_load_errors()
            if self.pp is not None and so.kv_connector_metadata.has_loads():
                # pipeline stages skip the same requests (they all see the same metadata)
                result.kv_load_errors = self.pp.agree_load_errors(result.kv_load_errors)
            req_ids = [r for r in req_ids if r not in result.kv_load_errors]
            self._run(req_ids, so, result)
            connector.wait_for_save(set(result.failed) | set(result.kv_load_errors))
            result.finished_sending, result.finished_recving = connector.get_finished(
                set(so.finished_req_ids))
            result.kv_load_errors.update(connector.get_load_errors())
            result.kv_connector_stats = connector.get_kv_connector_stats()
            return result
        finally:
            connector.clear_connector_metadata()

    def _run(self, req_ids: list[str], so: SchedulerOutput,
             result: ModelRunnerOutput) -> ModelRunnerOutput:
        """Run `req_ids`' share of the step, isolating a failing request (module docstring)."""
        if not req_ids:
            if so.forward_required:
                self.dummy_forward()
            return result
        saved = {r: s.generator.get_state() for r in req_ids
                 if (s := self.requests[r]).generator is not None}
        try:
            result.merge(self._execute(req_ids, so))
            return self._propose(result, so.drafting)
        except Exception as e:
            self._target_step = None
            if is_device_fault(e) or self.lockstep:  # a re-run would be collectives (or
                raise  # stage hand-overs) the other ranks never join
            if len(req_ids) == 1:
                _fail(result, req_ids[0], e, "step")
                return result
            logger.warning("A step of %d requests failed (%s: %s); re-running them one by one "
                           "to find the failing request.", len(req_ids), type(e).__name__, e)
        for rid, state in saved.items():  # seeded rows sample again from the same state
            gen = self.requests[rid].generator
            assert gen is not None
            gen.set_state(state)
        for rid in req_ids:
            try:
                result.merge(self._execute([rid], so))
            except Exception as e:
                if is_device_fault(e):
                    raise
                _fail(result, rid, e, "step")
        self._target_step = None  # the drafter's positions need the whole step at once
        return self._propose(result, so.drafting)

    def dummy_forward(self) -> None:
        """One token through the model, written to slot 0 of the null block (block 0, never
        a request's): an idle expert parallel rank's share of the step's collectives."""
        meta = AttentionMetadata.build(query_lens=[1], seq_lens=[1], block_tables=[[0]],
                                       block_size=self.block_size, device=self.device)
        ids = torch.zeros(1, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self.model(ids, meta.positions, self.kv_caches, meta)

    def _propose(self, result: ModelRunnerOutput, drafting: bool) -> ModelRunnerOutput:
        """The next step's drafts of the requests that sampled (module docstring); with
        `drafting` False (`SchedulerOutput.drafting`) the proposer only keeps its state."""
        proposer, target, self._target_step = self.proposer, self._target_step, None
        if proposer is None or not (result.sampled_token_ids or proposer.uses_target_step):
            return result
        try:
            result.spec_token_ids = proposer.propose(self.input_batch, result.sampled_token_ids,
                                                     target, draft=drafting)
        except Exception as e:
            if is_device_fault(e):
                raise
            logger.warning("Drafting failed (%s: %s); this step's requests decode without "
                           "drafts.", type(e).__name__, e, exc_info=e)
        return result

    def _execute(self, req_ids: list[str], so: SchedulerOutput) -> ModelRunnerOutput:
        """One forward pass and sampling over `req_ids` (a subset of `so`'s, in order).
        Request states change only once everything has succeeded."""
        inputs = build_step_inputs(self.input_batch, req_ids, so.num_scheduled_tokens,
                                   so.scheduled_spec_decode_tokens)
        meta = self._attention_metadata(inputs)
        meta.kv_hooks = self.kv_hooks
        ids = torch.from_numpy(inputs.token_ids).to(self.device)
        hidden = self._forward(ids, meta, inputs)
        result = ModelRunnerOutput()
        if hidden is None or not len(inputs.logits_indices):
            return result
        idx = torch.from_numpy(inputs.logits_indices).to(self.device)
        logits = self.model.compute_logits(hidden[idx])
        if int(inputs.num_logits.max()) > 1:
            self._verify(inputs, logits, so, result)
        else:
            self._sample(inputs, logits, so, result)
        return result

    def _forward(self, ids: torch.Tensor, meta: AttentionMetadata,
                 inputs: StepInputs) -> torch.Tensor | None:
        """The model's hidden states (None on a pipeline stage before the last); keeps the
        pass for a proposer that `uses_target_step`."""
        positions = meta.positions
        if self.pp is not None:
            return self._forward_stage(ids, meta)
        aux: list[torch.Tensor] = []
        if self.aux_hidden_state_layers:
            hidden, aux = self.model(ids, positions, self.kv_caches, meta,
                                     aux_hidden_state_layers=self.aux_hidden_state_layers)
        else:
            hidden = self.model(ids, positions, self.kv_caches, meta)
        if self.proposer is not None and self.proposer.uses_target_step:
            self._target_step = TargetStep(inputs, aux, hidden)
        return hidden

    def _forward_stage(self, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """This pipeline stage's layers, from the previous stage's hidden states (or the
        tokens); before the last stage they go on to the next one and None is returned."""
        link = self.pp
        intermediate = None if link.is_first else link.recv()
        out = self.model(ids, meta.positions, self.kv_caches, meta, intermediate=intermediate)
        if link.is_last:
            return out
        link.send(out)
        return None

    def append_sampled(self, sampled_token_ids: dict[str, list[int]]) -> None:
        """Append tokens sampled elsewhere (by the last pipeline stage) to the requests held
        here; ids no longer held are skipped."""
        batch = self.input_batch
        for rid, tokens in sampled_token_ids.items():
            state = self.requests.get(rid)
            if state is None:
                continue
            row = batch.req_id_to_index.get(rid)
            if row is None:  # out of the batch (preempted): it is re-added from its state
                state.output_token_ids.extend(tokens)
            else:
                self._append(row, state, tokens)

    def _attention_metadata(self, inputs: StepInputs) -> AttentionMetadata:
        num_blocks = inputs.num_blocks(self.block_size)
        tables = self.input_batch.block_table[inputs.rows, :max(int(num_blocks.max()), 1)]
        return AttentionMetadata.build(
            query_lens=inputs.query_lens, seq_lens=inputs.seq_lens, block_tables=tables,
            block_size=self.block_size, device=self.device)

    def _sample(self, inputs: StepInputs, logits: torch.Tensor, so: SchedulerOutput,
                result: ModelRunnerOutput) -> None:
        sampling = inputs.sampling_positions()
        states = [self.requests[inputs.req_ids[i]] for i in sampling]
        if so.grammar is not None:
            so.grammar.apply(logits, [s.req_id for s in states])
        md = self.input_batch.sampling_metadata(inputs.rows[sampling], logits.shape[1],
                                                self.device, self.eos_token_ids)
        out = sample(logits, md)
        sampled = out.sampled.tolist()
        for i, state, token in zip(sampling, states, sampled, strict=True):
            self._append(int(inputs.rows[i]), state, [token])
            result.sampled_token_ids[state.req_id] = [token]
        if out.logprobs is not None:
            _collect_logprobs(states, sampled, out.logprobs, result)

    def _verify(self, inputs: StepInputs, logits: torch.Tensor, so: SchedulerOutput,
                result: ModelRunnerOutput) -> None:
        """Verify the step's drafts with `rejection_sample` and append each request's accepted
        drafts plus its one more token. `logits` holds 1 + n rows per sampling request (n its
        drafts, `inputs.logits_indices` order); they are gathered into [R, k + 1, V] (k the
        configured draft length, so shapes do not change from step to step)."""
        sampling = inputs.sampling_positions()
        states = [self.requests[inputs.req_ids[i]] for i in sampling]
        rows = inputs.rows[sampling]
        num_logits = inputs.num_logits[sampling]
        k = max(self.max_spec_tokens, int(num_logits.max()) - 1)
        starts = np.cumsum(num_logits) - num_logits
        pos = np.minimum(np.arange(k + 1)[None, :], num_logits[:, None] - 1)
        target = logits[torch.from_numpy(starts[:, None] + pos).to(logits.device)]
        if so.grammar is not None:  # structured rows have no drafts: position 0 is theirs
            first = target[:, 0].contiguous()
            so.grammar.apply(first, [s.req_id for s in states])
            target[:, 0] = first
        batch = self.input_batch
        known = batch.num_tokens[rows]
        drafts = batch.token_ids[rows[:, None], known[:, None] + np.arange(k)[None, :]]
        md = batch.sampling_metadata(rows, logits.shape[1], self.device, self.eos_token_ids)
        out = rejection_sample(torch.from_numpy(drafts), (num_logits - 1).tolist(), target, md)
        emitted = parse_output(out)
        for row, state, tokens in zip(rows.tolist(), states, emitted, strict=True):
            self._append(row, state, tokens)
            result.sampled_token_ids[state.req_id] = tokens
        if out.logprobs is not None:
            _collect_run_logprobs(states, emitted, out.logprobs, result)

    def _append(self, row: int, state: CachedRequestState, tokens: list[int]) -> None:
        for token in tokens:
            state.output_token_ids.append(token)
            self.input_batch.append_token(row, token)


def _collect_logprobs(states: list[CachedRequestState], sampled: list[int],
                      logprobs: tuple[torch.Tensor, ...], result: ModelRunnerOutput) -> None:
    sampled_lp, rank, top_ids, top_lp = (t.tolist() for t in logprobs)
    for i, s in enumerate(states):
        k = s.sampling_params.logprobs
        if k is None:
            continue
        entry = {sampled[i]: Logprob(sampled_lp[i], rank[i])}
        for j in range(k):
            entry.setdefault(top_ids[i][j], Logprob(top_lp[i][j], j + 1))
        result.logprobs[s.req_id] = [entry]


def _collect_run_logprobs(states: list[CachedRequestState], emitted: list[list[int]],
                          logprobs: tuple[torch.Tensor, ...], result: ModelRunnerOutput) -> None:
    """`_collect_logprobs` for runs of tokens: `logprobs` per request and position."""
    token_lp, rank, top_ids, top_lp = (t.tolist() for t in logprobs)
    for i, (s, tokens) in enumerate(zip(states, emitted, strict=True)):
        k = s.sampling_params.logprobs
        if k is None:
            continue
        entries = []
        for j, token in enumerate(tokens):
            entry = {token: Logprob(token_lp[i][j], rank[i][j])}
            for r in range(k):
                entry.setdefault(top_ids[i][j][r], Logprob(top_lp[i][j][r], r + 1))
            entries.append(entry)
        result.logprobs[s.req_id] = entries


def _fail(result: ModelRunnerOutput, rid: str, e: Exception, where: str) -> None:
    logger.error("Request %s failed in its %s: %s: %s", rid, where, type(e).__name__, e,
                 exc_info=e)
    result.failed[rid] = f"{type(e).__name__}: {e}"


def is_device_fault(e: BaseException) -> bool:
    """True for errors that leave the device unusable (CUDA errors), whoever caused them."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    return isinstance(e, RuntimeError) and "CUDA error" in str(e)
