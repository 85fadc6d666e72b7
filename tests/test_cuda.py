"""sous on a CUDA device against transformers on the same device (skipped without CUDA).

Tiny random float32 checkpoints (tests/tiny_models.py) run through the offline `LLM` with
`device="cuda"` (and once through `sous serve --device cuda`): greedy tokens equal
transformers' `generate` on the GPU and logprobs agree within 1e-4 (TF32 off: float32 matmuls
are exact there, as on the CPU); 16 concurrent requests, with and without chunked prefill,
give each request's tokens alone; bfloat16 batched equals bfloat16 alone (a token may differ
only at a near tie); the KV cache and the weights live on the device; the CPU-only C++ ops are
never asked for. Also on the device: prefix and sub-block cache hits (slot copies), seeded
sampling with filters and penalties, MLA / MoE / indexer models, xgrammar's bitmask, scaled
RoPE tables.

`SOUS_CUDA_CHECK_DEVICE=cpu` runs the same tests on the CPU (to check the tests themselves;
with `SOUS_ATTENTION=torch` they also take the pure-torch paths the GPU takes). The default is
`cuda`, and then the module is skipped where CUDA is not available.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from serve_process import sous_serve
from sous import LLM, SamplingParams
from sous.engine.outputs import CompletionOutput
from tiny_models import make_tiny_deepseek, make_tiny_llama, make_tiny_minimax_m2

DEVICE = os.environ.get("SOUS_CUDA_CHECK_DEVICE", "cuda")
DEV = torch.device(DEVICE)
ON_CUDA = DEV.type == "cuda"
ATOL = 1e-4
BF16_TIE = 0.1
"""A bfloat16 greedy token may differ between two runs only where the two best logprobs of
the run that differs are within this (a few bf16 ulps of logits of magnitude < 8)."""

pytestmark = pytest.mark.skipif(
    ON_CUDA and not torch.cuda.is_available(),
    reason="CUDA is not available (SOUS_CUDA_CHECK_DEVICE=cpu runs these tests on the CPU)")


@pytest.fixture(scope="module", autouse=True)
def exact_float32():
    """No TF32 for float32 matmuls and convolutions while these tests run."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]
    torch.set_float32_matmul_precision(before[2])


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model of `path` on DEVICE (eager attention and experts: the plainest
    reference)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw: dict[str, Any] = {"attn_implementation": "eager"}
    cfg = AutoConfig.from_pretrained(path)
    if getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_local_experts", None):
        kw["experts_implementation"] = "eager"
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(DEV).eval()


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' `n` greedy tokens (EOS banned, as `min_tokens` does) and the raw
    log-softmax of each chosen token."""
    with torch.no_grad():
        gen = hf.generate(torch.tensor([prompt], device=DEV), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, output_logits=True, return_dict_in_generate=True)
    tokens = gen.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item()
           for s, t in zip(gen.logits, tokens, strict=True)]
    return tokens, lps


def _llm(path: Path, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(device=DEVICE, dtype="float32", max_model_len=256, block_size=16,
                                kv_cache_memory_bytes=16 << 20)
    args.update(kw)
    return LLM(str(path), **args)


def _greedy(n: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, logprobs=logprobs)


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[CompletionOutput]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _assert_on_device(llm: LLM, dtype: torch.dtype) -> None:
    runner = llm.engine.runner
    assert llm.engine.device.type == DEV.type and runner.device.type == DEV.type
    assert runner.kv_caches and all(c.device.type == DEV.type for c in runner.kv_caches)
    assert all(c.dtype == dtype for c in runner.kv_caches)
    params = list(runner.model.parameters())
    assert params and all(p.device.type == DEV.type for p in params)
    assert all(b.device.type == DEV.type for b in runner.model.buffers())
    if ON_CUDA:
        assert llm.engine.executor.worker.cpu_binding is None


def _check_against_hf(llm: LLM, hf: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The engine's greedy tokens for `prompts` (run together) equal transformers', and their
    logprobs agree within ATOL. Returns the tokens."""
    outs = _generate(llm, prompts, _greedy(n, logprobs=1))
    for prompt, got in zip(prompts, outs, strict=True):
        want, want_lp = _hf_greedy(hf, prompt, n)
        assert got.token_ids == want, (len(prompt), got.token_ids, want)
        assert got.logprobs is not None
        ours = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(want_lp), atol=ATOL, rtol=0)
    return [o.token_ids for o in outs]


def _assert_same_or_near_tie(got: CompletionOutput, want: CompletionOutput, tie: float) -> bool:
    """`got` and `want` (greedy, with top logprobs) are the same tokens, or first differ where
    `got`'s own logprobs put `want`'s token within `tie` of its choice; up to there their
    logprobs agree within `tie`. True when the tokens are equal."""
    assert got.logprobs is not None and want.logprobs is not None
    i = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True))
              if a != b), len(got.token_ids))
    same = [(g[t].logprob, w[t].logprob) for g, w, t in
            zip(got.logprobs[:i], want.logprobs[:i], got.token_ids[:i], strict=True)]
    if same:
        a, b = torch.tensor(same).unbind(1)
        torch.testing.assert_close(a, b, atol=tie, rtol=0)
    if i == len(got.token_ids):
        return True
    row = got.logprobs[i]
    other = want.token_ids[i]
    assert other in row, (i, got.token_ids, want.token_ids, row)
    gap = row[got.token_ids[i]].logprob - row[other].logprob
    assert 0 <= gap <= tie, (i, gap, got.token_ids, want.token_ids)
    return False


class StepShapes:
    """Records, per forward pass of the served model, (sequences, decode rows, tokens)."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[tuple[int, int, int]] = []
        model = llm.engine.runner.model
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, _module: Any, args: tuple[Any, ...]) -> None:
        meta = args[3]
        self.steps.append((meta.num_seqs, len(meta.decode_rows), meta.num_tokens))

    def close(self) -> None:
        self._handle.remove()


# ------------------------------------------------------------------------------ Llama


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama"), num_hidden_layers=3)


@pytest.fixture(scope="module")
def hf_llama(tiny_llama: Path) -> Any:
    return _hf(tiny_llama)


PROMPTS16 = [_ids(5 + 3 * i, 100 + i) for i in range(16)]
"""16 different prompts of 5 to 50 tokens."""
N16 = 24


@pytest.fixture(scope="module")
def llama_expected(hf_llama: Any) -> list[list[int]]:
    """transformers' N16 greedy tokens of each of PROMPTS16 on DEVICE."""
    return [_hf_greedy(hf_llama, p, N16)[0] for p in PROMPTS16]


def test_llama_float32_greedy_and_logprobs_match_transformers(tiny_llama: Path,
                                                              hf_llama: Any) -> None:
    """Prefill of 37 / 9 / 21 / 50 tokens, then 32 decodes together, block 16: tokens equal
    transformers' on the same device, logprobs within 1e-4; everything lives on the device."""
    llm = _llm(tiny_llama)
    _assert_on_device(llm, torch.float32)
    assert llm.engine.model_info.device.startswith(DEV.type)
    prompts = [_ids(37, 1), _ids(9, 2), _ids(21, 3), _ids(50, 4)]
    tokens = _check_against_hf(llm, hf_llama, prompts, 32)
    assert len({tuple(t) for t in tokens}) == len(prompts)
    # the first prompt again: its 2 full blocks come from the prefix cache
    again = llm.generate({"prompt_token_ids": prompts[0]}, _greedy(32), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == tokens[0]


def test_cuda_path_never_asks_for_cpu_ops(tiny_llama: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading, sizing and stepping on the GPU never builds or loads the C++ CPU extension
    (`sous.engine.ops.build`), and the worker binds no CPU threads. On the CPU the same
    instrumentation sees the requests (so it does watch the right functions)."""
    from sous.engine.ops import build

    calls: list[str] = []
    monkeypatch.setattr(build, "load", lambda: calls.append("load"))
    monkeypatch.setattr(build, "_cpu_ops", lambda: calls.append("_cpu_ops"))
    llm = _llm(tiny_llama)
    out = _generate(llm, [_ids(20, 5), _ids(3, 6)], _greedy(4))
    assert [len(o.token_ids) for o in out] == [4, 4]
    worker = llm.engine.executor.worker
    if ON_CUDA:
        assert calls == [] and worker.cpu_binding is None
    else:
        assert calls


def test_kv_budget_on_device(tiny_llama: Path) -> None:
    """`--gpu-memory-utilization` sizing reads the device's free memory (CUDA); `auto` dtype
    on CUDA is the checkpoint's half type or bfloat16."""
    from sous.config.cache import CacheConfig
    from sous.engine.kv_cache.sizing import kv_cache_budget_bytes, num_kv_blocks
    from sous.models.loader import resolve_dtype

    llm = _llm(tiny_llama)
    spec = llm.engine.model_info.kv_cache_spec
    cache = CacheConfig(gpu_memory_utilization=0.5)
    budget = kv_cache_budget_bytes(cache, DEV, 1 << 20)
    blocks = num_kv_blocks(cache, spec.page_bytes(cache.block_size), DEV, 1 << 20)
    assert blocks == budget // spec.page_bytes(16) and blocks >= 2
    if ON_CUDA:
        _, total = torch.cuda.mem_get_info(DEV)
        assert 0 < budget <= int(total * 0.5)
        assert resolve_dtype("auto", torch.float32, DEV) == torch.bfloat16
        assert resolve_dtype("auto", torch.float16, DEV) == torch.float16


@pytest.mark.parametrize("budget", [8192, 16], ids=["one_step_prefill", "chunked_prefill"])
def test_llama_16_concurrent_requests_equal_each_alone(tiny_llama: Path, llama_expected,
                                                       budget: int) -> None:
    """16 different prompts at once (one prefill step of all 16; or, with a 16-token step
    budget, prefill chunks mixed with decodes) give each prompt's tokens alone, which equal
    transformers'."""
    llm = _llm(tiny_llama, enable_prefix_caching=False, max_num_batched_tokens=budget)
    params = _greedy(N16)
    alone = [_generate(llm, [p], params)[0].token_ids for p in PROMPTS16]
    assert alone == llama_expected
    shapes = StepShapes(llm)
    together = [o.token_ids for o in _generate(llm, PROMPTS16, params)]
    shapes.close()
    assert together == alone
    if budget == 8192:
        assert shapes.steps[0] == (16, 0, sum(map(len, PROMPTS16)))
        assert max(s[0] for s in shapes.steps) == 16
    else:
        assert max(s[2] for s in shapes.steps) <= 16
        assert any(0 < decodes < seqs for seqs, decodes, _ in shapes.steps)  # mixed steps
        assert max(s[1] for s in shapes.steps) >= 8  # many decodes in one step


def test_llama_bfloat16_batched_equals_alone(tiny_llama: Path, hf_llama: Any) -> None:
    """bfloat16 weights, activations and KV cache: 16 requests together equal each alone (or
    first differ at a near tie); the first token's logprob is close to float32 transformers'."""
    llm = _llm(tiny_llama, dtype="bfloat16", enable_prefix_caching=False,
               max_num_batched_tokens=64)
    _assert_on_device(llm, torch.bfloat16)
    params = _greedy(N16, logprobs=5)
    alone = [_generate(llm, [p], params)[0] for p in PROMPTS16]
    together = _generate(llm, PROMPTS16, params)
    for t, a in zip(together, alone, strict=True):
        _assert_same_or_near_tie(t, a, BF16_TIE)
    for p, out in zip(PROMPTS16, alone, strict=True):
        want, want_lp = _hf_greedy(hf_llama, p, 1)
        assert out.logprobs is not None
        row = out.logprobs[0]
        if out.token_ids[0] != want[0]:  # only a near tie may flip
            assert want[0] in row, (p, out.token_ids[0], want[0])
            assert row[out.token_ids[0]].logprob - row[want[0]].logprob <= BF16_TIE
        else:
            assert abs(row[want[0]].logprob - want_lp[0]) < BF16_TIE


def test_prefix_and_sub_block_cache_on_device(tiny_llama: Path, hf_llama: Any) -> None:
    """Block 64 with a 16-token step budget: a prompt sharing 165 tokens with an earlier one
    takes 2 full blocks from the prefix cache and 2 sub-blocks of 16 copied slot by slot into
    a new block on the device (`kv_cache_copy_ops`), and still decodes transformers' tokens."""
    llm = _llm(tiny_llama, block_size=64, max_num_batched_tokens=16, enable_prefix_caching=True,
               enable_sub_block_cache=True)
    assert llm.engine.kv_cache_manager.sub_block_size == 16
    runner = llm.engine.runner
    copies: list[tuple[int, int, int]] = []
    copy_slots = runner.copy_slots

    def record(caches: list[torch.Tensor], src: int, dst: int, num_tokens: int) -> None:
        assert all(c.device.type == DEV.type for c in caches)
        copies.append((src, dst, num_tokens))
        copy_slots(caches, src, dst, num_tokens)

    runner.copy_slots = record
    first = _ids(180, 30)
    second = first[:165] + _ids(15, 31)
    out_first = llm.generate({"prompt_token_ids": first}, _greedy(8), use_tqdm=False)[0]
    assert out_first.num_cached_tokens == 0
    out = llm.generate({"prompt_token_ids": second}, _greedy(8, logprobs=1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 128 + 32
    assert len(copies) == 1 and copies[0][2] == 32 and copies[0][0] != copies[0][1]
    want, want_lp = _hf_greedy(hf_llama, second, 8)
    assert out.outputs[0].token_ids == want
    assert out.outputs[0].logprobs is not None
    ours = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, want, strict=True)]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(want_lp), atol=ATOL, rtol=0)


def test_seeded_sampling_on_device(tiny_llama: Path) -> None:
    """Random sampling with every filter and penalty on the device: a seed gives the same
    tokens in a batch and alone, another seed others; a greedy row in the batch is unchanged."""
    llm = _llm(tiny_llama, enable_prefix_caching=False)
    p0, p1 = _ids(12, 40), _ids(30, 41)

    def params(seed: int | None) -> SamplingParams:
        if seed is None:
            return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        return SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.01,
                              repetition_penalty=1.2, frequency_penalty=0.3,
                              presence_penalty=0.2, seed=seed, max_tokens=24, ignore_eos=True,
                              logprobs=3)

    prompts = [{"prompt_token_ids": p} for p in (p0, p1, p0, p0, p1)]
    seeds = [1, 2, 1, 3, None]
    outs = llm.generate(prompts, [params(s) for s in seeds], use_tqdm=False)
    tok = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == 24 for t in tok)
    assert tok[0] == tok[2] and tok[0] != tok[3] and tok[0] != tok[1]
    alone = llm.generate(prompts[0], params(1), use_tqdm=False)[0].outputs[0].token_ids
    assert alone == tok[0]
    greedy = llm.generate(prompts[4], params(None), use_tqdm=False)[0].outputs[0].token_ids
    assert greedy == tok[4]
    lps = outs[0].outputs[0].logprobs
    assert lps is not None and all(len(row) >= 3 for row in lps)
    assert all(lp.logprob <= 0 and lp.rank is not None and lp.rank >= 1
               for row in lps for lp in row.values())


# ------------------------------------------------------------------- MLA and MoE models

ARCHS = {
    "deepseek_v3": lambda p: make_tiny_deepseek(p, "DeepseekV3ForCausalLM"),
    "minimax_m2": make_tiny_minimax_m2,
    "deepseek_v32": lambda p: make_tiny_deepseek(p, "DeepseekV32ForCausalLM"),
    "axk2": lambda p: make_tiny_deepseek(p, "AXK2ForCausalLM"),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_moe_models_match_transformers(arch: str, tmp_path: Path) -> None:
    """DeepSeek-V3 (MLA latent cache, grouped routing, shared expert), MiniMax-M2 (GQA with
    partial rotary and QK norm, sigmoid routing with bias), DeepSeek-V3.2 / A.X-K2 (indexer
    top-8 over up to 61 positions): chunked prefill (8-token steps) and batched decodes of 3
    prompts equal transformers' greedy tokens on the device, logprobs within 1e-4; a repeat
    of the first prompt decodes the same on its prefix-cached blocks."""
    path = ARCHS[arch](tmp_path)
    hf = _hf(path)
    llm = _llm(path, max_num_batched_tokens=8, max_model_len=128)
    _assert_on_device(llm, torch.float32)
    prompts = [_ids(37, 20), _ids(21, 21), _ids(9, 22)]
    tokens = _check_against_hf(llm, hf, prompts, 24)
    again = llm.generate({"prompt_token_ids": prompts[0]}, _greedy(24), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == tokens[0]


# ------------------------------------------------------------------------------ server


def test_openai_server_chat_completion_on_device(tiny_llama: Path, hf_llama: Any,
                                                 tmp_path: Path) -> None:
    """`sous serve --device cuda` on the tiny Llama: one greedy chat completion through the
    `openai` client equals the offline engine's `chat` on the same device, whose tokens equal
    transformers'; the server's KV cache is on the device (its start-up log says so)."""
    import openai

    messages = [{"role": "user", "content": "hello how are you ?"}]
    n = 16
    llm = _llm(tiny_llama)
    offline = llm.chat(messages, _greedy(n), use_tqdm=False)[0]
    want, _ = _hf_greedy(hf_llama, offline.prompt_token_ids, n)
    assert offline.outputs[0].token_ids == want
    del llm
    log = tmp_path / "server.log"
    args = [str(tiny_llama), "--device", DEVICE, "--dtype", "float32", "--max-model-len", "256",
            "--block-size", "16", "--kv-cache-memory-bytes", "16MiB"]
    with sous_serve(args, log, timeout_s=240) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=n,
                                             temperature=0, extra_body={"min_tokens": n})
    assert out.usage is not None and out.usage.completion_tokens == n
    assert out.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content == offline.outputs[0].text
    assert f" on {DEV.type}" in log.read_text()


# ---------------------------------------------------------- structured output, RoPE scaling


def test_structured_choice_on_device(tiny_llama: Path) -> None:
    """xgrammar's bitmask applied to logits on the device (its Triton kernel on CUDA), for the
    structured rows of a batch that also has an unconstrained row."""
    llm = _llm(tiny_llama)
    choices = ["red", "green", "blue", "cat dog"]
    structured = SamplingParams(temperature=0.0, max_tokens=8,
                                structured_outputs={"choice": choices})
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [_ids(10, 50), _ids(25, 51), _ids(10, 50)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [structured, structured, free],
                        use_tqdm=False)
    for o in outs[:2]:
        assert o.outputs[0].text.strip() in choices, o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop"
    alone = llm.generate({"prompt_token_ids": prompts[2]}, free, use_tqdm=False)[0]
    assert outs[2].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(alone.outputs[0].token_ids) == 8


ROPE_VARIANTS = {
    "llama3_rope": lambda p: make_tiny_llama(p, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "deepseek_yarn": lambda p: make_tiny_deepseek(p, "DeepseekV3ForCausalLM", rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
        "mscale_all_dim": 1.0}),
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_scaled_rope_on_device(variant: str, tmp_path: Path) -> None:
    """Scaled RoPE (llama3, YaRN): its tables are built from transformers' CPU frequencies
    while the model is built on the device."""
    path = ROPE_VARIANTS[variant](tmp_path)
    llm = _llm(path, max_model_len=128)
    _assert_on_device(llm, torch.float32)
    _check_against_hf(llm, _hf(path), [_ids(40, 60), _ids(7, 61)], 16)

