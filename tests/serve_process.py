"""`sous serve` as a real subprocess for tests: a free loopback port, wait until ready, stop."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _sous_process(cmd: list[str], url: str, ready_path: str, log: Path, timeout_s: float,
                  env: dict[str, str] | None = None,
                  procs: dict[str, subprocess.Popen] | None = None) -> Iterator[str]:
    """Run `cmd` (output to `log`); yield `url` once `url + ready_path` answers 200, and
    terminate the process afterwards. Fails with the log's text if it exits or is not ready
    within `timeout_s`. `procs[url]` gets the process (for tests that kill it)."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    if procs is not None:
        procs[url] = proc
    name = " ".join(cmd[2:5])
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"{name} not ready:\n{log.read_text()}"
            try:
                if httpx.get(url + ready_path, timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def sous_serve(args: list[str], log: Path, timeout_s: float = 300.0,
               env: dict[str, str] | None = None,
               procs: dict[str, subprocess.Popen] | None = None,
               port: int | None = None) -> AbstractContextManager[str]:
    """`sous serve *args --port <port or a free one>` as a context manager yielding its base
    URL once `/v1/models` answers (see `_sous_process`)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "sous.cli", "serve", *args, "--port", str(port)]
    return _sous_process(cmd, f"http://127.0.0.1:{port}", "/v1/models", log, timeout_s, env,
                         procs)


def sous_route(config: Path, endpoints: list[str], log: Path, timeout_s: float = 120.0,
               extra: list[str] | None = None) -> AbstractContextManager[str]:
    """`sous route --config config --endpoint ... --port <free>` as a context manager
    yielding its base URL once `/health` answers 200 (an endpoint is up)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sous.cli", "route", "--config", str(config), "--port",
           str(port), *[w for e in endpoints for w in ("--endpoint", e)], *(extra or [])]
    return _sous_process(cmd, f"http://127.0.0.1:{port}", "/health", log, timeout_s)


def serve_flag_error(argv: list[str], environ: dict[str, str] | None = None) -> str:
    """The error `sous serve *argv` prints when it refuses its flags while parsing them (exit
    status 2 asserted): the parser the command runs, without starting a process."""
    from sous.config.engine_args import parse_serve_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_serve_args(argv, environ=environ or {})
    except SystemExit as e:
        assert e.code == 2, err.getvalue()
        return err.getvalue()
    raise AssertionError(f"sous serve {' '.join(argv)}: the flags were accepted")
