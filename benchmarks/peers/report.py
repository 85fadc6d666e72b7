"""Machine description, ratios and the markdown table of benchmarks/peers.py (imported by it)."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def machine_info() -> dict[str, Any]:
    """CPU model, the ISA flags that matter for these engines, cores, memory and the date."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    try:
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kib = 0
    return {"cpu": model, "flags": {f: f in flags for f in FLAGS}, "cores": os.cpu_count(),
            "memory_gib": round(mem_kib / 2**20, 1), "kernel": platform.release(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def _metrics(row: dict[str, Any], levels: list[int]) -> dict[str, float | None]:
    out: dict[str, float | None] = {"single_stream": row.get("single_stream_tok_per_s")}
    for n in levels:
        out[f"{n}-way"] = (row.get("levels") or {}).get(str(n), {}).get("tok_per_s")
    return out


def ratios(engines: dict[str, Any], sous_label: str, levels: list[int]) -> dict[str, Any]:
    """For every sous row: its tok/s over the best peer's, per figure, naming that peer."""
    mine = {k: v for k, v in engines.items() if k.startswith(sous_label)}
    peers = {k: _metrics(v, levels) for k, v in engines.items() if k not in mine}
    out: dict[str, Any] = {}
    for name, row in mine.items():
        figures = {}
        for metric, value in _metrics(row, levels).items():
            scored = [(m[metric], p) for p, m in peers.items() if m.get(metric)]
            if value and scored:
                best, peer = max(scored)
                figures[metric] = {"ratio": round(value / best, 3), "best_peer": peer}
        out[name] = figures
    return out


def _cell(value: Any, fmt: str = "{:.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def markdown(report: dict[str, Any], levels: list[int]) -> str:
    """engine | ready | single stream | N-way... | TTFT p50/p99 at 16 | peak RSS, then ratios."""
    m = report["machine"]
    isa = ", ".join(f for f, on in m["flags"].items() if on) or "none of " + ", ".join(FLAGS)
    lines = [f"{m['cpu']}, {m['cores']} cores ({isa}), {m['date']}; "
             f"{report['workload']['max_tokens']} tokens per request", "",
             "| engine | ready (s) | single stream (tok/s) | "
             + " | ".join(f"{n}-way (tok/s)" for n in levels)
             + " | TTFT p50/p99 at 16 (ms) | peak RSS (MiB) | full length |",
             "|---" * (6 + len(levels)) + "|"]
    for name, row in report["engines"].items():
        if "skipped" in row or "error" in row:
            why = row.get("skipped") or row.get("error", "")
            kind = "skipped" if "skipped" in row else "error"
            lines.append(f"| {name} | {kind}: {why.splitlines()[0][:100]} |"
                         + " |" * (5 + len(levels)))
            continue
        lv = row.get("levels") or {}
        ttft = (lv.get("16") or {}).get("ttft_ms") or {}
        ttft_cell = (f"{ttft['p50']:.0f} / {ttft['p99']:.0f}" if ttft.get("p50") is not None
                     else "–")
        cells = [_cell(row.get("ready_s"), "{:.2f}"), _cell(row.get("single_stream_tok_per_s")),
                 *(_cell((lv.get(str(n)) or {}).get("tok_per_s")) for n in levels),
                 ttft_cell, _cell(row.get("peak_rss_mib"), "{:.0f}"),
                 "yes" if row.get("all_full_length") else "NO"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, figures in report.get("ratios", {}).items():
        parts = [f"{k} {v['ratio']:.2f}x ({v['best_peer']})" for k, v in figures.items()]
        lines.append("")
        lines.append(f"{name} / best peer: " + ("; ".join(parts) or "no peer figures"))
    prof = report.get("attention_profile") or {}
    if all("attention_share" in (prof.get(k) or {}) for k in ("torch", "cpp")):
        lines.append("")
        lines.append("attention share of sous' step time (torch profiler): "
                     f"torch {prof['torch']['attention_share']:.1%}, "
                     f"cpp {prof['cpp']['attention_share']:.1%}")
    return "\n".join(lines) + "\n"
