"""What ``dmuon-tools simulate`` prints: a table per simulated layout, or one Markdown table.

Owns the wording and the layout of the predictions for a terminal and for the README (the
Markdown table ``tests/tools/test_cli_readme_table.py`` keeps equal to the README's). It must
not compute anything the ``Simulation`` does not hold.
"""

from __future__ import annotations

from collections.abc import Sequence

from dmuon_tools.simulator import Simulation

PREDICTION_LABEL = (
    "PREDICTED by dmuon-tools simulate (a model calibrated on one H200, not a measurement; "
    "docs/simulator.md, docs/simulator-calibration.md)"
)
BASELINE = "fsdp2-adamw"


def format_simulation(simulation: Simulation) -> str:
    """One layout's predictions: a line per system."""
    layout, model = simulation.layout, simulation.model
    lines = [
        f"{model.name} on {layout.describe()}: shard group on "
        f"{layout.link_class('shard')}, replicate group on {layout.link_class('replicate')}; "
        f"machine {simulation.machine.name}",
        f"  {simulation.workload.describe()}",
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


def format_markdown_table(simulations: Sequence[Simulation], dmuon_system: str = "dmuon-z3") -> str:
    """The README's prediction table: one row per (model, GPU count)."""
    lines = [
        "| model | GPUs (layout) | FSDP2 + AdamW step | dmuon step (vs FSDP2) | "
        "dmuon optimizer share | naive Muon step | memory per GPU, FSDP2 / dmuon / naive |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for simulation in simulations:
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
        lines.append(
            f"| {simulation.model.name} | {layout.world_size} (G x R = {grid}) | "
            f"{_step_cell(simulation, BASELINE)} | "
            f"{_step_cell(simulation, dmuon_system, versus=True)} | {share} | "
            f"{_step_cell(simulation, 'naive-muon', versus=True)} | {memory} GiB |"
        )
    if simulations:
        first = simulations[0]
        machine = first.machine
        lines += [
            "",
            f"{PREDICTION_LABEL}. Machine `{machine.name}`: NVLink "
            f"{machine.nvlink.bandwidth_gbps:g} GB/s inside a node of "
            f"{first.layout.gpus_per_node} GPUs, one NIC a GPU between nodes at "
            f"{machine.network.bandwidth_gbps:g} GB/s (both assumed); "
            f"{first.workload.describe()}; dmuon = "
            f"`{dmuon_system}`, asynchronous HSDP publish.",
        ]
    return "\n".join(lines)
