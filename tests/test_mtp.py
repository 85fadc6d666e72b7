"""MTP speculative decoding end to end on a tiny MiniMax-M2 checkpoint with MTP modules: real
`sous serve` processes with and without `--speculative-config '{"method": "mtp", ...}'`,
greedy completions compared token for token (alone, and 16 at once with preemption), vLLM's
spec-decode counters moving; checkpoints MTP cannot draft with exit 2 naming why."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from serve_process import sous_serve
from tiny_models import make_tiny_minimax_m2

MTP = {"method": "mtp", "num_speculative_tokens": 3}
ARGS = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "16"]
# 40 blocks of 16 tokens (640): 16 sequences of 72-117 tokens must preempt.
SMALL_KV = ["--num-gpu-blocks-override", "40"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_minimax_m2(tmp_path_factory.mktemp("mtp"), mtp_modules=1)


@pytest.fixture(scope="module")
def servers(tiny: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[str, openai.OpenAI, openai.OpenAI]]:
    """(MTP server URL, its client, a client of the same model without drafts)."""
    logs = tmp_path_factory.mktemp("logs")
    with sous_serve([str(tiny), *ARGS], logs / "plain.log") as plain, \
            sous_serve([str(tiny), *ARGS, *SMALL_KV, "--speculative-config", json.dumps(MTP)],
                       logs / "mtp.log") as url:
        yield (url, openai.OpenAI(base_url=url + "/v1", api_key="x"),
               openai.OpenAI(base_url=plain + "/v1", api_key="x"))


def complete(client: openai.OpenAI, prompt: list[int], max_tokens: int = 48
             ) -> tuple[str, list[str]]:
    """Greedy text and its tokens (from `logprobs`)."""
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert len(c.logprobs.tokens) == max_tokens
    return c.text, c.logprobs.tokens


def counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f"vllm:{name}"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no vllm:{name} in /metrics")


def prompt(i: int, n: int = 24) -> list[int]:
    return [(7 * i + 13 * j) % 997 + 2 for j in range(n)]


def test_greedy_alone_and_sixteen_at_once_equal_plain_decoding(servers) -> None:
    url, mtp, plain = servers
    before = counter(url, "spec_decode_num_draft_tokens_total")
    for i in range(3):
        assert complete(mtp, prompt(i)) == complete(plain, prompt(i))
    assert counter(url, "spec_decode_num_draft_tokens_total") > before
    preempted = counter(url, "num_preemptions_total")
    prompts = [prompt(i, 40 + 3 * i) for i in range(16)]

    def run(client: openai.OpenAI) -> list[tuple[str, list[str]]]:
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda p: complete(client, p, 32), prompts))

    assert run(mtp) == run(plain)
    assert counter(url, "num_preemptions_total") > preempted


def serve_exit(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sous.cli", "serve", *args],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)


def test_models_without_mtp_modules_exit_2(tmp_path: Path) -> None:
    no_weights = make_tiny_minimax_m2(tmp_path, name="no-mtp")
    spec = ["--speculative-config", json.dumps(MTP)]
    r = serve_exit([str(no_weights), *ARGS, *spec], tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--speculative-config" in r.stderr and "holds no MTP module weights" in r.stderr
    r = serve_exit(["--max-model-len", "256", *spec], tmp_path)  # the bundled Llama
    assert r.returncode == 2, r.stderr[-2000:]
    assert "method 'mtp' needs a model whose MTP modules sous runs" in r.stderr
