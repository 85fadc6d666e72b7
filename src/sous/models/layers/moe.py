"""Routed mixture-of-experts: router scores -> top-k experts -> SwiGLU experts, summed.

Shared by MiniMax-M2 and the DeepSeek-V3 family; shared experts are the model's business.

Numerics follow transformers 5.24 (`MiniMaxM2TopKRouter`, `DeepseekV3TopkRouter`,
`MixtralTopKRouter` and their eager experts loop):

* router logits are `x @ gate_weight^T` in the router dtype (float32 for DeepSeek, whose gate is
  kept in float32; the model dtype for MiniMax-M2), then scored in float32 (sigmoid or softmax);
* the correction bias is added to the scores for *selection* only; the weights are the unbiased
  scores of the chosen experts, renormalised (`/ (sum + 1e-20)`) and multiplied by
  `routed_scaling_factor`;
* grouped top-k (DeepSeek-V3 `n_group`): each group scores the sum of its two best biased
  scores, the best `topk_group` groups are kept, the others' experts are masked to -inf;
* each expert's output is multiplied by its float32 weight, cast to the activation dtype and
  accumulated into a zero tensor of that dtype, in increasing expert id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sous.models.layers.activation import silu_and_mul
from sous.models.layers.expert_parallel import (
    ExpertPlacement,
    current_placement,
    ep_moe_forward,
)


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    """Per routed expert."""
    scoring_func: str = "sigmoid"
    """"sigmoid" | "softmax"."""
    has_correction_bias: bool = True
    """`e_score_correction_bias` is added to the scores for selection only."""
    n_group: int | None = None
    """Grouped top-k (DeepSeek): top-2-sum per group, keep `topk_group` groups."""
    topk_group: int | None = None
    dropped_group_score: float = float("-inf")
    """Choice score of experts outside the kept groups: -inf (DeepSeek-V3) or 0.0 (A.X-K2's
    reference, where a negative biased score can then lose to a dropped expert)."""
    renormalize: bool = True
    """`norm_topk_prob`."""
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(
                f"MoE scoring function {self.scoring_func!r} is not supported yet "
                "(sigmoid, softmax)"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..num_experts ({self.num_experts})")
        if self.n_group and self.n_group > 1:
            if self.num_experts % self.n_group:
                raise ValueError(
                    f"{self.num_experts} experts do not split into {self.n_group} groups"
                )
            if not self.topk_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group must be in 1..n_group, got {self.topk_group}")


def _group_mask(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Bool `[T, E]`: True for experts in each token's `topk_group` best groups."""
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)
    group_scores = grouped.topk(min(2, e // n_group), dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return keep.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)


def select_experts(
    router_logits: torch.Tensor, correction_bias: torch.Tensor | None, cfg: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 router logits `[T, E]` -> `(topk_weights float32 [T, k], topk_ids int64 [T, k])`.

    The weights include renormalisation and `routed_scaling_factor` (see module docstring).
    `correction_bias` `[E]` (float32) only shifts the selection; None means no bias."""
    logits = router_logits.float()
    scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias
    if cfg.n_group and cfg.n_group > 1:
        assert cfg.topk_group is not None
        keep = _group_mask(choice, cfg.n_group, cfg.topk_group)
        choice = choice.masked_fill(~keep, cfg.dropped_group_score)
    topk_ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if cfg.renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * cfg.routed_scaling_factor
    return topk_weights, topk_ids


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])` for every token.

    x `[T, H]`, w13 `[E, 2I, H]` (gate rows then up rows), w2 `[E, H, I]`, topk_* `[T, k]`
    -> `[T, H]` in x's dtype. Token-expert pairs are sorted by expert id; the experts run as
    two grouped matmuls over those contiguous runs (`torch._grouped_mm` with the runs' end
    offsets), SiLU(gate) * up between them; the weighted rows are accumulated with one
    `index_add_`. No host sync: the group sizes stay on the device. Where the grouped matmul
    has no kernel for the device and dtype, one matmul per expert runs instead (that path
    reads the per-expert counts on the host), and also where a row is not a multiple of 16
    bytes, which the grouped matmul requires."""
    k = topk_ids.shape[1]
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_idx = order // k
    weights = topk_weights.reshape(-1).index_select(0, order)
    counts = torch.bincount(flat_ids, minlength=num_experts)
    ys = expert_rows(x.index_select(0, token_idx), w13, w2, weights, counts)
    out = torch.zeros_like(x)
    out.index_add_(0, token_idx, ys)
    return out


def expert_rows(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
    """The weighted expert outputs of rows `xs` `[N, H]` sorted by expert: the first
    `counts[0]` rows go through expert 0 of `w13`/`w2`, the next `counts[1]` through expert 1,
    and so on; each output row times its float32 weight, in xs's dtype (see `fused_experts`)."""
    row_bytes = w2.shape[2] * xs.element_size()  # I; H and 2I follow for the usual shapes
    aligned = row_bytes % 16 == 0 and xs.shape[1] * xs.element_size() % 16 == 0
    if aligned and xs.shape[0] and _grouped_mm_works(xs.device, xs.dtype):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        act = silu_and_mul(torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs))
        ys = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
        return (ys * weights[:, None]).to(xs.dtype)
    return _experts_loop(xs, w13, w2, weights, counts)


def _experts_loop(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  counts: torch.Tensor) -> torch.Tensor:
    """The per-expert fallback of `fused_experts` over rows sorted by expert."""
    ys = torch.empty((xs.shape[0], w2.shape[1]), dtype=xs.dtype, device=xs.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        end = start + n
        act = silu_and_mul(torch.mm(xs[start:end], w13[e].t()))
        y = torch.mm(act, w2[e].t())
        ys[start:end] = (y * weights[start:end, None]).to(xs.dtype)
        start = end
    return ys


_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


def _grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs for this device type and dtype, exactly (tried once on
    a small problem against per-group matmuls, then remembered)."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_OK:
        try:
            a = torch.arange(32, dtype=dtype, device=device).view(4, 8) / 8
            b = torch.arange(128, dtype=dtype, device=device).view(2, 8, 8) / 64
            offs = torch.tensor([1, 4], dtype=torch.int32, device=device)
            got = torch._grouped_mm(a, b, offs=offs)
            want = torch.cat([a[:1] @ b[0], a[1:4] @ b[1]])
            _GROUPED_MM_OK[key] = bool(torch.allclose(got, want))
        except (RuntimeError, NotImplementedError, AttributeError):
            _GROUPED_MM_OK[key] = False
    return _GROUPED_MM_OK[key]


_PER_EXPERT = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}


class FusedMoE(nn.Module):
    """Router + routed experts (shared experts are the model's business).

    Parameters: `gate_weight` `[E, H]` in `router_dtype` (float32 unless the model's reference
    computes its router in the model dtype), `e_score_correction_bias` `[E]` float32 (when
    `cfg.has_correction_bias`), `w13` `[E, 2I, H]` and `w2` `[E, H, I]` in `dtype`. Weights
    arrive through `load_weight`; `check_loaded` says what is still missing.
    `forward(x [T, H]) -> [T, H]`."""

    def __init__(
        self,
        cfg: MoEConfig,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        router_dtype: torch.dtype = torch.float32,
        placement: ExpertPlacement | None = None,
        ep_group: Any = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        if placement is None:
            placement, ep_group = current_placement(cfg.num_experts)
        self.placement = placement
        """Expert parallel: the block of routed experts this rank holds (None: all of them)."""
        self.ep_group = ep_group
        h, i = cfg.hidden_size, cfg.intermediate_size
        e = cfg.num_experts if placement is None else placement.count

        def param(shape: tuple[int, ...], dt: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dt, device=device), requires_grad=False)

        self.gate_weight = param((cfg.num_experts, h), router_dtype)
        self.e_score_correction_bias = (
            param((cfg.num_experts,), torch.float32) if cfg.has_correction_bias else None
        )
        self.w13 = param((e, 2 * i, h), dtype)
        self.w2 = param((e, h, i), dtype)
        self._router_loaded = False
        self._bias_loaded = False
        self._expert_loaded = torch.zeros((e, 3), dtype=torch.bool)
        """Per expert held here: gate rows, up rows, down loaded."""

    # ---------------------------------------------------------------- weights
    def load_weight(self, kind: str, w: torch.Tensor, expert_id: int | None = None) -> None:
        """Copy one checkpoint tensor in. `kind`: "router" `[E, H]`, "correction_bias" `[E]`,
        "gate_proj" / "up_proj" `[I, H]` and "down_proj" `[H, I]` of expert `expert_id`, or fused
        over all experts (`expert_id` None): "gate_up_proj" `[E, 2I, H]`, "down_proj"
        `[E, H, I]`. Raises ValueError on an unknown kind or a shape mismatch."""
        i = self.cfg.intermediate_size
        if kind == "router":
            self._copy(self.gate_weight, w, kind)
            self._router_loaded = True
        elif kind == "correction_bias":
            if self.e_score_correction_bias is None:
                raise ValueError("this MoE layer has no correction bias (has_correction_bias off)")
            self._copy(self.e_score_correction_bias, w, kind)
            self._bias_loaded = True
        elif expert_id is None and kind == "gate_up_proj":
            self._copy(self.w13, self._held(w), kind)
            self._expert_loaded[:, :2] = True
        elif expert_id is None and kind == "down_proj":
            self._copy(self.w2, self._held(w), kind)
            self._expert_loaded[:, 2] = True
        elif expert_id is not None and kind in _PER_EXPERT:
            if not 0 <= expert_id < self.cfg.num_experts:
                raise ValueError(f"expert id {expert_id} out of range "
                                 f"0..{self.cfg.num_experts - 1}")
            e = expert_id if self.placement is None else self.placement.local_id(expert_id)
            if e is None:
                return  # another expert parallel rank holds it
            part = _PER_EXPERT[kind]
            dst = self.w2[e] if part == 2 else self.w13[e, part * i : (part + 1) * i]
            self._copy(dst, w, f"{kind} of expert {e}")
            self._expert_loaded[e, part] = True
        else:
            raise ValueError(f"unknown MoE weight kind {kind!r} (expert_id={expert_id})")

    def _held(self, w: torch.Tensor) -> torch.Tensor:
        """The experts this rank holds of a tensor over all of them (dim 0)."""
        if self.placement is None or w.shape[0] != self.cfg.num_experts:
            return w
        return w[self.placement.start:self.placement.end]

    @staticmethod
    def _copy(dst: torch.Tensor, w: torch.Tensor, what: str) -> None:
        if tuple(w.shape) != tuple(dst.shape):
            raise ValueError(f"MoE {what}: expected shape {tuple(dst.shape)}, got {tuple(w.shape)}")
        with torch.no_grad():
            dst.copy_(w.to(device=dst.device, dtype=dst.dtype))

    def check_loaded(self) -> None:
        """Raise ValueError naming whatever has not been loaded yet."""
        missing = []
        if not self._router_loaded:
            missing.append("router")
        if self.e_score_correction_bias is not None and not self._bias_loaded:
            missing.append("correction_bias")
        for part, name in enumerate(_PER_EXPERT):
            first = 0 if self.placement is None else self.placement.start
            held = (~self._expert_loaded[:, part]).nonzero().flatten().tolist()
            absent = [first + e for e in held]
            if absent:
                shown = ", ".join(map(str, absent[:8])) + (" ..." if len(absent) > 8 else "")
                missing.append(f"{name} of experts {shown}")
        if missing:
            raise ValueError(f"MoE weights not loaded: {'; '.join(missing)}")

    # ---------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, H]` -> routed experts' weighted sum `[T, H]` in x's dtype. With a placement
        every rank of `ep_group` must call this together (`ep_moe_forward`)."""
        if self.placement is not None and self.placement.size > 1:
            return ep_moe_forward(x, self, self.placement, self.ep_group)
        logits = F.linear(x.to(self.gate_weight.dtype), self.gate_weight).float()
        weights, ids = select_experts(logits, self.e_score_correction_bias, self.cfg)
        return fused_experts(x, self.w13, self.w2, weights, ids)
