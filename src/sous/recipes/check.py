"""`sous recipe check`: the memory fit of a composed plan, or of a model without a recipe.

From a plan, each engine process's flags give its inputs (`--block-size`,
`--max-model-len`, `--max-num-seqs`, `--kv-cache-dtype`, the parallel sizes,
`--gpu-memory-utilization`, the speculative tokens of `--speculative-config`); the
strategy's variant gives the weight format, the option's SKU the device. `CheckOverrides`
replace any of them (a what-if), and a model without a recipe uses them directly.
Processes with the same inputs (the ranks of one role) are reported once.

Public API: `CheckOverrides`, `CheckRow`, `inputs_for_process`, `check_plan`, `check_model`,
`render_check_text`, `check_to_dict`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sous.recipes.archs import ARCHS, ModelArch, find_arch
from sous.recipes.compose import Plan, Process
from sous.recipes.fit import DEVICES, GIB, DeviceSpec, FitInputs, FitReport, fit
from sous.recipes.schema import RecipeError

__all__ = [
    "CheckOverrides",
    "CheckRow",
    "check_model",
    "check_plan",
    "check_to_dict",
    "inputs_for_process",
    "render_check_text",
]


@dataclass(frozen=True)
class CheckOverrides:
    """Values given on the command line; None keeps the recipe's (or the default)."""

    block_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None
    weight_format: str | None = None
    device: str | None = None
    device_memory_gib: float | None = None


@dataclass(frozen=True)
class CheckRow:
    """The fit of one process, or of several identical ones (`labels`)."""

    labels: tuple[str, ...]
    report: FitReport


def _device(name: str | None, memory_gib: float | None) -> DeviceSpec:
    if name is not None and name in DEVICES:
        spec = DEVICES[name]
    elif memory_gib is None:
        known = ", ".join(DEVICES)
        raise RecipeError(f"unknown device {name!r}: give --device-memory GIB "
                          f"(known devices: {known})")
    else:
        spec = DeviceSpec(name or "device", 0)
    if memory_gib is not None:
        spec = dataclasses.replace(spec, memory_bytes=int(memory_gib * GIB))
    return spec


def _arch(model: str) -> tuple[ModelArch, str | None]:
    found = find_arch(model)
    if found is None:
        raise RecipeError(f"no architecture numbers for model {model!r} "
                          f"(known: {', '.join(ARCHS)})")
    return found


def _int(process: Process, flag: str) -> int | None:
    arg = process.arg(flag)
    value = None if arg is None else arg.value
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _lookahead(process: Process) -> int:
    arg = process.arg("--speculative-config")
    value = None if arg is None else arg.value
    n = value.get("num_speculative_tokens", 0) if isinstance(value, dict) else 0
    return n if isinstance(n, int) else 0


def _pick(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def inputs_for_process(process: Process, plan: Plan, over: CheckOverrides) -> FitInputs:
    """The fit inputs of one composed process (RecipeError for an unknown model/device)."""
    arch, fmt = _arch(process.model)
    skus = plan.option.skus
    dtype = process.arg("--kv-cache-dtype")
    util = process.arg("--gpu-memory-utilization")
    max_len = _pick(over.max_model_len, _int(process, "--max-model-len"), arch.max_position, 0)
    if not max_len:
        raise RecipeError(f"{process.label}: no --max-model-len and {arch.name} publishes no "
                          "maximum; give --max-model-len")
    return FitInputs(
        arch=arch,
        block_size=_pick(over.block_size, _int(process, "--block-size"), 16),
        max_model_len=max_len,
        max_num_seqs=_pick(over.max_num_seqs, _int(process, "--max-num-seqs"), 1),
        kv_cache_dtype=str(_pick(over.kv_cache_dtype, dtype.value if dtype else None, "auto")),
        weight_format=_pick(over.weight_format, fmt, plan.variant, arch.checkpoint_format),
        tensor_parallel_size=_pick(over.tensor_parallel_size,
                                   _int(process, "--tensor-parallel-size"), 1),
        pipeline_parallel_size=_pick(over.pipeline_parallel_size,
                                     _int(process, "--pipeline-parallel-size"), 1),
        data_parallel_size=_pick(over.data_parallel_size,
                                 _int(process, "--data-parallel-size"), 1),
        lookahead_tokens=_lookahead(process),
        gpu_memory_utilization=float(_pick(over.gpu_memory_utilization,
                                           util.value if util else None, 0.9)),
        device=_device(_pick(over.device, skus[0] if skus else None, "RBLN-CR13"),
                       over.device_memory_gib),
    )


def _grouped(labelled: Sequence[tuple[Process, FitInputs]]) -> list[CheckRow]:
    groups: dict[FitInputs, list[Process]] = {}
    for process, inputs in labelled:
        groups.setdefault(inputs, []).append(process)
    return [CheckRow(_labels(procs), fit(inputs)) for inputs, procs in groups.items()]


def _labels(processes: Sequence[Process]) -> tuple[str, ...]:
    """`("decode ranks 0-3",)` for the contiguous ranks of a role, else one label each."""
    out: list[str] = []
    for role in dict.fromkeys(p.role for p in processes):
        ranks = [p.rank for p in processes if p.role == role]
        ints = [r for r in ranks if r is not None]
        if len(ints) > 1 and len(ints) == len(ranks) and ints == list(range(ints[0], ints[-1] + 1)):
            out.append(f"{role} ranks {ints[0]}-{ints[-1]}")
        else:
            out += [role if r is None else f"{role} rank {r}" for r in ranks]
    return tuple(out)


def _checked(make: Any) -> Any:
    try:
        return make()
    except ValueError as e:  # unknown dtype or weight format
        raise RecipeError(str(e)) from None


def check_plan(plan: Plan, over: CheckOverrides | None = None) -> list[CheckRow]:
    """The fit of every process of a plan; identical processes share one row."""
    over = over or CheckOverrides()
    labelled = [(p, inputs_for_process(p, plan, over)) for p in plan.processes]
    return _checked(lambda: _grouped(labelled))


def check_model(model: str, over: CheckOverrides, lookahead_tokens: int = 0) -> CheckRow:
    """The fit of one engine process of `model` with the given settings (no recipe)."""
    arch, fmt = _arch(model)
    max_len = _pick(over.max_model_len, arch.max_position, 0)
    if not max_len:
        raise RecipeError(f"{arch.name} publishes no maximum context; give --max-model-len")
    inputs = FitInputs(
        arch=arch, block_size=_pick(over.block_size, 16), max_model_len=max_len,
        max_num_seqs=_pick(over.max_num_seqs, 1),
        kv_cache_dtype=_pick(over.kv_cache_dtype, "auto"),
        weight_format=_pick(over.weight_format, fmt, arch.checkpoint_format),
        tensor_parallel_size=_pick(over.tensor_parallel_size, 1),
        pipeline_parallel_size=_pick(over.pipeline_parallel_size, 1),
        data_parallel_size=_pick(over.data_parallel_size, 1),
        lookahead_tokens=lookahead_tokens,
        gpu_memory_utilization=_pick(over.gpu_memory_utilization, 0.9),
        device=_device(_pick(over.device, "RBLN-CR13"), over.device_memory_gib))
    return _checked(lambda: CheckRow(("engine",), fit(inputs)))


# ----------------------------------------------------------------------------- output


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _layout(i: FitInputs) -> str:
    return (f"TP{i.tensor_parallel_size} PP{i.pipeline_parallel_size} "
            f"DP{i.data_parallel_size}")


def _row_lines(row: CheckRow) -> list[str]:
    r, i = row.report, row.report.inputs
    dev = i.device
    room = max(r.kv_room_bytes, 0)
    need = r.kv_bytes * r.replication
    verdict = {"fits": f"FITS: {_gib(need)} of KV in {_gib(room)}",
               "partial": f"PARTIAL: {r.full_length_seqs_that_fit} of {i.max_num_seqs} "
                          f"full-length sequences fit in {_gib(room)} (the engine starts: "
                          "it needs one)",
               "does not fit": f"DOES NOT FIT: {_gib(need)} of KV, {_gib(room)} free "
                               "after weights"}[r.verdict]
    repl = f", kept x{r.replication} (kv heads per rank < {dev.chiplets} chiplets)" \
        if r.replication > 1 else ""
    look = f" + {i.lookahead_tokens} speculative" if i.lookahead_tokens else ""
    top = i.arch.max_position
    cap = f" (the model's maximum is {top:,})" if top and r.max_model_len_that_fits > top else ""
    return [
        f"{', '.join(row.labels)}: {i.arch.name}, {i.weight_format} weights, "
        f"KV {i.kv_cache_dtype}{' (bf16)' if i.kv_cache_dtype == 'auto' else ''}, block {i.block_size}, {_layout(i)}",
        f"  KV bytes per token        {r.kv_bytes_per_token:,} B per rank",
        f"  KV cache per sequence     {_gib(r.kv_bytes_per_seq)} "
        f"(({r.blocks_per_seq} + 1) blocks x {i.block_size} tokens for "
        f"{i.max_model_len:,}{look} tokens)",
        f"  KV cache per rank         {_gib(r.kv_bytes)} for --max-num-seqs {i.max_num_seqs}"
        f"{repl}",
        f"  weights per rank          {_gib(r.weight_bytes)}",
        f"  device memory             {dev.name} {_gib(dev.memory_bytes)} x "
        f"{i.gpu_memory_utilization:.2f} = {_gib(r.budget_bytes)}"
        + (f", minus {_gib(dev.reserve_bytes)} runtime reserve" if dev.reserve_bytes else ""),
        f"  verdict                   {verdict}",
        f"  largest --max-model-len   {r.max_model_len_that_fits:,} tokens for "
        f"{i.max_num_seqs} sequence(s)" + cap,
    ]


def render_check_text(rows: Sequence[CheckRow], title: str) -> str:
    """Human-readable report: a title line, then one block per row."""
    blocks = [title] + ["\n".join(_row_lines(row)) for row in rows]
    return "\n\n".join(blocks) + "\n"


def check_to_dict(rows: Sequence[CheckRow]) -> list[dict[str, Any]]:
    """One JSON object per row: its inputs, every figure in bytes, and the verdict."""
    out = []
    for row in rows:
        r, i = row.report, row.report.inputs
        out.append({
            "processes": list(row.labels),
            "model": i.arch.name,
            "inputs": {
                "block_size": i.block_size, "max_model_len": i.max_model_len,
                "max_num_seqs": i.max_num_seqs, "kv_cache_dtype": i.kv_cache_dtype,
                "weight_format": i.weight_format, "tensor_parallel_size": i.tensor_parallel_size,
                "pipeline_parallel_size": i.pipeline_parallel_size,
                "data_parallel_size": i.data_parallel_size,
                "lookahead_tokens": i.lookahead_tokens,
                "gpu_memory_utilization": i.gpu_memory_utilization,
                "device": i.device.name, "device_memory_bytes": i.device.memory_bytes,
            },
            "kv_bytes_per_token": r.kv_bytes_per_token,
            "blocks_per_seq": r.blocks_per_seq,
            "kv_bytes_per_seq": r.kv_bytes_per_seq,
            "kv_bytes_per_rank": r.kv_bytes,
            "kv_replication": r.replication,
            "weight_bytes_per_rank": r.weight_bytes,
            "budget_bytes": r.budget_bytes,
            "kv_room_bytes": r.kv_room_bytes,
            "verdict": r.verdict,
            "fits": r.fits,
            "full_length_seqs_that_fit": r.full_length_seqs_that_fit,
            "max_model_len_that_fits": r.max_model_len_that_fits,
        })
    return out
