"""Plots of a partition, of dmuon's per-step communication and of a simulated step (needs
``dmuon-tools[plots]``).

Owns drawing and saving figures; the numbers come from ``owner_load``, ``comm_plan`` and
``simulator``.
matplotlib is imported only when a plot is drawn, so ``import dmuon_tools`` never needs it. Figures
are built with ``matplotlib.figure.Figure`` directly (no pyplot): no GUI backend, no global state.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

import dmuon.inspect
from dmuon.inspect import OwnershipPlan
from dmuon_tools.comm_plan import COLLECTIVE_KINDS, summarize_comm_plan
from dmuon_tools.owner_load import FLOP_PER_GFLOP
from dmuon_tools.simulator import Simulation

PLOTS_INSTALL_HINT = (
    "pip install dmuon-tools[plots] (dmuon-tools is not on PyPI yet: from the repository's "
    "checkout, pip install ./packages/dmuon-tools[plots])"
)
# Above this many owners a bar per owner is unreadable (and slow to draw): draw a step line.
_MAX_BARS = 512
_BYTES_PER_MIB = 2**20


def _figure():
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            f"dmuon_tools.plots needs matplotlib, which is not installed: {PLOTS_INSTALL_HINT}"
        ) from error
    return Figure(figsize=(10, 4), layout="constrained")


def _plan_of(plan_or_model: OwnershipPlan | nn.Module) -> OwnershipPlan:
    if isinstance(plan_or_model, OwnershipPlan):
        return plan_or_model
    if not (isinstance(plan_or_model, nn.Module) and dmuon.inspect.is_prepared(plan_or_model)):
        raise TypeError(
            "plot_owner_load needs a dmuon.inspect.OwnershipPlan or a model prepared with "
            f"dmuon.dedicate_params, got {type(plan_or_model).__name__}."
        )
    return dmuon.inspect.view(plan_or_model).plan


def plot_owner_load(
    plan_or_model: OwnershipPlan | nn.Module, path: str | Path, *, title: str | None = None
) -> Path:
    """Save a bar chart of the Newton-Schulz load (GFLOP) of every owner slot, with the mean.

    Slot ``i`` is the owner ``(shard=i % G, replicate=i // G)``. Returns the path written (the
    format follows its suffix: ``.png``, ``.svg``, ``.pdf``, ...).
    """
    figure = _figure()
    _draw_owner_load(figure.subplots(), _plan_of(plan_or_model), title)
    return _save(figure, path)


def _format_gflop(value: float) -> str:
    """A load for a label: three significant digits below 1,000 (``0.00812``, ``12.3``), whole
    numbers with thousands separators above (``19,242``), so a small load never reads 0.0."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _draw_owner_load(axes, plan: OwnershipPlan, title: str | None) -> None:
    from matplotlib.ticker import MaxNLocator

    loads = [load / FLOP_PER_GFLOP for load in plan.loads]
    slots = range(len(loads))
    if len(loads) <= _MAX_BARS:
        axes.bar(slots, loads, width=0.8, color="tab:blue")
    else:
        axes.step(slots, loads, where="mid", color="tab:blue", linewidth=0.6)
    # Slots are whole numbers: no fractional ticks (one slot would get -0.4 .. 0.4).
    axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    mean = sum(loads) / len(loads)
    axes.axhline(
        mean, color="tab:red", linestyle="--", linewidth=1, label=f"mean {_format_gflop(mean)}"
    )
    axes.set_xlabel(
        f"owner slot (shard = slot % {plan.num_shards}, replicate = slot // {plan.num_shards})"
    )
    axes.set_ylabel("Newton-Schulz load (GFLOP)")
    axes.set_title(
        title
        or f"dmuon owner load: G={plan.num_shards} x R={plan.num_replicas}, "
        f"imbalance {plan.imbalance:.3f}"
    )
    axes.legend(loc="upper right")


def plot_comm_bytes(
    model_or_summary: nn.Module | Mapping[str, Any], path: str | Path, *, title: str | None = None
) -> Path:
    """Save a bar chart of the bytes this rank sends and receives per step, per collective kind.

    Takes the model (its ``summarize_comm_plan``) or a ``summarize_comm_plan`` result. The
    numbers are the plan's estimates, not measurements.
    """
    figure = _figure()
    summary = (
        summarize_comm_plan(model_or_summary)
        if isinstance(model_or_summary, nn.Module)
        else model_or_summary
    )
    per_kind = summary["this_rank"]["per_kind"]
    axes = figure.subplots()
    positions = range(len(COLLECTIVE_KINDS))
    width = 0.4
    for offset, field, color in (
        (-width / 2, "sent", "tab:orange"),
        (width / 2, "received", "tab:green"),
    ):
        values = [per_kind[kind][f"{field}_bytes"] / _BYTES_PER_MIB for kind in COLLECTIVE_KINDS]
        axes.bar([p + offset for p in positions], values, width=width, label=field, color=color)
    axes.set_xticks(list(positions), [kind.replace("_", "\n") for kind in COLLECTIVE_KINDS])
    if summary["this_rank"]["total"]["collectives"] == 0:
        axes.text(
            0.5, 0.5, "no collectives (one owner slot)", transform=axes.transAxes, ha="center"
        )
    axes.set_ylabel("MiB per step (estimate)")
    axes.set_title(
        title
        or f"dmuon communication per step, rank {summary['rank']} "
        f"(G={summary['num_shards']} x R={summary['num_replicas']})"
    )
    axes.legend(loc="upper right")
    return _save(figure, path)


# Rows of a timeline, top to bottom; streams not listed follow in the order they appear.
_STREAM_ORDER = (
    "compute",
    "fsdp2 all-gather",
    "dmuon shard",
    "fsdp2 reduce-scatter",
    "dmuon replicate",
)
# One colour per kind of operation in a timeline; kinds not listed are grey.
_KIND_COLOURS = {
    "forward": "tab:blue",
    "backward": "tab:cyan",
    "head": "tab:purple",
    "optimizer": "tab:red",
    "all-gather": "tab:green",
    "reduce-scatter": "tab:olive",
    "shard broadcast": "tab:orange",
    "shard reduce": "tab:brown",
    "replicate all-reduce": "tab:pink",
    "replicate reduce": "tab:pink",
    "replicate publish": "gold",
    "naive all-gather": "tab:green",
    "tp all-reduce": "tab:gray",
    "tp exchange": "tab:gray",
}


def plot_timeline(simulation: Simulation, path: str | Path, *, title: str | None = None) -> Path:
    """Save one simulated step per system as a Gantt chart: a row per stream, a bar per
    operation, coloured by kind (the second of the two simulated steps; time 0 is the end of
    the first)."""
    predictions = list(simulation.predictions.values())
    if not predictions or not any(p.spans for p in predictions):
        raise ValueError("plot_timeline needs a simulation with timelines (simulate(...)).")
    _figure()  # raises the ImportError naming the extra before matplotlib is imported here
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 1.2 + 1.1 * len(predictions)), layout="constrained")
    axes_list = figure.subplots(len(predictions), 1, sharex=True, squeeze=False)[:, 0]
    seen: dict[str, object] = {}
    for axes, prediction in zip(axes_list, predictions):
        present = dict.fromkeys(span["stream"] for span in prediction.spans)
        streams = [s for s in _STREAM_ORDER if s in present]
        streams += [s for s in present if s not in streams]
        for row, stream in enumerate(streams):
            spans = [s for s in prediction.spans if s["stream"] == stream]
            for kind in dict.fromkeys(s["kind"] for s in spans):
                bars = [
                    (s["start_ms"], s["end_ms"] - s["start_ms"]) for s in spans if s["kind"] == kind
                ]
                handle = axes.broken_barh(
                    bars, (row - 0.4, 0.8), color=_KIND_COLOURS.get(kind, "tab:gray")
                )
                seen.setdefault(kind, handle)
        axes.set_yticks(range(len(streams)), streams)
        axes.set_ylim(-0.6, len(streams) - 0.4)
        axes.invert_yaxis()
        axes.axvline(prediction.step_ms, color="black", linewidth=0.8)
        axes.set_title(
            f"{prediction.system}: step {prediction.step_ms:,.1f} ms, optimizer "
            f"{prediction.optimizer_ms:,.1f} ms, exposed communication "
            f"{prediction.exposed_comm_ms:,.1f} ms",
            fontsize=9,
            loc="left",
        )
    axes_list[-1].set_xlabel("ms (PREDICTED; 0 = end of the previous step)")
    figure.legend(list(seen.values()), list(seen), loc="outside lower center", ncols=7, fontsize=8)
    figure.suptitle(
        title or f"dmuon-tools simulate: {simulation.model.name} on {simulation.layout.describe()}",
        fontsize=10,
    )
    return _save(figure, path)


def _save(figure, path: str | Path) -> Path:
    path = Path(path)
    figure.savefig(path)
    return path
