"""``torch.distributed.checkpoint.async_save`` with a dmuon model on gloo (issue 43, item 7): the
state of ``dmuon.checkpoint.get_state_dict``, saved while training goes on, resumes as the
uninterrupted run, bit for bit on the same layout. The save runs on a gloo group of its own, as
torchtitan's does: on the default group its background collectives would meet FSDP2's all-gathers
there and time out (tried; docs/troubleshooting.md)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import scenarios_async_save as scenarios
from tests.distributed import scenarios_checkpoint

# (world size, replicas)
LAYOUTS = {"1d-2": (2, 1), "hsdp-2x2": (4, 2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_async_save_while_training_goes_on_resumes_bit_identical_to_the_uninterrupted_run(
    gloo_pool, tmp_path, layout
):
    world, replicas = LAYOUTS[layout]
    pool = gloo_pool(world)
    path = str(tmp_path / "async")
    uninterrupted = pool.run(scenarios.async_save_midway_and_finish, path=path, replicas=replicas)
    # The training around the save is the plain one (the save took nothing from it).
    plain = pool.run(
        scenarios_checkpoint.save_midway_and_finish, path=str(tmp_path / "sync"), replicas=replicas
    )
    weights = uninterrupted[0]["weights"]
    assert all(torch.equal(weights[k], v) for k, v in plain[0]["weights"].items())
    resumed = pool.run(scenarios.resume_with_dcp_load_and_finish, path=path, replicas=replicas)
    assert resumed[0]["weights"].keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(resumed[0]["weights"][key], value), key
