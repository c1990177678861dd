"""``model.state_dict()`` on a distributed dmuon model: what a DCP-based trainer saves and loads.

It is sharded like FSDP2's: each dedicated matrix is its owner's fp32 master itself (a DTensor of
its TP chunks under TP), absent on the other ranks; ``model.load_state_dict`` takes it back and
the next forward serves it on every rank. A trainer's save / resume through
``torch.distributed.checkpoint`` continues as if uninterrupted, and the checkpoint moves to and
from a stock FSDP2 model.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import scenarios_model_state_dict as scenarios
from tests.distributed.test_checkpoint import (
    FP32_TOLERANCE,
    LAYOUTS,
    max_relative_difference,
    run,
)


@pytest.mark.parametrize("layout", ["1d-2", "hsdp-2x2", "dp1-tp2"])
def test_each_dedicated_entry_is_its_owners_master_itself_and_absent_elsewhere(gloo_pool, layout):
    world, replicas, tp = LAYOUTS[layout]
    results = gloo_pool(world).run(scenarios.entries, replicas=replicas, tp=tp)
    for result in results:
        entries = result["entries"]
        assert all(entry["numel"] > 0 for entry in entries.values())  # never a placeholder
        present = sorted(key for key in entries if key in result["dedicated"])
        assert present == result["owned"]
        for key in present:
            assert entries[key]["is_master"], key
            assert entries[key]["dtensor"] == (tp > 1), key
    # Every dedicated matrix is held by some rank, with its full shape.
    held = {key for result in results for key in result["owned"]}
    assert held == set(results[0]["dedicated"])


@pytest.fixture(scope="module")
def checkpoints(gloo_pool, tmp_path_factory):
    """Per saving layout: the plain state dict saved by DCP after ``SAVE_AT`` steps, and the final
    weights."""
    made = {}

    def checkpoint_of(layout: str):
        if layout not in made:
            path = str(tmp_path_factory.mktemp("plain") / layout)
            result = run(gloo_pool, layout, scenarios.save_midway_and_finish, path=path)
            made[layout] = (path, result["weights"])
        return made[layout]

    return checkpoint_of


@pytest.mark.parametrize("layout", ["1d-2", "hsdp-2x2", "dp2-tp2"])
def test_a_trainers_dcp_resume_on_the_same_layout_is_bit_identical(gloo_pool, checkpoints, layout):
    path, uninterrupted = checkpoints(layout)
    resumed = run(gloo_pool, layout, scenarios.resume_and_finish, path=path)["weights"]
    assert resumed.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key


@pytest.mark.parametrize(
    ("saved_on", "resumed_on"), [("1d-2", "hsdp-2x2"), ("hsdp-2x2", "1d-2"), ("1d-4", "dp2-tp2")]
)
def test_a_trainers_dcp_resume_on_another_layout_continues_like_the_uninterrupted_run(
    gloo_pool, checkpoints, saved_on, resumed_on
):
    path, uninterrupted = checkpoints(saved_on)
    resumed = run(gloo_pool, resumed_on, scenarios.resume_and_finish, path=path)["weights"]
    assert max_relative_difference(resumed, uninterrupted) < FP32_TOLERANCE


def test_torchs_sharded_state_dict_functions_save_and_resume_bit_identically(pool4, tmp_path):
    # torch.distributed.checkpoint.state_dict.get_model_state_dict / set_model_state_dict
    # (strict) read and write through model.state_dict() / load_state_dict (Lightning's way).
    path = str(tmp_path / "torch")
    uninterrupted = pool4.run(scenarios.save_midway_and_finish, path=path, replicas=2, via="torch")[
        0
    ]["weights"]
    resumed = pool4.run(scenarios.resume_and_finish, path=path, replicas=2, via="torch")[0]
    for key, value in uninterrupted.items():
        assert torch.equal(resumed["weights"][key], value), key


@pytest.mark.parametrize("layout", ["1d-2", "hsdp-2x2"])
def test_the_checkpoint_loads_into_a_stock_fsdp2_model_and_back_with_equal_weights(
    gloo_pool, layout, tmp_path
):
    to_stock = run(gloo_pool, layout, scenarios.dmuon_saves_stock_loads, path=str(tmp_path / "a"))
    from_stock = run(gloo_pool, layout, scenarios.stock_saves_dmuon_loads, path=str(tmp_path / "b"))
    for weights in (to_stock["weights"], from_stock["weights"]):
        assert weights["dmuon"].keys() == weights["stock"].keys()
        for key, value in weights["stock"].items():
            assert torch.equal(weights["dmuon"][key], value), key


@pytest.mark.parametrize("layout", ["1d-2", "hsdp-2x2"])
def test_loaded_weights_serve_the_next_forward_on_every_rank(gloo_pool, layout, tmp_path):
    world, replicas, _ = LAYOUTS[layout]
    for scenario, key in (
        (scenarios.full_values_load_on_every_rank, "plain"),
        (scenarios.stock_saves_dmuon_loads, "stock"),
    ):
        kwargs = {"path": str(tmp_path / "stock")} if key == "stock" else {}
        for result in gloo_pool(world).run(scenario, replicas=replicas, **kwargs):
            logits = result["logits"]
            assert torch.allclose(logits["dmuon"], logits[key], rtol=1e-6, atol=1e-6)


def test_a_strict_load_reports_a_missing_dedicated_key_on_its_owner_only(pool2):
    messages = pool2.run(scenarios.strict_load_of_a_dict_without_one_key)
    failed = [m for m in messages if m != "no error"]
    assert len(failed) == 1
    assert 'Missing key(s) in state_dict: "layers.0.q_proj.weight"' in failed[0]
