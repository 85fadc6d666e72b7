"""`sous serve <folder>` for every architecture sous runs: a greedy completion through the
`openai` client equals transformers' `generate` on the same tiny random checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from serve_process import sous_serve
from tiny_models import make_tiny_deepseek, make_tiny_llama, make_tiny_minimax_m2

MAKERS: dict[str, Callable[[Path], Path]] = {
    "llama": make_tiny_llama,
    "minimax_m2": make_tiny_minimax_m2,
    "deepseek_v3": lambda p: make_tiny_deepseek(p, "DeepseekV3ForCausalLM", seed=5),
    "deepseek_v32": lambda p: make_tiny_deepseek(p, "DeepseekV32ForCausalLM", seed=5),
    "axk2": lambda p: make_tiny_deepseek(p, "AXK2ForCausalLM", seed=5),
}
PROMPT = "the cat and the dog are big and the sun is red"


@pytest.mark.parametrize("arch", list(MAKERS))
def test_sous_serve_completion_equals_transformers(arch: str, tmp_path: Path) -> None:
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = MAKERS[arch](tmp_path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(PROMPT)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12,
                           min_new_tokens=12)[0, len(ids):].tolist()
    args = [str(path), "--dtype", "float32", "--max-model-len", "256", "--block-size", "16",
            "--kv-cache-memory-bytes", "16MiB", "--max-num-batched-tokens", "8"]
    # min_new_tokens bans EOS in transformers; vLLM's min_tokens does the same.
    with sous_serve(args, tmp_path / "server.log", env={"OMP_NUM_THREADS": "1"}) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                        temperature=0, extra_body={"min_tokens": 12})
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 12
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text == tok.decode(ids + want)[len(tok.decode(ids)):]
