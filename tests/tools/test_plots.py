"""``dmuon_tools.plots``: figures when matplotlib is installed, an install hint when it is not."""

import importlib.util
import sys

import pytest

import dmuon
from dmuon.inspect import make_param_specs, plan_ownership
from dmuon_tools import plots
from dmuon_tools.machine import H200
from dmuon_tools.model_shapes import PRESETS
from dmuon_tools.simulator import Layout, Workload, simulate
from tests.distributed.models import TinyDecoder, proj_predicate

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(
    not HAS_MATPLOTLIB, reason="matplotlib is not installed (pip install dmuon-tools[plots])"
)


def dedicated_model():
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    return model


def test_plots_without_matplotlib_raise_an_import_error_naming_the_extra(tmp_path, monkeypatch):
    # A None entry in sys.modules makes the import fail as an uninstalled matplotlib does.
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    hint = r"pip install dmuon-tools\[plots\] .*pip install \./packages/dmuon-tools\[plots\]"
    with pytest.raises(ImportError, match=hint):
        plots.plot_owner_load(dedicated_model(), tmp_path / "load.png")
    with pytest.raises(ImportError, match=hint):
        plots.plot_comm_bytes(dedicated_model(), tmp_path / "bytes.png")
    simulation = simulate(PRESETS["llama3.2-1b"], Layout(num_shards=2), Workload(), H200)
    with pytest.raises(ImportError, match=hint):  # not matplotlib's own bare error
        plots.plot_timeline(simulation, tmp_path / "step.png")


@needs_matplotlib
@pytest.mark.parametrize("num_slots", [16, 4096], ids=["bars", "step-line"])
def test_owner_load_plot_of_a_plan_is_written_as_png(tmp_path, num_slots):
    specs = make_param_specs(PRESETS["qwen2.5-0.5b"].matrices())
    path = plots.plot_owner_load(plan_ownership(specs, num_slots), tmp_path / "load.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_matplotlib
def test_owner_load_and_comm_bytes_plots_of_a_model_are_written(tmp_path):
    model = dedicated_model()
    assert plots.plot_owner_load(model, tmp_path / "load.svg").read_text().startswith("<?xml")
    assert plots.plot_comm_bytes(model, tmp_path / "bytes.png").stat().st_size > 0


@needs_matplotlib
def test_owner_load_plot_refuses_a_model_without_dedicated_parameters(tmp_path):
    with pytest.raises(TypeError, match="OwnershipPlan or a model prepared with"):
        plots.plot_owner_load(TinyDecoder(), tmp_path / "load.png")


@needs_matplotlib
def test_owner_load_plot_of_one_slot_has_an_integer_tick_and_shows_a_small_mean():
    from matplotlib.figure import Figure

    # One small matrix on one slot: 6 * 64^2 * 128 + 14 * 64^3 FLOPs = 0.00682 GFLOP.
    plan = plan_ownership(make_param_specs([("layers.0.q_proj.weight", (64, 128))]), 1)
    axes = Figure().subplots()
    plots._draw_owner_load(axes, plan, None)
    low, high = axes.get_xlim()
    shown_ticks = [tick for tick in axes.get_xticks() if low <= tick <= high]
    assert shown_ticks == [0]
    assert [text.get_text() for text in axes.get_legend().get_texts()] == ["mean 0.00682"]


@pytest.mark.parametrize(
    ("gflop", "label"),
    [(0.0, "0"), (0.008, "0.008"), (12.345, "12.3"), (999.4, "999"), (19241.5, "19,242")],
)
def test_load_labels_keep_three_significant_digits_below_a_thousand(gflop, label):
    assert plots._format_gflop(gflop) == label
