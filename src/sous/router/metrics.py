"""The router's own Prometheus metrics (text format), rendered at scrape time.

- `sous:router_requests_total{endpoint, profile}`: legs sent, per endpoint and profile
  (`decode`, `prefill`, or `fail-open`);
- `sous:router_decisions_total{decision}`: `disaggregated`, `decode-only`, `fail-open`,
  `rejected` (FailClose, or no endpoint at all);
- `sous:router_retries_total{role}`: legs re-sent to another endpoint after a connection
  error or a 502/503/504;
- `sous:router_endpoint_healthy{endpoint, role}`, `sous:router_endpoint_waiting_requests`,
  `sous:router_endpoint_kv_cache_usage_perc` and `sous:router_endpoint_scrape_age_seconds`
  (seconds since the last good scrape; -1 before the first).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from sous.router.framework import Endpoint

__all__ = ["RouterMetrics"]


def _labels(**kv: str) -> str:
    return ",".join(f'{k}="{v}"' for k, v in kv.items())


class RouterMetrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()
        self.decisions: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()

    def render(self, endpoints: Sequence[Endpoint]) -> str:
        out: list[str] = []

        def family(name: str, kind: str, text: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{{{labels}}} {float(v)!r}" for labels, v in samples)

        family("sous:router_requests_total", "counter", "Request legs sent, per endpoint and "
               "scheduling profile.",
               [(_labels(endpoint=e, profile=p), n) for (e, p), n in sorted(self.requests.items())])
        family("sous:router_decisions_total", "counter", "Routing decisions.",
               [(_labels(decision=d), n) for d, n in sorted(self.decisions.items())])
        family("sous:router_retries_total", "counter", "Legs re-sent to another endpoint.",
               [(_labels(role=r), n) for r, n in sorted(self.retries.items())])
        now = time.monotonic()
        rows = [(e, _labels(endpoint=e.url, role=e.role or "")) for e in endpoints]
        family("sous:router_endpoint_healthy", "gauge", "1 while the endpoint answers.",
               [(lab, float(e.healthy)) for e, lab in rows])
        family("sous:router_endpoint_waiting_requests", "gauge",
               "Scraped vllm:num_requests_waiting.", [(lab, e.metrics.waiting) for e, lab in rows])
        family("sous:router_endpoint_kv_cache_usage_perc", "gauge",
               "Scraped vllm:kv_cache_usage_perc.", [(lab, e.metrics.kv_usage) for e, lab in rows])
        family("sous:router_endpoint_scrape_age_seconds", "gauge",
               "Seconds since the endpoint's last good scrape (-1: never).",
               [(lab, -1.0 if e.metrics.scraped_at is None else now - e.metrics.scraped_at)
                for e, lab in rows])
        return "\n".join(out) + "\n"
