"""Expert parallel MoE layers over a real gloo process group (two processes): each rank's
`FusedMoE` holds only its block of experts, and every rank's output equals, bit for bit, the
rows a one-process layer holding every expert computes for all ranks' tokens together — with
uneven token counts, an idle rank (no tokens), DeepSeek-V3 grouped routing and MiniMax-M2
softmax routing."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sous.models.layers.expert_parallel import ExpertPlacement
from sous.models.layers.moe import FusedMoE, MoEConfig

CONFIGS = {
    "deepseek": MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16,
                          scoring_func="sigmoid", n_group=2, topk_group=1,
                          routed_scaling_factor=2.5),
    "minimax": MoEConfig(num_experts=6, top_k=2, hidden_size=32, intermediate_size=16,
                         scoring_func="softmax", has_correction_bias=False),
}
TOKENS = {"uneven": (3, 5), "idle rank": (4, 0)}


def make_layer(cfg: MoEConfig, placement: ExpertPlacement | None, group: object = None
               ) -> FusedMoE:
    """A layer with seeded weights; the checkpoint offers every expert, one tensor each."""
    g = torch.Generator().manual_seed(0)
    moe = FusedMoE(cfg, torch.float32, placement=placement, ep_group=group)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    moe.load_weight("router", torch.randn(e, h, generator=g))
    if cfg.has_correction_bias:
        moe.load_weight("correction_bias", torch.randn(e, generator=g) * 0.1)
    for expert in range(e):
        moe.load_weight("gate_proj", torch.randn(i, h, generator=g) * 0.2, expert)
        moe.load_weight("up_proj", torch.randn(i, h, generator=g) * 0.2, expert)
        moe.load_weight("down_proj", torch.randn(h, i, generator=g) * 0.2, expert)
    moe.check_loaded()
    return moe


def inputs(cfg: MoEConfig, counts: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(n, cfg.hidden_size, generator=g) for n in counts]


def _rank(rank: int, port: int, name: str, counts: tuple[int, ...], out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=len(counts))
    try:
        cfg = CONFIGS[name]
        placement = ExpertPlacement(rank, len(counts), cfg.num_experts)
        moe = make_layer(cfg, placement, dist.group.WORLD)
        assert moe.w13.shape[0] == moe.w2.shape[0] == placement.count
        x = inputs(cfg, counts)[rank]
        with torch.no_grad():
            y = moe(x)
            y2 = moe(x)  # a second layer call in the same order on every rank
        out[rank] = (y, y2, placement.start, placement.end)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("case", sorted(TOKENS))
def test_two_ranks_equal_one_layer_holding_every_expert(name: str, case: str) -> None:
    counts = TOKENS[case]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(_free_port(), name, counts, out), nprocs=len(counts), join=True)
        got = dict(out)
    cfg = CONFIGS[name]
    full = make_layer(cfg, None)
    with torch.no_grad():
        want = full(torch.cat(inputs(cfg, counts)))
    first = 0
    for rank, n in enumerate(counts):
        y, y2, start, end = got[rank]
        assert torch.equal(y, want[first:first + n]) and torch.equal(y2, y)
        first += n
    assert [got[r][2:] for r in range(2)] == [(0, cfg.num_experts // 2 + cfg.num_experts % 2),
                                              (cfg.num_experts // 2 + cfg.num_experts % 2,
                                               cfg.num_experts)]


def test_placement_blocks_and_errors() -> None:
    assert [ExpertPlacement(r, 3, 8).bounds(r) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert ExpertPlacement(1, 3, 8).local_id(4) == 1 and ExpertPlacement(1, 3, 8).local_id(2) is None
    with pytest.raises(ValueError, match="every rank needs at least one"):
        ExpertPlacement(0, 9, 8)
