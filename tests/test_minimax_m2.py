"""sous' MiniMax-M2 on the paged KV cache against transformers' MiniMaxM2ForCausalLM (float32).

The tiny checkpoint (tests/tiny_models.py): hidden 64, 3 layers, GQA 4 q / 2 kv heads x 16,
partial rotary 8 of 16, full-width QK norm, 8 experts top-2 with a random correction bias.
Tolerance: logits within atol 1e-4 (observed ~1e-6); greedy generation token-identical.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
import torch

from sous.config.load import LoadConfig
from sous.config.model import ModelConfig
from sous.models.loader import load_model
from sous.models.minimax_m2 import MiniMaxM2ForCausalLM
from test_llama import PagedRunner
from tiny_models import MINIMAX_MTP_NAMES, make_tiny_minimax_m2

CPU = torch.device("cpu")
ATOL = 1e-4


@cache  # models are read-only here: one load per checkpoint for the module
def _hf(path: Path):
    from transformers import MiniMaxM2ForCausalLM as HFMiniMaxM2

    return HFMiniMaxM2.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return _hf(path)(torch.tensor([ids])).logits[0]


@cache
def _ours(path: Path) -> MiniMaxM2ForCausalLM:
    model = load_model(ModelConfig(model=str(path), dtype="float32"), LoadConfig(), CPU).model
    assert isinstance(model, MiniMaxM2ForCausalLM)
    return model


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_minimax_m2(tmp_path_factory.mktemp("mm"))


def test_full_prefill_matches_transformers(tiny: Path) -> None:
    ids = _ids(40, 1)
    ours = PagedRunner(_ours(tiny), block_size=16).step({0: ids})[0]
    torch.testing.assert_close(ours, _hf_logits(tiny, ids), atol=ATOL, rtol=0)


def test_bfloat16_close_to_transformers_bfloat16(tiny: Path) -> None:
    """bf16 weights and activations, bf16 router and bias as in transformers: logits within
    a few bf16 ulps (atol 0.06 at |logit| < 4; observed 0.02), same argmax."""
    from transformers import MiniMaxM2ForCausalLM as HFMiniMaxM2

    ids = _ids(40, 1)
    hf = HFMiniMaxM2.from_pretrained(tiny, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    model = load_model(ModelConfig(model=str(tiny), dtype="bfloat16"), LoadConfig(), CPU).model
    ours = PagedRunner(model, block_size=16).step({0: ids})[0]
    torch.testing.assert_close(ours, ref, atol=0.06, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_then_decode(tiny: Path, block_size: int) -> None:
    ids = _ids(48, 2)
    ref = _hf_logits(tiny, ids)
    runner = PagedRunner(_ours(tiny), block_size=block_size)
    pos = 0
    for size in [5, 3, 9, 1, 14]:  # chunks straddle block boundaries for both block sizes
        got = runner.step({0: ids[pos : pos + size]})[0]
        torch.testing.assert_close(got, ref[pos : pos + size], atol=ATOL, rtol=0)
        pos += size
    while pos < len(ids):
        got = runner.step({0: [ids[pos]]})[0]
        torch.testing.assert_close(got, ref[pos : pos + 1], atol=ATOL, rtol=0)
        pos += 1


def test_mixed_batch_matches_transformers(tiny: Path) -> None:
    """Prefill chunks and decodes of several sequences in one step: routing is per token."""
    seqs = {s: _ids(n, 10 + s) for s, n in {0: 22, 1: 18, 2: 25}.items()}
    refs = {s: _hf_logits(tiny, ids) for s, ids in seqs.items()}
    runner = PagedRunner(_ours(tiny), block_size=4)
    done = dict.fromkeys(seqs, 0)
    for plan in [{0: 12, 1: 17}, {1: 1, 2: 9, 0: 1}, {2: 16, 0: 9}]:
        out = runner.step({s: seqs[s][done[s] : done[s] + n] for s, n in plan.items()})
        for s, n in plan.items():
            torch.testing.assert_close(out[s], refs[s][done[s] : done[s] + n], atol=ATOL, rtol=0)
            done[s] += n
    assert done == {0: 22, 1: 18, 2: 25}


def test_greedy_generation_matches_transformers_generate(tiny: Path) -> None:
    """32 greedy tokens through `LLM` with 16-token step budgets (chunked prefill), block 16."""
    from sous import LLM, SamplingParams

    prompts = [_ids(37, 20), _ids(9, 21), _ids(21, 22)]
    hf = _hf(tiny)
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32,
                              do_sample=False)
            expected.append(out[0, len(p):].tolist())
    llm = LLM(str(tiny), dtype="float32", max_model_len=256, block_size=16,
              max_num_batched_tokens=16, kv_cache_memory_bytes=4 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert len(set(map(tuple, expected))) == 3


def test_mtp_weights_loaded_into_mtp_submodule(tmp_path: Path, tiny: Path) -> None:
    path = make_tiny_minimax_m2(tmp_path, mtp_modules=2)
    model = _ours(path)
    assert model.mtp.num_modules == 2 and model.mtp.num_loaded == 2 * len(MINIMAX_MTP_NAMES)
    assert set(model.mtp.tensors[1]) == set(MINIMAX_MTP_NAMES)
    assert model.mtp.tensors[0]["eh_proj.weight"].shape == (64, 128)
    ids = _ids(20, 3)  # the MTP modules do not change the main model's logits
    ours = PagedRunner(model, block_size=16).step({0: ids})[0]
    torch.testing.assert_close(ours, _hf_logits(tiny, ids), atol=ATOL, rtol=0)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def _fresh(path: Path) -> MiniMaxM2ForCausalLM:
    from transformers import AutoConfig

    return MiniMaxM2ForCausalLM(AutoConfig.from_pretrained(path), torch.float32)


def test_unknown_and_missing_weights_raise(tiny: Path) -> None:
    weights = _weights(tiny)

    def load(extra: dict[str, torch.Tensor], drop: str = "") -> None:
        _fresh(tiny).load_weights([*((k, v) for k, v in weights.items() if k != drop),
                                   *extra.items()])

    load({})
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.3.enorm.weight'"):
        load({"model.layers.3.enorm.weight": torch.ones(64)})  # no MTP modules in this config
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.mlp.bogus.weight'"):
        load({"model.layers.0.mlp.bogus.weight": torch.ones(1)})
    with pytest.raises(ValueError, match=r"layers.1.block_sparse_moe: .*up_proj of experts 5"):
        load({}, drop="model.layers.1.block_sparse_moe.experts.5.w3.weight")
    with pytest.raises(ValueError, match=r"missing weights: model.layers.2.self_attn.q_norm"):
        load({}, drop="model.layers.2.self_attn.q_norm.weight")
    with pytest.raises(ValueError, match="incomplete q/k/v weights for layers \\[0\\]"):
        load({}, drop="model.layers.0.self_attn.v_proj.weight")


def test_transformers_internal_names_load(tiny: Path) -> None:
    """transformers' in-memory names (fused 3-D experts under `mlp.`) load to the same model."""
    hf = _hf(tiny)
    ours = _fresh(tiny)
    ours.load_weights((k, v.detach()) for k, v in hf.state_dict().items())
    assert any(".mlp.experts.gate_up_proj" in k for k in hf.state_dict())
    ids = _ids(24, 4)
    got = PagedRunner(ours, block_size=16).step({0: ids})[0]
    torch.testing.assert_close(got, _hf_logits(tiny, ids), atol=ATOL, rtol=0)


def test_kv_cache_spec_bytes(tiny: Path) -> None:
    from transformers import MiniMaxM2Config

    spec = _ours(tiny).kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size) == (3, 2, 16)
    assert spec.bytes_per_token == 2 * 3 * 2 * 16 * 4
    real = MiniMaxM2Config(rotary_dim=64, use_qk_norm=True, num_mtp_modules=3)
    with torch.device("meta"):  # MiniMax-M2.7 shape, no memory: 62 x 8 kv heads x 128, bf16
        big = MiniMaxM2ForCausalLM(real, torch.bfloat16)
    assert big.rotary_dim == 64 and big.mtp.num_modules == 3
    assert big.kv_cache_spec().bytes_per_token == 62 * 8 * 128 * 2 * 2 == 253_952


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import httpx

    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "sous.cli", "serve", str(tiny), "--port", str(port),
           "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"sous serve exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"sous serve not ready:\n{log.read_text()}"
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_sous_serve_answers_completion(served: str, tiny: Path) -> None:
    import openai

    from tiny_models import make_tokenizer

    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0)
    prompt = "hello world how are you"
    ids = make_tokenizer(1000)(prompt)["input_ids"]
    out = client.completions.create(model=str(tiny), prompt=prompt, max_tokens=8,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    with torch.no_grad():
        ref = _hf(tiny).generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8,
                                 do_sample=False)[0, len(ids):].tolist()
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 8
    assert out.choices[0].finish_reason == "length"
    tok = make_tokenizer(1000)  # text is the continuation decoded in the prompt's context
    assert out.choices[0].text == tok.decode(ids + ref)[len(tok.decode(ids)) :]
