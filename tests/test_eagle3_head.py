"""EAGLE-3 head: the server's paged draft head (`sous.models.llama_eagle3`) computes what the
trainer's dense head (`sous.draft.eagle3_head`, EAGLE-3's training-time test) computes, from
the same checkpoint; checkpoint problems are ConfigErrors naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_runner import CPU, load_ours
from sous.config.errors import ConfigError
from sous.draft.eagle3_head import Eagle3Head, HeadConfig
from sous.engine.attention import AttentionMetadata
from sous.models.layers.int8_linear import Int8Linear
from sous.models.layers.qgemm_linear import qgemm_ops
from sous.models.llama_eagle3 import load_eagle3_draft
from tiny_models import make_tiny_llama, tiny_llama_config

DRAFT_VOCAB = 600


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, object]:
    path = make_tiny_llama(tmp_path_factory.mktemp("target"), num_hidden_layers=5)
    return load_ours(path), tiny_llama_config(num_hidden_layers=5)


def write_head(folder: Path, hf: object, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(HeadConfig.for_target(hf, DRAFT_VOCAB, (3, 1, 2), 10000.0))
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.08)
        ids = torch.randperm(hf.vocab_size)[:DRAFT_VOCAB].sort().values
        head.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
    head.save(folder)
    return head


def meta(query_len: int, seq_len: int, table: list[int], block_size: int) -> AttentionMetadata:
    return AttentionMetadata.build([query_len], [seq_len], np.array([table]), block_size, CPU)


@torch.inference_mode()
def test_paged_head_equals_the_training_head_step_by_step(target, tmp_path: Path) -> None:
    """Step 0 over a sequence, then a draft chain from one position (fed the true tokens, as
    training does): the server's logits equal the unrolled training head's at every step."""
    model, hf = target
    head = write_head(tmp_path / "head", hf)
    draft, aux_layers = load_eagle3_draft(str(tmp_path / "head"), model, hf, CPU)
    assert aux_layers == (1, 2, 3)  # in layer order, as the target returns them
    torch.manual_seed(1)
    n, bs, table = 24, 8, [5, 2, 7, 0]
    tokens = torch.randint(hf.vocab_size, (n,))
    aux = torch.randn(n, 3 * hf.hidden_size)
    embeds = model.model.embed_tokens.forward(tokens).float()
    dense = head.forward_ttt(embeds[1:][None], head.fc(aux[:n - 1])[None], 3)
    want = [head.lm_head(h[0]) for h in dense]

    cache = draft.kv_cache_spec().allocate(8, bs, CPU)[0]
    t = n - 1
    m = meta(t, t, table, bs)
    normed, prenorm = draft.forward(tokens[1:], m.positions,
                                    draft.combine_hidden_states(list(aux[:t].chunk(3, -1))),
                                    cache, m)
    torch.testing.assert_close(draft.lm_head.forward(normed), want[0], atol=1e-4, rtol=1e-4)
    p = 15
    hidden = prenorm[p:p + 1]
    for j in (1, 2):
        m = meta(1, p + j + 1, table, bs)
        normed, hidden = draft.forward(tokens[p + j + 1:p + j + 2], m.positions, hidden, cache, m)
        torch.testing.assert_close(draft.lm_head.forward(normed)[0], want[j][p], atol=1e-4,
                                   rtol=1e-4)
    got = draft.draft_argmax(normed)
    assert int(got) == int(head.d2t[want[2][p].argmax()] + want[2][p].argmax())


@torch.inference_mode()
def test_int8_head_swaps_only_its_own_linears_and_stays_close(target, tmp_path: Path) -> None:
    """`int8=True` (what the worker asks for under a quantised target): where the qgemm kernel
    runs, every linear of the head is W8A8 and its logits stay within int8 rounding of the
    float head's; the target's modules are left as they were."""
    model, hf = target
    write_head(tmp_path / "head", hf)
    plain, _ = load_eagle3_draft(str(tmp_path / "head"), model, hf, CPU)
    before = [(name, type(m)) for name, m in model.named_modules()]
    q, _ = load_eagle3_draft(str(tmp_path / "head"), model, hf, CPU, int8=True)
    assert [(name, type(m)) for name, m in model.named_modules()] == before
    assert not plain.int8 and q.int8 == (qgemm_ops(CPU) is not None)
    if not q.int8:
        pytest.skip("no qgemm kernel on this CPU: the head stays dense")
    attn, mlp = q.layer.self_attn, q.layer.mlp
    linears = [q.fc, q.lm_head, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    assert all(isinstance(m, Int8Linear) for m in linears)
    torch.manual_seed(2)
    t, bs, table = 20, 8, [3, 1, 6]
    tokens = torch.randint(hf.vocab_size, (t,))
    aux = list(torch.randn(t, 3 * hf.hidden_size).chunk(3, -1))
    logits = []
    for head in (plain, q):
        cache = head.kv_cache_spec().allocate(8, bs, CPU)[0]
        m = meta(t, t, table, bs)
        normed, _ = head.forward(tokens, m.positions, head.combine_hidden_states(aux), cache, m)
        logits.append(head.lm_head.forward(normed).float())
    assert float((logits[1] - logits[0]).norm() / logits[0].norm()) < 0.05


def _edit(folder: Path, config: dict | None = None, drop: str | None = None,
          tensors: dict[str, torch.Tensor] | None = None) -> None:
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(config)
        (folder / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(folder / "model.safetensors"))
    if drop:
        del weights[drop]
    weights.update(tensors or {})
    save_file(weights, str(folder / "model.safetensors"))


@pytest.mark.parametrize("change,needle", [
    ({"config": {"architectures": ["LlamaForCausalLM"]}}, "not an EAGLE-3 draft"),
    ({"drop": "d2t"}, "draft_vocab_size=600 does not map onto the target's vocabulary"),
    ({"tensors": {"d2t": torch.full((DRAFT_VOCAB,), 900)}}, "d2t maps draft ids outside"),
    ({"config": {"draft_vocab_size": 500}}, "draft_vocab_size=500"),
    ({"config": {"target_hidden_size": 128}}, "target_hidden_size=128"),
    ({"drop": "midlayer.hidden_norm.weight"}, "midlayer.hidden_norm.weight"),
    ({"config": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 9, 2]}}},
     "eagle_aux_hidden_state_layer_ids=[1, 9, 2]"),
    ({"config": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}}},
     "3 distinct layers"),
])
def test_checkpoint_problems_name_the_field(target, tmp_path: Path, change: dict,
                                            needle: str) -> None:
    model, hf = target
    write_head(tmp_path / "head", hf)
    _edit(tmp_path / "head", **change)
    with pytest.raises(ConfigError, match="--speculative-config") as e:
        load_eagle3_draft(str(tmp_path / "head"), model, hf, CPU)
    assert needle in str(e.value)


def test_a_folder_that_is_not_a_draft(target, tmp_path: Path) -> None:
    model, hf = target
    with pytest.raises(ConfigError, match="no such folder .*sous draft train"):
        load_eagle3_draft(str(tmp_path / "missing"), model, hf, CPU)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_eagle3_draft(str(tmp_path / "empty"), model, hf, CPU)
