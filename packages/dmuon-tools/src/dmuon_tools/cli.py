"""The ``dmuon-tools`` command (also ``python -m dmuon_tools``).

Owns argument parsing and printing; the work is done by ``planner`` (``plan``) and dmuon's
kernel status (``backend``). Errors in the user's input print one line naming the fix and exit
with status 2.

    dmuon-tools backend
    dmuon-tools plan --config llama3-70b --mesh 8x16
    dmuon-tools plan --config path/to/config.json --mesh 10000 --ns-table ns.json

``ns.json``: a ``benchmarks/bench_ns.py`` result or a plain ``{"MxN": ms}`` object (the wheel ships
no table; the repository's ``benchmarks/results/`` holds measured ones).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from dmuon.inspect import DEFAULT_SMALL_PARAM_NUMEL
from dmuon_tools.model_shapes import PRESETS, load_decoder_shape
from dmuon_tools.ns_table import DEFAULT_CANDIDATE, NSTimeTable
from dmuon_tools.planner import format_report, parse_mesh, plan_report

USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dmuon-tools", description="Diagnostics and partition what-ifs for dmuon."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "backend",
        help="print the Newton-Schulz backend and the kernel status as JSON",
        description="Print dmuon.get_ns_backend() and dmuon.get_backend_status() as JSON.",
    )
    plan = commands.add_parser(
        "plan",
        help="partition a model config over a G x R mesh and predict per-rank optimizer time",
        description=(
            "Run dmuon's ownership partition for a Llama-style decoder config on a mesh of G "
            "shards x R replicas, without building the model, and print the per-owner load; with "
            "--ns-table, also the predicted Newton-Schulz time per rank."
        ),
    )
    plan.add_argument(
        "--config",
        help="a HuggingFace config.json (or its folder) or a preset name (see --list-presets)",
    )
    plan.add_argument("--mesh", help="GxR (e.g. 8x16: 8 shards x 16 replicas) or G (one replica)")
    plan.add_argument(
        "--ns-table",
        metavar="JSON",
        help='measured NS times: a benchmarks/bench_ns.py result or {"MxN": ms}',
    )
    plan.add_argument(
        "--candidate",
        default=DEFAULT_CANDIDATE,
        help=f"which candidate's rows of a bench_ns.py result to use (default {DEFAULT_CANDIDATE!r})",
    )
    plan.add_argument(
        "--heaviest",
        type=int,
        default=5,
        help="how many of the heaviest owners to list (default 5)",
    )
    plan.add_argument(
        "--all-owners", action="store_true", help="with --json: include every owner's load"
    )
    plan.add_argument(
        "--small-param-numel",
        type=int,
        default=DEFAULT_SMALL_PARAM_NUMEL,
        help="parameters smaller than this are packed per layer (dmuon's default "
        f"{DEFAULT_SMALL_PARAM_NUMEL:_})",
    )
    plan.add_argument("--json", action="store_true", help="print the report as JSON")
    plan.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "backend":
            return _backend()
        return _plan(args)
    except ValueError as error:
        print(f"dmuon-tools {args.command}: error: {error}", file=sys.stderr)
        return USAGE_ERROR


def _backend() -> int:
    import dmuon

    report = {"ns_backend": dmuon.get_ns_backend(), "status": dmuon.get_backend_status()}
    print(json.dumps(report, indent=2, default=str))
    return 0


def _plan(args: argparse.Namespace) -> int:
    if args.list_presets:
        for shape in PRESETS.values():
            print(shape.describe())
        return 0
    if args.config is None or args.mesh is None:
        raise ValueError(
            "plan needs --config (a config.json or a preset) and --mesh (GxR or G), e.g. "
            "dmuon-tools plan --config llama3-8b --mesh 8x16"
        )
    shape = load_decoder_shape(args.config)
    num_shards, num_replicas = parse_mesh(args.mesh)
    table = NSTimeTable.load(args.ns_table, args.candidate) if args.ns_table else None
    report = plan_report(
        shape,
        num_shards,
        num_replicas,
        table=table,
        heaviest=args.heaviest,
        every_owner=args.all_owners,
        small_param_numel=args.small_param_numel,
    )
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
