"""The `sous` command: subcommand dispatch, --version, placeholders, serve -> run_server."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import sous
from sous.cli import main
from sous.config import EngineConfig, ServerConfig


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"sous {sous.__version__}"


def test_console_script_version() -> None:
    exe = [sys.executable, "-c", "import sys; from sous.cli import main; sys.exit(main())"]
    proc = subprocess.run([*exe, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and sous.__version__ in proc.stdout


def test_help_lists_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("serve", "bench", "recipe", "page", "route"):
        assert name in out


def test_no_command_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: sous" in capsys.readouterr().err


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serv"])
    assert exc.value.code == 2
    assert "serv" in capsys.readouterr().err


def test_route_flag_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["route", "list"])  # --config and --endpoint are required
    assert exc.value.code == 2
    assert "--config" in capsys.readouterr().err
    assert main(["route", "--config", "/no/such.yaml", "--endpoint", "http://h:1"]) == 2
    assert "/no/such.yaml: cannot read" in capsys.readouterr().err


def test_bench_needs_a_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 2
    assert main(["bench", "latency"]) == 2
    assert "unknown benchmark 'latency'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--help"])
    assert exc.value.code == 0
    assert "--concurrency" in capsys.readouterr().out


def test_serve_calls_run_server(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[EngineConfig, ServerConfig]] = []
    fake = types.ModuleType("sous.server.api_server")
    fake.run_server = lambda e, s: calls.append((e, s)) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sous.server.api_server", fake)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert main(["serve", "/models/x.gguf", "--port", "9001", "--max-model-len", "512"]) == 0
    (engine, server), = calls
    assert engine.model.model == "/models/x.gguf" and engine.model.max_model_len == 512
    assert server.port == 9001


def test_serve_errors_before_starting(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    fake = types.ModuleType("sous.server.api_server")
    fake.run_server = lambda e, s: pytest.fail("server started")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sous.server.api_server", fake)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--tensor-parallel-size", "2"])
    assert exc.value.code == 2
    assert "`--tensor-parallel-size` is not supported yet" in capsys.readouterr().err
