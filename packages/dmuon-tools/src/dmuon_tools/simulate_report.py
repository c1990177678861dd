"""What ``dmuon-tools simulate`` prints: a table per simulated layout, or one Markdown table.

Owns the wording and the layout of the predictions for a terminal and for the README (the
Markdown table ``tests/tools/test_cli_readme_table.py`` keeps equal to the README's). It must
not compute anything the ``Simulation`` does not hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dmuon_tools.simulator import Simulation

PREDICTION_LABEL = (
    "PREDICTED by dmuon-tools simulate (a model calibrated on one H200, not a measurement; "
    "docs/simulator.md, docs/simulator-calibration.md)"
)
BASELINE = "fsdp2-adamw"


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """The same model and layout under another workload or machine (``--tokens-per-step``,
    ``--training-tflops``): ``simulation``, or None with the ``note`` saying why not."""

    label: str  # "at 1M tokens a step", "at 291.7 TFLOP/s (-30% compute rate)"
    simulation: Simulation | None = None
    note: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportRow:
    """One model on one layout: the run the options describe and its variants."""

    main: Simulation
    variants: tuple[Variant, ...] = ()

    @property
    def simulations(self) -> list[Simulation]:
        return [self.main] + [v.simulation for v in self.variants if v.simulation is not None]


def format_tokens(tokens: int) -> str:
    """Tokens in binary units where they divide (1M = 2**20, 512K = 2**19 tokens)."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if tokens >= size and tokens % size == 0:
            return f"{tokens // size}{unit}"
    return f"{tokens:,}"


def format_simulation(simulation: Simulation) -> str:
    """One layout's predictions: a line per system."""
    layout, model = simulation.layout, simulation.model
    lines = [
        f"{model.name} on {layout.describe()}: shard group on "
        f"{layout.link_class('shard')}, replicate group on {layout.link_class('replicate')}; "
        f"machine {simulation.machine.name}",
        f"  {simulation.workload.describe()}; {simulation.tokens_per_step:,} tokens a step; "
        f"forward+backward at {simulation.machine.training_tflops:g} TFLOP/s",
        f"  {simulation.owners.plan.describe()}",
        f"  {'system':<16} {'step ms':>10} {'vs fsdp2':>9} {'optimizer ms':>13} {'share':>6} "
        f"{'exposed comm':>13} {'memory GiB':>11}",
    ]
    baseline = simulation.predictions.get(BASELINE)
    for name, prediction in simulation.predictions.items():
        ratio = f"{prediction.step_ms / baseline.step_ms:.3f}x" if baseline else "-"
        fits = "" if prediction.fits else " DOES NOT FIT"
        lines.append(
            f"  {name:<16} {prediction.step_ms:>10.1f} {ratio:>9} {prediction.optimizer_ms:>13.1f} "
            f"{prediction.optimizer_share:>6.1%} {prediction.exposed_comm_ms:>13.1f} "
            f"{prediction.memory_gib['peak']:>11.1f}{fits}"
        )
    lines.append(f"  {PREDICTION_LABEL}")
    return "\n".join(lines)


def _step_cell(simulation: Simulation, system: str, *, versus: bool = False) -> str:
    prediction = simulation.predictions.get(system)
    if prediction is None:
        return "-"
    text = f"{prediction.step_ms / 1e3:.2f} s"
    baseline = simulation.predictions.get(BASELINE)
    if versus and baseline is not None:
        text += f" ({prediction.step_ms / baseline.step_ms - 1:+.1%})"
    if not prediction.fits:
        text += f", does not fit ({prediction.memory_gib['peak']:.0f} GiB)"
    return text


def _versus(simulation: Simulation | None, system: str) -> str:
    """``system``'s step against FSDP2 + AdamW's, with the micro-batches a step."""
    if simulation is None:
        return "-"
    prediction = simulation.predictions.get(system)
    baseline = simulation.predictions.get(BASELINE)
    if prediction is None or baseline is None:
        return "-"
    text = f"{prediction.step_ms / baseline.step_ms - 1:+.1%}"
    accumulation = simulation.workload.accumulation
    if accumulation > 1:
        text += f" ({accumulation} micro-batches)"
    if not prediction.fits or not baseline.fits:
        text += ", does not fit"
    return text


def format_markdown_table(
    rows: Sequence[ReportRow | Simulation], dmuon_system: str = "dmuon-z3"
) -> str:
    """The README's prediction table: one row per (model, GPU count), and a column per variant
    (tokens a step, compute rate) giving dmuon's step against FSDP2 + AdamW's there."""
    rows = [row if isinstance(row, ReportRow) else ReportRow(main=row) for row in rows]
    labels = list(dict.fromkeys(v.label for row in rows for v in row.variants))
    header = (
        "| model | GPUs (layout) | tokens a step | FSDP2 + AdamW step | dmuon step (vs FSDP2) | "
        "dmuon optimizer share | naive Muon step | memory per GPU, FSDP2 / dmuon / naive |"
    )
    header += "".join(f" dmuon vs FSDP2 {label} |" for label in labels)
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(labels)]
    notes: list[str] = []
    for row in rows:
        simulation = row.main
        layout = simulation.layout
        grid = f"{layout.num_shards} x {layout.num_replicas}" + (
            f" x TP {layout.tp}" if layout.tp > 1 else ""
        )
        dmuon = simulation.predictions.get(dmuon_system)
        share = f"{dmuon.optimizer_share:.1%}" if dmuon is not None and dmuon.fits else "-"
        memory = " / ".join(
            f"{simulation.predictions[name].memory_gib['peak']:.0f}"
            if name in simulation.predictions
            else "-"
            for name in (BASELINE, dmuon_system, "naive-muon")
        )
        line = (
            f"| {simulation.model.name} | {layout.world_size} (G x R = {grid}) | "
            f"{format_tokens(simulation.tokens_per_step)} | "
            f"{_step_cell(simulation, BASELINE)} | "
            f"{_step_cell(simulation, dmuon_system, versus=True)} | {share} | "
            f"{_step_cell(simulation, 'naive-muon', versus=True)} | {memory} GiB |"
        )
        by_label = {v.label: v for v in row.variants}
        for label in labels:
            variant = by_label.get(label)
            line += f" {_versus(variant.simulation if variant else None, dmuon_system)} |"
            if variant is not None and variant.simulation is None and variant.note:
                notes.append(variant.note)
        lines.append(line)
    if rows:
        first = rows[0].main
        machine = first.machine
        lines += [
            "",
            f"{PREDICTION_LABEL}. Machine `{machine.name}`: NVLink "
            f"{machine.nvlink.bandwidth_gbps:g} GB/s inside a node of "
            f"{first.layout.gpus_per_node} GPUs, one NIC a GPU between nodes at "
            f"{machine.network.bandwidth_gbps:g} GB/s (both assumed); forward+backward at "
            f"{machine.training_tflops:g} TFLOP/s of model FLOPs (measured, "
            f"{machine.training_tflops / machine.gemm_tflops:.0%} of its measured dense GEMM "
            f"rate, {machine.gemm_tflops:g} TFLOP/s); {first.workload.describe()}; dmuon = "
            f"`{dmuon_system}`, asynchronous HSDP publish.",
        ]
        if labels:
            lines[-1] += (
                " A variant column gives dmuon's step against FSDP2 + AdamW's on the same "
                "layout, with the micro-batches a step it takes (gradients reduced on each, "
                "dmuon's and FSDP2's default without no_sync)."
            )
        if notes:
            lines[-1] += f" -: {'; '.join(dict.fromkeys(notes))}."
    return "\n".join(lines)
