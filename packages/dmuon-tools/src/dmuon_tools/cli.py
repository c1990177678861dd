"""The ``dmuon-tools`` command (also ``python -m dmuon_tools``).

Owns argument parsing and printing; the work is done by ``planner`` (``plan``), ``simulator``
(``simulate``), ``calibration`` (``calibrate``) and dmuon's kernel status (``backend``). Errors in the user's input print one line naming the fix and exit
with status 2. ``backend`` still prints its report when ``DMUON_NS_KERNEL`` asks for a kernel
that cannot run here: ``ns_backend`` is null, ``ns_backend_error`` says why, and the same reason
goes to stderr as that one line (status 2). A reader that stops early (``| head``) ends the
command quietly with status 141, as a shell reports SIGPIPE. ``simulate --plot`` prints the
predictions first; without matplotlib it then exits 2 with that line naming the install.

    dmuon-tools backend
    dmuon-tools plan --config llama3-70b --mesh 8x16
    dmuon-tools plan --config path/to/config.json --mesh 10000 --ns-table ns.json
    dmuon-tools simulate --config llama3-8b --gpus 64 [--mesh 8x8] [--plot timeline.png]
    dmuon-tools simulate --config llama3-8b --gpus 64 --tokens-per-step 1M --training-tflops 300
    dmuon-tools calibrate --results benchmarks/results [--markdown]

``ns.json``: a ``benchmarks/kernels/bench_ns.py`` result or a plain ``{"MxN": ms}`` object (the wheel ships
no table; the repository's ``benchmarks/results/`` holds measured ones).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from dmuon.inspect import DEFAULT_SMALL_PARAM_NUMEL
from dmuon_tools.calibration import calibrate, format_markdown, format_text
from dmuon_tools.machine import load_machine, with_training_tflops
from dmuon_tools.model_shapes import PRESETS, load_decoder_shape
from dmuon_tools.ns_table import DEFAULT_CANDIDATE, NSTimeTable
from dmuon_tools.planner import format_report, parse_mesh, plan_report
from dmuon_tools.simulate_report import (
    ReportRow,
    Variant,
    format_markdown_table,
    format_simulation,
    format_tokens,
)
from dmuon_tools.simulator import (
    DEFAULT_SYSTEMS,
    SYSTEMS,
    Layout,
    Workload,
    accumulation_for,
    choose_layout,
    simulate,
)

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
        help='measured NS times: a benchmarks/kernels/bench_ns.py result or {"MxN": ms}',
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
    _add_simulate(commands)
    calibration = commands.add_parser(
        "calibrate",
        help="the simulator against the committed benchmark results",
        description=(
            "Fit the H200 machine's constants on the benchmark results they name and compare "
            "every other measured component with its prediction."
        ),
    )
    calibration.add_argument(
        "--results", required=True, help="the dmuon repository's benchmarks/results folder"
    )
    output = calibration.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the report as JSON")
    output.add_argument(
        "--markdown", action="store_true", help="print docs/simulator-calibration.md"
    )
    return parser


def _add_simulate(commands) -> None:
    parser = commands.add_parser(
        "simulate",
        help="predict the step time of FSDP2 + AdamW, dmuon and naive Muon on a layout",
        description=(
            "Lay out one training step per system (FSDP2 + AdamW, dmuon Z2/Z3 with synchronous "
            "or asynchronous HSDP publish, naive Muon on DTensors) for a dense decoder on a "
            "layout of G shards x R replicas x TP and print the predicted step, optimizer step, "
            "exposed communication and memory per GPU. A prediction from a model calibrated on "
            "one H200 (docs/simulator.md)."
        ),
    )
    parser.add_argument(
        "--config",
        action="append",
        help="a HuggingFace config.json or a preset (see plan --list-presets); repeat for a table",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--mesh", help="GxR: G shards x R replicas (with --tp: x TP each)")
    where.add_argument(
        "--gpus",
        type=int,
        action="append",
        help="a GPU count; the layout is the smallest shard group (at least a node) where "
        "FSDP2 + AdamW fits, HSDP over the rest; repeat for a table",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (with --mesh)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--machine", default="h200", help="a preset (h200) or a machine JSON file")
    parser.add_argument("--seq", type=int, default=8192, help="sequence length (default 8192)")
    parser.add_argument(
        "--micro-batch", type=int, default=1, help="sequences per data-parallel rank (default 1)"
    )
    parser.add_argument(
        "--accumulation",
        type=int,
        default=1,
        help="micro-batches per optimizer step (gradient accumulation, default 1)",
    )
    parser.add_argument(
        "--no-sync",
        action="store_true",
        help="accumulate under dmuon.no_sync: only the last micro-batch reduces its gradients "
        "(default: each micro-batch does)",
    )
    parser.add_argument(
        "--tokens-per-step",
        action="append",
        default=[],
        metavar="TOKENS",
        help="also simulate each layout at this many tokens per optimizer step over all ranks, "
        "by gradient accumulation (e.g. 1M = 2**20, 512K, 4194304); repeat for more; an "
        "extra column of --markdown",
    )
    parser.add_argument(
        "--training-tflops",
        action="append",
        type=float,
        default=[],
        metavar="TFLOPS",
        help="also simulate each layout with this model FLOP rate of forward+backward instead "
        "of the machine's (the sensitivity to the compute rate); repeat for more; an extra "
        "column of --markdown",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="recompute each layer in backward (default on)",
    )
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma list of {', '.join(SYSTEMS)} (default {','.join(DEFAULT_SYSTEMS)}, "
        "plus the -sync variants under HSDP)",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the predictions as JSON")
    output.add_argument(
        "--markdown", action="store_true", help="print one Markdown table (the README's)"
    )
    parser.add_argument(
        "--timeline", action="store_true", help="with --json: include every operation's span"
    )
    parser.add_argument(
        "--plot", metavar="PATH", help="save the timeline of each system (needs [plots])"
    )
    parser.add_argument(
        "--write-machine", metavar="PATH", help="write the machine as JSON (to edit) and exit"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "backend":
            return _backend()
        if args.command == "simulate":
            return _simulate(args)
        if args.command == "calibrate":
            return _calibrate(args)
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


def _simulate(args: argparse.Namespace) -> int:
    machine = load_machine(args.machine)
    if args.write_machine:
        with open(args.write_machine, "w") as out:
            json.dump(machine.to_json(), out, indent=2)
            out.write("\n")
        print(f"wrote {args.write_machine}")
        return 0
    if not args.config or (args.mesh is None and not args.gpus):
        raise ValueError(
            "simulate needs --config (a config.json or a preset) and --mesh GxR or --gpus N, "
            "e.g. dmuon-tools simulate --config llama3-8b --gpus 64"
        )
    if args.gpus and args.tp != 1:
        raise ValueError("--tp goes with --mesh (GxR x TP); --gpus picks layouts without TP.")
    workload = Workload(
        seq_len=args.seq,
        micro_batch=args.micro_batch,
        accumulation=args.accumulation,
        no_sync=args.no_sync,
        activation_checkpointing=args.activation_checkpointing,
    )
    tokens_per_step = [parse_tokens(text) for text in args.tokens_per_step]
    rates = [_positive_tflops(value) for value in args.training_tflops]
    rows: list[ReportRow] = []
    for config in args.config:
        shape = load_decoder_shape(config)
        if args.mesh is not None:
            num_shards, num_replicas = parse_mesh(args.mesh)
            layouts = [
                Layout(
                    num_shards=num_shards,
                    num_replicas=num_replicas,
                    tp=args.tp,
                    gpus_per_node=args.gpus_per_node,
                )
            ]
        else:
            layouts = [
                choose_layout(shape, gpus, machine, workload, gpus_per_node=args.gpus_per_node)
                for gpus in args.gpus
            ]
        for layout in layouts:
            if args.systems:
                systems = [name.strip() for name in args.systems.split(",") if name.strip()]
            else:
                systems = list(DEFAULT_SYSTEMS)
                if layout.num_replicas > 1:
                    systems.insert(2, "dmuon-z3-sync")
            main_run = simulate(shape, layout, workload, machine, systems)
            variants: list[Variant] = []
            data_parallel = layout.num_shards * layout.num_replicas
            for tokens in tokens_per_step:
                label = f"at {format_tokens(tokens)} tokens a step"
                if tokens < workload.tokens * data_parallel:
                    note = (
                        f"{format_tokens(tokens)} tokens a step is less than one micro-batch on "
                        f"each of the {data_parallel:,} data-parallel ranks "
                        f"({format_tokens(workload.tokens * data_parallel)})"
                    )
                    variants.append(Variant(label=label, note=note))
                    continue
                accumulated = replace(
                    workload, accumulation=accumulation_for(tokens, workload, data_parallel)
                )
                variants.append(
                    Variant(
                        label=label,
                        simulation=simulate(shape, layout, accumulated, machine, systems),
                    )
                )
            for rate in rates:
                label = (
                    f"at {rate:g} TFLOP/s ({rate / machine.training_tflops - 1:+.0%} compute rate)"
                )
                scaled = with_training_tflops(machine, rate)
                variants.append(
                    Variant(
                        label=label, simulation=simulate(shape, layout, workload, scaled, systems)
                    )
                )
            rows.append(ReportRow(main=main_run, variants=tuple(variants)))
    runs = [run for row in rows for run in row.simulations]
    for row in rows:
        for variant in row.variants:
            if variant.simulation is None and not args.markdown:
                print(f"dmuon-tools simulate: {row.main.model.name} on "
                      f"{row.main.layout.describe()}: skipped {variant.label}: {variant.note}.",
                      file=sys.stderr)  # fmt: skip
    # The predictions are printed before any plot is drawn: a missing matplotlib (or a path
    # that cannot be written) must not lose them.
    if args.json:
        print(json.dumps([run.to_json(spans=args.timeline) for run in runs], indent=2))
    elif args.markdown:
        print(format_markdown_table(rows))
    else:
        print("\n\n".join(format_simulation(run) for run in runs))
    if args.plot:
        sys.stdout.flush()
        _plot(runs, args.plot)
    return 0


def _plot(runs, path: str) -> None:
    from dmuon_tools.plots import plot_timeline

    for index, simulation in enumerate(runs):
        target = path if len(runs) == 1 else _numbered(path, index)
        try:
            plot_timeline(simulation, target)
        except ImportError as error:
            raise ValueError(
                f"--plot {path}: the predictions are printed above, but no plot: {error}"
            ) from error
        print(f"wrote {target}", file=sys.stderr)


def parse_tokens(text: str) -> int:
    """``--tokens-per-step``: an integer, or one with a K (2**10) or M (2**20) suffix."""
    value = text.strip().replace("_", "").replace(",", "")
    scale = {"K": 2**10, "M": 2**20}.get(value[-1:].upper(), 1)
    digits = value[:-1] if scale > 1 else value
    if not digits.isdigit() or int(digits) == 0:
        raise ValueError(
            f"--tokens-per-step {text!r} is not a positive number of tokens; give an integer or "
            "one with K (2**10) or M (2**20), e.g. 1M or 4194304."
        )
    return int(digits) * scale


def _positive_tflops(value: float) -> float:
    if not value > 0:
        raise ValueError(f"--training-tflops must be positive (TFLOP/s), got {value!r}.")
    return value


def _numbered(path: str, index: int) -> str:
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}-{index}.{suffix}" if dot else f"{path}-{index}"


def _calibrate(args: argparse.Namespace) -> int:
    calibration = calibrate(args.results)
    if args.json:
        print(json.dumps(calibration.to_json(), indent=2))
    elif args.markdown:
        print(format_markdown(calibration), end="")
    else:
        print(format_text(calibration))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
