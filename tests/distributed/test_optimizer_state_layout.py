"""Per-rank ``optimizer.state_dict()`` + ``torch.save`` (torch's habit) on gloo: each rank's own
file resumes bit for bit; another rank's file, or files of another world size, raise on every
rank before anything changes, naming ``dmuon.checkpoint`` (issue 43, item 3)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from dmuon.optim_layout import LAYOUT_KEY
from tests.distributed import scenarios_checkpoint
from tests.distributed import scenarios_optimizer_state_layout as scenarios

# (world size, replicas, tensor-parallel size)
LAYOUTS = {"1d-2": (2, 1, 1), "1d-4": (4, 1, 1), "hsdp-2x2": (4, 2, 1), "dp2-tp2": (4, 1, 2)}


@pytest.fixture(scope="module")
def per_rank_files(gloo_pool, tmp_path_factory):
    """Per layout: the folder of per-rank files after ``SAVE_AT`` steps, and the uninterrupted
    run's final weights."""
    made = {}

    def files_of(layout: str):
        if layout not in made:
            world, replicas, tp = LAYOUTS[layout]
            path = str(tmp_path_factory.mktemp("per-rank") / layout)
            results = gloo_pool(world).run(
                scenarios.save_per_rank_and_finish, path=path, replicas=replicas, tp=tp
            )
            made[layout] = (path, results[0]["weights"])
        return made[layout]

    return files_of


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_resuming_from_its_own_file_is_bit_identical_to_the_uninterrupted_run(
    gloo_pool, per_rank_files, layout
):
    path, uninterrupted = per_rank_files(layout)
    world, replicas, tp = LAYOUTS[layout]
    resumed = gloo_pool(world).run(
        scenarios.resume_from_own_file, path=path, replicas=replicas, tp=tp
    )
    assert resumed[0]["weights"].keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[0]["weights"][key], value), key


def assert_refused_on_every_rank(results, *lines: str) -> None:
    errors = [result["error"] for result in results]
    assert all(error is not None for error in errors), errors
    assert len(set(errors)) == 1, "every rank raises the same error"
    for line in lines:
        assert line in errors[0]
    assert "Nothing was loaded, on any rank." in errors[0]
    assert "dmuon.checkpoint.get_state_dict(model, optimizer)" in errors[0]
    # Nothing changed before the raise, and every rank goes on in step with the others.
    assert all(result["unchanged"] and result["stepped"] for result in results)


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_first_ranks_file_loaded_on_every_rank_raises_on_every_rank_and_changes_nothing(
    gloo_pool, per_rank_files, world_size
):
    path, _ = per_rank_files(f"1d-{world_size}")
    results = gloo_pool(world_size).run(scenarios.load_another_file, path=path, file_rank=0)
    others = list(range(1, world_size))
    assert_refused_on_every_rank(
        results,
        "the per-rank optimizer state dict does not fit the layout it is loaded on, on "
        + ("rank 1 of 2:" if world_size == 2 else f"ranks {others} of {world_size}:"),
        f"rank 1: it was written by rank 0 of {world_size}, and is loaded on rank 1 of "
        f"{world_size}.",
    )
    assert "rank 0:" not in results[0]["error"]


def test_the_first_ranks_file_under_tensor_parallelism_raises_on_every_rank(pool4, per_rank_files):
    # dp 2 x tp 2: rank 1 is rank 0's TP peer (another ownership grid), and raises too.
    path, _ = per_rank_files("dp2-tp2")
    results = pool4.run(scenarios.load_another_file, path=path, file_rank=0, tp=2)
    assert_refused_on_every_rank(
        results,
        "on ranks [1, 2, 3] of 4:",
        "rank 1: it was written by rank 0 of 4, and is loaded on rank 1 of 4.",
    )


def test_files_of_two_ranks_loaded_on_four_raise_on_every_rank_and_change_nothing(
    pool4, per_rank_files
):
    path, _ = per_rank_files("1d-2")
    results = pool4.run(scenarios.load_another_file, path=path)  # rank r loads file r % 2
    assert_refused_on_every_rank(
        results,
        "on ranks [0, 1, 2, 3] of 4:",
        "rank 0: it was written by rank 0 of 2, and is loaded on rank 0 of 4.",
        "rank 3: it was written by rank 1 of 2, and is loaded on rank 3 of 4.",
    )


def test_hsdp_files_loaded_on_a_1d_layout_of_the_same_size_raise_naming_the_grid(
    pool4, per_rank_files
):
    path, _ = per_rank_files("hsdp-2x2")
    results = pool4.run(scenarios.load_another_file, path=path)  # each rank its own rank's file
    assert_refused_on_every_rank(
        results,
        "rank 0: it was written on an ownership grid of (shards, replicas, TP size) (2, 2, 1), "
        "and is loaded on (4, 1, 1).",
    )


def test_a_pipeline_stage_given_the_first_ranks_file_raises_on_every_stage(pool2, tmp_path):
    # One stage a rank: each rank is its own ownership grid, so the ranks agree over the
    # default group; the first rank, whose own file it is, raises too.
    results = pool2.run(scenarios.pipeline_stage_loads_the_first_ranks_file, path=str(tmp_path))
    assert_refused_on_every_rank(
        results,
        "on rank 1 of 2:",
        "rank 1: it was written by rank 0 of 2, and is loaded on rank 1 of 2.",
    )


def test_a_file_without_the_layout_record_is_refused_on_every_rank_with_how_to_add_it(
    pool2, per_rank_files
):
    path, _ = per_rank_files("1d-2")
    results = pool2.run(scenarios.load_another_file, path=path, drop_record=True)
    assert_refused_on_every_rank(
        results,
        "rank 1: the state dict has no 'dmuon_layout' record (written by torch.optim, or by a "
        "dmuon before the record)",
        "saved['dmuon_layout'] = optimizer.state_dict()['dmuon_layout']",
    )


def test_a_file_without_the_layout_record_loads_in_one_process_bit_for_bit():
    model, optimizer = scenarios_checkpoint.build(replicas=0)
    scenarios_checkpoint.train(model, optimizer, range(2))
    saved = copy.deepcopy(optimizer.state_dict())  # torch's load keeps the saved tensors
    del saved[LAYOUT_KEY]
    twin, twin_optimizer = scenarios_checkpoint.build(replicas=0)
    twin.load_state_dict(model.state_dict())
    twin_optimizer.load_state_dict(saved)
    scenarios_checkpoint.train(model, optimizer, range(2, 4))
    scenarios_checkpoint.train(twin, twin_optimizer, range(2, 4))
    theirs = twin.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(theirs[key], value), key


def test_the_layout_record_is_plain_values_that_torch_load_reads_with_weights_only(pool2):
    records = pool2.run(scenarios.record)
    assert [(r["world_size"], r["rank"], r["grid"]) for r in records] == [
        (2, 0, (2, 1, 1)),
        (2, 1, (2, 1, 1)),
    ]
    owners = records[0]["owners"]
    assert owners == records[1]["owners"]
    assert {owner for fqn, owner in owners.items() if fqn.endswith("_proj.weight")} == {0, 1}
    assert owners["embed.weight"] is None  # sharded by FSDP2
    buffer = io.BytesIO()
    torch.save({LAYOUT_KEY: records[1]}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)[LAYOUT_KEY] == records[1]
