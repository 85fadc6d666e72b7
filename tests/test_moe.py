"""The shared MoE layer: routing against a direct per-token reference and transformers' routers
(MiniMax-M2 sigmoid + bias, DeepSeek-V3 grouped top-k), experts against a per-expert loop and
transformers' MiniMaxM2SparseMoeBlock. float32 results agree to 1e-6 (observed ~1e-7)."""

from __future__ import annotations

import pytest
import torch

from sous.models.layers.moe import FusedMoE, MoEConfig, fused_experts, select_experts

GEN_SEED = 0


def _gen(seed: int = GEN_SEED) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ordered by expert id (top-k order is unspecified)."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _reference_routing(
    logits: torch.Tensor, bias: torch.Tensor | None, cfg: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token, straight from the definitions (ids ascending)."""
    ws, ids = [], []
    for row in logits:
        scores = row.sigmoid() if cfg.scoring_func == "sigmoid" else row.softmax(-1)
        choice = scores + (bias if bias is not None else 0.0)
        allowed = list(range(cfg.num_experts))
        if cfg.n_group:
            size = cfg.num_experts // cfg.n_group
            group_score = [
                sorted(choice[g * size : (g + 1) * size].tolist())[-2:] for g in range(cfg.n_group)
            ]
            best = sorted(range(cfg.n_group), key=lambda g: -sum(group_score[g]))[: cfg.topk_group]
            allowed = [e for e in allowed if e // size in best]
        top = sorted(sorted(allowed, key=lambda e: -choice[e].item())[: cfg.top_k])
        w = scores[top]
        if cfg.renormalize:
            w = w / w.sum()
        ws.append(w * cfg.routed_scaling_factor)
        ids.append(top)
    return torch.stack(ws), torch.tensor(ids)


@pytest.mark.parametrize(
    "cfg",
    [
        MoEConfig(num_experts=16, top_k=4, hidden_size=8, intermediate_size=8),
        MoEConfig(
            num_experts=16, top_k=4, hidden_size=8, intermediate_size=8, n_group=4, topk_group=2,
            routed_scaling_factor=2.5,
        ),
        MoEConfig(
            num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, scoring_func="softmax",
            has_correction_bias=False, renormalize=False,
        ),
    ],
    ids=["sigmoid_bias", "grouped", "softmax_plain"],
)
def test_select_experts_matches_reference(cfg: MoEConfig) -> None:
    g = _gen()
    logits = torch.randn(64, cfg.num_experts, generator=g) * 2
    bias = torch.randn(cfg.num_experts, generator=g) * 0.2 if cfg.has_correction_bias else None
    w, ids = select_experts(logits, bias, cfg)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert w.shape == ids.shape == (64, cfg.top_k)
    ref_w, ref_ids = _reference_routing(logits, bias, cfg)
    w, ids = _sorted(w, ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)
    if cfg.n_group:  # every chosen expert lies in one of the topk_group kept groups
        for row in ids // (cfg.num_experts // cfg.n_group):
            assert len(set(row.tolist())) <= cfg.topk_group


def test_bias_changes_selection_not_weights() -> None:
    cfg = MoEConfig(num_experts=4, top_k=1, hidden_size=4, intermediate_size=4)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    w, ids = select_experts(logits, bias, cfg)
    assert ids.tolist() == [[3]] and w.tolist() == [[1.0]]  # renormalised unbiased score
    cfg2 = MoEConfig(num_experts=4, top_k=2, hidden_size=4, intermediate_size=4)
    w, ids = _sorted(*select_experts(logits, bias, cfg2))
    assert ids.tolist() == [[0, 3]]
    s = logits[0].sigmoid()
    torch.testing.assert_close(w[0], torch.stack([s[0], s[3]]) / (s[0] + s[3]))


def test_grouped_topk_matches_transformers_deepseek_v3_router() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_cfg = DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )
    router = DeepseekV3TopkRouter(hf_cfg)
    g = _gen(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g) * 0.3)
        router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.2)
    x = torch.randn(50, 32, generator=g)
    with torch.no_grad():
        _, ref_w, ref_ids = router(x)
    cfg = MoEConfig(
        num_experts=16, top_k=4, hidden_size=32, intermediate_size=8, n_group=4, topk_group=2,
        routed_scaling_factor=2.5,
    )
    w, ids = select_experts(x @ router.weight.t(), router.e_score_correction_bias, cfg)
    w, ids = _sorted(w, ids)
    ref_w, ref_ids = _sorted(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)


def _expert_loop_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    out = torch.zeros_like(x, dtype=torch.float32)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = w13[e, :inter].float() @ x[t].float(), w13[e, inter:].float() @ x[t].float()
            act = torch.nn.functional.silu(gate) * up
            out[t] += weights[t, j] * (w2[e].float() @ act)
    return out


@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_fused_experts_matches_per_expert_loop(num_tokens: int) -> None:
    g = _gen(2)
    e, h, i, k = 8, 16, 12, 3
    x = torch.randn(num_tokens, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.2
    w2 = torch.randn(e, h, i, generator=g) * 0.2
    logits = torch.randn(num_tokens, e, generator=g)
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=i)
    weights, ids = select_experts(logits, None, cfg)
    got = fused_experts(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    ref = _expert_loop_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # bfloat16 activations and weights: same result to bf16 precision
    got_bf16 = fused_experts(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16.float(), ref, atol=3e-2, rtol=3e-2)


def _hf_minimax_block(seed: int = 3):
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock

    from tiny_models import tiny_minimax_m2_config

    hf_cfg = tiny_minimax_m2_config(hidden_size=32, intermediate_size=24, num_local_experts=8)
    block = MiniMaxM2SparseMoeBlock(hf_cfg).eval()
    g = _gen(seed)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(8, 32, generator=g) * 0.3)
        block.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.1)
        block.experts.gate_up_proj.copy_(torch.randn(8, 48, 32, generator=g) * 0.1)
        block.experts.down_proj.copy_(torch.randn(8, 32, 24, generator=g) * 0.1)
    return block


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_fused_moe_matches_transformers_minimax_block(layout: str) -> None:
    block = _hf_minimax_block()
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=24)
    moe = FusedMoE(cfg, torch.float32)
    moe.load_weight("router", block.gate.weight.detach())
    moe.load_weight("correction_bias", block.e_score_correction_bias)
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    if layout == "fused":
        moe.load_weight("gate_up_proj", gate_up)
        moe.load_weight("down_proj", down)
    else:
        for e in range(8):
            moe.load_weight("gate_proj", gate_up[e, :24], e)
            moe.load_weight("up_proj", gate_up[e, 24:], e)
            moe.load_weight("down_proj", down[e], e)
    moe.check_loaded()
    x = torch.randn(2, 20, 32, generator=_gen(4))
    with torch.no_grad():
        ref = block(x).reshape(40, 32)
    torch.testing.assert_close(moe(x.reshape(40, 32)), ref, atol=1e-6, rtol=0)


def test_load_weight_validation_and_check_loaded() -> None:
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=6)
    moe = FusedMoE(cfg, torch.float32)
    with pytest.raises(ValueError, match="router; correction_bias; gate_proj of experts 0, 1, 2"):
        moe.check_loaded()
    with pytest.raises(ValueError, match=r"expected shape \(6, 8\)"):
        moe.load_weight("gate_proj", torch.zeros(8, 6), 0)
    with pytest.raises(ValueError, match="unknown MoE weight kind"):
        moe.load_weight("w1", torch.zeros(6, 8), 0)
    with pytest.raises(ValueError, match="out of range"):
        moe.load_weight("up_proj", torch.zeros(6, 8), 4)
    moe.load_weight("router", torch.zeros(4, 8))
    moe.load_weight("correction_bias", torch.zeros(4))
    moe.load_weight("gate_up_proj", torch.zeros(4, 12, 8))
    for e in (0, 1, 3):
        moe.load_weight("down_proj", torch.zeros(8, 6), e)
    with pytest.raises(ValueError, match=r"down_proj of experts 2$"):
        moe.check_loaded()
    moe.load_weight("down_proj", torch.ones(8, 6), 2)
    moe.check_loaded()
    assert torch.equal(moe.w2[2], torch.ones(8, 6)) and not moe.w2[0].any()
    no_bias = FusedMoE(
        MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=6,
                  has_correction_bias=False), torch.float32)
    assert no_bias.e_score_correction_bias is None
    with pytest.raises(ValueError, match="no correction bias"):
        no_bias.load_weight("correction_bias", torch.zeros(4))


def test_moe_config_validation() -> None:
    with pytest.raises(ValueError, match="not supported yet"):
        MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, scoring_func="relu")
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(num_experts=4, top_k=5, hidden_size=8, intermediate_size=8)
    with pytest.raises(ValueError, match="topk_group"):
        MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, n_group=4)


def _no_host_sync(*args: object, **kwargs: object) -> None:
    raise AssertionError("host sync (.tolist()/.item()) inside the MoE forward")


def test_moe_forward_never_syncs_with_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The routed-experts forward reads no tensor value on the host, so it never waits on
    the device (checked on CPU by making .tolist()/.item() raise while it runs)."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)
    moe = FusedMoE(cfg, torch.float32)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(9, 32)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", _no_host_sync)
        m.setattr(torch.Tensor, "item", _no_host_sync)
        out = moe(x)
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_grouped_and_per_expert_paths_are_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    from sous.models.layers import moe as moe_mod

    torch.manual_seed(1)
    e, h, i, t, k = 8, 32, 16, 37, 3
    x = torch.randn(t, h)
    w13, w2 = torch.randn(e, 2 * i, h) / 6, torch.randn(e, h, i) / 4
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[:, 0] = 5  # one busy expert; some experts get no token at all
    weights = torch.rand(t, k)
    grouped = fused_experts(x, w13, w2, weights, ids)
    monkeypatch.setitem(moe_mod._GROUPED_MM_OK, ("cpu", torch.float32), False)
    loop = fused_experts(x, w13, w2, weights, ids)
    assert torch.equal(grouped, loop)
