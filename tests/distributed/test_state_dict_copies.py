"""A full state dict is a snapshot: the steps after it do not change its values.

``dmuon.checkpoint``'s full model and optimizer state dicts (``full_state_dict=True``, with and
without ``cpu_offload``) hold tensors of their own, on 2 gloo ranks (the owner that is also the
receiving rank hands out its masters and momentum buffers) and in one process (every value is
local there, plain parameters and AdamW's step included). The sharded default may alias, by
design: see ``test_model_state_dict``.
"""

from __future__ import annotations

import pytest

from tests.distributed import scenarios_state_dict_copies as scenarios
from tests.distributed.test_checkpoint import run


def assert_a_snapshot(result: dict) -> None:
    assert result["keys"], "the dict holds no tensor on this rank"
    assert result["moved"] == []
    # The step did change the training state: an alias would have moved with it.
    assert any(key.startswith("model.") for key in result["trained"]), result["trained"]
    assert any(key.startswith("optim.") for key in result["trained"]), result["trained"]


@pytest.mark.parametrize("options", ["cpu_offload", "every_rank"])
@pytest.mark.parametrize("layout", ["1d-2", "dp1-tp2"])
def test_a_full_state_dict_on_the_receiving_rank_keeps_its_values_through_later_steps(
    gloo_pool, layout, options
):
    result = run(gloo_pool, layout, scenarios.snapshots_after_a_step, options=options)
    assert_a_snapshot(result)


@pytest.mark.parametrize("options", ["cpu_offload", "every_rank"])
def test_a_full_state_dict_in_one_process_keeps_its_values_through_later_steps(options):
    assert_a_snapshot(scenarios.snapshots_after_a_step(options, replicas=0))
