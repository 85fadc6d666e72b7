"""Speculative decoding end to end: real `sous serve` processes with `--speculative-config`
(n-gram, suffix and EAGLE-3 drafters, as the recipes pass them) against a server without it,
over HTTP with the official client. The EAGLE-3 head is trained here by `sous draft train` on
this file's prompts (a smoke run). Greedy output must be token-for-token the same (alone, among
16 concurrent requests, under preemption, with stop strings, `min_tokens`, logprobs and
structured output); the drafts must really be accepted (vLLM's counters in `/metrics`)."""

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

from serve_process import serve_flag_error, sous_serve

MODEL = "SmolLM2-135M-Instruct"
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
PROMPTS = [
    f"Copy this code exactly, then add a mul function in the same style:\n{CODE}",
    "Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig, grape.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
]
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2},
    # The recipes' suffix config: per-request trees only.
    "suffix": {"method": "suffix", "num_speculative_tokens": 3,
               "suffix_decoding_max_cached_requests": 0},
    # The recipes' EAGLE-3 config, with a head `sous draft train` wrote (`eagle3_head`).
    "eagle3": {"method": "eagle3", "model": "HEAD", "num_speculative_tokens": 3},
}
# 80 blocks of 16 tokens: 16 concurrent chats of ~200 tokens must preempt.
SMALL_KV = ["--max-model-len", "1024", "--num-gpu-blocks-override", "80"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "0.5"}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    log = tmp_path_factory.mktemp("spec") / "baseline.log"
    with sous_serve(["--max-model-len", "1024"], log, env=ENV) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        client.sous_memo = {}  # type: ignore[attr-defined]
        yield client


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An EAGLE-3 head for the bundled model from a short `sous draft train` run on PROMPTS
    (interrupted once and resumed, as a user would)."""
    tmp = tmp_path_factory.mktemp("eagle3")
    (tmp / "prompts.json").write_text(json.dumps(PROMPTS))
    cmd = [sys.executable, "-m", "sous.cli", "draft", "train", "--out", str(tmp / "head"),
           "--prompts", str(tmp / "prompts.json"), "--num-prompts", "4", "--max-tokens", "96",
           "--batch-size", "2", "--save-every", "10", "--seed", "0"]
    first = subprocess.run([*cmd, "--max-steps", "10"], capture_output=True, text=True,
                           timeout=600, cwd=tmp)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Training the EAGLE-3 head" in first.stderr and "10/10" in first.stderr
    again = subprocess.run([*cmd, "--max-steps", "40"], capture_output=True, text=True,
                           timeout=600, cwd=tmp)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming training at step 10 of 40" in again.stderr, again.stderr[-3000:]
    assert "captured sequences" in again.stderr  # the data was not generated twice
    assert "--speculative-config" in again.stdout
    return tmp / "head"


@pytest.fixture(scope="module", params=sorted(SPECS))
def spec(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[str, openai.OpenAI]]:
    """(base URL, client) of a server with the `request.param` drafter and a small KV cache."""
    log = tmp_path_factory.mktemp("spec") / f"{request.param}.log"
    config = dict(SPECS[request.param])
    if config.get("model") == "HEAD":
        config["model"] = str(request.getfixturevalue("eagle3_head"))
    args = [*SMALL_KV, "--speculative-config", json.dumps(config)]
    with sous_serve(args, log, env=ENV) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="x")


def chat(client: openai.OpenAI, text: str, max_tokens: int = 96, **extra: object):
    """A greedy chat; the baseline server's answers are asked once per module (the same
    question comes from every drafter's tests)."""
    memo = getattr(client, "sous_memo", None)
    key = (text, max_tokens, json.dumps(extra, sort_keys=True, default=str))
    if memo is not None and key in memo:
        return memo[key]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], temperature=0,
        max_tokens=max_tokens, **extra)
    if memo is not None:
        memo[key] = reply
    return reply


def answer(r) -> tuple[str, str, int]:
    c = r.choices[0]
    return c.message.content, c.finish_reason, r.usage.completion_tokens


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:spec_decode") or line.startswith("vllm:num_preemptions"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            if 'position="' in name:
                key += "[" + name.split('position="')[1].split('"')[0] + "]"
            out[key] = float(value)
    return out


def test_greedy_alone_equals_plain_decoding_and_drafts_are_accepted(baseline, spec) -> None:
    url, client = spec
    before = metrics(url)
    for text in PROMPTS:
        assert answer(chat(client, text)) == answer(chat(baseline, text)), text
    after = metrics(url)
    drafts = after["vllm:spec_decode_num_drafts_total"] - before["vllm:spec_decode_num_drafts_total"]
    drafted = (after["vllm:spec_decode_num_draft_tokens_total"]
               - before["vllm:spec_decode_num_draft_tokens_total"])
    accepted = (after["vllm:spec_decode_num_accepted_tokens_total"]
                - before["vllm:spec_decode_num_accepted_tokens_total"])
    assert drafts > 10 and drafted >= drafts and 0.2 * drafted < accepted <= drafted
    per_pos = [after[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{j}]"] for j in range(3)]
    assert per_pos[0] >= per_pos[1] >= per_pos[2] and sum(per_pos) == after[
        "vllm:spec_decode_num_accepted_tokens_total"]


def test_confidence_threshold_drafts_only_sure_tokens(baseline, eagle3_head: Path,
                                                      tmp_path: Path) -> None:
    """`draft_confidence_threshold`: the recipe's EAGLE-3 config plus a threshold answers the
    same, and chains end early (fewer draft tokens per draft than k = 3, which the head drafts
    on every step without it)."""
    config = {**SPECS["eagle3"], "model": str(eagle3_head), "draft_confidence_threshold": 0.6}
    args = [*SMALL_KV, "--speculative-config", json.dumps(config)]
    with sous_serve(args, tmp_path / "threshold.log", env=ENV) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        for text in PROMPTS:
            assert answer(chat(client, text)) == answer(chat(baseline, text)), text
        m = metrics(url)
    drafts, drafted = (m["vllm:spec_decode_num_drafts_total"],
                       m["vllm:spec_decode_num_draft_tokens_total"])
    assert drafts > 10 and drafted < 3 * drafts, (drafts, drafted)
    # Without the threshold 35 % of this head's drafts were accepted here, with it 69 %.
    assert m["vllm:spec_decode_num_accepted_tokens_total"] > 0.4 * drafted


def test_disable_by_batch_size_keeps_the_head_current(baseline, eagle3_head: Path,
                                                      tmp_path: Path) -> None:
    """EAGLE-3 with `disable_by_batch_size` 2: while more requests run, the head proposes
    nothing (it only passes over the new tokens, keeping its KV cache whole); when the two short
    answers end, the two long ones draft again mid-answer, their drafts are accepted, and every
    answer equals plain decoding."""
    config = {**SPECS["eagle3"], "model": str(eagle3_head), "disable_by_batch_size": 2}
    args = [*SMALL_KV, "--speculative-config", json.dumps(config)]
    asks = [(PROMPTS[0], 96), (PROMPTS[1], 96), (PROMPTS[2], 8), (PROMPTS[3], 12)]

    def run(c: openai.OpenAI) -> list[tuple[str, str, int]]:
        with ThreadPoolExecutor(len(asks)) as pool:
            return list(pool.map(lambda a: answer(chat(c, a[0], max_tokens=a[1])), asks))

    with sous_serve(args, tmp_path / "disable.log", env=ENV) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        assert run(client) == run(baseline)
        m = metrics(url)
    drafts, drafted = (m["vllm:spec_decode_num_drafts_total"],
                       m["vllm:spec_decode_num_draft_tokens_total"])
    assert 0 < drafts < 2 * 96, drafts  # only while at most 2 requests remain
    assert m["vllm:spec_decode_num_accepted_tokens_total"] > 0.2 * drafted, m


def test_sixteen_concurrent_with_preemption_equal_plain_decoding(baseline, spec) -> None:
    url, client = spec
    texts = [f"{PROMPTS[i % 2]} (version {i})" for i in range(16)]
    preempted = metrics(url)["vllm:num_preemptions_total"]

    def run(c: openai.OpenAI) -> list[tuple[str, str, int]]:
        with ThreadPoolExecutor(16) as pool:  # 16 x ~180 tokens: more than the 1264 it holds
            return list(pool.map(lambda t: answer(chat(
                c, t, max_tokens=100, extra_body={"ignore_eos": True})), texts))

    assert run(client) == run(baseline)
    assert metrics(url)["vllm:num_preemptions_total"] > preempted


def test_stop_strings_min_tokens_and_length_inside_accepted_runs(baseline, spec) -> None:
    _, client = spec
    text = PROMPTS[0]
    for extra in ({"stop": ["b\n\ndef"]}, {"stop": ["return a -"]}, {"max_tokens": 7},
                  {"extra_body": {"min_tokens": 40}, "stop": ["```"]}):
        kwargs = {"max_tokens": 96, **extra}
        assert answer(chat(client, text, **kwargs)) == answer(chat(baseline, text, **kwargs)), extra


def test_logprobs_of_accepted_tokens(baseline, spec) -> None:
    _, client = spec
    got = chat(client, PROMPTS[0], max_tokens=40, logprobs=True, top_logprobs=2)
    want = chat(baseline, PROMPTS[0], max_tokens=40, logprobs=True, top_logprobs=2)
    g, w = got.choices[0].logprobs.content, want.choices[0].logprobs.content
    assert [t.token for t in g] == [t.token for t in w]
    for a, b in zip(g, w, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=2e-3)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]


def test_structured_output_and_seeded_sampling(baseline, spec) -> None:
    _, client = spec
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    text = "Give a JSON object with name and age for Alice, 30."
    got = answer(chat(client, text, response_format=fmt))
    assert got == answer(chat(baseline, text, response_format=fmt))
    assert set(json.loads(got[0])) == {"name", "age"}
    seeded = [client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], temperature=0.8,
        top_p=0.95, seed=7, max_tokens=48).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1] and seeded[0]


@pytest.mark.parametrize("config,needle", [
    ('{"method": "ngram", "num_speculative_tokens": 3, "lookup": 2}', "unknown field 'lookup'"),
    ('{"method": "medusa2", "num_speculative_tokens": 3}', "unknown method 'medusa2'"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}', "suffix_decoding_min_token_prob"),
    ('{"method": "eagle3", "model": "/x/eagle3", "num_speculative_tokens": 0}',
     "num_speculative_tokens must be in [1, 32], got 0"),
])
def test_bad_speculative_config_exits_2_naming_it(config: str, needle: str) -> None:
    err = serve_flag_error(["--speculative-config", config])
    assert "--speculative-config" in err and needle in err, err


@pytest.mark.parametrize("config,needle", [
    ('{"method": "mtp", "num_speculative_tokens": 1}', "needs a model whose MTP modules sous runs"),
    ('{"method": "eagle3", "model": "/x/eagle3", "num_speculative_tokens": 3}',
     "is not an EAGLE-3 draft checkpoint here: no such folder"),
])
def test_drafter_the_model_cannot_serve_exits_2_naming_it(config: str, needle: str,
                                                          tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "sous.cli", "serve", "--speculative-config", config],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--speculative-config" in r.stderr and needle in r.stderr, r.stderr[-2000:]


def test_benchmark_smoke_reports_decode_speed_and_identical_answers(tmp_path: Path) -> None:
    """benchmarks/spec_decode.py, scaled down: the copy/edit workload through a server with
    and without suffix drafts; its JSON has both rates, acceptance, and identical answers."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "spec.json"
    r = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "spec_decode.py"), "--methods", "off,suffix",
         "--workloads", "edit", "--concurrency", "1", "--rounds", "1", "--max-tokens", "48",
         "--idle-wait", "0", "--disable-by-batch-size", "4", "--output", str(out)],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["configs"]["suffix"]["disable_by_batch_size"] == 4
    off, suffix = report["results"]["off"]["edit/1"], report["results"]["suffix"]["edit/1"]
    for case in (off, suffix):
        assert case["identical"] and case["output_tok_per_s"] > 0 and case["decode_tok_per_s"] > 0
    assert off["decode_ratio_vs_off"] == 1.0 and off["mean_acceptance_length"] is None
    assert suffix["mean_acceptance_length"] > 1.0  # the answer repeats the prompt's text
