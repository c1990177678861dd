"""The calibration report: every measured component the simulator predicts, the prediction, the
error, and whether the measurement fixed a constant (``fit``) or was left out of every fit
(``held out``); printed as text or as the Markdown page ``docs/simulator-calibration.md``.

Owns comparing each committed result with the simulator on the fitted machine (``calibrate``, a
``Row`` per compared quantity, the summary by component) and printing it. It must not fit a
constant (``fit`` does) or read a file other than through ``results``' loaders.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmuon_tools.calibration.fit import derive_h200, gloo_layout, gloo_machine
from dmuon_tools.calibration.results import (
    CUBLAS_NS_CANDIDATE,
    E2E_FILE,
    GLOO_FILE,
    HOST_FILE,
    NS_FILE,
    STEP_FILE,
    bench_e2e_shape,
    bench_step_counts,
    device_of,
    e2e_workload,
    measured_ns_ms,
    model_config_text,
    overlap_what_if,
    ran_on_cpu,
    read_result,
    value_at,
)
from dmuon_tools.costs import (
    ADAMW_BYTES_PER_ELEMENT,
    COLLECTIVES,
    MUON_BYTES_PER_ELEMENT,
    REFERENCE_MUON_BYTES_PER_ELEMENT,
    collective_ms,
    elementwise_ms,
    ns_batch_ms,
    owner_ns_ms,
)
from dmuon_tools.machine import Machine
from dmuon_tools.simulator import Layout, Workload, simulate

BENCH_E2E_DEFAULT_MODEL = {"vocab": 32000, "dim": 2048, "layers": 16, "heads": 16,
                           "kv_heads": 8, "ffn": 5632}  # fmt: skip
# Variants of bench_e2e / profile_host and the simulator's system for each.
E2E_SYSTEMS = {
    "fsdp2-adamw": "fsdp2-adamw",
    "dmuon-z3": "dmuon-z3",
    "dmuon-z2": "dmuon-z2",
    "dmuon-z3-overlap": "dmuon-z3-overlap",
    "dmuon-z2-overlap": "dmuon-z2-overlap",
    "naive-muon": "naive-muon",
}
BENCH_STEP_ROWS = {
    "fused AdamW": "adamw",
    "torch.optim.Muon": "reference",
    "dmuon.Muon (gram, kernel auto)": "dmuon",
    "dmuon.Muon (gram, kernel cublas)": "dmuon cublas",
}
# The error of the memory components the host profile lists after a step is not a test of the
# model when it is exact by construction (sizes of tensors); they are still reported.
DEFAULT_COMMAND = "dmuon-tools calibrate --results benchmarks/results"


# ---- the report ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    source: str  # file name
    case: str  # variant or configuration
    quantity: str
    measured: float
    predicted: float
    role: str  # "fit" or "held out"
    unit: str = "ms"
    setting: str = "world size 1"  # where it ran: "NCCL, 8 GPUs", "gloo, 4 ranks on one GPU"

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured if self.measured else math.nan


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    machine: Machine
    gloo: Machine
    rows: tuple[Row, ...]
    excluded: tuple[tuple[str, str], ...]  # (file, reason)

    def summary(self) -> list[dict[str, Any]]:
        """Held-out rows of the latest file of each benchmark, grouped by what they measure:
        how many, median and largest absolute error."""
        groups: dict[str, list[Row]] = {}
        for row in self.rows:
            if row.role == "held out" and _is_latest(row.source):
                groups.setdefault(_group_of(row), []).append(row)
        return [
            {
                "component": name,
                "rows": len(rows),
                "median_abs_error": statistics.median(abs(r.error) for r in rows),
                "max_abs_error": max(abs(r.error) for r in rows),
            }
            for name, rows in sorted(groups.items(), key=lambda item: _summary_order(item[0]))
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "command": DEFAULT_COMMAND,
            "machine": self.machine.to_json(),
            "gloo_link": dataclasses.asdict(self.gloo.nvlink),
            "summary": self.summary(),
            "rows": [{**dataclasses.asdict(row), "error": _finite(row.error)} for row in self.rows],
            "excluded": [{"file": f, "reason": r} for f, r in self.excluded],
        }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


# The newest file of each family (the ones the fits use, and their gloo and host siblings).
_LATEST = {
    STEP_FILE,
    E2E_FILE,
    GLOO_FILE,
    HOST_FILE,
    "host-llama1b-h200-2026-12-01-576a0bf.json",
}


def _is_latest(source: str) -> bool:
    return source in _LATEST or source.startswith("collectives-")


_SUMMARY_ORDER = ("whole step", "forward+backward", "optimizer step", "memory", "collectives")


def _summary_order(group: str) -> tuple[bool, int, str]:
    """World size 1 first, then the other settings; within each, the step before its parts."""
    rank = next((i for i, prefix in enumerate(_SUMMARY_ORDER) if group.startswith(prefix)), 9)
    return "world size 1" not in group and not group.startswith("memory"), rank, group


def _group_of(row: Row) -> str:
    if row.source.startswith("collectives-"):
        return f"collectives ({row.setting})"
    if row.unit == "GiB":
        if row.quantity == "peak":
            return "memory per GPU, peak"
        return "memory per GPU, persistent state by component (tensor sizes)"
    world = row.setting
    if row.quantity.startswith("optimizer") or row.source.startswith("step-"):
        return f"optimizer step ({world})"
    if row.quantity == "forward+backward":
        return f"forward+backward ({world})"
    return f"whole step ({world})"


def calibrate(results: str | Path, machine: Machine | None = None) -> Calibration:
    """Every prediction the committed results can check, on ``machine`` (default: the figures
    ``derive_h200`` computes from ``results``)."""
    results = Path(results)
    if not results.is_dir():
        raise ValueError(
            f"--results {str(results)!r} is not a folder; pass the repository's benchmarks/results."
        )
    machine = machine or derive_h200(results)
    gloo = gloo_machine(results, machine)
    cublas_ns = measured_ns_ms(results / NS_FILE, CUBLAS_NS_CANDIDATE)
    rows: list[Row] = []
    excluded: list[tuple[str, str]] = []
    for path in sorted(results.glob("*.json")):
        name = path.name
        device = device_of(path)
        if ran_on_cpu(path):  # the simulator models the GPU: a CPU run checks nothing of it
            excluded.append((name, "a CPU run (the simulator models the H200)"))
        elif device is not None and device != machine.gpu:  # another card's figures
            excluded.append(
                (name, f"a run on an {device} (the simulator models the {machine.gpu})")
            )
        elif name.startswith("step-"):
            rows += _step_rows(path, machine, cublas_ns)
        elif name.startswith("e2e-"):
            rows += _e2e_rows(path, machine, gloo)
        elif name.startswith("overlap-ab-"):
            what_if = overlap_what_if(path)
            if what_if is None:
                rows += _overlap_ab_rows(path, machine, gloo)
            else:
                excluded.append((name, what_if))
        elif name.startswith("host-"):
            rows += _host_rows(path, machine)
        elif name.startswith("collectives-"):
            rows += _collective_rows(path, machine, gloo)
        elif name.startswith("protocol-"):
            excluded.append(
                (
                    name,
                    "correctness run: its 'seconds' time the whole check (the reference model, "
                    "per-step comparisons and all-reduces) and no step time is recorded",
                )
            )
    return Calibration(machine=machine, gloo=gloo, rows=tuple(rows), excluded=tuple(excluded))


def _step_rows(
    path: Path, machine: Machine, cublas_ns: Mapping[tuple[int, int], float]
) -> list[Row]:
    data = read_result(path)
    counts = bench_step_counts(data, path)
    numel = sum(count * a * b for (a, b), count in counts.items())
    predicted = {
        "adamw": elementwise_ms(numel, ADAMW_BYTES_PER_ELEMENT, machine.copy_gbps),
        "reference": math.fsum(
            count * ns_batch_ms(machine.reference_ns_ms, shape, 1)
            for shape, count in counts.items()
        )
        + elementwise_ms(numel, REFERENCE_MUON_BYTES_PER_ELEMENT, machine.copy_gbps),
        "dmuon": owner_ns_ms(machine.ns_ms, counts)
        + elementwise_ms(numel, MUON_BYTES_PER_ELEMENT, machine.copy_gbps),
        "dmuon cublas": owner_ns_ms(cublas_ns, counts)
        + elementwise_ms(numel, MUON_BYTES_PER_ELEMENT, machine.copy_gbps),
    }
    rows = []
    for case, what in BENCH_STEP_ROWS.items():
        result = value_at(data, "results", path).get(case)
        if result is None or result.get("median_ms") is None:
            continue
        fit = path.name == STEP_FILE and what == "adamw"
        rows.append(
            Row(
                source=path.name,
                case=case,
                quantity="optimizer step",
                measured=float(result["median_ms"]),
                predicted=predicted[what],
                role="fit" if fit else "held out",
            )
        )
    return rows


def _e2e_setting(
    data: Mapping[str, Any], path: Path, machine: Machine, gloo: Machine
) -> tuple[Machine, Layout, str]:
    """The machine, layout and setting label of a run of bench_e2e's model: NCCL runs on one
    node (one GPU a rank), gloo runs of several ranks sharing the one GPU (how the project's GPU
    machine runs them)."""
    world = int(value_at(data, "world_size", path))
    if value_at(data, "backend", path) == "gloo" and world > 1:
        return gloo, gloo_layout(world), f"gloo, {world} ranks on one GPU"
    layout = Layout(num_shards=world, gpus_per_node=max(8, world))
    return machine, layout, "world size 1" if world == 1 else f"NCCL, {world} GPUs"


def _e2e_rows(path: Path, machine: Machine, gloo: Machine) -> list[Row]:
    """``bench_e2e.py``: each variant's step, its parts and its peak."""
    data = read_result(path)
    inputs = value_at(data, "inputs", path)
    machine, layout, setting = _e2e_setting(data, path, machine, gloo)
    shape = bench_e2e_shape(inputs["model"], path.name)
    workload = e2e_workload(inputs)
    variants = [
        v for v, result in value_at(data, "results", path).items()
        if v in E2E_SYSTEMS and "error" not in result
    ]  # fmt: skip
    simulation = simulate(shape, layout, workload, machine, [E2E_SYSTEMS[v] for v in variants])
    rows = []
    for variant in variants:
        result = data["results"][variant]
        prediction = simulation.predictions[E2E_SYSTEMS[variant]]
        measured = {
            "step": result["step_ms_median"],
            "optimizer step": result["optimizer_ms_median"],
            "forward+backward": result["step_ms_median"] - result["optimizer_ms_median"],
        }
        predicted = {
            "step": prediction.step_ms,
            "optimizer step": prediction.optimizer_ms,
            "forward+backward": prediction.step_ms - prediction.optimizer_ms,
        }
        # The overlapped step's owner work runs during backward on the GPU (sharing it with
        # backward's kernels) and only in backward's idle compute in the simulator: where the
        # time falls between backward and step() differs by construction, the step compares.
        quantities = ["step"] if E2E_SYSTEMS[variant].endswith("-overlap") else list(measured)
        for quantity in quantities:
            rows.append(
                Row(
                    source=path.name,
                    case=variant,
                    quantity=quantity,
                    measured=float(measured[quantity]),
                    predicted=predicted[quantity],
                    role=_e2e_role(path.name, variant, quantity),
                    setting=setting,
                )
            )
        peaks = [p for p in result.get("peak_gib_per_rank") or [] if p is not None]
        if peaks:
            rows.append(
                Row(
                    source=path.name,
                    case=variant,
                    quantity="peak",
                    measured=max(peaks),
                    predicted=prediction.memory_gib["peak"],
                    role="held out",
                    unit="GiB",
                    setting=setting,
                )
            )
    return rows


# The two systems ``overlap_ab.py`` alternates, and its summary's key for each.
OVERLAP_AB_SYSTEMS = {"dmuon-z3": "plain_median_ms", "dmuon-z3-overlap": "overlapped_median_ms"}


def _overlap_ab_rows(path: Path, machine: Machine, gloo: Machine) -> list[Row]:
    """``overlap_ab.py``: the plain and the overlapped step measured paired (their iterations
    alternated on one machine), each step and the ratio of the two."""
    # Its first version ran NCCL at world size 1 only and recorded neither.
    data = {"world_size": 1, "backend": "nccl", **read_result(path)}
    machine, layout, setting = _e2e_setting(data, path, machine, gloo)
    shape = bench_e2e_shape(value_at(data, "model", path), path.name)
    # bench_e2e's defaults (activation checkpointing, bf16) where the file predates recording them
    workload = e2e_workload(data)
    predictions = simulate(shape, layout, workload, machine, list(OVERLAP_AB_SYSTEMS))
    predicted = {s: predictions.predictions[s].step_ms for s in OVERLAP_AB_SYSTEMS}
    rows = [
        Row(
            source=path.name,
            case=system,
            quantity="step",
            measured=float(value_at(data, f"summary.{key}", path)),
            predicted=predicted[system],
            role="held out",
            setting=setting,
        )
        for system, key in OVERLAP_AB_SYSTEMS.items()
    ]
    plain, overlapped = OVERLAP_AB_SYSTEMS
    rows.append(
        Row(
            source=path.name,
            case=f"{overlapped} / {plain}, paired",
            quantity="step ratio",
            measured=float(value_at(data, "summary.ratio", path)),
            predicted=predicted[overlapped] / predicted[plain],
            role="held out",
            unit="x",
            setting=setting,
        )
    )
    return rows


def _e2e_role(name: str, variant: str, quantity: str) -> str:
    # The rows a constant was fitted on, and the ones that fit fixes almost whole (a step whose
    # forward+backward was the fit, and the reverse).
    fits = {
        (E2E_FILE, "fsdp2-adamw", "forward+backward"),
        (E2E_FILE, "fsdp2-adamw", "step"),
        (E2E_FILE, "naive-muon", "optimizer step"),
        (GLOO_FILE, "fsdp2-adamw", "step"),
        (GLOO_FILE, "fsdp2-adamw", "forward+backward"),
    }
    return "fit" if (name, variant, quantity) in fits else "held out"


def _host_rows(path: Path, machine: Machine) -> list[Row]:
    data = read_result(path)
    inputs = value_at(data, "inputs", path)
    config = {k: int(v) for k, v in model_config_text(inputs["model"]).items()}
    shape = bench_e2e_shape(config, path.name)
    # profile_host checkpoints activations exactly for bench_e2e's default model (--llama-1b);
    # the file does not record it.
    checkpointing = all(config.get(k) == v for k, v in BENCH_E2E_DEFAULT_MODEL.items())
    workload = Workload(
        seq_len=int(inputs["seq"]),
        micro_batch=int(inputs["micro_batch"]),
        activation_checkpointing=checkpointing,
    )
    results = value_at(data, "results", path)
    variants = [v for v in results if v in E2E_SYSTEMS]
    simulation = simulate(shape, Layout(num_shards=1), workload, machine, variants)
    rows = []
    for variant in variants:
        result, prediction = results[variant], simulation.predictions[variant]
        pairs = (
            ("forward+backward", "device_forward_backward_ms",
             prediction.step_ms - prediction.optimizer_ms, "ms"),
            ("optimizer step", "device_step_ms", prediction.optimizer_ms, "ms"),
            ("peak", "peak_gib", prediction.memory_gib["peak"], "GiB"),
        )  # fmt: skip
        for quantity, key, predicted, unit in pairs:
            if result.get(key) is None:
                continue
            fit = path.name == HOST_FILE and quantity == "forward+backward"
            rows.append(
                Row(
                    source=path.name,
                    case=variant,
                    quantity=quantity,
                    measured=float(result[key]),
                    predicted=predicted,
                    role="fit" if fit else "held out",
                    unit=unit,
                )
            )
        for component, measured in (result.get("memory_after_step_gib") or {}).items():
            if component in prediction.memory_gib:
                rows.append(
                    Row(
                        source=path.name,
                        case=variant,
                        quantity=component,
                        measured=float(measured),
                        predicted=prediction.memory_gib[component],
                        role="held out",
                        unit="GiB",
                    )
                )
    return rows


def _collective_rows(path: Path, machine: Machine, gloo: Machine) -> list[Row]:
    """``bench_collectives.py``: each measured collective against the ring model on the link
    its ranks use (gloo ranks sharing a GPU: the fitted loopback; NCCL in one node: NVLink;
    across nodes: the network)."""
    data = read_result(path)
    world = int(value_at(data, "world_size", path))
    backend = value_at(data, "backend", path)
    if backend == "gloo":
        link = gloo.nvlink
    else:
        link = machine.nvlink if int(data.get("nodes", 1)) <= 1 else machine.network
    rows = []
    for result in value_at(data, "results", path):
        if "error" in result or result.get("kind") not in COLLECTIVES:
            continue
        rows.append(
            Row(
                source=path.name,
                case=f"{backend} x {world}",
                quantity=f"{result['kind']} {result['bytes'] / 2**20:g} MiB",
                measured=float(result["median_ms"]),
                predicted=collective_ms(result["kind"], result["bytes"], world, link),
                role="held out",
                setting=f"{backend}, {world} ranks",
            )
        )
    return rows


# ---- printing ---------------------------------------------------------------------------------


def format_markdown(calibration: Calibration) -> str:
    """The report as the Markdown page ``docs/simulator-calibration.md`` holds."""
    machine = calibration.machine
    lines = [
        "# Simulator calibration",
        "",
        "Generated by `" + DEFAULT_COMMAND + " --markdown` (do not edit: "
        "`tests/tools/test_calibration.py` keeps this page equal to the command's output). "
        "What the simulator assumes is in [simulator.md](simulator.md).",
        "",
        "Every number below is measured on one H200 (NVIDIA, torch 2.11) and committed under "
        "`benchmarks/results/`. A row marked **fit** fixed one of the machine's constants; every "
        "other row is **held out**: predicted from constants fitted elsewhere. No multi-GPU "
        "NCCL measurement exists yet, so the NVLink and network links are assumed and nothing "
        "here tests them; the communication model is tested only on 4 gloo ranks sharing the "
        "GPU (a TCP loopback, not NCCL).",
        "",
        "## Summary (held-out rows of the newest run of each benchmark)",
        "",
        "| component | rows | median abs. error | max abs. error |",
        "|---|---:|---:|---:|",
    ]
    for entry in calibration.summary():
        lines.append(
            f"| {entry['component']} | {entry['rows']} | {entry['median_abs_error']:.1%} | "
            f"{entry['max_abs_error']:.1%} |"
        )
    lines += [
        "",
        "Reading the summary:",
        "",
        "- At world size 1 the model is tested on the optimizer step of two shapes (the 8B-shaped "
        "4-layer stack of `bench_step.py`, the 1 B Llama of `bench_e2e.py`) and on the whole "
        "iteration of the 1 B Llama. Its largest errors there are the launch-bound optimizer "
        "steps of the GPT-2-small shape (the simulator has no host model for the step) and the "
        "run-to-run spread of the measurements themselves: " + _largest_spread(calibration.rows)
        + ".",
        "- On 4 gloo ranks sharing the GPU the ring model mispredicts dmuon by about 2x while "
        "FSDP2's step is the fit: the ring model prices gloo's broadcast and reduce (dmuon's "
        "collectives) like its all-gather and reduce-scatter (FSDP2's), and the measurements say "
        "gloo does not (one explanation, unverified: a reduce-scatter run as an all-reduce, "
        "twice the bytes). `benchmarks/overlap/bench_collectives.py --backend gloo` on 4 ranks measures "
        "each kind; a per-kind link would replace the one fitted bandwidth.",
        "- Nothing here tests NVLink or the network: those predictions rest on the assumed links "
        "until `benchmarks/multi_gpu_session.sh` runs.",
        "",
        "## The machine's constants",
        "",
        "| constant | value | from |",
        "|---|---:|---|",
        f"| GEMM rate (bf16) | {machine.gemm_tflops:g} TFLOP/s | {machine.sources['gemm_tflops']} |",
        f"| forward+backward model FLOP rate | {machine.training_tflops:g} TFLOP/s | "
        f"{machine.sources['training_tflops']} |",
        f"| element-wise (HBM) bandwidth | {machine.copy_gbps:g} GB/s | "
        f"{machine.sources['copy_gbps']} |",
        f"| host floor per layer, FSDP2 / dmuon | {machine.layer_host_ms['fsdp2']:g} / "
        f"{machine.layer_host_ms['dmuon']:g} ms | {machine.sources['layer_host_ms']} |",
        f"| DTensor host time per matrix (naive Muon) | {machine.dtensor_host_ms_per_matrix:g} "
        f"ms | {machine.sources['dtensor_host_ms_per_matrix']} |",
        f"| gloo loopback link (4 ranks, one GPU) | {calibration.gloo.nvlink.bandwidth_gbps:g} "
        f"GB/s, {calibration.gloo.nvlink.latency_us:g} us | {calibration.gloo.sources['nvlink']} |",
        f"| NVLink | {machine.nvlink.bandwidth_gbps:g} GB/s, {machine.nvlink.latency_us:g} us | "
        f"{machine.sources['nvlink']} |",
        f"| network | {machine.network.bandwidth_gbps:g} GB/s, {machine.network.latency_us:g} us |"
        f" {machine.sources['network']} |",
        "",
        "Newton-Schulz per call (ms), " + machine.sources["ns_ms"] + " and "
        + machine.sources["reference_ns_ms"] + ":",
        "",
        "| shape | dmuon | torch.optim.Muon |",
        "|---|---:|---:|",
    ]  # fmt: skip
    for shape in sorted(machine.ns_ms):
        reference = machine.reference_ns_ms.get(shape)
        lines.append(
            f"| {shape[0]}x{shape[1]} | {machine.ns_ms[shape]:g} | "
            + (f"{reference:g}" if reference is not None else "-")
            + " |"
        )
    lines += ["", "## Every row", ""]
    current = None
    for row in calibration.rows:
        if row.source != current:
            current = row.source
            lines += [
                "",
                f"### {row.source}",
                "",
                "| case | quantity | measured | predicted | error | role |",
                "|---|---|---:|---:|---:|---|",
            ]
        lines.append(
            f"| {row.case} | {row.quantity} | {_value(row.measured, row.unit)} | "
            f"{_value(row.predicted, row.unit)} | {row.error:+.1%} | {row.role} |"
        )
    lines += ["", "## Not used", ""]
    for name, reason in calibration.excluded:
        lines.append(f"- `{name}`: {reason}.")
    return "\n".join(lines) + "\n"


def _value(value: float, unit: str) -> str:
    """A measured or predicted figure with its unit; a ratio ("x") to four decimals."""
    return f"{value:.4f} x" if unit == "x" else f"{value:.2f} {unit}"


def _largest_spread(rows: Sequence[Row]) -> str:
    """The widest run-to-run spread of one quantity measured in several committed runs of the
    same benchmark configuration at world size 1 (same case and predicted value)."""
    runs: dict[tuple[str, str, str, float], list[float]] = {}
    for row in rows:
        if row.setting == "world size 1" and row.unit == "ms" and row.quantity == "step":
            key = (row.source.split("-")[0], row.case, row.quantity, round(row.predicted, 6))
            runs.setdefault(key, []).append(row.measured)
    repeated = [(max(v) / min(v), key, v) for key, v in runs.items() if len(v) > 1]
    if not repeated:
        return "no configuration was measured twice"
    spread, (_, case, quantity, _), values = max(repeated)
    return (
        f"the {case} {quantity} measured {min(values):.1f} to {max(values):.1f} ms across "
        f"{len(values)} committed runs of one configuration ({spread - 1:.0%} apart)"
    )


def format_text(calibration: Calibration, rows: Sequence[Row] | None = None) -> str:
    """The summary and the constants, for a terminal."""
    lines = ["calibration: held-out rows of the newest run of each benchmark"]
    for entry in calibration.summary():
        lines.append(
            f"  {entry['component']}: {entry['rows']} rows, median |error| "
            f"{entry['median_abs_error']:.1%}, max {entry['max_abs_error']:.1%}"
        )
    lines.append("every row:")
    for row in rows if rows is not None else calibration.rows:
        lines.append(
            f"  {row.source} {row.case} {row.quantity}: measured {_value(row.measured, row.unit)}"
            f", predicted {_value(row.predicted, row.unit)} ({row.error:+.1%}, {row.role})"
        )
    return "\n".join(lines)
