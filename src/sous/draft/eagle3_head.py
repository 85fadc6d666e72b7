"""`Eagle3Head`: the EAGLE-3 draft head as a plain, differentiable torch module (training and
reference), with parameters named as the checkpoint the server loads
(`sous.models.llama_eagle3`): `fc`, `midlayer.*`, `norm`, `lm_head`, buffer `d2t`.

Inputs are batched `[B, T, ...]` without a KV cache. `forward_ttt` unrolls the head the way
the server drafts (EAGLE-3's training-time test): at step 0 position p reads the token at
p + 1 and the target's fused hidden state at p, causally over the sequence; at step j > 0
row p sits at position p + j, reads the token at p + j + 1 and its own pre-norm output of
step j - 1, and attends to step 0's keys at positions <= p plus its own keys of steps 1..j
(what the server's draft chain sees in its KV cache). Step j predicts the token at p + j + 2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape; `config_json` writes it in the layout vLLM's loader reads."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, int, int]

    @classmethod
    def for_target(cls, hf: Any, draft_vocab_size: int, aux_layers: tuple[int, int, int],
                   rope_theta: float) -> HeadConfig:
        """A head shaped like one layer of the target (`hf`: its Hugging Face config)."""
        heads = hf.num_attention_heads
        return cls(hf.hidden_size, hf.intermediate_size, heads,
                   getattr(hf, "num_key_value_heads", None) or heads,
                   getattr(hf, "head_dim", None) or hf.hidden_size // heads, hf.rms_norm_eps,
                   rope_theta, hf.max_position_embeddings, hf.vocab_size, draft_vocab_size,
                   hf.hidden_size, aux_layers)

    def config_json(self) -> dict[str, Any]:
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "tie_word_embeddings": False,
            "norm_before_residual": False, "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                             "use_aux_hidden_state": True},
        }


class _Norm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        d, h = c.head_dim, c.hidden_size
        self.q_proj = nn.Linear(2 * h, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.input_layernorm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)


class Eagle3Head(nn.Module):
    """See the module docstring."""

    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.c = c
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _Layer(c)
        self.norm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        d = c.head_dim
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE (Hugging Face layout) of `x` `[B, heads, T, d]` at `positions`
        `[B, T]`."""
        freqs = positions[:, None, :, None].float() * self.inv_freq
        cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-b, a], dim=-1) * sin

    def _qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v, residual) of the layer; q `[B, heads, T, d]`, k/v `[B, kv heads, T, d]`."""
        layer, c = self.midlayer, self.c
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        b, t = x.shape[:2]
        a = layer.self_attn
        q = a.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        rep = c.num_attention_heads // c.num_key_value_heads
        k = self._rope(k, positions).repeat_interleave(rep, dim=1)
        return self._rope(q, positions), k, v.repeat_interleave(rep, dim=1), hidden

    def _finish(self, attn: torch.Tensor, residual: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(post-norm, pre-norm) hidden from the attention output `[B, heads, T, d]`."""
        layer = self.midlayer
        b, _, t, _ = attn.shape
        h = layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1)) + residual
        h = layer.mlp(layer.post_attention_layernorm(h)) + h
        return self.norm(h), h

    def forward_ttt(self, embeds: torch.Tensor, fused: torch.Tensor, num_steps: int
                    ) -> list[torch.Tensor]:
        """Post-norm hidden states `[B, T, H]` of each step (module docstring; `lm_head` of
        them are the draft logits). `embeds[:, i]` is the embedding of token i + 1; step j
        reads `embeds[:, j:]` (rows past the end are padding the caller masks). `fused`:
        `fc(aux)` `[B, T, H]`."""
        b, t, _ = fused.shape
        base = torch.arange(t, device=fused.device).expand(b, t)
        scale = self.c.head_dim ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=fused.device).tril()
        hidden, out = fused, []
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        for j in range(num_steps):
            e = F.pad(embeds[:, j:], (0, 0, 0, j))
            q, k, v, residual = self._qkv(e, hidden, base + j)
            if j == 0:
                k0, v0 = k, v
            else:
                keys.append((k, v))
            scores = ((q @ k0.transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))
            if keys:
                diag = torch.stack([(q * kk).sum(-1) for kk, _ in keys], -1) * scale
                scores = torch.cat([scores, diag], -1)
            p = scores.softmax(-1)
            attn = p[..., :t] @ v0
            for m, (_, vv) in enumerate(keys):
                attn = attn + p[..., t + m, None] * vv
            normed, hidden = self._finish(attn, residual)
            out.append(normed)
        return out

    def save(self, folder: Path) -> None:
        """Write `config.json` and `model.safetensors` (the server's layout)."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.c.config_json(), indent=2) + "\n")
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(folder / "model.safetensors"))
