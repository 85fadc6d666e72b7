"""Expert parallel ranks step together: the process group and the per-step agreement.

With `--enable-expert-parallel` every MoE layer is a collective over the data parallel ranks
(`sous.models.layers.expert_parallel`), so every rank must run the same number of forward
passes, in the same order, whether it has requests or not (vLLM's dummy batches). Each step
the ranks all-reduce whether any of them runs a forward pass; a rank with nothing to run then
runs a one-token dummy pass (into the KV cache's null block) so the others' collectives
complete. While no rank has work, each polls every `IDLE_POLL_S`.

The group is torch.distributed over gloo on CPU (NCCL for the MoE collectives when CUDA is
present would be a second group; not built yet), rendezvous at the API server's address on
the port it hands out in its welcome. Collectives time out after `COLLECTIVE_TIMEOUT_S`: a
lost rank makes the others fail instead of hanging, and the API server then reports the
engine dead.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from sous.config.engine import EngineConfig
from sous.config.errors import ConfigError

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.005
"""How often idle expert parallel ranks agree that nobody has work."""
COLLECTIVE_TIMEOUT_S = 60.0


def init_dp_group(host: str, port: int, rank: int, size: int, label: str = "Expert parallel",
                  backend: str = "gloo") -> None:
    """Join a process group of `size` ranks (blocks until all have joined; `label` names it
    in the log). On a loopback address gloo is told to use the loopback interface (it
    otherwise picks the one the host name resolves to, which may not reach 127.0.0.1)."""
    if host in ("127.0.0.1", "localhost") and sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    logger.info("%s: rank %d of %d joined the %s process group at %s:%d", label, rank, size,
                backend, host, port)


def join_external_ep_group(config: EngineConfig) -> StepSync:
    """Join the expert parallel group as an external rank (`--data-parallel-rank R`: one
    server per rank, behind a router), rendezvous at --data-parallel-address and
    --data-parallel-rpc-port (rank 0 hosts it); returns the rank's StepSync. ConfigError
    naming those flags when the group does not form in time."""
    from sous.engine.dp.wire import DEFAULT_RPC_PORT

    par = config.parallel
    host = par.data_parallel_address or "127.0.0.1"
    port = par.data_parallel_rpc_port or DEFAULT_RPC_PORT
    try:
        init_dp_group(host, port, par.dp_rank, par.data_parallel_size)
    except (RuntimeError, ValueError) as e:  # torch's store errors derive from RuntimeError
        raise ConfigError(
            f"--enable-expert-parallel --data-parallel-rank {par.dp_rank}: the "
            f"{par.data_parallel_size} ranks did not meet at --data-parallel-address {host} "
            f"--data-parallel-rpc-port {port} within {COLLECTIVE_TIMEOUT_S:.0f} s ({e}); start "
            "every rank with the same flags") from e
    return StepSync()


@contextlib.contextmanager
def expert_parallel_loading(config: EngineConfig) -> Iterator[None]:
    """MoE layers built inside hold this rank's experts when expert parallel is active."""
    par = config.parallel
    if not par.expert_parallel_active:
        yield
        return
    from sous.models.layers.expert_parallel import expert_parallel

    with expert_parallel(par.dp_rank, par.data_parallel_size, dist.group.WORLD):
        yield


def log_expert_placement(model: Any) -> None:
    """Log which experts this rank holds; ConfigError naming the flag for a dense model."""
    from sous.models.layers.moe import FusedMoE

    layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m.placement]
    if not layers:
        raise ConfigError(f"--enable-expert-parallel: {type(model).__name__} has no MoE layers "
                          "whose experts could be split over the ranks (drop the flag)")
    p = layers[0].placement
    held = sum(m.w13.numel() + m.w2.numel() for m in layers)
    logger.info("Expert parallel: rank %d of %d holds routed experts %d-%d of %d in each of "
                "%d MoE layers (%d expert weights here)", p.rank, p.size, p.start, p.end - 1,
                p.num_experts, len(layers), held)


class StepSync:
    """The per-step agreement of expert parallel ranks (see the module docstring)."""

    def __init__(self) -> None:
        self._flag = torch.zeros(1, dtype=torch.int32)

    def any_rank_runs(self, runs_here: bool) -> bool:
        """True if some rank runs a forward pass this step (a collective: every rank calls
        it once per step)."""
        self._flag[0] = int(runs_here)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return bool(self._flag[0])

    @staticmethod
    def close() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
