"""Training data for `sous draft train`: the served model's own greedy answers to a prompt
corpus, with the hidden states an EAGLE-3 head reads, captured by the engine's model.

The corpus is generated from topic x task templates (deterministic, `prompts(n)`), or read
from a file. Each `Sample` holds the chat-formatted prompt and the
greedy answer as one token sequence, the prompt length, and the target's aux hidden states
(layers `aux_layers`, concatenated: `[num_tokens, 3 * hidden]`, float16 to halve memory).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sous.engine.attention import AttentionMetadata

_TOPICS = (
    "the sea", "volcanoes", "honey bees", "the moon", "bread baking", "chess", "rainforests",
    "the Roman Empire", "electric cars", "photosynthesis", "jazz", "mountain climbing",
    "coffee", "the printing press", "black holes", "recycling", "the human heart", "robots",
    "ancient Egypt", "the internet", "deserts", "penguins", "solar power", "gardening",
    "the water cycle", "trains", "friendship", "earthquakes", "the Olympic games", "music",
    "dinosaurs", "clouds", "vaccines", "libraries", "the stock market", "sleep", "cheese",
    "airplanes", "coral reefs", "painting", "Python programming", "sorting algorithms",
    "databases", "the French Revolution", "climate change", "owls", "rivers", "bicycles",
    "tea", "the immune system", "glaciers", "space travel", "cats", "dogs", "maps",
    "mathematics", "wind", "castles", "the Great Wall of China", "rain",
)
_TASKS = (
    "Write a short essay about {t}.", "Explain {t} to a ten-year-old.",
    "List five interesting facts about {t}.", "Write a short story involving {t}.",
    "What are the pros and cons of {t}?", "Describe the history of {t} in a few paragraphs.",
    "Write a poem about {t}.", "Give me three questions and answers about {t}.",
)


def prompts(n: int, path: Path | None = None) -> list[str]:
    """`n` prompts: from `path` (a `.json` list of strings, else one prompt per line; cycled)
    or the built-in templates."""
    if path is not None:
        text = path.read_text()
        if path.suffix == ".json":
            lines = [str(x) for x in json.loads(text)]
        else:
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"{path}: no prompts")
        return list(itertools.islice(itertools.cycle(lines), n))
    pairs = [task.format(t=topic) for task in _TASKS for topic in _TOPICS]
    order = np.random.default_rng(0).permutation(len(pairs))
    return [pairs[i] for i in itertools.islice(itertools.cycle(order), n)]


@dataclass
class Sample:
    token_ids: torch.Tensor
    """Prompt then greedy answer, int64 `[N]`."""
    num_prompt_tokens: int
    aux: torch.Tensor
    """float16 `[N, 3 * hidden]`: the target's aux hidden states at each position."""


def generate(llm: Any, texts: list[str], max_tokens: int) -> list[tuple[list[int], int]]:
    """(chat-formatted prompt + greedy answer token ids, prompt length) for each prompt, from
    the engine."""
    from sous.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.chat([[{"role": "user", "content": t}] for t in texts], params)
    return [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids))
            for o in outs]


@torch.inference_mode()
def capture_aux(model: Any, token_ids: list[int], aux_layers: tuple[int, ...],
                device: torch.device, block_size: int = 16) -> torch.Tensor:
    """The target's aux hidden states over `token_ids` (one prefill in a scratch KV cache)."""
    n = len(token_ids)
    num_blocks = (n + block_size - 1) // block_size
    caches = model.kv_cache_spec().allocate(num_blocks, block_size, device)
    meta = AttentionMetadata.build(query_lens=[n], seq_lens=[n],
                                   block_tables=np.arange(num_blocks)[None, :],
                                   block_size=block_size, device=device)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    _, aux = model(ids, meta.positions, caches, meta, aux_hidden_state_layers=aux_layers)
    return torch.cat(aux, dim=-1).to(torch.float16).cpu()


@torch.inference_mode()
def dense_lm_head(model: Any, hidden_size: int, device: torch.device) -> torch.Tensor:
    """The target's output projection as a dense float32 `[vocab, hidden]` matrix (whatever
    form its weights are kept in): its logits for the unit vectors."""
    eye = torch.eye(hidden_size, dtype=model.dtype, device=device)
    return model.compute_logits(eye).float().t().contiguous().cpu()


def draft_vocabulary(samples: list[Sample], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids most frequent in the answers (ascending ids): the draft vocab."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        counts.index_add_(0, s.token_ids[s.num_prompt_tokens:],
                          torch.ones(len(s.token_ids) - s.num_prompt_tokens, dtype=torch.int64))
    ranked = torch.argsort(counts, descending=True, stable=True)[:size]
    return ranked.sort().values
