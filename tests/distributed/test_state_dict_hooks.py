"""Another module's state-dict hooks see real tensors on a dmuon model, and its keys round-trip.

The fused QKV module of ``models_fused`` splits its dedicated ``wqkv`` matrix into ``wq`` /
``wk`` / ``wv`` keys when saved and merges them when loaded, as fused projections of training
frameworks do. On a dmuon model its hooks must get the owner's value (and no key elsewhere), so
dmuon's state dicts hold the split keys with the reference's values, and every way of saving and
loading them (dmuon.checkpoint sharded and full, plain ``model.state_dict()`` through DCP) resumes
like the uninterrupted run, on 1-D, HSDP and another world size.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import scenarios_state_dict_hooks as scenarios
from tests.distributed.test_checkpoint import FP32_TOLERANCE, max_relative_difference

# (world size, replicas)
LAYOUTS = {"1d-2": (2, 1), "hsdp-2x2": (4, 2), "1d-4": (4, 1), "1d-3": (3, 1)}


def run(gloo_pool, layout: str, scenario, **kwargs) -> list:
    world, replicas = LAYOUTS[layout]
    return gloo_pool(world).run(scenario, replicas=replicas, **kwargs)


@pytest.mark.parametrize("layout", ["1d-2", "hsdp-2x2"])
def test_state_dicts_hold_the_split_keys_with_the_reference_values(gloo_pool, layout):
    results = run(gloo_pool, layout, scenarios.state_dicts_after, steps=3)
    reference = scenarios.reference_state_dict(3)
    assert max_relative_difference(results[0]["full"], reference) < FP32_TOLERANCE
    for result in results:
        assert not any("wqkv" in key for key in result["sharded_keys"] + result["plain_keys"])
        # The split keys of a fused matrix are on its owner only (a sharded dict is per rank).
        for key in ("sharded_keys", "plain_keys"):
            split = {k.rpartition(".qkv.")[0] for k in result[key] if ".qkv.wq.weight" in k}
            owned = {fqn.rpartition(".qkv.")[0] for fqn in result["owns_wqkv"]}
            assert split == owned, key
    owners = [fqn for result in results for fqn in result["owns_wqkv"]]
    assert sorted(owners) == ["layers.0.qkv.wqkv.weight", "layers.1.qkv.wqkv.weight"]


def test_the_full_state_dict_loads_into_the_unfused_model(pool2):
    result = pool2.run(scenarios.split_model_loads_the_full_state_dict)[0]
    relative = (result["split"] - result["reference"]).norm() / result["reference"].norm()
    assert relative < FP32_TOLERANCE


@pytest.fixture(scope="module")
def checkpoints(gloo_pool, tmp_path_factory):
    """Per saving layout: sharded and full checkpoints after ``SAVE_AT`` steps, and the final
    weights."""
    made = {}

    def checkpoint_of(layout: str):
        if layout not in made:
            path = str(tmp_path_factory.mktemp("fused") / layout)
            result = run(gloo_pool, layout, scenarios.save_midway_and_finish, path=path)[0]
            made[layout] = (path, result["weights"])
        return made[layout]

    return checkpoint_of


@pytest.mark.parametrize(
    ("saved_on", "resumed_on", "full"),
    [
        ("1d-2", "1d-2", False),
        ("1d-2", "1d-2", True),
        ("1d-2", "hsdp-2x2", True),
        ("hsdp-2x2", "1d-3", False),
    ],
    ids=["1d-2-sharded", "1d-2-full", "to-hsdp-full", "hsdp-to-1d-3-sharded"],
)
def test_a_checkpoint_resumes_like_the_uninterrupted_run_and_the_reference(
    gloo_pool, checkpoints, saved_on, resumed_on, full
):
    path, uninterrupted = checkpoints(saved_on)
    resumed = run(gloo_pool, resumed_on, scenarios.resume_and_finish, path=path, full=full)[0]
    if saved_on == resumed_on:
        for key, value in uninterrupted.items():
            assert torch.equal(resumed["weights"][key], value), key
    else:
        assert max_relative_difference(resumed["weights"], uninterrupted) < FP32_TOLERANCE
    reference = scenarios.reference_state_dict(scenarios.STEPS)
    assert max_relative_difference(resumed["weights"], reference) < FP32_TOLERANCE


@pytest.mark.parametrize("layout", ["1d-2", "hsdp-2x2"])
def test_dcp_of_the_plain_state_dict_resumes_bit_identically_through_the_merge_hook(
    gloo_pool, layout, tmp_path
):
    result = run(gloo_pool, layout, scenarios.plain_dcp_round_trip, path=str(tmp_path / "dcp"))[0]
    for key, value in result["uninterrupted"].items():
        assert torch.equal(result["resumed"][key], value), key
