"""The ``dmuon-tools`` command (also ``python -m dmuon_tools``).

Owns argument parsing and printing; the work is done by ``planner`` (``plan``) and dmuon's
kernel status (``backend``). Errors in the user's input print one line naming the fix and exit
with status 2. ``backend`` still prints its report when ``DMUON_NS_KERNEL`` asks for a kernel
that cannot run here: ``ns_backend`` is null, ``ns_backend_error`` says why, and the same reason
goes to stderr as that one line (status 2). A reader that stops early (``| head``) ends the
command quietly with status 141, as a shell reports SIGPIPE.

    dmuon-tools backend
    dmuon-tools plan --config llama3-70b --mesh 8x16
    dmuon-tools plan --config path/to/config.json --mesh 10000 --ns-table ns.json

``ns.json``: a ``benchmarks/bench_ns.py`` result or a plain ``{"MxN": ms}`` object (the wheel ships
no table; the repository's ``benchmarks/results/`` holds measured ones).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from dmuon.inspect import DEFAULT_SMALL_PARAM_NUMEL
from dmuon_tools.model_shapes import PRESETS, load_decoder_shape
from dmuon_tools.ns_table import DEFAULT_CANDIDATE, NSTimeTable
from dmuon_tools.planner import format_report, parse_mesh, plan_report

USAGE_ERROR = 2
BROKEN_PIPE = 141  # 128 + SIGPIPE, the status a shell reports for a writer whose reader left


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
            "Run dmuon's ownership partition for a decoder config (llama, mistral, qwen2, qwen3; "
            "the mixture-of-experts mixtral, qwen2_moe, qwen3_moe) on a mesh of G shards x R "
            "replicas (at most 1,000,000 owners), without building the model, and print the "
            "per-owner load; with --ns-table, also the predicted Newton-Schulz time per rank."
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
    except BrokenPipeError:
        # The reader left early (``dmuon-tools plan ... | head``): not an error of ours. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE


def _backend() -> int:
    import dmuon

    report: dict[str, object] = {"ns_backend": None, "status": dmuon.get_backend_status()}
    try:
        report["ns_backend"] = dmuon.get_ns_backend()
    except (ValueError, RuntimeError) as error:
        # DMUON_NS_KERNEL is not a kernel name, or names one this machine cannot run: the
        # report is what a user needs to see why, so print it before the error line.
        report["ns_backend_error"] = str(error)
        print(json.dumps(report, indent=2, default=str))
        print(f"dmuon-tools backend: error: {error}", file=sys.stderr)
        return USAGE_ERROR
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
