"""The quantised modes on the bundled model: `--quantization int8` (int8 weights with dynamic
per-token int8 activations, W8A8) and the default (`--dtype auto`: the GGUF file's exact Q4
weights times int8 block activations on the qgemm kernel, or torch's int4 kernel without VNNI;
a bfloat16 KV cache where activations are float32). Both must be batch-invariant: greedy output
the same alone, batched, chunked and under preemption."""

from __future__ import annotations

import pytest
import torch

from sous import LLM, SamplingParams
from sous.config.load import LoadConfig
from sous.config.model import ModelConfig
from sous.models.layers.int8_linear import Int8Linear, quantize_rows
from sous.models.layers.linear import DenseLinear, Int4Linear
from sous.models.layers.qgemm_linear import BlockQuantLinear, qgemm_ops
from sous.models.loader import load_model
from test_engine import PROMPTS

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_int8_linear_close_to_dense_and_row_independent() -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    dense = DenseLinear(w, b)
    q = Int8Linear(dense.weight_t.data, dense.bias)
    assert not any(p.is_floating_point() and p.numel() > 96 for p in q.buffers())
    x = torch.randn(7, 64, generator=g)
    x[3] = 0.0  # an all-zero row quantises to zeros, not NaN
    ref, out = dense(x), q(x)
    assert ((out - ref).norm() / ref.norm()).item() < 0.02
    assert torch.equal(out[3], b)
    for i in range(7):  # a row's result does not depend on the other rows
        assert torch.equal(q(x[i:i + 1]), out[i:i + 1])


def test_quantize_rows_round_trip() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    x8, scale = quantize_rows(x)
    assert x8.tolist()[0] == [64, -127, 32] and x8.tolist()[1] == [0, 0, 0]
    assert scale.view(-1).tolist() == pytest.approx([2.0 / 127, 1.0])


@pytest.fixture(scope="module", params=["int8", "gguf"])
def quant(request: pytest.FixtureRequest) -> str:
    return request.param


def quant_kwargs(quant: str) -> dict:
    """`int8`: --dtype float32 --quantization int8; `gguf`: the default flags."""
    return {"dtype": "float32", "quantization": "int8"} if quant == "int8" else {}


@pytest.fixture(scope="module")
def llmq(quant: str) -> LLM:
    return LLM(**quant_kwargs(quant), max_model_len=512, kv_cache_memory_bytes=128 << 20,
               max_num_seqs=32)


@pytest.fixture(scope="module")
def aloneq(llmq: LLM) -> list[list[int]]:
    return [llmq.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def test_every_linear_is_quantized(llmq: LLM, quant: str) -> None:
    model = llmq.engine.loaded.model
    if quant == "int8":
        linears = [m for m in model.modules() if isinstance(m, Int8Linear | DenseLinear)]
        assert linears and all(isinstance(m, Int8Linear) for m in linears)
        assert llmq.engine.loaded.quantization == "int8"
    else:  # no dense copy is kept beside the quantised weights
        kernel = BlockQuantLinear if qgemm_ops(CPU) is not None else Int4Linear
        quantized = [m for m in model.modules() if isinstance(m, kernel)]
        assert quantized and all(getattr(m, "weight_t", None) is None for m in quantized)
        assert not any(isinstance(m, DenseLinear) for m in model.modules())
        assert llmq.engine.loaded.quantization == "gguf"
        # float32 activations (CPUs without bf16) keep a bfloat16 cache; bf16 ones their own
        caches = llmq.engine.runner.kv_caches
        assert caches and all(c.dtype == torch.bfloat16 for c in caches)


def test_batched_equals_alone(llmq: LLM, aloneq: list[list[int]]) -> None:
    outs = llmq.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == aloneq


def test_chunked_prefill_equals_alone(quant: str, aloneq: list[list[int]]) -> None:
    chunked = LLM(**quant_kwargs(quant), max_model_len=512,
                  kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=5,
                  enable_prefix_caching=False)
    outs = chunked.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == aloneq[:4]


def test_preemption_equals_alone(quant: str, aloneq: list[list[int]]) -> None:
    tight = LLM(**quant_kwargs(quant), max_model_len=128,
                num_gpu_blocks_override=11, enable_prefix_caching=False)
    outs = tight.generate(PROMPTS[:8], GREEDY, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == aloneq[:8]


def test_layer_stack_equals_the_python_layers(llmq: LLM, quant: str) -> None:
    """GGUF weights run a step's decoder layers as one C++ call (`sous.models.llama_stack`):
    bit-identical to the Python layers, batched, with sampled logprobs; so are the stacks
    split at EAGLE-3's aux layers (which hand back the residual stream there). The first step
    holds more tokens than one sub-step of the stack (256), with the long prompt split across
    two sub-steps."""
    model = llmq.engine.loaded.model
    if quant != "gguf" or qgemm_ops(CPU) is None:
        assert quant == "gguf" or model._layer_stacks(()) is None  # int8 linears: Python layers
        return
    layers = model.config.num_hidden_layers
    ((start, end, _),) = model._layer_stacks(())
    assert (start, end) == (0, layers)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    long = " ".join(f"Item {i} costs {i * 7} coins." for i in range(30))
    assert len(llmq.get_tokenizer()(long)["input_ids"]) > 300
    prompts = [*PROMPTS[:6], long]

    def run() -> list:
        llmq.engine.reset_prefix_cache()
        return llmq.generate(prompts, params, use_tqdm=False)

    fused = run()
    runner = llmq.engine.runner
    runner.aux_hidden_state_layers = (2, layers // 2, layers - 3)
    try:
        split = run()
        assert len(model._stacks[runner.aux_hidden_state_layers]) == 4
        model._stacks = {(): None}  # the Python layers
        plain = run()
    finally:
        model._stacks = {}
        runner.aux_hidden_state_layers = ()
    for a, b, c in zip(fused, split, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs == c.outputs[0].logprobs


def test_int8_logits_close_to_float32() -> None:
    """The approximation is bounded: logits of a fixed text stay close to float32's."""
    from paged_runner import PagedRunner

    dense = load_model(ModelConfig(dtype="float32"), LoadConfig(), CPU)
    ids = dense.tokenizer("The three primary colours are red, yellow and blue. Mixing red and "
                          "yellow gives orange, and mixing blue and yellow gives")["input_ids"]
    ref = PagedRunner(dense.model, block_size=16).step({0: ids})[0]
    q8 = load_model(ModelConfig(dtype="float32", quantization="int8"), LoadConfig(), CPU)
    ours = PagedRunner(q8.model, block_size=16).step({0: ids})[0]
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cos.median() > 0.99 and cos.min() > 0.75, cos  # measured: 0.994 / 0.806
    top5 = ours.topk(5, dim=-1).indices
    assert (top5 == ref.argmax(-1, keepdim=True)).any(-1).float().mean() >= 0.9



def test_fused_ops_equal_the_torch_form() -> None:
    """The C++ quantise / rescale passes compute exactly what the torch ops compute."""
    from sous.engine.ops.build import load

    ops = load()
    if ops is None:
        pytest.skip("the C++ ops are not built on this machine")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 200, generator=g) * 3
    x[5] = 0.0
    x8, scale = quantize_rows(x)
    f8, fscale = ops.quantize_rows_int8(x)
    assert torch.equal(f8, x8) and torch.equal(fscale, scale)
    w8 = torch.randint(-127, 128, (200, 64), dtype=torch.int8, generator=g)
    w_scale, bias = torch.rand(64, generator=g), torch.randn(64, generator=g)
    acc = torch._int_mm(x8, w8)
    ref = acc.float().mul_(scale).mul_(w_scale) + bias
    assert torch.equal(ops.rescale_int32(acc, scale, w_scale, bias), ref)
    assert torch.equal(ops.rescale_int32(acc, scale, w_scale, None),
                       acc.float().mul_(scale).mul_(w_scale))


CODE_PROMPT = ("Rewrite this Python code with type hints. Keep everything else the same.\n\n"
               "```python\n" + "\n".join(
                   f"def get_{a}({b}, {c}):\n    result = []\n    for x in {b}:\n"
                   f"        if x > {c}:\n            result.append(x)\n    return result\n"
                   for a, b, c in (("limit", "name", "count"), ("delta", "record", "user"),
                                   ("value", "count", "index"))) + "```")


def test_stacks_split_at_aux_layers_keep_every_bit(llmq: LLM, quant: str) -> None:
    """A prefill and 40 greedy decode steps through the stacks split at EAGLE-3's aux layers
    write the same KV and hidden states, bit for bit, as one stack (the stream between stacks
    is handed over as (h, residual), not summed: RMSNorm of a sum rounds differently)."""
    import numpy as np

    from sous.engine.attention import AttentionMetadata

    model = llmq.engine.loaded.model
    if quant != "gguf" or qgemm_ops(CPU) is None:
        pytest.skip("the C++ layer stack runs GGUF weights on qgemm only")
    tok = llmq.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": CODE_PROMPT}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    layers = model.config.num_hidden_layers
    runs = []
    for aux in ((), (2, layers // 2, layers - 3)):
        caches = model.kv_cache_spec().allocate(24, 16, CPU)
        table = np.arange(24)[None]
        seq, hidden = list(ids), []
        with torch.inference_mode():
            step = seq
            for _ in range(41):
                n = len(seq)
                meta = AttentionMetadata.build([len(step)], [n], table, 16, CPU)
                out = model(torch.tensor(step), meta.positions, caches, meta,
                            aux_hidden_state_layers=aux)
                h = out[0] if aux else out
                hidden.append(h[-1])
                step = [int(model.compute_logits(h[-1:]).argmax())]
                seq.append(step[0])
        runs.append((seq, torch.stack(hidden), caches))
    (seq_a, h_a, c_a), (seq_b, h_b, c_b) = runs
    assert seq_a == seq_b
    assert torch.equal(h_a, h_b)
    assert all(torch.equal(a, b) for a, b in zip(c_a, c_b, strict=True))
