"""dmuon on slices of larger named meshes.

dmuon is given one dim of a 2-D ("dp", "tp") or ("pp", "dp") mesh on 4 gloo processes; every rank
must create the same groups in the same order (else the ranks block in mismatched ``new_group``
calls) and each data-parallel slice must train like its own single-process reference. The
timeouts of the groups dmuon creates (also on a slice of a 3-D mesh) and a stalled peer:
``tests/reliability/test_timeouts.py``.
"""

import pytest

from tests.distributed.scenarios_meshes import train_on_the_dp_dim_of_a_2d_mesh
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
