"""Expert parallel serving. The MoE layer over a real gloo process group (two processes):
each rank's `FusedMoE` holds only its block of experts, and every rank's output equals, bit
for bit, the rows a one-process layer holding every expert computes for all ranks' tokens
together — with uneven token counts, an idle rank (no tokens), DeepSeek-V3 grouped routing and
MiniMax-M2 softmax routing. Then `sous serve --data-parallel-size 2 --enable-expert-parallel`
on tiny DeepSeek-V3 and MiniMax-M2 checkpoints answers greedy completions token for token as
one process does, alone and 16 at once (idle ranks step with the busy one), each rank holding
half of every MoE layer's experts; bad combinations exit 2 naming the flags."""

from __future__ import annotations

import os
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from serve_process import serve_flag_error, sous_serve
from sous.models.layers.expert_parallel import ExpertPlacement
from sous.models.layers.moe import FusedMoE, MoEConfig
from tiny_models import make_tiny_deepseek, make_tiny_minimax_m2

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


MODELS = {  # maker, routed experts, MoE layers, expert weights per layer (E x (2I x H + H x I))
    "deepseek_v3": (lambda p: make_tiny_deepseek(p, "DeepseekV3ForCausalLM", seed=5), 8, 2,
                    8 * 3 * 32 * 64),
    "minimax_m2": (make_tiny_minimax_m2, 8, 3, 8 * 3 * 32 * 64),
}
SENTENCE = "the cat and the dog are big and the sun is red"


def _complete(url: str, prompt: str, extra: str = "min_tokens") -> str:
    """Ten greedy tokens; `extra` "ignore_eos" instead of min_tokens lets drafts start at once
    (no request is drafted for before its min_tokens)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"min_tokens": 10} if extra == "min_tokens"
                                    else {"ignore_eos": True})
    return out.choices[0].text


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_dp2_expert_parallel_answers_as_one_process(arch: str, tmp_path: Path) -> None:
    make, experts, layers, per_layer = MODELS[arch]
    path = make(tmp_path)
    args = [str(path), "--dtype", "float32", "--max-model-len", "256", "--block-size", "16",
            "--kv-cache-memory-bytes", "16MiB"]
    words = SENTENCE.split()
    rotations = [words[i:] + words[:i] for i in range(len(words))]
    prompts = [" ".join(w) for w in rotations + [r[::-1] for r in rotations]][:16]
    env = {"OMP_NUM_THREADS": "1"}
    with sous_serve(args, tmp_path / "one.log", env=env) as one:
        want = [_complete(one, p) for p in prompts]
    ep_args = [*args, "--data-parallel-size", "2", "--enable-expert-parallel"]
    with sous_serve(ep_args, tmp_path / "ep.log", env=env) as ep:
        assert [_complete(ep, p) for p in prompts[:2]] == want[:2]  # one rank idle
        with ThreadPoolExecutor(16) as pool:
            assert list(pool.map(lambda p: _complete(ep, p), prompts)) == want
    log = (tmp_path / "ep.log").read_text()
    half = experts // 2
    for rank, (lo, hi) in enumerate(((0, half - 1), (half, experts - 1))):
        line = (f"Expert parallel: rank {rank} of 2 holds routed experts {lo}-{hi} of "
                f"{experts} in each of {layers} MoE layers ({layers * per_layer // 2} expert "
                "weights here)")
        assert line in log, re.findall(r"Expert parallel: .*", log)


def test_drafts_verified_over_expert_parallel_ranks_answer_as_one_process(
        tmp_path: Path) -> None:
    """Suffix drafts with DP=2 + EP: each rank verifies its own requests' drafts (prompts
    asked a second time match the answers its suffix cache holds) in steps whose MoE layers
    span both ranks; greedy output equals one process without drafts, and drafts were
    accepted."""
    from test_data_parallel import engine_counters

    path = make_tiny_minimax_m2(tmp_path)
    args = [str(path), "--dtype", "float32", "--max-model-len", "256", "--block-size", "16",
            "--kv-cache-memory-bytes", "16MiB"]
    prompts = [" ".join(SENTENCE.split()[i:] + SENTENCE.split()[:i]) for i in range(8)]
    env = {"OMP_NUM_THREADS": "1"}
    with sous_serve(args, tmp_path / "one.log", env=env) as one:
        want = [_complete(one, p, "ignore_eos") for p in prompts]
    ep_args = [*args, "--data-parallel-size", "2", "--enable-expert-parallel",
               "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 3}']
    with sous_serve(ep_args, tmp_path / "ep.log", env=env) as ep:
        for _ in range(2):
            with ThreadPoolExecutor(8) as pool:
                assert list(pool.map(lambda p: _complete(ep, p, "ignore_eos"), prompts)) == want
        accepted = engine_counters(ep, "vllm:spec_decode_num_accepted_tokens_total")
    assert len(accepted) == 2 and sum(accepted.values()) > 0, accepted


def test_separate_rank_servers_answer_as_one_process(tmp_path: Path) -> None:
    """Two servers, `--data-parallel-rank 0` and `1` (as the recipes' P/D decode ranks run
    behind a router), split a tiny MiniMax-M2's experts over one process group and step in
    lockstep: each answers greedy completions as one process, alone (the other idle) and
    with 16 requests spread over both."""
    import subprocess
    import sys
    import time

    import httpx

    from serve_process import free_port

    make, experts, _, _ = MODELS["minimax_m2"]
    path = make(tmp_path)
    args = [str(path), "--dtype", "float32", "--max-model-len", "256", "--block-size", "16",
            "--kv-cache-memory-bytes", "16MiB"]
    prompts = [" ".join(SENTENCE.split()[i:] + SENTENCE.split()[:i]) for i in range(8)] * 2
    env = {"OMP_NUM_THREADS": "1"}
    with sous_serve(args, tmp_path / "one.log", env=env) as one:
        want = [_complete(one, p) for p in prompts]
    group = ["--data-parallel-size", "2", "--enable-expert-parallel",
             "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port",
             str(free_port())]
    port0 = free_port()
    rank0 = subprocess.Popen(
        [sys.executable, "-m", "sous.cli", "serve", *args, *group, "--data-parallel-rank", "0",
         "--port", str(port0)], stdout=(tmp_path / "rank0.log").open("w"),
        stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        with sous_serve([*args, *group, "--data-parallel-rank", "1"], tmp_path / "rank1.log",
                        env=env) as url1:
            url0 = f"http://127.0.0.1:{port0}"
            deadline = time.monotonic() + 120
            while True:  # rank 0 may still be opening its port when rank 1 answers
                try:
                    if httpx.get(url0 + "/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline and rank0.poll() is None
                time.sleep(0.3)
            assert _complete(url0, prompts[0]) == want[0]  # rank 1 idle
            assert _complete(url1, prompts[1]) == want[1]  # rank 0 idle
            urls = [url0, url1] * 8
            with ThreadPoolExecutor(16) as pool:
                got = list(pool.map(_complete, urls, prompts))
            assert got == want
            rank0.terminate()  # a clean stop; rank 1 then loses its group and stops too
            assert rank0.wait(timeout=60) == 0
    finally:
        if rank0.poll() is None:
            rank0.kill()
    half = experts // 2
    for rank, lo in ((0, 0), (1, half)):
        log = (tmp_path / f"rank{rank}.log").read_text()
        assert (f"Expert parallel: rank {rank} of 2 holds routed experts {lo}-"
                f"{lo + half - 1} of {experts}") in log


def test_expert_parallel_on_a_dense_model_exits_2_naming_the_flag(tmp_path: Path) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "sous.cli", "serve", "--data-parallel-size", "2",
                        "--enable-expert-parallel", "--max-model-len", "512"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "0.1"})
    assert r.returncode == 2, r.stderr[-3000:]
    assert "--enable-expert-parallel: LlamaForCausalLM has no MoE layers" in r.stderr


@pytest.mark.parametrize("argv,needle", [
    (["--enable-expert-parallel"], "--enable-expert-parallel needs --data-parallel-size > 1"),
    (["--enable-expert-parallel", "--data-parallel-size", "1", "--data-parallel-rank", "0"],
     "--enable-expert-parallel needs --data-parallel-size > 1"),
    (["--enable-expert-parallel", "--data-parallel-size", "2", "--speculative-config",
      '{"method": "mtp", "num_speculative_tokens": 1}'],
     "--enable-expert-parallel with --speculative-config method 'mtp' is not supported yet"),
])
def test_expert_parallel_flag_combinations_exit_2(argv: list[str], needle: str) -> None:
    assert needle in serve_flag_error(argv)
