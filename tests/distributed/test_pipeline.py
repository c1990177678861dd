"""Pipeline parallelism as torchtitan runs it (stage modules, one dmuon.Muon per stage sharing a
dmuon.StepGroup, a real torch.distributed.pipelining schedule, one clip norm over all stages)
against the unpipelined single-process reference, on gloo."""

import pytest

from tests.distributed.scenarios_pipeline import (
    collectives_of_clip_and_steps,
    nonfinite_on_one_stage,
    step_group_setup_errors,
    train_pipeline_against_reference,
)

FP32_TOLERANCE = 1e-5
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b"]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("world_size", "dp"), [(2, 1), (4, 2)], ids=["pp2", "pp2xdp2"])
def test_pipeline_stages_clipped_with_one_norm_train_like_the_reference(
    gloo_pool, world_size, dp, schedule
):
    # max_norm well below the gradient norm: every step is clipped, so a norm that missed a
    # stage, a chunk or a shard changes the weights.
    results = gloo_pool(world_size).run(
        train_pipeline_against_reference, schedule=schedule, dp=dp, clip_max_norm=0.05
    )
    for rank, result in enumerate(results):
        worst = max(result["max_errors"])
        assert worst < FP32_TOLERANCE, f"rank {rank}: max relative error {worst:.3e}"
        if result["losses"] is not None:  # the last stage's ranks
            assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5)


NAN_CASES = {
    # (schedule, stage, parameter): a dedicated matrix on its owner, an FSDP2 / plain weight on
    # dp rank 0 only, and one on the second chunk of rank 0 under the interleaved schedule.
    "1f1b-stage0-dedicated": ("1f1b", 0, "layers.0.q_proj.weight"),
    "1f1b-stage1-sharded": ("1f1b", 1, "lm_head.weight"),
    "interleaved-stage2-dedicated": ("interleaved_1f1b", 2, "layers.2.up_proj.weight"),
}


@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("case", NAN_CASES.values(), ids=NAN_CASES.keys())
@pytest.mark.parametrize(("world_size", "dp"), [(2, 1), (4, 2)], ids=["pp2", "pp2xdp2"])
def test_a_nan_gradient_on_one_stage_skips_the_step_on_every_stage(
    gloo_pool, world_size, dp, case, clip
):
    schedule, stage, name = case
    results = gloo_pool(world_size).run(
        nonfinite_on_one_stage,
        schedule=schedule,
        dp=dp,
        steps=2,
        nonfinite="skip",
        clip_max_norm=0.05 if clip else None,
        nan_at=(2, stage, name),
    )
    for rank, result in enumerate(results):
        assert result["outcome"] == "stepped", f"rank {rank}: {result['outcome']}"
        assert result["unchanged"], f"rank {rank}: a stage stepped"
        # One warning per rank, from the optimizer that decided for the rank's stages; the
        # clip left the gradients unscaled, so the culprit alone is named.
        [warning] = result["warnings"]
        assert f"step 2: 1 parameters have NaN or inf gradients ({name})" in warning
        assert "skipped on every rank" in warning


def test_a_nan_gradient_on_one_stage_raises_on_every_stage_with_nonfinite_raise(pool4):
    results = pool4.run(
        nonfinite_on_one_stage,
        schedule="1f1b",
        dp=2,
        steps=2,
        nonfinite="raise",
        nan_at=(2, 0, "layers.1.down_proj.weight"),
    )
    for rank, result in enumerate(results):
        assert result["outcome"].startswith("raised: dmuon.Muon: step 2: 1 parameters"), rank
        assert "layers.1.down_proj.weight" in result["outcome"]
        assert result["unchanged"]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"], ids=["1-stage", "2-stages"])
def test_the_step_groups_check_costs_one_flag_all_reduce_per_group_and_none_after_a_clip(
    pool4, schedule
):
    # pp2 x dp2, one or two stages per rank: the counts do not grow with the stages a rank holds.
    clipped = pool4.run(
        collectives_of_clip_and_steps,
        schedule=schedule,
        dp=2,
        nonfinite="skip",
        clip_max_norm=0.05,
    )
    for counted in clipped:
        # masters over the dp grid, FSDP2's shards over their mesh, the total over pp; the
        # steps' non-finite check reads the clip's norm instead of communicating.
        assert counted == {"clip": [("all_reduce", 2)] * 3, "steps": []}
    unclipped = pool4.run(
        collectives_of_clip_and_steps, schedule=schedule, dp=2, nonfinite="skip", clip_max_norm=None
    )
    for counted in unclipped:
        assert counted == {"clip": [], "steps": [("all_reduce", 2)] * 2}  # dp grid, then pp


def test_step_group_setup_errors_show_the_fix_on_every_rank(pool2):
    for messages in pool2.run(step_group_setup_errors):
        assert "pp_mesh must be the 1-D pipeline dim of the mesh" in messages["2d"]
        assert "pass mesh['pp']" in messages["2d"]
        policies = messages["policies"]
        assert "use different nonfinite policies across pipeline stages" in policies
        assert "rank 0 has 'skip', rank 1 has 'ignore'" in policies
