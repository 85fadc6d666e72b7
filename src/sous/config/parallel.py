from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sous.engine.cpu_threads import CpuThreadsEnv


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Tensor parallel ranks."""
    pipeline_parallel_size: int = 1
    """Pipeline parallel stages."""
    data_parallel_size: int = 1
    """Data parallel engine replicas."""
    data_parallel_rank: int | None = None
    """This process's data parallel rank (external launcher mode)."""
    data_parallel_address: str | None = None
    """Address of the data parallel coordinator."""
    data_parallel_rpc_port: int | None = None
    """RPC port of the data parallel coordinator."""
    enable_expert_parallel: bool = False
    """Shard MoE experts across data/tensor parallel ranks instead of tensor-splitting them."""
    distributed_executor_backend: Literal["uni", "mp", "ray", "external_launcher"] | None = None
    """Where the model runs: `uni` (default) in the engine's process, `mp` in a worker
    process (started with VLLM_WORKER_MULTIPROC_METHOD) behind the same interface."""
    worker_multiproc_method: Literal["spawn", "fork"] = "spawn"
    """How worker processes are started (from the environment variable
    VLLM_WORKER_MULTIPROC_METHOD, as in vLLM; not a flag). sous defaults to spawn: a fork
    after torch has run its OpenMP threads can deadlock the child."""
    cpu_threads: CpuThreadsEnv = CpuThreadsEnv()
    """OpenMP threads and their CPU binding on CPU (from the environment variables
    VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU and OMP_NUM_THREADS, as in
    vLLM-CPU; not flags). See `sous.engine.cpu_threads`."""
