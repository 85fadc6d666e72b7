from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """OpenAI-server settings (the engine's are in EngineConfig)."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 8000
    """Port to bind."""
    api_key: str | None = None
    """Require `Authorization: Bearer <key>` on /v1 endpoints (also read from VLLM_API_KEY)."""
    uvicorn_log_level: str = "info"
    """uvicorn log level."""
    enable_log_requests: bool = False
    """Log each request at INFO: its prompt, prompt token ids and sampling parameters."""
    disable_log_requests: bool | None = None
    """Deprecated (as in vLLM): requests are not logged unless --enable-log-requests;
    --no-disable-log-requests is read as --enable-log-requests."""
    max_log_len: int | None = None
    """Longest prompt text/ids logged per request."""
    enable_auto_tool_choice: bool = False
    """Let the model choose tool calls (needs --tool-call-parser)."""
    tool_call_parser: str | None = None
    """Tool-call parser name."""
    reasoning_parser: str | None = None
    """Reasoning parser name."""
    response_role: str = "assistant"
    """Role of the generated chat message."""
    max_request_body_bytes: int = 32 * 2**20
    """sous-specific: requests with a larger body get 413 before it is read (32 MiB holds a
    prompt of a million tokens, as text or as token ids)."""
    headless: bool = False
    """Run data parallel engine ranks only (no API server): ranks
    --data-parallel-start-rank to + --data-parallel-size-local join the API server at
    --data-parallel-address:--data-parallel-rpc-port."""
    shutdown_timeout: int = 5
    """On SIGTERM/SIGINT: seconds requests in flight may take to finish while new ones get
    503; the rest are then aborted (finish_reason "abort"). 0: abort at once. A second signal
    exits immediately. (vLLM's flag; its default is 0.)"""
