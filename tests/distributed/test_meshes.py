"""dmuon on slices of larger named meshes, and the timeouts of the process groups it creates.

Meshes: dmuon is given one dim of a 2-D ("dp", "tp") or ("pp", "dp") mesh on 4 gloo processes;
every rank must create the same groups in the same order (else the ranks block in mismatched
``new_group`` calls) and each data-parallel slice must train like its own single-process
reference. Timeouts: every group dmuon creates carries the default group's timeout (or the
``timeout=`` given), so a stalled peer fails dmuon's collectives within it.
"""

import pytest

from tests.distributed.pool import WorkerPool
from tests.distributed.scenarios_meshes import (
    group_timeouts,
    stalled_peer_fails_the_forward_broadcast,
    train_on_the_dp_dim_of_a_2d_mesh,
)
from tests.distributed.test_protocol import FP32_TOLERANCE, assert_matches_reference

POLICIES = ["isolated", "shared"]


@pytest.mark.parametrize("process_group_policy", POLICIES)
def test_the_dp_dim_of_a_dp_tp_mesh_trains_like_the_single_process_reference(
    pool4, process_group_policy
):
    results = pool4.run(
        train_on_the_dp_dim_of_a_2d_mesh,
        dims=("tp", "dp"),
        process_group_policy=process_group_policy,
    )
    assert_matches_reference(results, FP32_TOLERANCE)
    # mesh[[tp][dp]] = [[0, 1], [2, 3]]: the dp slices are {0, 1} and {2, 3}.
    for rank, result in enumerate(results):
        dp_slice = [0, 1] if rank < 2 else [2, 3]
        assert result["rank_grid"] == [dp_slice]
        assert result["world_group_ranks"] == dp_slice


@pytest.mark.parametrize("process_group_policy", POLICIES)
def test_each_pipeline_stage_trains_its_own_model_on_its_own_dp_slice(pool4, process_group_policy):
    # The stages' models differ (2 and 3 layers): one rank-agreement check or gradient norm over
    # the whole world would mix them. Clipping every step makes a norm from the wrong ranks show.
    results = pool4.run(
        train_on_the_dp_dim_of_a_2d_mesh,
        dims=("pp", "dp"),
        process_group_policy=process_group_policy,
        layers_per_stage=(2, 3),
        clip_max_norm=0.05,
    )
    assert_matches_reference(results, FP32_TOLERANCE)
    assert [result["stage"] for result in results] == [0, 0, 1, 1]
    for rank, result in enumerate(results):
        stage_ranks = [0, 1] if rank < 2 else [2, 3]
        assert result["world_group_ranks"] == stage_ranks


def test_the_dp_dim_that_is_not_the_last_dim_gets_the_ranks_of_its_column(pool4):
    # ("dp", "tp"): mesh[dp][tp] = [[0, 1], [2, 3]], so rank 0's dp slice is {0, 2}.
    results = pool4.run(
        train_on_the_dp_dim_of_a_2d_mesh,
        dims=("dp", "tp"),
        process_group_policy="isolated",
        steps=2,
    )
    assert_matches_reference(results, FP32_TOLERANCE)
    for rank, result in enumerate(results):
        assert result["world_group_ranks"] == [rank % 2, rank % 2 + 2]


# ---- timeouts ----------------------------------------------------------------------------------


def test_every_group_dmuon_creates_inherits_the_default_groups_timeout(pool4):
    for result in pool4.run(group_timeouts):
        assert result["default"] == pool4.pg_timeout_s
        assert (result["shard"], result["replicate"], result["world"]) == (result["default"],) * 3


def test_a_timeout_given_to_dedicate_params_wins_over_the_default_groups(pool4):
    for result in pool4.run(group_timeouts, timeout_s=7.0):
        assert (result["shard"], result["replicate"], result["world"]) == (7.0, 7.0, 7.0)


def test_hsdp_on_the_replicate_and_shard_dims_of_a_3d_mesh_owns_over_its_own_slice(pool8):
    # mesh[replicate][shard][tp] over ranks 0..7: rank r's slice is the ranks with its tp index.
    results = pool8.run(
        group_timeouts, dims=("replicate", "shard", "tp"), shape=(2, 2, 2), timeout_s=9.0
    )
    for rank, result in enumerate(results):
        tp = rank % 2
        assert result["rank_grid"] == [[tp, tp + 2], [tp + 4, tp + 6]]
        assert result["world_group_ranks"] == [tp, tp + 2, tp + 4, tp + 6]
        assert (result["shard"], result["replicate"], result["world"]) == (9.0, 9.0, 9.0)


# A pool of its own: its default group's timeout is short, and the stalled scenario leaves a dmuon
# group out of step, which no later scenario may meet.
STALL_PG_TIMEOUT_S = 20.0  # also the workers' start-up rendezvous: room for a busy 2-core machine


@pytest.fixture(scope="module")
def short_timeout_pool2():
    with WorkerPool(2, pg_timeout_s=STALL_PG_TIMEOUT_S) as pool:
        yield pool


def test_a_stalled_peer_makes_the_others_fail_within_the_inherited_timeout(short_timeout_pool2):
    results = short_timeout_pool2.run(
        stalled_peer_fails_the_forward_broadcast, stalled_rank=1, deadline_s=60
    )
    assert results[1] == {"stalled": True}
    waited = results[0]
    assert waited["error"] is not None, "rank 0 finished a forward without its peer"
    assert "timed out" in waited["error"].lower(), waited["error"]
    # The error names dmuon's collective, its root and the ranks it waited for.
    assert "dmuon: the broadcast of" in waited["error"], waited["error"]
    assert "over ranks [0, 1]" in waited["error"], waited["error"]
    # Without inheritance the group's timeout would be torch's 30 minutes (and the pool's
    # deadline would end the scenario); the bound leaves room for a busy machine.
    assert waited["seconds"] < 6 * STALL_PG_TIMEOUT_S, waited
