"""Worker: the model side of the engine-core <-> worker boundary.

The engine core (scheduler, KV cache manager, output processing) never touches the model; it
asks a Worker, through an executor (`sous.engine.executor`), to load the model, to allocate
the KV cache once the core has sized it, and to run steps: `execute_model(SchedulerOutput)
-> ModelRunnerOutput`. Everything crossing the boundary is picklable, so the same Worker
runs in the engine's process or in a worker process.

The Worker owns the model, the KV cache tensors and the ModelRunner (with its persistent
input batch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sous.config.engine import EngineConfig
from sous.config.errors import ConfigError
from sous.engine.cpu_threads import CpuBinding, apply_cpu_threads
from sous.engine.dp.lockstep import expert_parallel_loading, log_expert_placement
from sous.engine.kv_cache.cache_dtype import (
    FP8_NAMES,
    apply_kv_scales,
    resolve_cache_dtype,
    with_cache_dtype,
)
from sous.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from sous.engine.spec_decode.config import resolve_speculative_config
from sous.engine.spec_decode.proposer import make_proposer
from sous.kv_transfer.base import KVConnectorRole
from sous.kv_transfer.factory import make_connector
from sous.models.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine.")
    return torch.device(name)


@dataclass
class ModelInfo:
    """What the engine core needs to know of the loaded model (everything but the weights)."""

    tokenizer: Any
    hf_config: Any
    served_model_name: str
    max_position_embeddings: int
    eos_token_ids: list[int]
    model_path: str
    kv_cache_spec: Any
    """The model's KV layout with --kv-cache-dtype applied (sizes the cache)."""
    device: str
    quantization: str | None = None
    draft_kv_cache_spec: Any = None
    """The drafter's own KV layers (EAGLE-3, MTP), allocated beside the model's (sizes the
    cache with it); None without one."""
    speculative_config: Any = None
    """`--speculative-config` resolved against the loaded drafter (k filled in); None: off."""
    extras: dict[str, Any] = field(default_factory=dict)


class Worker:
    """Loads the model on `config.device` and runs steps on it (see the module docstring)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 pp_rank: int = 0, pp_group: tuple[str, int] | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.pp_rank = pp_rank
        """This worker's pipeline stage (`--pipeline-parallel-size`; 0 of 1 without)."""
        self._pp_group = pp_group
        """Where the stages' process group meets (host, port); None: one stage."""
        self.pp_link: Any = None
        pp_size = config.parallel.pipeline_parallel_size
        if pp_group is not None and self.device.type == "cuda" and (
                torch.cuda.device_count() >= pp_size):
            self.device = torch.device("cuda", pp_rank)  # a device per stage
        self._loaded = loaded
        self.runner: Any = None
        self.loaded: LoadedModel | None = None
        self.cpu_binding: CpuBinding | None = None
        """The OpenMP CPU binding (CPU only; None: not bound), applied here, before the model
        loads, in the process and thread that builds the Worker (`sous.engine.cpu_threads`)."""
        if self.device.type == "cpu":
            par = config.parallel
            local = par.dp_size_local
            self.cpu_binding = apply_cpu_threads(
                par.cpu_threads, rank=pp_rank,
                world_size=par.tensor_parallel_size * par.pipeline_parallel_size,
                local_dp_rank=par.dp_rank - par.data_parallel_start_rank if local > 1 else None,
                local_dp_size=local)

    def load_model(self) -> ModelInfo:
        with expert_parallel_loading(self.config):
            loaded = self._loaded or load_model(self.config.model, self.config.load,
                                                self.device)
        if self.config.parallel.expert_parallel_active:
            log_expert_placement(loaded.model)
        if self._pp_group is not None:
            self._join_pipeline(loaded)
        self._loaded = None
        self.loaded = loaded
        cache_dtype = resolve_cache_dtype(self.config.cache.kv_cache_dtype,
                                          self.config.model.dtype, loaded.quantization,
                                          loaded.dtype)
        spec = with_cache_dtype(loaded.model.kv_cache_spec(), cache_dtype)
        if cache_dtype in FP8_NAMES:
            n = apply_kv_scales(loaded.model, loaded.kv_scales)
            logger.info("KV cache dtype %s: %d per-layer scales from the checkpoint (others 1.0)",
                        cache_dtype, n)
        self.kv_cache_spec = spec
        self.spec_config = resolve_speculative_config(self.config.speculative_config)
        self.draft: Any = None
        draft_spec = None
        self.aux_layers: tuple[int, ...] = ()
        if self.spec_config is not None and self.spec_config.use_eagle():
            self.draft, n_predict = self._load_drafter(loaded)
            self.spec_config = self.spec_config.with_draft_n_predict(n_predict)
            draft_spec = with_cache_dtype(self.draft.kv_cache_spec(), cache_dtype)
        self.draft_kv_cache_spec = draft_spec
        return ModelInfo(
            tokenizer=loaded.tokenizer, hf_config=loaded.hf_config,
            served_model_name=loaded.served_model_name,
            max_position_embeddings=loaded.max_position_embeddings,
            eos_token_ids=list(loaded.eos_token_ids), model_path=loaded.model_path,
            kv_cache_spec=spec, device=str(self.device), quantization=loaded.quantization,
            draft_kv_cache_spec=draft_spec, speculative_config=self.spec_config)

    def _join_pipeline(self, loaded: LoadedModel) -> None:
        """Keep this stage's share of the model and join the stages' process group."""
        from sous.engine.pp.link import StageLink
        from sous.models.pipeline import prune_to_stage

        size = self.config.parallel.pipeline_parallel_size
        if not hasattr(loaded.model, "pp_stage"):
            raise ConfigError(f"--pipeline-parallel-size {size}: {type(loaded.model).__name__} "
                              "cannot be split into pipeline stages yet")
        prune_to_stage(loaded.model, self.pp_rank, size)
        assert self._pp_group is not None
        host, port = self._pp_group
        self.pp_link = StageLink(self.pp_rank, size, host, port, self.device)

    def _load_drafter(self, loaded: LoadedModel) -> tuple[Any, int | None]:
        """The `DraftModel` of an `eagle3` / `mtp` config and its `n_predict` (None: unknown);
        sets `aux_layers` for EAGLE-3. ConfigError naming the field when it does not fit."""
        spec = self.spec_config
        assert spec is not None
        if spec.method == "mtp":
            from sous.engine.spec_decode.mtp import MTPDrafter

            if spec.model is not None and Path(spec.model).expanduser().resolve() != Path(
                    loaded.model_path).resolve():
                raise ConfigError(f"--speculative-config: method 'mtp' with model "
                                  f"{spec.model!r}: a separate MTP checkpoint is not supported "
                                  "yet (leave 'model' out to use the served model's modules)")
            drafter = MTPDrafter(loaded.model)
            return drafter, drafter.n_predict
        from sous.models.llama import LlamaForCausalLM
        from sous.models.llama_eagle3 import load_eagle3_draft

        assert spec.model is not None
        if not isinstance(loaded.model, LlamaForCausalLM):
            raise ConfigError(f"--speculative-config: method 'eagle3' needs a Llama-family "
                              f"target; {type(loaded.model).__name__} returns no aux hidden "
                              "states")
        int8 = loaded.quantization in ("gguf", "int8")
        draft, self.aux_layers = load_eagle3_draft(spec.model, loaded.model, loaded.hf_config,
                                                   self.device, int8=int8)
        logger.info("EAGLE-3 draft head %s: reads the target's layers %s%s", spec.model,
                    list(self.aux_layers), "; int8 linears" if draft.int8 else "")
        return draft, getattr(draft.config, "n_predict", None)

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate the KV cache (zeroed, so its memory is held) and build the runner."""
        from sous.engine.runner import ModelRunner

        assert self.loaded is not None, "load_model() first"
        cache = self.config.cache
        kv_caches = self.kv_cache_spec.allocate(num_blocks, cache.block_size, self.device)
        spec = self.spec_config
        k = (spec.num_speculative_tokens or 0) if spec else 0
        self.runner = ModelRunner(
            self.loaded.model, kv_caches, cache.block_size, self.device,
            seed=self.config.model.seed, max_num_reqs=self.config.scheduler.max_num_seqs,
            max_model_len=max_model_len, eos_token_ids=list(self.loaded.eos_token_ids),
            max_spec_tokens=k, num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0)
        self.runner.lockstep = self.config.parallel.expert_parallel_active
        if self.pp_link is not None:
            self.runner.pp = self.pp_link
            self.runner.lockstep = True
        if self.draft is not None:
            from sous.engine.spec_decode.eagle_proposer import EagleProposer

            draft_caches = self.draft_kv_cache_spec.allocate(num_blocks, cache.block_size,
                                                             self.device)
            self.runner.aux_hidden_state_layers = self.aux_layers
            assert spec is not None  # a drafter is loaded only for a speculative config
            self.runner.proposer = EagleProposer(
                self.draft, draft_caches, cache.block_size, k, max_model_len, self.device,
                spec.draft_confidence_threshold)
        elif spec is not None and (self.pp_link is None or self.pp_link.is_last):
            self.runner.proposer = make_proposer(spec, max_model_len)  # drafts from the tokens
        if self.config.kv_transfer_config is not None:
            connector = make_connector(self.config, KVConnectorRole.WORKER, self.kv_cache_spec,
                                       self.loaded, pp_rank=self.pp_rank)
            connector.register_kv_caches(kv_caches, cache.block_size)
            self.runner.connector = connector
            if connector.uses_layer_hooks:
                self.runner.kv_hooks = connector

    def execute_model(self, scheduler_output: SchedulerOutput,
                      sampled_token_ids: dict[str, list[int]] | None = None
                      ) -> ModelRunnerOutput:
        """Run a step. A pipeline stage before the last first appends `sampled_token_ids`
        (what the last stage sampled since the previous step) to its requests."""
        if self.cpu_binding is not None:  # steps on another thread use that thread's OpenMP pool
            self.cpu_binding.follow_current_thread()
        if sampled_token_ids and self.pp_link is not None and not self.pp_link.is_last:
            self.runner.append_sampled(sampled_token_ids)
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.runner is not None and self.runner.connector is not None:
            self.runner.connector.shutdown()
        if self.pp_link is not None:
            self.pp_link.close()
            self.pp_link = None
        self.runner = None
        self.loaded = None
