"""Every hyperparameter of dmuon.Muon is checked for agreement across ranks, on every rank."""

import pytest

from tests.reliability.scenarios_reliability import muon_with_a_different_value_on_rank_1


@pytest.mark.parametrize(
    ("name", "value", "default"),
    [
        ("lr", 0.03, 0.02),
        ("adamw_betas", (0.9, 0.95), (0.9, 0.999)),
        ("replicate_async", False, True),
    ],
)
def test_a_hyperparameter_that_differs_on_one_rank_fails_on_every_rank(pool2, name, value, default):
    messages = pool2.run(
        muon_with_a_different_value_on_rank_1, name=name, value=value, default=default
    )
    for message in messages:
        assert "ranks [1] use different hyperparameters" in message
        assert repr(value) in message or str(value) in message
