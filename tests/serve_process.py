"""`sous serve` as a real subprocess for tests: a free loopback port, wait until ready, stop."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def sous_serve(args: list[str], log: Path, timeout_s: float = 300.0,
               env: dict[str, str] | None = None) -> Iterator[str]:
    """Run `sous serve *args --port <free>` (output to `log`); yields the base URL once
    `/v1/models` answers, and terminates the server afterwards. Fails with the log's text if
    the server exits or is not ready within `timeout_s`."""
    port = free_port()
    cmd = [sys.executable, "-m", "sous.cli", "serve", *args, "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, f"sous serve exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"sous serve not ready:\n{log.read_text()}"
            try:
                if httpx.get(url + "/v1/models", timeout=2, trust_env=False).status_code == 200:
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
