"""Start, watch and stop the local server processes of `sous recipe launch`.

Each process starts in its own session (so it and its children are stopped together), logs
to its own file, and counts as ready once `GET /health` answers 200. Stopping sends SIGTERM
to each process group, then SIGKILL to what is left after a grace period. Ctrl-C (SIGINT)
and SIGTERM to the launcher both stop everything.

Public API: `supervise`, `probe_chat`, `describe_message`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sous.recipes.launch import LaunchSpec

__all__ = ["describe_message", "probe_chat", "supervise"]

_GRACE_S = 15.0


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _start(spec: LaunchSpec) -> subprocess.Popen[bytes]:
    log = spec.log.open("wb")
    try:
        return subprocess.Popen(list(spec.command), env={**os.environ, **spec.env},
                                stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 2.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(spec: LaunchSpec, lines: int = 15) -> str:
    try:
        text = spec.log.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def _exited(specs: Sequence[LaunchSpec], procs: Sequence[subprocess.Popen[bytes]]) -> str | None:
    for spec, proc in zip(specs, procs, strict=True):
        if proc.poll() is not None:
            return f"{spec.label} exited with status {proc.returncode}; log {spec.log}:\n" \
                   f"{_tail(spec)}"
    return None


def _wait_ready(specs: Sequence[LaunchSpec], procs: Sequence[subprocess.Popen[bytes]],
                timeout: float) -> str | None:
    deadline, waiting = time.monotonic() + timeout, set(range(len(specs)))
    while waiting:
        problem = _exited(specs, procs)
        if problem:
            return problem
        waiting = {i for i in waiting if not _healthy(specs[i].port)}
        if waiting and time.monotonic() > deadline:
            names = ", ".join(specs[i].label for i in sorted(waiting))
            return f"not ready after {timeout:.0f} s: {names}"
        if waiting:
            time.sleep(0.25)
    return None


def probe_chat(port: int, prompt: str = "Say hello.", max_tokens: int = 16) -> str:
    """One chat completion against the server on `port`, shown as a person reads it: the
    reply's reasoning (when a reasoning parser split it off) and its content, each quoted."""
    models = _http(f"http://127.0.0.1:{port}/v1/models")
    model = models["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0}
    reply = _http(f"http://127.0.0.1:{port}/v1/chat/completions", body, timeout=120.0)
    return describe_message(reply["choices"][0]["message"])


def describe_message(message: dict[str, Any]) -> str:
    """`reasoning: '...'; content: '...'` (reasoning only when present; an absent content
    is shown as `(none)`, not as 'None')."""
    parts = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        parts.append(f"reasoning: {reasoning!r}")
    content = message.get("content")
    parts.append(f"content: {content!r}" if content is not None else "content: (none)")
    return "; ".join(parts)


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _run_until_stopped(specs: Sequence[LaunchSpec], procs: Sequence[subprocess.Popen[bytes]],
                       duration: float | None) -> int:
    deadline = None if duration is None else time.monotonic() + duration
    _say("running; Ctrl-C stops them all" + (f" (or after {duration:.0f} s)" if duration else ""))
    while deadline is None or time.monotonic() < deadline:
        problem = _exited(specs, procs)
        if problem:
            _say(f"error: {problem}")
            return 1
        time.sleep(0.5)
    return 0


def supervise(specs: Sequence[LaunchSpec], duration: float | None = None,
              ready_timeout: float = 600.0, probe: bool = True) -> int:
    """Start every spec, wait until all are healthy, probe each with a chat request, run
    until Ctrl-C / `duration` / an exit; always stops them all. 0 on a clean stop."""
    for spec in specs:
        _say(f"starting {spec.label} on http://127.0.0.1:{spec.port} (log {spec.log})")
    procs: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # started in the background
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for spec in specs:
            procs.append(_start(spec))
        problem = _wait_ready(specs, procs, ready_timeout)
        if problem:
            _say(f"error: {problem}")
            return 1
        _say(f"all {len(specs)} process(es) ready in {time.monotonic() - started:.1f} s")
        for spec in specs:
            if spec.entry:
                _say(f"talk to the {spec.label}: http://127.0.0.1:{spec.port}/v1")
        for spec in specs if probe else ():
            try:
                _say(f"{spec.label}: chat reply: {probe_chat(spec.port)!r}")
            except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
                _say(f"error: {spec.label}: chat request failed: {e}")
                return 1
        return _run_until_stopped(specs, procs, duration)
    except KeyboardInterrupt:
        _say("stopping (Ctrl-C or SIGTERM)")
        return 0
    finally:
        _stop(procs)
        signal.signal(signal.SIGTERM, previous)
        _say("all processes stopped")
