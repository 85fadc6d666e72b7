"""Pipeline parallel serving: `sous serve --pipeline-parallel-size 2` runs the bundled model's
30 layers as two stage processes (0-14 with the embedding, 15-29 with the norm and LM head)
and answers greedy chats token for token as one process does, alone and 16 at once (two
micro-batches in flight); tiny DeepSeek-V3 and MiniMax-M2 checkpoints split the same way;
n-gram and suffix drafts are verified across the stages with the same output; a killed stage
makes the server fail its clients and exit non-zero; impossible splits and
unsupported combinations are refused naming the flag."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from serve_process import serve_flag_error, sous_serve
from sous.config.errors import ConfigError
from sous.engine.cpu_threads import CpuThreadsEnv, resolve_cpus
from sous.models.pipeline import PPMissingLayer, get_pp_indices
from test_data_parallel import ARGS, ENV, MODEL, PROMPTS, chat, kill_child_mid_stream
from tiny_models import make_tiny_deepseek, make_tiny_minimax_m2

PP = ["--pipeline-parallel-size", "2"]


# ------------------------------------------------------------------------- the split
@pytest.mark.parametrize("layers,size,want", [
    (30, 2, [(0, 15), (15, 30)]),
    (7, 3, [(0, 2), (2, 5), (5, 7)]),  # the extra layer goes before the last stage (vLLM)
    (5, 4, [(0, 1), (1, 2), (2, 4), (4, 5)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
])
def test_layers_split_as_vllm_splits_them(layers: int, size: int, want: list) -> None:
    assert [get_pp_indices(layers, r, size, partition="") for r in range(size)] == want


def test_layer_partition_variable_and_impossible_splits() -> None:
    assert [get_pp_indices(30, r, 2, partition="20,10") for r in range(2)] == [(0, 20),
                                                                                (20, 30)]
    with pytest.raises(ConfigError, match="VLLM_PP_LAYER_PARTITION='10,10': needs 2 positive"):
        get_pp_indices(30, 0, 2, partition="10,10")
    with pytest.raises(ConfigError, match="expected comma-separated layer counts"):
        get_pp_indices(30, 0, 2, partition="a,b")
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 31 is larger than the "
                                          "model's 30 decoder layers"):
        get_pp_indices(30, 0, 31)


def test_stages_split_the_cpus() -> None:
    env = CpuThreadsEnv()
    assert [resolve_cpus(env, range(4), rank=r, world_size=2) for r in range(2)] == [(0, 1),
                                                                                    (2, 3)]
    with pytest.raises(ValueError, match="3 engine ranks .* need at least one CPU each"):
        resolve_cpus(env, range(2), rank=0, world_size=3)


def test_more_stages_than_layers_fails_before_any_process_starts() -> None:
    from sous.engine.llm import LLM

    with pytest.raises(ConfigError, match="--pipeline-parallel-size 64 is larger than the "
                                          "model's 30 decoder layers"):
        LLM(pipeline_parallel_size=64)


@pytest.mark.parametrize("argv,needle", [
    (["--data-parallel-size", "2"], "--pipeline-parallel-size 2 with data parallel flags"),
    (["--distributed-executor-backend", "uni"], "cannot use --distributed-executor-backend uni"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
     "--pipeline-parallel-size 2 with --speculative-config method 'mtp' is not supported yet"),
    (["--speculative-config", '{"method": "eagle3", "model": "/x", '
                              '"num_speculative_tokens": 3}'],
     "--pipeline-parallel-size 2 with --speculative-config method 'eagle3' is not supported"),
])
def test_unsupported_combinations_exit_2_naming_the_flags(argv: list[str], needle: str) -> None:
    assert needle in serve_flag_error([*PP, *argv])


# ------------------------------------------------------------------------- stages in-process
MOE = {
    "deepseek_v3": lambda p: make_tiny_deepseek(p, "DeepseekV3ForCausalLM", seed=5),
    "minimax_m2": make_tiny_minimax_m2,
}


@pytest.mark.parametrize("arch", sorted(MOE))
def test_moe_families_split_into_stages_answer_as_one_process(arch: str,
                                                              tmp_path: Path) -> None:
    """Offline `LLM(pipeline_parallel_size=2)`: each stage keeps only its layers, and greedy
    output over a batch of prompts equals one process's."""
    from sous.config.engine_args import engine_config_from_kwargs
    from sous.engine.llm import LLM
    from sous.engine.sampling_params import SamplingParams
    from sous.models.loader import load_model
    from sous.models.pipeline import prune_to_stage

    path = MOE[arch](tmp_path)
    kwargs = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 16 << 20}
    prompts = [[(7 * i + j) % 900 + 5 for j in range(12 + i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(**extra: int) -> list[list[int]]:
        llm = LLM(str(path), **kwargs, **extra)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs]
        finally:
            llm.engine.shutdown()

    assert run(pipeline_parallel_size=2) == run()
    config = engine_config_from_kwargs(model=str(path), dtype="float32")
    loaded = load_model(config.model, config.load, torch.device("cpu"))
    total = len(loaded.model.model.layers)
    stage = prune_to_stage(loaded.model, 1, 2)
    kept = [i for i, layer in enumerate(loaded.model.model.layers)
            if not isinstance(layer, PPMissingLayer)]
    assert kept == list(range(stage.start_layer, total)) and stage.start_layer > 0
    assert isinstance(loaded.model.model.embed_tokens, PPMissingLayer)
    assert loaded.model.kv_cache_spec().num_layers == total - stage.start_layer


def test_chunked_prefill_and_preemption_with_batches_in_flight() -> None:
    """Prefill chunks of 16 tokens (a prompt's chunks in consecutive micro-batches) and a KV
    cache of 20 blocks for 8 requests (preemptions while a batch is in flight): the same
    greedy tokens as one process under the same pressure."""
    from sous.engine.llm import LLM
    from sous.engine.sampling_params import SamplingParams

    prompts = [f"Question {i}: describe {topic} in detail, with examples and history."
               for i, topic in enumerate(("rain", "tea", "jazz", "chess", "owls", "bread",
                                          "copper", "comets"))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    block_bytes = 30 * 2 * 3 * 64 * 4 * 16  # the bundled model's float32 KV, all layers
    results = []
    for pp in (1, 2):
        llm = LLM(dtype="float32", max_model_len=256, max_num_batched_tokens=16,
                  kv_cache_memory_bytes=20 * block_bytes // pp, pipeline_parallel_size=pp)
        try:
            assert llm.engine.num_blocks == 20
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert llm.engine.scheduler.num_preemptions > 0
            results.append([o.outputs[0].token_ids for o in outs])
        finally:
            llm.engine.shutdown()
    assert results[0] == results[1]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_drafts_verified_across_stages_answer_as_one_process(method: str) -> None:
    """n-gram and suffix drafts with two stages: the last stage drafts and verifies, the
    first learns the accepted tokens; greedy output equals one process without drafts, and
    drafts are accepted (copy-heavy prompts)."""
    from sous.engine.llm import LLM
    from sous.engine.sampling_params import SamplingParams

    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    prompts = [f"Repeat this code exactly, {n} times:\n{text}" for n in ("two", "three", "four")]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec["prompt_lookup_max"] = 4
    results = []
    for extra in ({}, {"pipeline_parallel_size": 2, "speculative_config": spec}):
        llm = LLM(dtype="float32", max_model_len=512, **extra)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append([o.outputs[0].token_ids for o in outs])
            stats = llm.engine.scheduler.spec_decoding
        finally:
            llm.engine.shutdown()
    assert results[0] == results[1]
    assert stats is not None and stats.num_accepted_tokens > 0


# ------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """(one-process URL, two-stage URL, the two-stage server's log)."""
    tmp = tmp_path_factory.mktemp("pp")
    with sous_serve(ARGS, tmp / "one.log", env=ENV) as one, \
            sous_serve([*ARGS, *PP], tmp / "pp.log", env=ENV) as pp:
        yield one, pp, tmp / "pp.log"


def test_two_stages_answer_as_one_process_alone_and_sixteen_way(servers) -> None:
    one, pp, log = servers
    base = openai.OpenAI(base_url=one + "/v1", api_key="x")
    staged = openai.OpenAI(base_url=pp + "/v1", api_key="x")
    expected = [chat(base, p) for p in PROMPTS]
    for p, want in zip(PROMPTS[:3], expected, strict=False):
        assert chat(staged, p) == want, p
    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(lambda p: chat(staged, p), PROMPTS)) == expected
    stream = staged.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[5]}], temperature=0,
        max_tokens=32, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
        expected[5][0])
    text = log.read_text()
    assert "Pipeline stage 1 of 2: decoder layers 0-14 of 30 + embedding" in text
    assert "Pipeline stage 2 of 2: decoder layers 15-29 of 30 + final norm and LM head" in text
    assert len(re.findall(r"Pipeline parallel: rank \d of 2 joined the gloo", text)) == 2


def test_killed_stage_fails_clients_and_the_server_exits_non_zero(tmp_path: Path) -> None:
    assert kill_child_mid_stream([*ARGS, *PP], tmp_path / "pp.log", victim=0) == 1
    assert "the worker process exited (-9)" in (tmp_path / "pp.log").read_text()
