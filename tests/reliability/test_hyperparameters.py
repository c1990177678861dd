"""Every hyperparameter of dmuon.Muon is checked, showing the value: in range and finite, booleans
are booleans, pairs are pairs (one process); and equal across ranks, on every rank."""

import pytest

import dmuon
from tests.distributed.models import TinyDecoder, proj_predicate
from tests.reliability.scenarios_reliability import muon_with_a_different_value_on_rank_1


@pytest.fixture(scope="module")
def dedicated_model():
    # dmuon.Muon refuses before it builds anything, so one model serves every bad value.
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    return model


# (keyword, bad value, the error, its message)
BAD_VALUES = [
    ("momentum", 1.5, ValueError, r"momentum must be in \[0, 1\), got 1.5"),
    ("lr", -0.1, ValueError, r"lr must be a non-negative number, got -0.1"),
    ("ns_backend", 3, TypeError, r"ns_backend must be 'gram', 'direct' or a dmuon"),
    ("lr", float("inf"), ValueError, r"lr must be a finite number, got inf"),
    ("adamw_eps", float("nan"), ValueError, r"adamw_eps must be a finite number, got nan"),
    ("nesterov", "no", TypeError, r"nesterov must be True or False, got 'no'"),
    ("replicate_async", 1, TypeError, r"replicate_async must be True or False, got 1"),
    ("adamw_betas", 0.9, ValueError, r"adamw_betas must be a pair of numbers .* got 0.9\."),
    ("adamw_betas", (0.9, 1.0), ValueError, r"adamw_betas must be a pair .* got \(0.9, 1.0\)"),
]


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    BAD_VALUES,
    ids=[f"{name}={value!r}" for name, value, *_ in BAD_VALUES],
)
def test_a_bad_hyperparameter_is_refused_with_its_value(
    dedicated_model, name, value, error, message
):
    with pytest.raises(error, match=message):
        dmuon.Muon(dedicated_model, **{name: value})


@pytest.mark.parametrize(
    ("name", "value", "default"),
    [
        ("lr", 0.03, 0.02),
        ("adamw_betas", (0.9, 0.95), (0.9, 0.999)),
        ("replicate_async", False, True),
        ("nonfinite", "skip", "ignore"),
    ],
)
def test_a_hyperparameter_that_differs_on_one_rank_fails_on_every_rank(pool2, name, value, default):
    messages = pool2.run(
        muon_with_a_different_value_on_rank_1, name=name, value=value, default=default
    )
    for message in messages:
        assert "ranks [1] use different hyperparameters" in message
        assert repr(value) in message or str(value) in message
