"""A real `redis-server` for tests: a free loopback port (retried on a port race), no
persistence, stopped (or killed) at the end."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from serve_process import free_port


class RedisServer:
    """`redis-server` on a free port; `stop()` and `start()` again keep the port."""

    def __init__(self, log: Path) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed (make setup installs it)")
        self.log = log
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port)

    def start(self, attempts: int = 5) -> RedisServer:
        for _ in range(attempts):
            port = self.port or free_port()
            with self.log.open("a") as out:
                self.proc = subprocess.Popen(
                    ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                     "--save", "", "--appendonly", "no"], stdout=out, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 10
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping()
                    self.port = port
                    return self
                except redis.ConnectionError:
                    time.sleep(0.05)
            self.stop()  # the port was taken (or it did not come up): try another
            if self.port:
                time.sleep(0.5)
        raise RuntimeError(f"redis-server did not start:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
