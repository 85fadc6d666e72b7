"""`sous serve` start-up errors: one line naming the flag, path or variable, exit 2, no
traceback; the port is checked before the model loads. And the CPU KV budget: fixed, logged,
and really held (touched) at start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from serve_process import free_port, sous_serve
from sous.config import CacheConfig
from sous.config.engine_args import parse_serve_args
from sous.config.errors import ConfigError
from sous.engine.kv_cache.sizing import (
    CPU_KVCACHE_SPACE_DEFAULT_BYTES,
    budget_source,
    kv_cache_budget_bytes,
)
from sous.recipes.launch import kv_cache_share_gib
from sous.recipes.supervise import describe_message


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "sous.cli", "serve", *args]
    if "--port" not in args:
        cmd += ["--port", str(free_port())]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def _one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("sous serve: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize(("args", "needles"), [
    (["--max-model-len", "32k"], ["--max-model-len 32000", "8192"]),
    (["--kv-cache-memory-bytes", "1k"], ["--kv-cache-memory-bytes 1000", "at least"]),
    (["/nonexistent/model-folder"], ["/nonexistent/model-folder", "not a local folder"]),
])
def test_start_up_errors_are_one_line(args: list[str], needles: list[str]) -> None:
    line = _one_line_error(_serve(*args), *needles)
    if "--kv-cache-memory-bytes" in args:
        assert "set --kv-cache-memory-bytes" not in line  # says how much, not the same flag


def test_busy_port_fails_before_the_model_loads() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        started = time.monotonic()
        proc = _serve("--port", str(port))
    _one_line_error(proc, f"--port {port}", "cannot listen")
    assert "Loading" not in proc.stderr  # refused before the engine started loading
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("value", ["lots", "-1"])
def test_bad_cpu_kvcache_space_names_the_variable(value: str) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_serve_args([], environ={"VLLM_CPU_KVCACHE_SPACE": value})
    assert exc.value.code == 2


def test_bad_tokenizer_cache_flag_stops_serve(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_serve_args([], environ={"SOUS_TOKENIZER_CACHE": "maybe"})
    assert exc.value.code == 2
    assert "SOUS_TOKENIZER_CACHE='maybe'" in capsys.readouterr().err
    parse_serve_args([], environ={"SOUS_TOKENIZER_CACHE": "off"})  # the accepted spellings


def test_cpu_kv_budget_sources() -> None:
    cpu = torch.device("cpu")
    assert kv_cache_budget_bytes(CacheConfig(), cpu, 0) == CPU_KVCACHE_SPACE_DEFAULT_BYTES
    assert "default of 4 GiB" in budget_source(CacheConfig(), cpu)
    engine, _ = parse_serve_args([], environ={"VLLM_CPU_KVCACHE_SPACE": "0.5"})
    assert engine.cache.cpu_kvcache_space_bytes == 2**29
    assert kv_cache_budget_bytes(engine.cache, cpu, 0) == 2**29
    assert budget_source(engine.cache, cpu) == "VLLM_CPU_KVCACHE_SPACE=0.5"
    both = CacheConfig(cpu_kvcache_space_bytes=2**29, kv_cache_memory_bytes=2**20)
    assert kv_cache_budget_bytes(both, cpu, 0) == 2**20  # the flag wins, as in vLLM
    with pytest.raises(ConfigError, match="VLLM_CPU_KVCACHE_SPACE=100000"):
        kv_cache_budget_bytes(CacheConfig(cpu_kvcache_space_bytes=100000 << 30), cpu, 0)


def test_kv_budget_is_logged_and_held_at_start(tmp_path: Path) -> None:
    """The CPU cache is touched at start: the server's RSS includes the whole logged budget
    before any request (a lazily allocated cache would stay far below it)."""
    log = tmp_path / "serve.log"
    with sous_serve([], log, env={"VLLM_CPU_KVCACHE_SPACE": "1.5"}) as url:
        port = int(url.rsplit(":", 1)[1])
        pids = [c.pid for c in psutil.net_connections("tcp")
                if c.laddr and c.laddr.port == port and c.status == "LISTEN" and c.pid]
        rss = psutil.Process(pids[0]).memory_info().rss
    text = log.read_text()
    assert "from VLLM_CPU_KVCACHE_SPACE=1.5" in text, text[-2000:]
    assert rss > 1.5 * 2**30, rss


def test_launch_shares_the_machine() -> None:
    assert kv_cache_share_gib(5, available_bytes=20 * 2**30) == 2.0
    assert kv_cache_share_gib(1, available_bytes=20 * 2**30) == 4.0  # vLLM-CPU's default cap
    assert kv_cache_share_gib(64, available_bytes=2**30) == 0.05


def test_probe_shows_reasoning_and_content() -> None:
    assert describe_message({"content": "Hi", "reasoning_content": "think"}) == \
        "reasoning: 'think'; content: 'Hi'"
    assert describe_message({"content": None, "reasoning_content": "all"}) == \
        "reasoning: 'all'; content: (none)"
    assert describe_message({"content": "Hi"}) == "content: 'Hi'"


def test_pythonhashseed_warning_only_where_hashes_cross_processes(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A default engine (no KV events) says nothing about PYTHONHASHSEED; publishing KV
    events without it warns exactly once."""
    from sous.config import EngineConfig
    from sous.engine.core import EngineCore
    from sous.engine.kv_cache.manager import KVCacheManager

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    caplog.set_level("WARNING")
    KVCacheManager(64, 16, True, "sha256")
    assert "PYTHONHASHSEED" not in caplog.text
    config = EngineConfig(kv_events_config={
        "enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"})
    publisher = EngineCore._make_publisher(config)
    assert publisher is not None
    publisher.close()
    warnings = [r for r in caplog.records if "PYTHONHASHSEED" in r.getMessage()]
    assert len(warnings) == 1 and "KV events" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()


def test_engine_ready_timeout_is_honoured() -> None:
    """VLLM_ENGINE_READY_TIMEOUT_S bounds the engine's start (loading the bundled model takes
    seconds, so half a second runs out): one line naming the variable, exit 2."""
    proc = _serve(env={"VLLM_ENGINE_READY_TIMEOUT_S": "0.5"})
    _one_line_error(proc, "VLLM_ENGINE_READY_TIMEOUT_S=0.5")
