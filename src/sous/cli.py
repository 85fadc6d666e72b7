"""The `sous` command: serve | bench serve | route | draft train | recipe.

`sous serve [MODEL] [vLLM flags]` parses with `sous.config.engine_args` and starts
`sous.server.api_server.run_server`; `sous bench serve` is the load generator in
`sous.bench.serve`. Heavy modules (torch, the server) are imported only by the
subcommand that needs them, so `sous --help` and flag errors are fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import sous

__all__ = ["main"]

_SUBCOMMANDS = {
    "serve": "OpenAI-compatible server (vLLM flags); `sous serve --help` lists them.",
    "bench": "`sous bench serve`: load generator against any OpenAI-compatible server.",
    "route": "llm-d router over sous/vLLM servers (prefix-aware, P/D): "
             "`sous route --config router-values.yaml --endpoint ROLE=URL ...`.",
    "draft": "`sous draft train --out DIR`: distil an EAGLE-3 draft head for a model here.",
    "recipe": "Read, plan, check and launch vendor deployment recipes, and browse them: "
              "`sous recipe list|show|plan|check|launch|page`.",
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sous", description="A vLLM-compatible serving engine and OpenAI server.")
    parser.add_argument("--version", action="version", version=f"sous {sous.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in _SUBCOMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(levelname)s %(asctime)s %(name)s: %(message)s")


def _port_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound (checked before the model loads), or None."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            return f"--host {host} --port {port}: cannot listen there ({e.strerror or e})"
    return None


def _serve(argv: list[str]) -> int:
    """`sous serve`: flag errors exit 2 in the parser; start-up ConfigErrors (a model path,
    a size that does not fit, a busy port) print one line and exit 2 too."""
    from sous.config.engine_args import parse_serve_args
    from sous.config.errors import ConfigError

    _setup_logging()
    engine_config, server_config = parse_serve_args(argv)
    try:
        if server_config.headless:
            from sous.engine.dp.headless import run_headless

            return run_headless(engine_config, server_config.reasoning_parser)
        problem = _port_problem(server_config.host, server_config.port)
        if problem:
            raise ConfigError(problem)
        from sous.server.api_server import run_server

        return run_server(engine_config, server_config)
    except ConfigError as e:
        print(f"sous serve: error: {e}", file=sys.stderr)
        return 2


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: sous bench serve [options]\n\n"
              "Subcommands:\n  serve  " + _SUBCOMMANDS["bench"].split(": ", 1)[1])
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"sous bench: error: unknown benchmark {argv[0]!r} (available: serve)",
              file=sys.stderr)
        return 2
    from sous.bench.serve import main as bench_serve_main

    return bench_serve_main(argv[1:])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `sous` console script; returns the exit status (errors in
    arguments raise SystemExit(2))."""
    args = list(sys.argv[1:] if argv is None else argv)
    command, rest = (args[0], args[1:]) if args else (None, [])
    if command == "serve":
        return _serve(rest)
    if command == "bench":
        return _bench(rest)
    if command == "draft":
        from sous.draft.train import main as draft_main

        return draft_main(rest)
    if command == "recipe":
        from sous.recipes.cli import main as recipe_main

        return recipe_main(rest)
    if command == "route":
        from sous.router.server import main as route_main

        return route_main(rest)
    parser = _top_parser()
    parser.parse_args(args)  # --help, --version and errors exit here
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
