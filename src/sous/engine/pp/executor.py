"""PipelineExecutor: the engine's model as N pipeline stages, one worker process each.

Stage r (`Worker(pp_rank=r)`) holds decoder layers `get_pp_indices(L, r, N)` and the KV
cache of those layers only; the first also embeds, the last also runs the final norm, the LM
head and sampling. Every step goes to every stage (one pickled message): each stage applies
it to its persistent batch, waits for the stage before it (`StageLink.recv`), runs its layers
and hands on its hidden states; only the last stage's reply carries what was sampled.

The engine keeps up to N batches in flight (`submit`, then `wait` for the oldest), so while
the last stage finishes batch k the first already runs batch k+1 (micro-batches keep every
stage busy). A request is in at most one unfinished batch that samples (its next token is
scheduled only once the last one is known), so stages other than the last learn sampled
tokens with the next step's message: `submit` carries every token sampled since the
previous submit.

A stage process that exits makes the pending `wait` raise `WorkerDiedError` within a
second; shutdown then kills every stage (those left waiting for a dead neighbour never
answer).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from sous.config.engine import EngineConfig
from sous.engine.dp.wire import free_port
from sous.engine.executor import WorkerProc, encode_call
from sous.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from sous.engine.worker import ModelInfo
from sous.models.loader import num_hidden_layers
from sous.models.pipeline import get_pp_indices

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


class PipelineExecutor:
    """See the module docstring. `submit` and `wait` are called by one thread, `wait` in
    submission order."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.parallel.pipeline_parallel_size
        get_pp_indices(num_hidden_layers(config.model), 0, size)  # fits, before any process
        self.max_concurrent_batches = size
        port = free_port(HOST)
        self._submitted = self._waited = 0
        self._sampled: dict[str, list[int]] = {}
        """Tokens sampled since the last submit (the earlier stages append them)."""
        self._transfers = StageTransfers(size)
        self._stages: list[WorkerProc] = []
        try:
            for rank in range(size):
                self._stages.append(WorkerProc(
                    config, f"sous-pp-stage{rank}",
                    {"pp_rank": rank, "pp_group": (HOST, port)}))
        except BaseException:
            self.shutdown()
            raise

    @property
    def pids(self) -> list[int | None]:
        return [s.pid for s in self._stages]

    def _all(self, method: str, *args: object) -> list[object]:
        call = encode_call(method, *args)
        for stage in self._stages:
            stage.send(call)
        return [stage.recv(method, self._stages) for stage in self._stages]

    def load_model(self) -> ModelInfo:
        """Every stage loads the model and keeps its layers. The KV cache is sized for the
        stage with the most layers (every stage holds the same number of blocks)."""
        infos: list[ModelInfo] = self._all("load_model")  # type: ignore[assignment]
        widest = max((i.kv_cache_spec for i in infos), key=lambda s: s.bytes_per_token)
        return replace(infos[-1], kv_cache_spec=widest)

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self._all("initialize_kv_cache", num_blocks, max_model_len)

    def submit(self, scheduler_output: SchedulerOutput) -> int:
        """Start a step on every stage; returns its handle for `wait`."""
        call = encode_call("execute_model", scheduler_output, self._sampled)
        self._sampled = {}
        for stage in self._stages:
            stage.send(call)
        self._submitted += 1
        return self._submitted

    def wait(self, handle: int) -> ModelRunnerOutput:
        """The output of the oldest step in flight (`handle`): the last stage's."""
        if handle != self._waited + 1:
            raise ValueError(f"steps finish in order: waiting for {self._waited + 1}, "
                             f"not {handle}")
        self._waited += 1
        replies = [stage.recv("execute_model", self._stages) for stage in self._stages]
        out: ModelRunnerOutput = replies[-1]  # type: ignore[assignment]
        out.finished_sending, out.finished_recving = self._transfers.update(replies)
        for reply in replies[:-1]:  # stages agree on failed loads; keep any stage's anyway
            for rid, valid in reply.kv_load_errors.items():
                out.kv_load_errors[rid] = min(valid, out.kv_load_errors.get(rid, valid))
        for rid, tokens in out.sampled_token_ids.items():
            self._sampled.setdefault(rid, []).extend(tokens)
        return out

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.wait(self.submit(scheduler_output))

    def shutdown(self) -> None:
        """Stop every stage; at once (no goodbye) when one has died or steps are in flight."""
        stages, self._stages = self._stages, []
        clean = self._submitted == self._waited and all(s.alive for s in stages)
        for stage in stages:
            stage.shutdown(wait_s=5.0 if clean else 0.0)


class StageTransfers:
    """KV transfers of a request finish once every stage has finished its part (each moves
    its own layers, and says so in its own step): the sets the engine sees."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self._sending: dict[str, int] = {}
        self._recving: dict[str, int] = {}

    def update(self, replies: list[ModelRunnerOutput]) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) on every stage by these replies."""
        return (self._count(self._sending, [r.finished_sending for r in replies]),
                self._count(self._recving, [r.finished_recving for r in replies]))

    def _count(self, seen: dict[str, int], finished: list[set[str]]) -> set[str]:
        done = set()
        for stage_finished in finished:
            for rid in stage_finished:
                seen[rid] = seen.get(rid, 0) + 1
                if seen[rid] == self.num_stages:
                    del seen[rid]
                    done.add(rid)
        return done
