"""Speculative decoding counters and vLLM's periodic log line.

Counted per verified draft, i.e. per request and step that had at least one draft token
(vLLM's `SpecDecodingStats.observe_draft`, called by the scheduler when it applies a step's
output): `num_drafts` += 1, `num_draft_tokens` += the drafts scheduled, `num_accepted_tokens`
+= those accepted, and `num_accepted_tokens_per_pos[j]` += 1 for each accepted position j.
Derived: acceptance rate = accepted / drafted tokens; mean acceptance length = 1 + accepted /
drafts (it counts the bonus or recovered token every verification emits); per-position rate =
accepted at j / drafts. Prometheus names: `vllm:spec_decode_num_drafts`,
`vllm:spec_decode_num_draft_tokens`, `vllm:spec_decode_num_accepted_tokens`,
`vllm:spec_decode_num_accepted_tokens_per_pos{position}`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class SpecDecodingStats:
    """Counters over some steps (one step's, or merged over a logging interval)."""

    num_spec_tokens: int
    """k: the positions tracked in `num_accepted_tokens_per_pos`."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    """[k]: how many drafts had position j accepted."""

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        if len(self.num_accepted_tokens_per_pos) != self.num_spec_tokens:
            raise ValueError(f"num_accepted_tokens_per_pos needs {self.num_spec_tokens} "
                             f"entries, got {len(self.num_accepted_tokens_per_pos)}")

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verification: `num_draft_tokens` (>= 1) drafts, of which the first
        `num_accepted` were accepted. ValueError unless 0 <= accepted <= drafted <= k."""
        if not 0 <= num_accepted <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(f"need 0 <= num_accepted ({num_accepted}) <= num_draft_tokens "
                             f"({num_draft_tokens}) <= k ({self.num_spec_tokens})")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.num_accepted_tokens_per_pos[j] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))

    def merge(self, other: SpecDecodingStats) -> None:
        """Add `other`'s counts into these (per-position lists are padded to the longer)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = other.num_accepted_tokens_per_pos
        if len(per_pos) > self.num_spec_tokens:
            self.num_accepted_tokens_per_pos += [0] * (len(per_pos) - self.num_spec_tokens)
            self.num_spec_tokens = len(per_pos)
        for j, count in enumerate(per_pos):
            self.num_accepted_tokens_per_pos[j] += count

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (nan before any draft)."""
        if not self.num_draft_tokens:
            return float("nan")
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted tokens per draft: tokens emitted per verification (1.0 before any)."""
        if not self.num_drafts:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        """[k]: accepted at position j / drafts (zeros before any draft)."""
        drafts = self.num_drafts or 1
        return [c / drafts for c in self.num_accepted_tokens_per_pos]

    def log_line(self, elapsed_s: float | None = None) -> str:
        """vLLM's line. With `elapsed_s` (the interval these counts cover) it also gives the
        accepted / drafted throughputs, as vLLM's periodic logger does."""
        rates = ", ".join(f"{r:.3f}" for r in self.per_position_acceptance_rate)
        parts = [f"Mean acceptance length: {self.mean_acceptance_length:.2f}"]
        if elapsed_s is not None:
            secs = elapsed_s if elapsed_s > 0 else float("inf")
            parts += [f"Accepted throughput: {self.num_accepted_tokens / secs:.2f} tokens/s",
                      f"Drafted throughput: {self.num_draft_tokens / secs:.2f} tokens/s"]
        parts += [f"Accepted: {self.num_accepted_tokens} tokens",
                  f"Drafted: {self.num_draft_tokens} tokens",
                  f"Per-position acceptance rate: {rates}",
                  f"Avg Draft acceptance rate: {self.acceptance_rate * 100:.1f}%"]
        return "SpecDecoding metrics: " + ", ".join(parts)


def _minus(a: SpecDecodingStats, b: SpecDecodingStats) -> SpecDecodingStats:
    """`a`'s counts less `b`'s (an interval of cumulative counters)."""
    per_pos = [x - y for x, y in zip(a.num_accepted_tokens_per_pos,
                                     b.num_accepted_tokens_per_pos, strict=True)]
    return SpecDecodingStats(a.num_spec_tokens, a.num_drafts - b.num_drafts,
                             a.num_draft_tokens - b.num_draft_tokens,
                             a.num_accepted_tokens - b.num_accepted_tokens, per_pos)


class SpecDecodingLogger:
    """Logs vLLM's line for each interval of at least `interval_s` seconds in which drafts
    were verified (vLLM's periodic stat logger, every 10 s)."""

    def __init__(self, num_spec_tokens: int, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last = SpecDecodingStats(num_spec_tokens)
        self._last_time = time.monotonic()

    def maybe_log(self, total: SpecDecodingStats) -> None:
        """`total`: the cumulative counters now (not kept; copied as needed)."""
        now = time.monotonic()
        if now - self._last_time < self.interval_s or total.num_drafts == self._last.num_drafts:
            return
        logger.info("%s", _minus(total, self._last).log_line(now - self._last_time))
        self._last = total.copy()
        self._last_time = now
