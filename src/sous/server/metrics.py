"""Prometheus metrics with vLLM's names, in the text exposition format (version 0.0.4).

A small self-contained writer (no prometheus-client dependency). Every sample carries the
labels `model_name` and `engine="0"`, like vLLM v1. Engine gauges and the preemption and
prefix-cache counters are read from `engine.get_stats()` at scrape time; the per-request
counters and histograms are recorded by the serving code through `RequestMetrics`.
Everything runs on the server's event loop, so no locking.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import Any

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISHED_REASONS = ("stop", "length", "abort")
KV_CONNECTOR_COUNTERS = {
    "kv_transfers": "P/D KV reads from a prefill server completed.",
    "kv_transfer_bytes": "Bytes of KV cache those reads moved.",
    "kv_transfer_seconds": "Seconds those reads took (start to seen done).",
}
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def buckets_1_2_5(max_value: int) -> list[float]:
    """[1, 2, 5, 10, 20, 50, ...] up to max_value (vLLM's token-count buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exponent
            if v > max_value:
                return out
            out.append(float(v))
        exponent += 1


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v))


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Histogram:
    def __init__(self, buckets: list[float]) -> None:
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cum = [], 0
        for bound, c in zip([*self.bounds, float("inf")], self.counts, strict=True):
            cum += c
            out.append(f'{name}_bucket{{{labels},le="{_fmt(bound)}"}} {_fmt(cum)}')
        out.append(f"{name}_count{{{labels}}} {_fmt(self.count)}")
        out.append(f"{name}_sum{{{labels}}} {_fmt(self.sum)}")
        return out


class ServerMetrics:
    """All metrics of one served model."""

    def __init__(self, model_name: str, max_model_len: int,
                 cache_info: dict[str, str] | None = None) -> None:
        self.model_label = f'model_name="{_escape(model_name)}"'
        self.labels = f'engine="0",{self.model_label}'
        self.cache_info = cache_info or {}
        token_buckets = buckets_1_2_5(max(max_model_len, 1))
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = dict.fromkeys(FINISHED_REASONS, 0)
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.tpot = _Histogram(TPOT_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.req_prompt = _Histogram(token_buckets)
        self.req_generation = _Histogram(token_buckets)
        self.prompt_sources: dict[str, int] = dict.fromkeys(PROMPT_SOURCES, 0)
        self.prompt_tokens_cached = 0
        self.prompt_tokens_recomputed = 0

    def count_prompt_sources(self, total: int, cached: int, external: int) -> None:
        """vLLM's prompt token accounting: `cached` tokens were not computed, `external` of
        them loaded by a KV connector. When all of a prompt was available, its last token was
        recomputed for its logits: it counts as computed and as recomputed."""
        recomputed = 1 if total > 0 and cached == total - 1 and external > 0 else 0
        self.prompt_sources["local_compute"] += total - cached
        self.prompt_sources["external_kv_transfer"] += external
        self.prompt_sources["local_cache_hit"] += cached + recomputed - external
        self.prompt_tokens_cached += cached
        self.prompt_tokens_recomputed += recomputed

    def start(self, prompt_tokens: int) -> RequestMetrics:
        """Track one engine request (one prompt, all its n choices)."""
        return RequestMetrics(self, prompt_tokens)

    def render(self, stats: Any | None) -> str:
        """The exposition text. `stats` is the engine's `get_engine_stats()` ({engine index:
        stats}; data parallel servers have one per rank), a single `get_stats()` snapshot
        (engine 0), or None if unavailable. Engine gauges and counters carry each engine's
        label; the per-request ones are the API server's (engine "0")."""
        lab = self.labels
        engines: dict[int, Any] = stats if isinstance(stats, dict) else {0: stats}
        out: list[str] = []

        def head(name: str, kind: str, text: str) -> None:
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")

        def per_engine(name: str, value: Callable[[Any], float], extra: str = "") -> None:
            for index, st in sorted(engines.items()):
                labels = f'engine="{index}",{self.model_label}'
                out.append(f"{name}{{{labels}{extra}}} {_fmt(value(st) if st is not None else 0)}")

        def stat(field: str) -> Callable[[Any], float]:
            return lambda st: float(getattr(st, field, 0) or 0)

        for name, field, text in (
                ("vllm:num_requests_running", "num_running",
                 "Number of requests in model execution batches."),
                ("vllm:num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
                ("vllm:kv_cache_usage_perc", "kv_cache_usage",
                 "KV-cache usage. 1 means 100 percent usage.")):
            head(name, "gauge", text)
            per_engine(name, stat(field))
        if self.cache_info:  # read by routers (llm-d: block size, index capacity)
            head("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
            info = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(self.cache_info.items()))
            per_engine("vllm:cache_config_info", lambda st: 1.0, "," + info)
        for name, field, text in (
                ("vllm:num_preemptions_total", "num_preemptions",
                 "Cumulative number of preemptions from the engine."),
                ("vllm:prefix_cache_queries_total", "prefix_cache_queries",
                 "Prefix cache queries, in terms of number of queried tokens."),
                ("vllm:prefix_cache_hits_total", "prefix_cache_hits",
                 "Prefix cache hits, in terms of number of cached tokens."),
                ("sous:kv_load_failures_total", "num_kv_load_failures",
                 "KV connector loads (offload tiers, P/D transfers) that fell short; their "
                 "requests recomputed the missing tokens or failed.")):
            head(name, "counter", text)
            per_engine(name, stat(field))
        for name, value, text in (
                ("vllm:prompt_tokens_total", self.prompt_tokens, "Number of prefill tokens processed."),
                ("vllm:generation_tokens_total", self.generation_tokens,
                 "Number of generation tokens processed.")):
            head(name, "counter", text)
            out.append(f"{name}{{{lab}}} {_fmt(value)}")
        head("vllm:prompt_tokens_by_source_total", "counter", "Number of prompt tokens by source.")
        for source, n in self.prompt_sources.items():
            out.append(f'vllm:prompt_tokens_by_source_total{{{lab},source="{source}"}} {_fmt(n)}')
        for name, value, text in (
                ("vllm:prompt_tokens_cached_total", self.prompt_tokens_cached,
                 "Number of cached prompt tokens (local prefix cache and KV connectors)."),
                ("vllm:prompt_tokens_recomputed_total", self.prompt_tokens_recomputed,
                 "Number of cached prompt tokens recomputed for their logits.")):
            head(name, "counter", text)
            out.append(f"{name}{{{lab}}} {_fmt(value)}")
        for key, text in KV_CONNECTOR_COUNTERS.items():
            name = f"sous:{key}_total"
            head(name, "counter", text)
            per_engine(name, lambda st, key=key: (st.kv_connector_stats or {}).get(key, 0))
        self._render_spec_decoding(engines, head, per_engine)
        head("vllm:request_success_total", "counter", "Count of successfully processed requests.")
        for reason, n in self.success.items():
            out.append(f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} {_fmt(n)}')
        for name, hist, text in (
                ("vllm:time_to_first_token_seconds", self.ttft, "Histogram of time to first token in seconds."),
                ("vllm:time_per_output_token_seconds", self.tpot,
                 "Histogram of time per output token in seconds."),
                ("vllm:e2e_request_latency_seconds", self.e2e,
                 "Histogram of e2e request latency in seconds."),
                ("vllm:request_prompt_tokens", self.req_prompt,
                 "Number of prefill tokens processed."),
                ("vllm:request_generation_tokens", self.req_generation,
                 "Number of generation tokens processed.")):
            head(name, "histogram", text)
            out.extend(hist.lines(name, lab))
        return "\n".join(out) + "\n"

    @staticmethod
    def _render_spec_decoding(engines: dict[int, Any], head: Callable[[str, str, str], None],
                              per_engine: Callable[..., None]) -> None:
        """vLLM's speculative decoding counters (cumulative), when drafting is configured."""
        specs = {i: getattr(st, "spec_decoding", None) for i, st in engines.items()}
        if all(spec is None for spec in specs.values()):
            return
        for key, text in (("num_drafts", "Number of spec decoding drafts."),
                          ("num_draft_tokens", "Number of draft tokens."),
                          ("num_accepted_tokens", "Number of accepted tokens.")):
            name = f"vllm:spec_decode_{key}_total"
            head(name, "counter", text)
            per_engine(name, lambda st, key=key: getattr(st.spec_decoding, key, 0))
        name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        head(name, "counter", "Accepted tokens per draft position.")
        positions = max(len(s.num_accepted_tokens_per_pos) for s in specs.values() if s)
        for j in range(positions):
            per_engine(name, lambda st, j=j: st.spec_decoding.num_accepted_tokens_per_pos[j],
                       f',position="{j}"')


class RequestMetrics:
    """Timing of one engine request; call `tokens()` as outputs arrive and `finish()` once."""

    __slots__ = ("_m", "arrival", "first_token", "prompt_tokens", "generated", "done",
                 "num_cached", "num_external")

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int) -> None:
        self._m = metrics
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.prompt_tokens = prompt_tokens
        self.generated = 0
        self.done = False
        self.num_cached = 0
        self.num_external = 0

    def cached(self, num_cached: int, num_external: int) -> None:
        """Prompt tokens the engine did not compute: `num_cached` in all, `num_external` of
        them loaded by a KV connector."""
        self.num_cached, self.num_external = num_cached, num_external

    def tokens(self, n: int) -> None:
        """`n` new tokens arrived (any choice)."""
        if n and self.first_token is None:
            self.first_token = time.monotonic()
            self._m.ttft.observe(self.first_token - self.arrival)
        self.generated += n

    def finish(self, reasons: list[str]) -> None:
        """The request ended; `reasons` has one finish reason per choice (`abort` if cut)."""
        if self.done:
            return
        self.done = True
        m, now = self._m, time.monotonic()
        for r in reasons:
            m.success[r] = m.success.get(r, 0) + 1
        m.prompt_tokens += self.prompt_tokens
        m.count_prompt_sources(self.prompt_tokens, self.num_cached, self.num_external)
        m.generation_tokens += self.generated
        m.e2e.observe(now - self.arrival)
        m.req_prompt.observe(self.prompt_tokens)
        m.req_generation.observe(self.generated)
        if self.first_token is not None and self.generated > 1:
            m.tpot.observe((now - self.first_token) / (self.generated - 1))
