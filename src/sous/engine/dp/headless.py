"""`sous serve --headless`: data parallel ranks for an API server on another node.

Ranks --data-parallel-start-rank .. + --data-parallel-size-local start here and join the
coordinator at --data-parallel-address:--data-parallel-rpc-port (vLLM's multi-node layout).
This process waits for them: it exits 0 once they all stopped cleanly (the API server told
them to), otherwise with the first failing rank's status (2: a start-up error such as an
unreachable coordinator). Ctrl-C or SIGTERM stops them.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from sous.config.engine import EngineConfig
from sous.engine.dp import wire
from sous.engine.dp.rank import start_local_ranks

logger = logging.getLogger(__name__)


def run_headless(config: EngineConfig, reasoning_parser: str | None) -> int:
    par = config.parallel
    host = par.data_parallel_address or "127.0.0.1"
    port = par.data_parallel_rpc_port or wire.DEFAULT_RPC_PORT
    coordinator = f"tcp://{host}:{port}"
    procs = start_local_ranks(config, coordinator, reasoning_parser)
    logger.info("Headless: data parallel ranks %s of %d joining %s", sorted(procs),
                par.data_parallel_size, coordinator)
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    status = 0
    while procs and not stopping:
        for rank, proc in list(procs.items()):
            if proc.exitcode is not None:
                del procs[rank]
                if proc.exitcode != 0 and status == 0:
                    status = proc.exitcode if proc.exitcode > 0 else 1
                    logger.error("data parallel rank %d exited with code %d", rank,
                                 proc.exitcode)
        if status:
            break
        time.sleep(0.2)
    for proc in procs.values():  # stop the rest (a signal, or a rank failed)
        proc.terminate()
    for proc in procs.values():
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return status
