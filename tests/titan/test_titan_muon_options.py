"""``dmuon_titan.DMuonConfig`` takes the Muon route's defaults, choices and checks from
``dmuon.MuonOptions`` instead of listing them again."""

# First: its import-time workarounds must precede torchtitan's own import (see its docstring).
import tests.titan.titan_on_cpu  # noqa: F401

# isort: split
import dataclasses
from typing import get_args

import pytest
import torch

import dmuon
import dmuon_titan


def test_the_muon_route_defaults_of_the_titan_config_are_dmuon_muons():
    config, options = dmuon_titan.DMuonConfig(), dmuon.MuonOptions()
    shared = [f.name for f in dataclasses.fields(dmuon.MuonOptions) if hasattr(config, f.name)]
    assert sorted(shared) == sorted(
        ["lr", "momentum", "nesterov", "weight_decay", "adjust_lr", "normuon", "momentum_dtype",
         "ns_backend", "replicate_async", "nonfinite", "adamw_lr", "adamw_betas", "adamw_eps",
         "adamw_weight_decay"]
    )  # fmt: skip
    for name in ("lr", "momentum", "nesterov", "weight_decay", "adjust_lr", "normuon"):
        assert getattr(config, name) == getattr(options, name), name
    assert options.momentum_dtype == torch.float32 and config.momentum_dtype == "float32"
    assert (config.ns_backend, config.replicate_async) == (options.ns_backend, True)
    assert get_args(dmuon.MomentumDtype) == dmuon_titan.config.MOMENTUM_DTYPES


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"lr": -0.1}, ValueError, r"dmuon.Muon: lr must be a non-negative number, got -0.1"),
        ({"momentum": 1.5}, ValueError, r"dmuon.Muon: momentum must be in \[0, 1\), got 1.5"),
        ({"adjust_lr": "rms"}, ValueError, r"adjust_lr='rms' is not one of"),
        ({"nonfinite": "warn"}, ValueError, r"nonfinite='warn' is not one of"),
        ({"nesterov": "no"}, TypeError, r"nesterov must be True or False, got 'no'"),
    ],
)
def test_a_bad_muon_route_value_is_refused_by_the_config_with_dmuon_muons_message(
    options, error, message
):
    with pytest.raises(error, match=message):
        dmuon_titan.DMuonConfig(**options)


def test_the_config_gives_dmuon_muon_its_muon_route_options_and_its_newton_schulz():
    config = dmuon_titan.DMuonConfig(
        lr=0.01, momentum=0.9, nesterov=False, weight_decay=0.1, adjust_lr="spectral",
        normuon=True, momentum_dtype="bfloat16", ns_coefficients="keller", ns_dtype="float32",
        replicate_async=False, nonfinite="raise",
    )  # fmt: skip
    options = config.muon_options()
    assert isinstance(options, dmuon.MuonOptions)
    assert (options.lr, options.momentum, options.nesterov, options.weight_decay) == (
        0.01,
        0.9,
        False,
        0.1,
    )
    assert (options.adjust_lr, options.normuon, options.replicate_async) == (
        "spectral",
        True,
        False,
    )
    assert (options.momentum_dtype_name, options.nonfinite) == ("bfloat16", "raise")
    assert options.newton_schulz().config == config.newton_schulz().config
    assert options.newton_schulz().config.dtype == "float32"
    # Unset here, dmuon's defaults: the AdamW route's values come from the job's optimizer config.
    default = dmuon.MuonOptions()
    assert dmuon_titan.DMuonConfig().muon_options().nonfinite == default.nonfinite
    assert (options.adamw_lr, options.param_groups, options.step_group) == (
        default.adamw_lr,
        None,
        None,
    )
