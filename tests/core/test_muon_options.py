"""``dmuon.MuonOptions``: ``dmuon.Muon``'s options, typed and validated in one place; the
keywords of ``dmuon.Muon`` are its fields, and ``Muon.from_options`` steps like them."""

import dataclasses
import functools
import inspect
from typing import get_args

import pytest
import torch

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon.muon_options import AdjustLr, MomentumDtype, NonfinitePolicy
from dmuon.muon_update import MOMENTUM_DTYPES
from dmuon.nonfinite import NONFINITE_POLICIES
from dmuon.routing import ADJUST_LR
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate
from tests.reliability.test_hyperparameters import BAD_VALUES

FP32_NS = functools.partial(NewtonSchulz, dtype=torch.float32, kernel="cublas")


def dedicated_model() -> TinyDecoder:
    torch.manual_seed(0)
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    return model


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    BAD_VALUES,
    ids=[f"{name}={value!r}" for name, value, *_ in BAD_VALUES],
)
def test_muon_options_refuses_a_bad_value_with_the_message_of_dmuon_muon(
    name, value, error, message
):
    with pytest.raises(error, match=message):
        dmuon.MuonOptions(**{name: value})


def test_muon_options_refuses_an_unknown_ns_backend_name_before_any_model():
    # The name was checked only when dmuon.Muon built its NewtonSchulz, after the model's.
    with pytest.raises(ValueError, match=r"backend must be 'gram' or 'direct'; got 'grma'"):
        dmuon.MuonOptions(ns_backend="grma")


def test_the_keywords_of_dmuon_muon_are_the_fields_of_muon_options_with_their_defaults():
    keywords = list(inspect.signature(dmuon.Muon).parameters.values())[1:]  # after the model
    defaults = dmuon.MuonOptions()
    assert [(p.name, p.default) for p in keywords] == [
        (f.name, getattr(defaults, f.name)) for f in dataclasses.fields(dmuon.MuonOptions)
    ]


def test_the_literal_choices_are_the_ones_checked_at_run_time():
    assert (*get_args(AdjustLr), None) == ADJUST_LR
    assert sorted(get_args(NonfinitePolicy)) == sorted(NONFINITE_POLICIES)
    assert get_args(MomentumDtype) == tuple(MOMENTUM_DTYPES)


def test_muon_options_are_frozen():
    options = dmuon.MuonOptions(lr=0.05)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.lr = 0.1


def test_an_optimizer_from_options_and_overrides_steps_as_the_same_keywords():
    options = dmuon.MuonOptions(lr=0.05, momentum_dtype="bfloat16", normuon=True)
    from_options = dedicated_model()
    from_keywords = dedicated_model()
    optimizers = [
        dmuon.Muon.from_options(from_options, options, weight_decay=0.1, ns_backend=FP32_NS()),
        dmuon.Muon(
            from_keywords,
            lr=0.05,
            momentum_dtype=torch.bfloat16,
            normuon=True,
            weight_decay=0.1,
            ns_backend=FP32_NS(),
        ),
    ]
    assert optimizers[0].options == dataclasses.replace(
        options, weight_decay=0.1, ns_backend=optimizers[0].newton_schulz
    )
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizers[0].param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in optimizers[1].param_groups
    ]
    for batch in batches(2, 1):
        for model, optimizer in zip((from_options, from_keywords), optimizers):
            loss_fn(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
    masters = [
        {p.fqn: p.master for p in get_dedicated_state(model).iter_owned_masters()}
        for model in (from_options, from_keywords)
    ]
    assert masters[0].keys() == masters[1].keys()
    for name, master in masters[0].items():
        assert torch.equal(master, masters[1][name]), name


def test_from_options_refuses_what_is_not_muon_options():
    with pytest.raises(TypeError, match=r"from_options takes a dmuon.MuonOptions, got dict"):
        dmuon.Muon.from_options(dedicated_model(), {"lr": 0.05})
