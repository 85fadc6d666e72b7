"""vLLM-compatible flags for `sous serve`, built from the frozen config dataclasses.

Every field of ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoadConfig,
EngineConfig (its scalar fields) and ServerConfig becomes `--field-name`; the field's
docstring is the flag's help, `Literal[...]` gives the choices, bools get `--x/--no-x`.
Names, defaults and meanings follow vLLM. Flags sous parses but does not implement yet are
listed in ONE table, `NOT_SUPPORTED_YET`: start-up exits with status 2 naming each of them
(nothing is silently ignored). Delete a row when the feature lands.

Public API: `make_serve_parser`, `parse_serve_args`, `engine_config_from_kwargs`,
`human_readable_int`, `NOT_SUPPORTED_YET`, `NotSupportedYetError`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import logging
import os
import sys
import textwrap
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, NoReturn

from sous.config import (
    CacheConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
)
from sous.config.env_vars import env_values
from sous.config.flag_utils import (
    at_least,
    class_doc,
    field_docs,
    human_readable_int,
    parse_float,
    parse_int,
    parse_json_object,
    parse_max_model_len,
    unwrap_optional,
)

__all__ = [
    "NOT_SUPPORTED_YET",
    "NotSupportedYetError",
    "NotYet",
    "engine_config_from_kwargs",
    "human_readable_int",
    "make_serve_parser",
    "parse_serve_args",
]

logger = logging.getLogger(__name__)

# (config class, attribute of EngineConfig holding it; None: EngineConfig itself or server)
_GROUPS: tuple[tuple[type, str | None], ...] = (
    (ModelConfig, "model"),
    (CacheConfig, "cache"),
    (SchedulerConfig, "scheduler"),
    (ParallelConfig, "parallel"),
    (LoadConfig, "load"),
    (EngineConfig, None),
    (ServerConfig, None),
)
# Fields that are not flags: derived values and settings vLLM takes from the environment.
_NOT_FLAGS = {
    (SchedulerConfig, "max_model_len"),  # copied from --max-model-len
    (CacheConfig, "cpu_kvcache_space_bytes"),  # VLLM_CPU_KVCACHE_SPACE
    (ParallelConfig, "worker_multiproc_method"),  # VLLM_WORKER_MULTIPROC_METHOD
    (EngineConfig, "engine_ready_timeout_s"),  # VLLM_ENGINE_READY_TIMEOUT_S
    (CacheConfig, "enable_sub_block_cache"),  # VLLM_RBLN_SUB_BLOCK_CACHE
}
_KEYWORD_NOT_FLAGS = {(CacheConfig, "enable_sub_block_cache")}
"""Fields that are no flag but are keywords of `engine_config_from_kwargs` (the offline `LLM`):
an explicit keyword wins over the environment variable."""
_EXTRA_CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "cpu", "cuda"),
    "uvicorn_log_level": ("critical", "error", "warning", "info", "debug", "trace"),
}
_ALIASES: dict[str, dict[str, str]] = {"dtype": {"half": "float16", "float": "float32"}}
_OFFLINE_DEFAULTS: dict[str, Any] = {"max_num_batched_tokens": 8192}  # vLLM's LLM class


# ----------------------------------------------------------------------------- values

_HUMAN_INTS = {"max_num_batched_tokens", "kv_cache_memory_bytes", "max_request_body_bytes"}
_HUMAN_INT_HELP = ("Accepts k/m/g/t (x1000) and K/M/G/T, Ki/Mi/Gi/Ti, KiB/MiB/GiB/TiB "
                   "(x1024) suffixes, e.g. 32k, 4GiB.")
_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "block_size": at_least(1),
    "gpu_memory_utilization": lambda v: None if 0 < v <= 1 else "must be in (0, 1]",
    "kv_cache_memory_bytes": at_least(1),
    "num_gpu_blocks_override": at_least(1),
    "max_model_len": at_least(1),
    "max_num_seqs": at_least(1),
    "max_num_batched_tokens": at_least(1),
    "long_prefill_token_threshold": at_least(0),
    "tensor_parallel_size": at_least(1),
    "pipeline_parallel_size": at_least(1),
    "data_parallel_size": at_least(1),
    "data_parallel_rank": at_least(0),
    "data_parallel_size_local": at_least(0),
    "data_parallel_start_rank": at_least(0),
    "data_parallel_rpc_port": lambda v: None if v is None or 0 < v < 65536 else "not a port",
    "port": lambda v: None if 0 <= v < 65536 else "not a port",
    "max_log_len": at_least(0),
    "max_request_body_bytes": at_least(1),
    "shutdown_timeout": at_least(0),
    "kv_events_config": lambda v: _kv_events_problem(v),
    "kv_transfer_config": lambda v: _kv_transfer_problem(v),
    "structured_outputs_config": lambda v: _structured_outputs_problem(v),
    "speculative_config": lambda v: _speculative_problem(v),
    "tool_call_parser": lambda v: _parser_problem("tool_parsers", "tool call", v),
    "reasoning_parser": lambda v: _parser_problem("reasoning", "reasoning", v),
}


def _parser_problem(package: str, what: str, name: str | None) -> str | None:
    """Unknown `--tool-call-parser` / `--reasoning-parser` names (the registries list them)."""
    import importlib

    known = importlib.import_module(f"sous.server.{package}").names()
    if name is None or name in known:
        return None
    return f"unknown {what} parser; choose from {', '.join(known)}"


def _kv_events_problem(value: dict[str, Any] | None) -> str | None:
    from sous.kv_transfer.events import KVEventsConfig

    try:
        KVEventsConfig.from_dict(value or {})
    except (TypeError, ValueError) as e:
        return str(e).removeprefix("--kv-events-config: ")
    return None


def _kv_transfer_problem(value: dict[str, Any] | None) -> str | None:
    from sous.kv_transfer.config import KVTransferConfig
    from sous.kv_transfer.factory import check_connector_name

    if value is None:
        return None
    try:
        check_connector_name(KVTransferConfig.from_dict(value))
    except (TypeError, ValueError) as e:
        return str(e).removeprefix("--kv-transfer-config: ")
    return None


def _speculative_problem(value: dict[str, Any] | None) -> str | None:
    from sous.engine.spec_decode.config import resolve_speculative_config

    try:
        resolve_speculative_config(value)
    except ValueError as e:
        return str(e).removeprefix("--speculative-config: ")
    return None


def _spec_method(value: dict[str, Any] | None) -> str | None:
    """The method of a `--speculative-config` (None: none, or one its own check reports)."""
    from sous.engine.spec_decode.config import resolve_speculative_config

    try:
        spec = resolve_speculative_config(value)
    except ValueError:  # reported by its check
        return None
    return None if spec is None else spec.method


def _eagle1(value: dict[str, Any] | None) -> bool:
    """An EAGLE (1) `--speculative-config` (not built yet; n-gram, suffix, EAGLE-3 and MTP
    are)."""
    return _spec_method(value) == "eagle"


def _structured_outputs_problem(value: dict[str, Any] | None) -> str | None:
    from sous.config.structured_outputs import StructuredOutputsConfig

    try:
        parser = StructuredOutputsConfig.from_dict(value).reasoning_parser
    except ValueError as e:
        return str(e).removeprefix("--structured-outputs-config: ")
    return _parser_problem("reasoning", "reasoning", parser or None)


# ----------------------------------------------------------------------------- not yet


class NotYet(NamedTuple):
    """One row of the not-supported-yet table: `when(value)` true (and `context`, if any, true
    of all the values) means refuse."""

    field: str
    when: Callable[[Any], bool]
    flag: str
    reason: str
    refused: str = ""
    """The refused values as `--help` shows them (e.g. `> 1`); empty: any value."""
    context: Callable[[Mapping[str, Any]], bool] | None = None
    """Refuse only when this is also true of all the flags' values (None: always)."""

    def refuses(self, values: Mapping[str, Any]) -> bool:
        """True when `values` (field name -> value) hold a refused setting of this row."""
        return (self.field in values and bool(self.when(values[self.field]))
                and (self.context is None or self.context(values)))


NOT_SUPPORTED_YET: tuple[NotYet, ...] = (
    NotYet("tensor_parallel_size", lambda v: v > 1, "--tensor-parallel-size",
           "sous runs one engine process on one device", "> 1"),
    NotYet("enable_chunked_prefill", lambda v: not v, "--no-enable-chunked-prefill",
           "the scheduler always chunks prefills"),
    NotYet("model_impl", lambda v: v == "transformers", "--model-impl",
           "running transformers' modelling code is not wired in", "transformers"),
    NotYet("distributed_executor_backend", lambda v: v in ("ray", "external_launcher"),
           "--distributed-executor-backend", "sous runs workers in processes (`mp`) or in the "
           "engine's process (`uni`)", "ray|external_launcher"),
    NotYet("speculative_config", _eagle1, "--speculative-config",
           "EAGLE (1) heads are planned (methods ngram, suffix, eagle3 and mtp work)",
           "eagle"),
)


def _parallel_problems(values: Mapping[str, Any]) -> list[str]:
    """Data parallel flags that contradict each other, each message naming its flags."""
    size, rank = values.get("data_parallel_size", 1), values.get("data_parallel_rank")
    local, start = values.get("data_parallel_size_local"), values.get("data_parallel_start_rank", 0)
    out = []
    if rank is not None and rank >= size:
        out.append(f"--data-parallel-rank {rank}: must be below --data-parallel-size {size}")
    if local is not None and start + local > size:
        out.append(f"--data-parallel-start-rank {start} --data-parallel-size-local {local}: "
                   f"ranks past --data-parallel-size {size}")
    if values.get("headless"):
        if size < 2 or rank is not None:
            out.append("--headless runs data parallel ranks for an API server elsewhere: it "
                       "needs --data-parallel-size > 1 and no --data-parallel-rank")
        elif local == 0:
            out.append("--headless --data-parallel-size-local 0: no rank to run")
    elif start and rank is None:
        out.append(f"--data-parallel-start-rank {start}: only with --headless (the API "
                   "server's node runs ranks from 0)")
    if values.get("enable_expert_parallel"):
        if size < 2:
            out.append("--enable-expert-parallel needs --data-parallel-size > 1: the routed "
                       "experts are split over the data parallel ranks")
        elif _spec_method(values.get("speculative_config")) == "mtp":
            out.append("--enable-expert-parallel with --speculative-config method 'mtp' is "
                       "not supported yet: the MTP layer's experts are split over the ranks "
                       "too, so its draft passes would have to run on every rank in step")
    out += _pipeline_problems(values)
    if size > 1 and rank is None and values.get("distributed_executor_backend") == "mp":
        out.append("--distributed-executor-backend mp with --data-parallel-size > 1 is not "
                   "supported yet: each data parallel rank runs its model in its own process")
    return out


def _pipeline_problems(values: Mapping[str, Any]) -> list[str]:
    """--pipeline-parallel-size combinations sous does not run (yet), naming the flags."""
    pp = values.get("pipeline_parallel_size", 1)
    if pp < 2:
        return []
    flag = f"--pipeline-parallel-size {pp}"
    out = []
    if values.get("data_parallel_size", 1) > 1 or values.get("data_parallel_rank") is not None:
        out.append(f"{flag} with data parallel flags is not supported yet: run one of them")
    if values.get("distributed_executor_backend") == "uni":
        out.append(f"{flag} runs a worker process per stage: it cannot use "
                   "--distributed-executor-backend uni (leave it out, or use mp)")
    method = _spec_method(values.get("speculative_config"))
    if method in ("eagle3", "mtp"):
        out.append(f"{flag} with --speculative-config method {method!r} is not supported "
                   "yet: its drafter reads hidden states of layers on other stages (ngram and "
                   "suffix work)")
    return out


class NotSupportedYetError(ValueError):
    """Raised by `engine_config_from_kwargs` for settings sous does not implement yet."""


def _not_yet_messages(values: Mapping[str, Any], *, as_kwargs: bool = False) -> list[str]:
    out = []
    for row in NOT_SUPPORTED_YET:
        if row.refuses(values):
            value = values[row.field]
            name = f"{row.field}={value!r}" if as_kwargs else row.flag
            got = "" if as_kwargs or isinstance(value, bool) else f" (got {value!r})"
            out.append(f"`{name}` is not supported yet{got}: {row.reason}.")
    return out


# ----------------------------------------------------------------------------- fields


class _Field(NamedTuple):
    name: str  # field name = argparse dest = keyword argument
    owner: type
    flag: str
    help: str
    default: Any
    base: Any  # the annotation with Optional removed
    optional: bool


@functools.cache
def _fields(keywords: bool = False) -> tuple[_Field, ...]:
    """All flag fields of all groups, in group order (`keywords`: and _KEYWORD_NOT_FLAGS);
    checks names are unique."""
    out: list[_Field] = []
    for cls, _ in _GROUPS:
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            base, optional = unwrap_optional(hints[f.name])
            key = (cls, f.name)
            if key in _NOT_FLAGS and not (keywords and key in _KEYWORD_NOT_FLAGS):
                continue
            if dataclasses.is_dataclass(base):
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            flag = "--" + f.name.replace("_", "-")
            out.append(_Field(f.name, cls, flag, docs.get(f.name, ""), default, base, optional))
    names = [f.name for f in out]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise RuntimeError(f"config fields map to the same flag: {sorted(dupes)}")
    return tuple(out)


def _converter(f: _Field) -> Callable[[str], Any]:
    """str -> value for one field (raises ValueError with a readable reason)."""
    if f.name == "max_model_len":
        return parse_max_model_len
    if f.name in _HUMAN_INTS:
        return human_readable_int
    if f.base is int:
        return parse_int
    if f.base is float:
        return parse_float
    if typing.get_origin(f.base) is dict:
        return parse_json_object
    aliases = _ALIASES.get(f.name, {})
    return lambda s: aliases.get(s, s)


def _checked(f: _Field, value: Any) -> Any:
    check = _CHECKS.get(f.name)
    problem = check(value) if check else None
    if problem:
        raise ValueError(problem)
    return value


def _choices(f: _Field) -> tuple[Any, ...] | None:
    if typing.get_origin(f.base) is Literal:
        return typing.get_args(f.base)
    return _EXTRA_CHOICES.get(f.name)


def _help(f: _Field) -> str:
    text = f.help
    if f.name in _HUMAN_INTS or f.name == "max_model_len":
        text += " " + _HUMAN_INT_HELP
    if f.name == "max_model_len":
        text += " `auto` or -1: the model's context length."
    for row in NOT_SUPPORTED_YET:
        if row.field == f.name:
            refused = f" {row.refused}" if row.refused else ""
            text += f" [{row.flag}{refused} is not supported yet: {row.reason}.]"
    return text.replace("%", "%%")


# ----------------------------------------------------------------------------- parser


class _ServeParser(argparse.ArgumentParser):
    """Exit 2 on errors, naming the flag; suggests close matches for unknown flags."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            known = [s for a in self._actions for s in a.option_strings]
            hints = []
            for token in message.split(":", 1)[1].split():
                if token.startswith("--"):
                    close = difflib.get_close_matches(token.split("=")[0], known, n=3)
                    if close:
                        hints.append(f"{token}: did you mean {' or '.join(close)}?")
            if hints:
                message += "\n" + "\n".join(hints)
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=40)

    def _split_lines(self, text: str, width: int) -> list[str]:
        """Wrap without breaking flag names at their hyphens."""
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def make_serve_parser(prog: str = "sous serve") -> argparse.ArgumentParser:
    """The `sous serve [MODEL] [flags]` parser: one group per config dataclass."""
    parser = _ServeParser(
        prog=prog, formatter_class=_HelpFormatter, allow_abbrev=False,
        description="Start the OpenAI-compatible server (vLLM's `vllm serve` flags). "
        "Environment: VLLM_API_KEY (api key fallback), VLLM_CPU_KVCACHE_SPACE (KV cache GiB on "
        "CPU, default 4), VLLM_ENGINE_READY_TIMEOUT_S (seconds the engine may take to start), "
        "VLLM_WORKER_MULTIPROC_METHOD (spawn|fork: how the worker process of "
        "--distributed-executor-backend mp starts), PYTHONHASHSEED (the root of "
        "prefix-cache hashes; set it wherever hashes cross processes: KV events), "
        "VLLM_RBLN_SUB_BLOCK_CACHE (0 turns sub-block prefix caching off), "
        "VLLM_SERVER_DEV_MODE (1 exposes POST /reset_prefix_cache, as in vLLM).")
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="Model folder or GGUF file (default: the bundled "
                        "SmolLM2-135M-Instruct). Same as --model.")
    groups = {cls: parser.add_argument_group(cls.__name__, class_doc(cls)) for cls, _ in _GROUPS}
    for f in _fields():
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": _help(f)}
        if f.base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            conv = _converter(f)

            def parse(text: str, f: _Field = f, conv: Callable[[str], Any] = conv) -> Any:
                try:
                    return _checked(f, conv(text))
                except ValueError as e:
                    raise argparse.ArgumentTypeError(f"invalid value {text!r}: {e}") from None

            kwargs["type"] = parse
            kwargs["choices"] = _choices(f)
            kwargs["metavar"] = "{" + ",".join(map(str, kwargs["choices"])) + "}" \
                if kwargs["choices"] else f.name.upper()
        groups[f.owner].add_argument(f.flag, **kwargs)
    return parser


def _normalize(argv: Sequence[str]) -> list[str]:
    """vLLM accepts underscores in flag names: `--max_model_len` == `--max-model-len`."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            arg = key.replace("_", "-") + eq + value
        out.append(arg)
    return out


def _build(values: Mapping[str, Any]) -> tuple[EngineConfig, ServerConfig]:
    """Group flat field values into (EngineConfig, ServerConfig); missing ones default."""

    def make(cls: type, **extra: Any) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names and k not in extra}, **extra)

    max_len = values.get("max_model_len")
    sched = {} if max_len is None else {"max_model_len": max_len}
    subs = {attr: make(cls, **(sched if cls is SchedulerConfig else {}))
            for cls, attr in _GROUPS if attr}
    return make(EngineConfig, **subs), make(ServerConfig)


def _log_notes(values: Mapping[str, Any]) -> None:
    """Flags that are accepted with a documented, logged meaning instead of an effect."""
    if values.get("trust_remote_code"):
        logger.warning("--trust-remote-code: sous runs only its own model code, never code "
                       "shipped with a checkpoint; the flag has no further effect.")
    if values.get("download_dir"):
        logger.warning("--download-dir: sous never downloads models; pass a local folder "
                       "or GGUF file as MODEL.")


def parse_serve_args(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> tuple[EngineConfig, ServerConfig]:
    """Parse `sous serve` arguments (without the `serve` word) into configs.

    Errors (unknown flag, malformed value, not-supported-yet flag, bad environment
    variable) print a message naming the flag to stderr and raise SystemExit(2)."""
    environ = os.environ if environ is None else environ
    parser = make_serve_parser()
    values = vars(parser.parse_args(_normalize(argv)))
    model_tag = values.pop("model_tag")
    if model_tag is not None:
        if values["model"] is not None and values["model"] != model_tag:
            parser.error(f"MODEL given twice: {model_tag!r} and --model {values['model']!r}")
        values["model"] = model_tag
    elif values["model"] is not None:
        logger.warning("--model is deprecated in vLLM; pass the model as the first argument.")
    if values["disable_log_requests"] is not None:
        logger.warning("--disable-log-requests is deprecated in vLLM: requests are logged only "
                       "with --enable-log-requests.")
        values["enable_log_requests"] |= not values["disable_log_requests"]
    try:
        values.update(env_values(environ))
    except ValueError as e:
        parser.error(str(e))
    if values["api_key"] is None and environ.get("VLLM_API_KEY"):
        values["api_key"] = environ["VLLM_API_KEY"]
    problems = _not_yet_messages(values) + _parallel_problems(values)
    if problems:
        parser.exit(2, "".join(f"{parser.prog}: error: {p}\n" for p in problems))
    if values["enable_auto_tool_choice"] and not values["tool_call_parser"]:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    so_parser = (values.get("structured_outputs_config") or {}).get("reasoning_parser")
    if so_parser and values["reasoning_parser"] not in (None, so_parser):
        parser.error(f"--reasoning-parser {values['reasoning_parser']!r} and "
                     f"--structured-outputs-config reasoning_parser {so_parser!r} differ")
    values["reasoning_parser"] = values["reasoning_parser"] or so_parser or None
    _log_notes(values)
    return _build(values)


def _coerce(f: _Field, value: Any) -> Any:
    """A Python keyword value -> the field's value (ValueError/TypeError naming nothing)."""
    if value is None:
        if f.optional or f.name == "max_model_len":
            return None
        raise TypeError("None is not allowed")
    if f.base is bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected a bool, got {type(value).__name__}")
        return value
    if isinstance(value, str):
        value = _converter(f)(value)
    elif isinstance(value, os.PathLike) and f.base is str:
        value = os.fspath(value)
    elif f.base is int and isinstance(value, int) and not isinstance(value, bool):
        value = None if f.name == "max_model_len" and value == -1 else value
    elif f.base is float and isinstance(value, int | float) and not isinstance(value, bool):
        value = float(value)
    elif not (typing.get_origin(f.base) is dict and isinstance(value, dict)):
        raise TypeError(f"unexpected type {type(value).__name__}")
    choices = _choices(f)
    if choices and value not in choices:
        raise ValueError(f"{value!r} is not one of {list(choices)}")
    return _checked(f, value)


def engine_config_from_kwargs(**kwargs: Any) -> EngineConfig:
    """EngineConfig from vLLM `EngineArgs`-style keyword arguments (flag names with
    underscores, e.g. `model=..., max_model_len=..., block_size=...`), with the offline
    defaults of vLLM's `LLM` class (`max_num_batched_tokens=8192`).

    Raises TypeError for unknown keywords or wrong types, ValueError for bad values and
    NotSupportedYetError for settings sous does not implement yet; all name the keyword."""
    fields = {f.name: f for f in _fields(keywords=True) if f.owner is not ServerConfig}
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        hints = [f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(
            k, fields, n=1)) else k for k in unknown]
        raise TypeError(f"unexpected keyword argument(s): {', '.join(hints)}")
    values: dict[str, Any] = {n: f.default for n, f in fields.items()}
    values.update(_OFFLINE_DEFAULTS)
    for name, value in kwargs.items():
        try:
            values[name] = _coerce(fields[name], value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}={value!r}: {e}") from None
    values.update({k: v for k, v in env_values(os.environ).items() if k not in kwargs})
    problems = _not_yet_messages(values, as_kwargs=True) + _pipeline_problems(values)
    if values["data_parallel_size"] > 1:
        problems.append("`data_parallel_size` > 1 is not supported yet in the offline LLM: "
                        "it runs one engine (`sous serve --data-parallel-size N` serves N).")
    if problems:
        raise NotSupportedYetError(" ".join(problems))
    _log_notes(values)
    return _build(values)[0]
