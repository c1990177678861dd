"""The Newton-Schulz kernel switch is agreed (gloo, 2 and 4 ranks): whatever step each rank's
background compile job ends on, every rank switches on the same step (the first where all have
ended), and a job that fails on one rank keeps cuBLAS on every rank from that step, with one
warning on the failing rank only."""

import pytest

from tests.distributed.scenarios_kernel_switch import step_group_switch_steps, switch_steps


@pytest.mark.parametrize("pool_name", ["pool2", "pool4"])
def test_ranks_whose_jobs_end_at_different_steps_all_switch_on_the_step_the_last_one_ends(
    pool_name, request, tmp_path
):
    pool = request.getfixturevalue(pool_name)
    world = pool.world_size
    steps = world + 2
    results = pool.run(switch_steps, release_dir=str(tmp_path), steps=steps)
    for rank, result in enumerate(results):
        # Rank r's job ends before step r + 1: the last rank's at step `world`.
        assert result["switch_step"] == world, (rank, result)
        expected = [step < world for step in range(1, steps + 1)]
        assert result["deferred"] == expected, (rank, result)
        assert not result["active"]
        assert result["warnings"] == []


def test_a_job_that_fails_on_one_rank_keeps_cublas_on_every_rank_with_one_warning(pool2, tmp_path):
    results = pool2.run(switch_steps, release_dir=str(tmp_path), steps=3, failing_rank=1)
    for rank, result in enumerate(results):
        assert result["switch_step"] is None, (rank, result)
        assert result["deferred"] == [True, True, True], (rank, result)
        assert not result["active"]
    assert results[0]["warnings"] == []
    (warning,) = results[1]["warnings"]
    assert "dmuon background kernel compile failed: it exited with status 3" in warning
    assert "simulated crash of the kernel library" in warning
    assert "Newton-Schulz keeps running cuBLAS on every rank" in warning
    assert "DMUON_KERNEL_COMPILE=wait" in warning


@pytest.mark.parametrize("pool_name", ["pool2", "pool4"])
def test_optimizers_of_one_step_group_agree_as_often_on_every_rank_through_a_skipped_step(
    pool_name, request, tmp_path
):
    pool = request.getfixturevalue(pool_name)
    world = pool.world_size
    results = pool.run(
        step_group_switch_steps, release_dir=str(tmp_path), steps=world + 2, nan_step=1
    )
    for rank, result in enumerate(results):
        assert result["switch_step"] == world, (rank, result)
        assert not result["active"] and not result["deferred"], (rank, result)
        assert result["skipped"] == [1], (rank, result)
