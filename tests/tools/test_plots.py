"""``dmuon_tools.plots``: figures when matplotlib is installed, an install hint when it is not."""

import importlib.util

import pytest

import dmuon
from dmuon.inspect import make_param_specs, plan_ownership
from dmuon_tools import plots
from dmuon_tools.model_shapes import PRESETS
from tests.distributed.models import TinyDecoder, proj_predicate

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(
    not HAS_MATPLOTLIB, reason="matplotlib is not installed (pip install dmuon-tools[plots])"
)


def dedicated_model():
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    return model


@pytest.mark.skipif(
    HAS_MATPLOTLIB,
    reason="tests the install hint given without matplotlib, which is installed here",
)
def test_plots_without_matplotlib_raise_an_import_error_naming_the_extra(tmp_path):
    with pytest.raises(ImportError, match=r"pip install dmuon-tools\[plots\]"):
        plots.plot_owner_load(dedicated_model(), tmp_path / "load.png")
    with pytest.raises(ImportError, match=r"pip install dmuon-tools\[plots\]"):
        plots.plot_comm_bytes(dedicated_model(), tmp_path / "bytes.png")


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
