"""A setup error on some ranks of ``dedicate_params`` is raised on every rank; nothing hangs.

Before dmuon creates any process group the ranks agree on whether setup went well (one
``all_gather_object`` on the default group), so a rank whose predicate or argument failed never
leaves the others blocked in a group creation it will not join. Each scenario catches the error
on every rank and returns it; ``deadline_s`` turns a hang into a failure well before the pool's
default deadline.
"""

import pytest

from tests.reliability.scenarios_setup_failures import (
    bad_argument_on_rank_1,
    different_process_group_policies,
    failure_on_another_pipeline_stage,
    meshes_that_disagree,
    predicate_raises_on,
)

DEADLINE_S = 60


def test_a_predicate_that_raises_on_rank_1_only_raises_its_error_on_every_rank(pool2):
    results = pool2.run(predicate_raises_on, failing_ranks=[1], deadline_s=DEADLINE_S)
    for result in results:
        assert result["type"] == "ValueError"
        assert result["message"].startswith(
            "dedicate_params failed on rank 1 of 2 (ranks [0] did not fail): "
            "ValueError: boom on rank 1\n"
        )
        assert "Fix the error on rank 1" in result["message"]
    # The failed rank's error keeps its original, with its traceback, as the cause.
    assert results[0]["cause"] is None
    assert results[1]["cause"] == "ValueError: boom on rank 1"


def test_different_errors_on_several_ranks_are_all_named_on_every_rank(pool4):
    results = pool4.run(predicate_raises_on, failing_ranks=[1, 3], deadline_s=DEADLINE_S)
    for result in results:
        assert result["type"] == "ValueError"
        assert result["message"].startswith(
            "dedicate_params failed on ranks [1, 3] of 4 (ranks [0, 2] did not fail):\n"
            "  rank 1: ValueError: boom on rank 1\n"
            "  rank 3: ValueError: boom on rank 3\n"
        )


def test_when_every_rank_fails_each_raises_its_own_error_unchanged(pool2):
    # Nobody is left waiting, and the seed's exact messages (e.g. the TP named-mesh error) stay
    # exactly as written.
    results = pool2.run(predicate_raises_on, failing_ranks=[0, 1], deadline_s=DEADLINE_S)
    for rank, result in enumerate(results):
        assert (result["type"], result["message"]) == ("ValueError", f"boom on rank {rank}")


@pytest.mark.parametrize(
    ("argument", "error_type", "original"),
    [
        ("policy", "ValueError", "ValueError: process_group_policy='clone' is not one of"),
        ("mesh", "TypeError", "TypeError: mesh must be a torch.distributed DeviceMesh or None"),
        ("param_policy", "ValueError", "ValueError: param_policy['defaults']['param_dtype']='fp8'"),
    ],
    ids=["unknown-process-group-policy", "mesh-that-is-no-device-mesh", "unknown-param-dtype"],
)
def test_a_bad_argument_on_one_rank_raises_on_every_rank(pool2, argument, error_type, original):
    results = pool2.run(bad_argument_on_rank_1, argument=argument, deadline_s=DEADLINE_S)
    for result in results:
        assert result["type"] == error_type
        assert "dedicate_params failed on rank 1 of 2" in result["message"]
        assert original in result["message"]


def test_a_failure_on_another_pipeline_stage_raises_on_every_stage(pool4):
    results = pool4.run(failure_on_another_pipeline_stage, deadline_s=DEADLINE_S)
    for result in results:
        # KeyError is neither a ValueError nor a TypeError: it travels as a RuntimeError.
        assert result["type"] == "RuntimeError"
        assert result["message"].startswith(
            "dedicate_params failed on rank 3 of 4 (ranks [0, 1, 2] did not fail): "
            "KeyError: 'embed.weight'\n"
        )


def test_different_process_group_policies_raise_on_every_rank_before_any_group_exists(pool2):
    results = pool2.run(different_process_group_policies, deadline_s=DEADLINE_S)
    for result in results:
        assert result["type"] == "ValueError"
        assert result["message"].startswith(
            "dedicate_params got different process_group_policy values across ranks: "
            "'isolated' on ranks [0]; 'shared' on ranks [1]. Pass the same "
            "process_group_policy on every rank"
        )


def test_meshes_that_disagree_across_ranks_raise_on_every_rank_with_the_fix(pool4):
    results = pool4.run(meshes_that_disagree, deadline_s=DEADLINE_S)
    for result in results:
        assert result["type"] == "ValueError"
        assert (
            "rank 2's mesh spans the owner grid [[0, 2]] (ranks by [replicate][shard]), which "
            "holds rank 0, but rank 0's spans [[0, 1]]"
        ) in result["message"]
        assert "Build the DeviceMesh the same way on every rank" in result["message"]
