"""`sous recipe list | show | plan | check | launch | page`.

Exit status: 0 on success; 2 for a usage error — an unknown recipe, strategy, target, axis,
value or placeholder (the message lists the valid choices), or an excluded selection (the
message names the `excluded` entry); `check` exits 1 when a process does not fit.

Public API: `main(argv) -> int`, `make_parser`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from sous.config.flag_utils import human_readable_int
from sous.recipes.catalog import list_recipes, load_recipe
from sous.recipes.check import (
    CheckOverrides,
    check_model,
    check_plan,
    check_to_dict,
    render_check_text,
)
from sous.recipes.compose import Plan, compose, parse_assignments
from sous.recipes.fit import WEIGHT_FORMATS
from sous.recipes.k8s import DEFAULT_IMAGE, DEFAULT_RESOURCE, render_k8s
from sous.recipes.page import list_table, show_text
from sous.recipes.render import render_json, render_shell
from sous.recipes.schema import RecipeError

__all__ = ["main", "make_parser"]

_PROG = "sous recipe"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _selection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", metavar="SLUG",
                   help="strategy slug (see `sous recipe show NAME`); required")
    p.add_argument("--target", choices=None, metavar="Latency|Throughput",
                   help="optimisation target; may be omitted when the strategy has one")
    p.add_argument("--set", dest="sets", action="extend", nargs="+", default=[],
                   metavar="AXIS=VALUE", help="choose a value of an option axis (repeatable; "
                   "applied after --recommended)")
    p.add_argument("--recommended", action="store_true",
                   help="start from the page's recommended selection")
    p.add_argument("--var", dest="vars", action="extend", nargs="+", default=[],
                   metavar="NAME=VALUE", help="fill a <NAME> placeholder (repeatable)")


def _size_int(text: str) -> int:
    """An integer with `sous serve`'s size suffixes (`128k` = 128000, `32K` = 32768)."""
    try:
        return human_readable_int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: {e}") from None


def _check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="check a model without a recipe (skt/A.X-K2, "
                   "MiniMaxAI/MiniMax-M2.7)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-model-len", type=_size_int, metavar="N",
                   help="tokens; accepts size suffixes like `sous serve` (128k, 32K)")
    p.add_argument("--max-num-seqs", type=int,
                   help="sequences held at full length (default: the recipe's, else 1)")
    p.add_argument("--kv-cache-dtype")
    p.add_argument("--tensor-parallel-size", "-tp", type=int)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int)
    p.add_argument("--data-parallel-size", "-dp", type=int)
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="lookahead slots per sequence (no recipe; a recipe's "
                   "--speculative-config gives its own)")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS)
    p.add_argument("--device", help="accelerator (default: the option's SKU, else RBLN-CR13)")
    p.add_argument("--device-memory", type=float, metavar="GIB",
                   help="memory of one device in GiB (overrides the device's)")
    p.add_argument("--format", choices=("text", "json"), default="text")


def make_parser() -> argparse.ArgumentParser:
    """The `sous recipe` argument parser."""
    parser = _Parser(prog=_PROG, description="Read, plan, check and launch vendor recipes.")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    p = sub.add_parser("list", help="shipped recipes: name, model, badges, context, strategies")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p = sub.add_parser("show", help="strategies, targets, hardware, axes, recommended selection")
    p.add_argument("name", metavar="NAME", help="recipe name (file stem) or path")
    p.add_argument("--lang", default="en", help="page copy language (en, ko)")
    p = sub.add_parser("plan", help="compose the commands of one selection")
    p.add_argument("name", metavar="NAME", help="recipe name (file stem) or path")
    _selection_args(p)
    p.add_argument("--format", choices=("shell", "json", "k8s"), default="shell")
    p.add_argument("--image", default=DEFAULT_IMAGE, help="container image (k8s)")
    p.add_argument("--accelerator-resource", default=DEFAULT_RESOURCE,
                   help="extended resource name of an accelerator (k8s)")
    p = sub.add_parser(
        "check", help="memory fit per rank, before anything starts",
        description="Memory fit per rank of a recipe selection (NAME --strategy ...) or of "
        "a model (--model). Flags given here override the recipe's. Exit status: 0 fits "
        "(or only some full-length sequences fit), 1 a process does not fit, 2 usage error.")
    p.add_argument("name", metavar="NAME", nargs="?", help="recipe name (file stem) or path")
    _selection_args(p)
    _check_args(p)
    from sous.recipes.launch import add_launch_parser

    add_launch_parser(sub, _selection_args)
    p = sub.add_parser(
        "page", help="the recipe page in a browser (served, or written with --out)",
        description="Serve the recipe page (every shipped recipe and each --recipe file): "
        "strategies, options, the composed commands and their memory fit. With --out, write "
        "the same page as static files (all compositions precomputed) and exit.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks one)")
    p.add_argument("--recipe", dest="recipes", action="append", default=[], metavar="PATH",
                   help="also show this recipe file (repeatable)")
    p.add_argument("--out", metavar="DIR", help="write static files into DIR instead")
    return parser


def _plan(args: argparse.Namespace, fill_all: str | None = None) -> Plan:
    """The composed plan of the selection in `args`; `fill_all` fills every placeholder
    that --var does not."""
    lr = load_recipe(args.name)
    variables = parse_assignments(args.vars, "--var")

    def make() -> Plan:
        return compose(lr.recipe, args.strategy, args.target,
                       sets=parse_assignments(args.sets, "--set"),
                       recommended=args.recommended, variables=variables, name=lr.name)

    plan = make()
    if fill_all is not None and plan.placeholders_left:
        variables.update({p: fill_all for p in plan.placeholders_left})
        plan = make()
    return plan


def _list(args: argparse.Namespace) -> int:
    recipes = list_recipes()
    if args.format == "json":
        from sous.recipes.page import context_length

        rows = [{"name": lr.name, "model": lr.recipe.model, "badges": lr.recipe.badge_texts(),
                 "context": context_length(lr.recipe),
                 "strategies": [s.slug for s in lr.recipe.strategies]} for lr in recipes]
        sys.stdout.write(json.dumps(rows, indent=2, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(list_table(recipes))
    return 0


def _show(args: argparse.Namespace) -> int:
    try:
        sys.stdout.write(show_text(load_recipe(args.name), args.lang))
    except ValueError as e:
        if isinstance(e, RecipeError):
            raise
        raise RecipeError(str(e)) from None
    return 0


def _plan_cmd(args: argparse.Namespace) -> int:
    plan = _plan(args)
    if args.format == "json":
        sys.stdout.write(render_json(plan))
    elif args.format == "k8s":
        sys.stdout.write(render_k8s(plan, image=args.image, resource=args.accelerator_resource))
    else:
        sys.stdout.write(render_shell(plan))
    return 0


def _overrides(args: argparse.Namespace) -> CheckOverrides:
    return CheckOverrides(
        block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size, weight_format=args.weight_format,
        device=args.device, device_memory_gib=args.device_memory)


def _check(args: argparse.Namespace) -> int:
    over = _overrides(args)
    if args.name is not None:
        if args.model is not None:
            raise RecipeError("give a recipe NAME or --model, not both")
        plan = _plan(args)
        rows = check_plan(plan, over)
        title = f"{plan.recipe}: {plan.strategy} ({plan.target}), memory fit per rank"
    elif args.model is not None:
        rows = [check_model(args.model, over, args.num_speculative_tokens)]
        title = f"{args.model}: memory fit per rank"
    else:
        raise RecipeError("give a recipe NAME (with --strategy) or --model")
    if args.format == "json":
        sys.stdout.write(json.dumps(check_to_dict(rows), indent=2) + "\n")
    else:
        sys.stdout.write(render_check_text(rows, title))
    return 1 if any(r.report.verdict == "does not fit" for r in rows) else 0


def _page(args: argparse.Namespace) -> int:
    from sous.recipes.web.server import make_server, write_static

    recipes = [*list_recipes(), *(load_recipe(path) for path in args.recipes)]
    if args.out is not None:
        written = write_static(args.out, recipes)
        index = next(p for p in written if p.name == "index.html")
        print(f"wrote {len(written)} files; open {index.resolve().as_uri()}")
        return 0
    try:
        server = make_server(recipes, args.host, args.port)
    except OSError as e:
        raise RecipeError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    host, port = server.server_address[:2]
    print(f"recipe page on http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run `sous recipe ...` (argv without the `recipe` word); returns the exit status."""
    parser = make_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    actions = {"list": _list, "show": _show, "plan": _plan_cmd, "check": _check, "page": _page}
    if args.action is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.action == "launch":
            from sous.recipes.launch import run_launch

            return run_launch(args, _plan(args, fill_all="127.0.0.1"))
        return actions[args.action](args)
    except RecipeError as e:
        print(f"{_PROG} {args.action}: error: {e}", file=sys.stderr)
        return 2
