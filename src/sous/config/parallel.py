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
    """Data parallel engine ranks: each has its own scheduler, KV cache and prefix cache; one
    API server balances requests over them by queue length and KV usage."""
    data_parallel_rank: int | None = None
    """This server's data parallel rank when an external load balancer (a router) spreads
    requests over one API server per rank: the rank offsets the KV-events port and the NIXL
    side channel port and is sent in KV event batches."""
    data_parallel_size_local: int | None = None
    """Data parallel ranks this node runs (default: all of them). Fewer: the others join
    from other machines (`--headless`) at --data-parallel-address:--data-parallel-rpc-port."""
    data_parallel_start_rank: int = 0
    """First rank this node runs (with --headless, on the nodes after the first)."""
    data_parallel_address: str | None = None
    """Address of the data parallel coordinator (the API server's node; default
    127.0.0.1)."""
    data_parallel_rpc_port: int | None = None
    """Port of the data parallel coordinator (default: a free port when every rank is
    local, else 29550)."""
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

    @property
    def dp_rank(self) -> int:
        """This engine's data parallel rank (0 without data parallelism)."""
        return self.data_parallel_rank or 0

    @property
    def expert_parallel_active(self) -> bool:
        """This engine is one rank of an expert parallel group (a data parallel rank process
        of `--data-parallel-size N --enable-expert-parallel`)."""
        return (self.enable_expert_parallel and self.data_parallel_size > 1
                and self.data_parallel_rank is not None)

    @property
    def dp_size_local(self) -> int:
        """Data parallel ranks started on this node."""
        if self.data_parallel_size_local is not None:
            return self.data_parallel_size_local
        return 1 if self.data_parallel_rank is not None else self.data_parallel_size
