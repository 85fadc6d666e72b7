"""`suffix`: suffix decoding (Oliaro et al., arXiv 2411.04975) on arctic-inference's suffix
trees, with vLLM's semantics.

Per request a local tree holds its prompt and its response so far; with
`suffix_decoding_max_cached_requests` > 0 a global tree also keeps the responses of the last
that many requests (FIFO), so a request can draft from what earlier requests answered. Each
step the request's newest tokens are added to its trees and the last `max_tree_depth` tokens
of its context are matched; the better-scoring of the local and global continuations is the
draft: at most `min(k, max_model_len - num_tokens - 1)` tokens, at most `max_spec_factor *`
the match length, and only while each token's estimated probability is at least
`min_token_prob`.

State: the `SuffixDecodingCache`, owned here. A request starts (its prompt is added) the
first time it samples, and stops when the runner says it is gone (`finish`).
"""

from __future__ import annotations

import numpy as np

from sous.config.errors import ConfigError
from sous.engine.input_batch import InputBatch
from sous.engine.spec_decode.config import FLAG, SpeculativeConfig
from sous.engine.spec_decode.proposer import TargetStep, draftable


class SuffixProposer:
    """Suffix-tree drafter (`--speculative-config '{"method": "suffix", ...}'`)."""

    uses_target_step = False

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as e:
            raise ConfigError(f"{FLAG}: method 'suffix' needs arctic-inference's suffix tree "
                              f"({e}); `make setup` builds it (pip install "
                              "arctic-inference==0.3.0 with a C++ compiler)") from None
        assert config.num_speculative_tokens is not None
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.max_tree_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.cache = SuffixDecodingCache(
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests)

    def propose(self, batch: InputBatch, sampled: dict[str, list[int]],
                target: TargetStep | None = None, draft: bool = True) -> dict[str, list[int]]:
        cache = self.cache
        for rid, tokens in sampled.items():
            if rid in cache.active_requests:
                cache.add_active_response(rid, tokens)
                continue
            if rid in cache.cached_requests:  # an id reused: its old response goes
                cache.evict_cached_response(rid)
            row = batch.req_id_to_index[rid]
            num_prompt = int(batch.num_prompt_tokens[row])
            cache.start_request(rid, _int32(batch.token_ids[row, :num_prompt]))
            cache.add_active_response(rid, _int32(batch.token_ids[row, num_prompt:
                                                                   batch.num_tokens[row]]))
        drafts: dict[str, list[int]] = {}
        if not draft:  # the trees above keep up; nothing to speculate
            return drafts
        ids, rows = draftable(batch, list(sampled))
        for rid, row in zip(ids, rows.tolist(), strict=True):
            num_tokens = int(batch.num_tokens[row])
            room = min(self.k, self.max_model_len - num_tokens - 1)
            if room <= 0:
                continue
            context = _int32(batch.token_ids[row, max(0, num_tokens - self.max_tree_depth):
                                             num_tokens])
            draft = cache.speculate(rid, context, max_spec_tokens=room,
                                    max_spec_factor=self.max_spec_factor,
                                    min_token_prob=self.min_token_prob)
            if draft.token_ids:
                drafts[rid] = list(draft.token_ids)
        return drafts

    def finish(self, req_ids: set[str]) -> None:
        for rid in req_ids & set(self.cache.active_requests):
            self.cache.stop_request(rid)


def _int32(tokens: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(tokens, dtype=np.int32)
