"""`sous serve` flags: vLLM names, values from the shipped recipes, errors naming the flag."""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sous.cli import main
from sous.config.engine_args import (
    NOT_SUPPORTED_YET,
    NotSupportedYetError,
    _fields,
    engine_config_from_kwargs,
    human_readable_int,
    make_serve_parser,
    parse_serve_args,
)

# DESIGN.md "Compatibility contracts": every flag that appears in a shipped recipe.
CONTRACT_FLAGS = [
    "--block-size", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
    "--data-parallel-size", "--data-parallel-rank", "--data-parallel-address",
    "--data-parallel-rpc-port", "--enable-expert-parallel", "--pipeline-parallel-size",
    "--kv-cache-dtype", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--prefix-caching-hash-algo", "--enable-auto-tool-choice", "--tool-call-parser",
    "--reasoning-parser", "--model-impl", "--safetensors-load-strategy", "--revision",
    "--trust-remote-code", "--gpu-memory-utilization", "--kv-transfer-config",
    "--kv-events-config", "--speculative-config", "--port",
]

_KV_BOTH = '{\n      "kv_connector": "RBLNLMCacheConnectorV1",\n      "kv_role": "kv_both"\n    }'
_EVENTS = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
           '"endpoint": "tcp://<EPP_HOST>:5557", "topic": "kv@<POD_IP>:8000@MiniMaxAI/MiniMax-M2.7"}')
_EAGLE = ('{"method": "eagle3", "model": "asherszhang/MiniMax-M2.7-EAGLE3-draft-vocab200k", '
          '"num_speculative_tokens": 3}')
_SUFFIX = ('{"method": "suffix", "num_speculative_tokens": 3, '
           '"suffix_decoding_max_cached_requests": 0}')

# Values exactly as shared/recipes/minimax-m2.7.json writes them: (argv, supported now).
RECIPE_ARGS: list[tuple[list[str], bool]] = [
    (["--block-size", "4096"], True),
    (["--max-model-len", "204800"], True),
    (["--max-num-seqs", "1"], True),
    (["--max-num-batched-tokens", "512"], True),
    (["--no-enable-prefix-caching"], True),
    (["--enable-prefix-caching"], True),
    (["--prefix-caching-hash-algo", "sha256_cbor"], True),
    (["--model-impl", "vllm"], True),
    (["--safetensors-load-strategy", "prefetch"], True),
    (["--revision", "main"], True),
    (["--trust-remote-code"], True),
    (["--gpu-memory-utilization", "0.8"], True),
    (["--port", "8200"], True),
    (["--pipeline-parallel-size", "1"], True),
    (["--data-parallel-size", "4"], True),
    (["--data-parallel-rank", "0"], True),
    (["--data-parallel-address", "<POD_IP>"], True),
    (["--data-parallel-rpc-port", "5555"], True),
    (["--enable-expert-parallel", "--data-parallel-size", "4"], True),
    (["--enable-expert-parallel", "--data-parallel-size", "4", "--data-parallel-rank", "1"],
     True),
    (["--pipeline-parallel-size", "4"], True),
    (["--kv-cache-dtype", "fp8"], True),
    (["--kv-cache-dtype", "bfloat16"], True),
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], True),
    (["--tool-call-parser", "minimax_m2"], True),
    (["--reasoning-parser", "minimax_m2"], True),
    (["--kv-transfer-config", _KV_BOTH], True),
    (["--kv-events-config", _EVENTS], True),
    (["--speculative-config", _EAGLE], True),
    (["--speculative-config", _SUFFIX], True),
]


def _exit2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_serve_args(argv, environ={})
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_recipe_values_cover_every_contract_flag() -> None:
    used = {a for argv, _ in RECIPE_ARGS for a in argv if a.startswith("--")}
    assert set(CONTRACT_FLAGS) <= used


@pytest.mark.parametrize(("argv", "supported"), RECIPE_ARGS, ids=lambda a: str(a)[:40])
def test_recipe_flag(argv: list[str], supported: bool, capsys: pytest.CaptureFixture[str]) -> None:
    if supported:
        parse_serve_args(argv, environ={})
    else:
        err = _exit2(argv, capsys)
        assert f"`{argv[0]}` is not supported yet" in err


def test_recipe_values_land_in_config() -> None:
    eng, srv = parse_serve_args(
        ["--block-size", "4096", "--max-model-len", "204800", "--max-num-seqs", "1",
         "--max-num-batched-tokens", "512", "--no-enable-prefix-caching",
         "--prefix-caching-hash-algo", "sha256_cbor", "--safetensors-load-strategy", "prefetch",
         "--gpu-memory-utilization", "0.8", "--port", "8203", "--model-impl", "vllm"], environ={})
    assert (eng.cache.block_size, eng.model.max_model_len, eng.scheduler.max_model_len) == (
        4096, 204800, 204800)
    assert (eng.scheduler.max_num_seqs, eng.scheduler.max_num_batched_tokens) == (1, 512)
    assert eng.cache.enable_prefix_caching is False
    assert eng.cache.prefix_caching_hash_algo == "sha256_cbor"
    assert eng.load.safetensors_load_strategy == "prefetch"
    assert eng.cache.gpu_memory_utilization == 0.8 and srv.port == 8203


def _recipe_files() -> list[Path]:
    repo = Path(__file__).resolve().parents[1]
    dirs = [repo / "shared" / "recipes", repo.parent / "shared" / "recipes",
            repo / "src" / "sous" / "recipes" / "catalog"]
    return sorted({f for d in dirs if d.is_dir() for f in d.glob("*.json")})


def _arg_strings(obj: object) -> list[str]:
    if isinstance(obj, dict):
        out = [v for k, v in obj.items()
               if isinstance(k, str) and k.startswith("--") and isinstance(v, str)]
        return out + [s for v in obj.values() for s in _arg_strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _arg_strings(v)]
    return []


def test_every_recipe_arg_parses_or_is_not_yet(capsys: pytest.CaptureFixture[str]) -> None:
    strings = sorted({s for f in _recipe_files() for s in _arg_strings(json.loads(f.read_text()))})
    assert strings, "no recipe found (shared/recipes/*.json)"
    not_yet_flags = {row.flag for row in NOT_SUPPORTED_YET}
    for text in strings:
        argv = shlex.split(text)
        if argv == ["--enable-auto-tool-choice"]:  # needs its parser, as in vLLM
            argv += ["--tool-call-parser", "hermes"]
        if argv[0] == "--data-parallel-rank":  # below the size, as the recipes pass them
            argv += ["--data-parallel-size", str(int(argv[1]) + 1)]
        if argv == ["--enable-expert-parallel"]:  # the recipes pass it with their DP size
            argv += ["--data-parallel-size", "4"]
        try:
            parse_serve_args(argv, environ={})
        except SystemExit as e:
            assert e.code == 2
            err = capsys.readouterr().err
            assert argv[0] in not_yet_flags and f"`{argv[0]}` is not supported yet" in err, text


def test_all_not_yet_flags_listed_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit2(["--tensor-parallel-size", "2",
                  "--no-enable-chunked-prefill", "--model-impl", "transformers"], capsys)
    for flag in ("--tensor-parallel-size", "--no-enable-chunked-prefill", "--model-impl"):
        assert f"`{flag}` is not supported yet" in err


def test_not_yet_exit_status_from_the_command_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "sous.cli", "serve", "--tensor-parallel-size",
                           "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "`--tensor-parallel-size` is not supported yet" in proc.stderr


def test_unknown_flag_named_with_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit2(["--max-model-length", "4096"], capsys)
    assert "unrecognized arguments: --max-model-length" in err
    assert "did you mean --max-model-len" in err


@pytest.mark.parametrize(("argv", "flag"), [
    (["--block-size", "abc"], "--block-size"),
    (["--block-size", "0"], "--block-size"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-batched-tokens", "x"], "--max-num-batched-tokens"),
    (["--max-model-len", "1.5K"], "--max-model-len"),
    (["--kv-cache-memory-bytes", "lots"], "--kv-cache-memory-bytes"),
    (["--kv-cache-dtype", "fp9"], "--kv-cache-dtype"),
    (["--prefix-caching-hash-algo", "md5"], "--prefix-caching-hash-algo"),
    (["--kv-transfer-config", "{not json"], "--kv-transfer-config"),
    (["--speculative-config", "[1, 2]"], "--speculative-config"),
    (["--port", "70000"], "--port"),
    (["--dtype", "int3"], "--dtype"),
])
def test_malformed_value_names_flag(argv: list[str], flag: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert f"argument {flag}:" in _exit2(argv, capsys)


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100000")  # no wrapping: compare docs verbatim
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for f in _fields():
        assert f.flag in out
        assert " ".join(f.help.split()) in out, f.flag
    for flag in CONTRACT_FLAGS:
        assert flag in out


@pytest.mark.parametrize(("text", "value"), [
    ("32k", 32_000), ("32K", 32_768), ("1M", 1_048_576), ("25.6k", 25_600), ("1m", 1_000_000),
    ("4G", 4 * 2**30), ("4Gi", 4 * 2**30), ("4GiB", 4 * 2**30), ("2g", 2_000_000_000),
    ("4096", 4096), (" 7 ", 7),
])
def test_human_readable_int(text: str, value: int) -> None:
    assert human_readable_int(text) == value


def test_human_readable_flags() -> None:
    eng, _ = parse_serve_args(["--max-model-len", "32k", "--kv-cache-memory-bytes", "4GiB",
                               "--max-num-batched-tokens", "8K"], environ={})
    assert eng.model.max_model_len == 32_000
    assert eng.cache.kv_cache_memory_bytes == 4 * 2**30
    assert eng.scheduler.max_num_batched_tokens == 8192
    eng, _ = parse_serve_args(["--max-model-len", "auto"], environ={})
    assert eng.model.max_model_len is None


def test_vllm_defaults() -> None:
    eng, srv = parse_serve_args([], environ={})
    assert eng.cache.block_size == 16 and eng.cache.gpu_memory_utilization == 0.9
    assert eng.scheduler.max_num_seqs == 256 and eng.scheduler.max_num_batched_tokens == 2048
    assert eng.cache.enable_prefix_caching and eng.scheduler.enable_chunked_prefill
    assert eng.model.model is None and srv.api_key is None and srv.port == 8000


def test_model_positional_or_flag_and_underscores(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_serve_args(["/m.gguf"], environ={})[0].model.model == "/m.gguf"
    assert parse_serve_args(["--model", "/m.gguf"], environ={})[0].model.model == "/m.gguf"
    eng, _ = parse_serve_args(["/m", "--max_model_len=2k", "--dtype", "half"], environ={})
    assert eng.model.max_model_len == 2000 and eng.model.dtype == "float16"
    assert "given twice" in _exit2(["/a", "--model", "/b"], capsys)


def test_environment(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"VLLM_ENGINE_READY_TIMEOUT_S": "9600", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "VLLM_API_KEY": "k1", "PYTHONHASHSEED": "42"}
    eng, srv = parse_serve_args([], environ=env)
    assert eng.engine_ready_timeout_s == 9600
    assert eng.parallel.worker_multiproc_method == "spawn"
    assert srv.api_key == "k1"
    assert parse_serve_args(["--api-key", "k2"], environ=env)[1].api_key == "k2"
    for bad in ({"VLLM_ENGINE_READY_TIMEOUT_S": "soon"}, {"VLLM_WORKER_MULTIPROC_METHOD": "x"}):
        with pytest.raises(SystemExit) as exc:
            parse_serve_args([], environ=bad)
        assert exc.value.code == 2
        assert next(iter(bad)) in capsys.readouterr().err


def test_enforce_eager_is_accepted() -> None:
    eng, _ = parse_serve_args(["--enforce-eager"], environ={})
    assert eng.model.enforce_eager
    assert not parse_serve_args([], environ={})[0].model.enforce_eager


def test_log_requests_flags(caplog: pytest.LogCaptureFixture) -> None:
    """As in vLLM: requests are logged only with --enable-log-requests; the deprecated
    --disable-log-requests is accepted with a warning (--no-disable-log-requests logs)."""
    assert not parse_serve_args([], environ={})[1].enable_log_requests
    assert parse_serve_args(["--enable-log-requests"], environ={})[1].enable_log_requests
    with caplog.at_level(logging.WARNING, logger="sous.config.engine_args"):
        assert not parse_serve_args(["--disable-log-requests"], environ={})[1].enable_log_requests
        assert parse_serve_args(["--no-disable-log-requests"], environ={})[1].enable_log_requests
    assert caplog.text.count("--disable-log-requests is deprecated") == 2


def test_trust_remote_code_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="sous.config.engine_args"):
        eng, _ = parse_serve_args(["--trust-remote-code"], environ={})
    assert eng.model.trust_remote_code
    assert "sous runs only its own model code" in caplog.text


def test_one_table_drives_the_not_yet_help() -> None:
    help_text = " ".join(make_serve_parser().format_help().split())
    assert help_text.count("is not supported yet:") == len(NOT_SUPPORTED_YET)
    for row in NOT_SUPPORTED_YET:  # the help names exactly what is refused
        refused = f" {row.refused}" if row.refused else ""
        assert f"[{row.flag}{refused} is not supported yet: {row.reason}.]" in help_text
    # accepted values are not marked: --enable-chunked-prefill works, its --no- form does not
    assert "[--no-enable-chunked-prefill is not supported yet" in help_text
    assert "[--model-impl transformers is not supported yet" in help_text


def test_kwargs_api(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("VLLM_ENGINE_READY_TIMEOUT_S", "VLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.delenv(var, raising=False)
    eng = engine_config_from_kwargs(model=Path("/m.gguf"), max_model_len="32k", block_size=32,
                                    enable_prefix_caching=False, dtype="bfloat16")
    assert eng.model.model == "/m.gguf" and eng.model.max_model_len == 32_000
    assert eng.cache.block_size == 32 and not eng.cache.enable_prefix_caching
    assert eng.scheduler.max_num_batched_tokens == 8192  # vLLM's LLM-class default
    assert engine_config_from_kwargs().cache.block_size == 16
    with pytest.raises(TypeError, match=r"max_model_length \(did you mean max_model_len\?\)"):
        engine_config_from_kwargs(max_model_length=5)
    with pytest.raises(TypeError, match="port"):
        engine_config_from_kwargs(port=8000)  # a server setting, not an engine one
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        engine_config_from_kwargs(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp9'"):
        engine_config_from_kwargs(kv_cache_dtype="fp9")
    with pytest.raises(TypeError, match="block_size"):
        engine_config_from_kwargs(block_size=1.5)
    with pytest.raises(NotSupportedYetError, match=r"`tensor_parallel_size=2` is not supported"):
        engine_config_from_kwargs(tensor_parallel_size=2)
    cfg = {"kv_connector": "X", "kv_role": "kv_both"}
    with pytest.raises(ValueError, match="unknown kv_connector 'X'; known: LMCacheConnectorV1"):
        engine_config_from_kwargs(kv_transfer_config=cfg)



def test_auto_tool_choice_needs_a_parser(capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit2(["--enable-auto-tool-choice"], capsys)
    assert "--enable-auto-tool-choice requires --tool-call-parser" in err
