"""Canonical FQNs: every name dmuon records, matches or writes leaves out wrapper segments.

Blocks wrapped before ``dedicate_params`` (torch's ``checkpoint_wrapper``, ``torch.compile``)
must change nothing dmuon decides or writes: owners, routing, optimizer groups and state keys,
checkpoint keys. So a checkpoint written with the wrappers on resumes with them off (and the
other way) as if uninterrupted, and its model part moves to and from a stock FSDP2 run.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import scenarios_canonical_names as scenarios
from tests.distributed.test_checkpoint import FP32_TOLERANCE, max_relative_difference


@pytest.fixture(scope="module")
def plain_names(pool4):
    return pool4.run(scenarios.names_seen, wrappers="")


@pytest.mark.parametrize("wrappers", ["ac", "compile", "ac+compile"])
def test_every_name_dmuon_sees_or_writes_is_the_plain_models_with_wrappers_on(
    pool4, plain_names, wrappers
):
    wrapped = pool4.run(scenarios.names_seen, wrappers=wrappers)
    for rank, (plain, seen) in enumerate(zip(plain_names, wrapped)):
        assert seen == plain, rank
    # The predicate saw canonical names; routes= and param_groups took them in either spelling.
    assert "layers.0.q_proj.weight" in wrapped[0]["predicate"]
    routing = {fqn: (route, lr, wd) for fqn, route, lr, wd in wrapped[0]["routing"]}
    assert routing["layers.1.o_proj.bias"][0] == "adamw"
    assert routing["layers.0.q_proj.weight"] == ("muon", 0.01, 0.0)
    assert routing["layers.2.up_proj.weight"][2] == 0.5


@pytest.fixture(scope="module")
def checkpoints(gloo_pool, tmp_path_factory):
    """Per (wrappers, world size, via): a checkpoint after ``SAVE_AT`` steps, the final weights."""
    made = {}

    def checkpoint_of(wrappers: str, world: int = 2, via: str = "dckpt"):
        key = (wrappers, world, via)
        if key not in made:
            path = str(tmp_path_factory.mktemp("canonical") / f"{wrappers or 'plain'}-{world}")
            result = gloo_pool(world).run(
                scenarios.save_midway_and_finish, path=path, wrappers=wrappers, via=via
            )[0]
            made[key] = (path, result["weights"])
        return made[key]

    return checkpoint_of


@pytest.mark.parametrize(
    ("saved_with", "resumed_with", "via"),
    [
        ("ac", "", "dckpt"),
        ("compile", "", "dcp"),
        ("", "ac+compile", "dckpt"),
    ],
)
def test_a_checkpoint_resumes_with_other_wrappers_bit_identically(
    pool2, checkpoints, saved_with, resumed_with, via
):
    path, uninterrupted = checkpoints(saved_with, via=via)
    resumed = pool2.run(scenarios.resume_and_finish, path=path, wrappers=resumed_with, via=via)[0][
        "weights"
    ]
    assert resumed.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key


@pytest.mark.parametrize(("resumed_with", "replicas"), [("", 2), ("compile", 1)])
def test_a_checkpoint_written_with_activation_checkpointing_resumes_on_four_ranks_without_it(
    pool4, checkpoints, resumed_with, replicas
):
    path, uninterrupted = checkpoints("ac")
    resumed = pool4.run(
        scenarios.resume_and_finish, path=path, wrappers=resumed_with, replicas=replicas
    )[0]["weights"]
    assert max_relative_difference(resumed, uninterrupted) < FP32_TOLERANCE


def test_a_stock_fsdp2_models_checkpoint_loads_into_dmuon_with_wrappers(pool2, tmp_path):
    path = str(tmp_path / "stock")
    stock = pool2.run(scenarios.stock_saves, path=path, wrappers="")[0]
    for wrappers, via in (("ac", "dckpt"), ("ac+compile", "dcp")):
        loaded = pool2.run(scenarios.dmuon_loads_model_part, path=path, wrappers=wrappers, via=via)
        assert loaded[0].keys() == stock.keys()
        for key, value in stock.items():
            assert torch.equal(loaded[0][key], value), (wrappers, key)


def test_dmuons_checkpoint_written_with_wrappers_loads_into_a_stock_fsdp2_model(pool2, tmp_path):
    path = str(tmp_path / "dmuon")
    saved = pool2.run(scenarios.dmuon_saves_model_part, path=path, wrappers="ac+compile")[0]
    for wrappers in ("", "ac"):
        loaded = pool2.run(scenarios.stock_loads, path=path, wrappers=wrappers)[0]
        assert loaded.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), (wrappers, key)
