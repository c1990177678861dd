"""Every process group dmuon creates inherits a timeout, so a stalled peer fails, never hangs.

The groups carry the default group's timeout (``init_process_group(timeout=...)``), or the
``timeout=`` given to ``dedicate_params``, also on a slice of a larger mesh; a rank whose peer
stalls fails within it, with an error that names dmuon's collective, its root and its ranks. (A
peer that dies instead of stalling: ``test_rank_death.py``.)
"""

import re

import pytest

from tests.distributed.pool import WorkerPool
from tests.reliability.scenarios_timeouts import (
    boundary_skipped_on_one_rank,
    group_timeouts,
    stalled_peer_fails_the_forward_broadcast,
    stalled_peer_fails_the_step_checks,
)


def test_every_group_dmuon_creates_inherits_the_default_groups_timeout(pool4):
    for result in pool4.run(group_timeouts):
        assert result["default"] == pool4.pg_timeout_s
        assert (result["shard"], result["replicate"], result["world"]) == (result["default"],) * 3


def test_a_timeout_given_to_dedicate_params_wins_over_the_default_groups(pool4):
    for result in pool4.run(group_timeouts, timeout_s=7.0):
        assert (result["shard"], result["replicate"], result["world"]) == (7.0, 7.0, 7.0)


def test_hsdp_on_a_slice_of_a_3d_mesh_owns_over_its_slice_with_the_timeout_given(pool8):
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
# The workers start under the pool's start-up deadline, not this timeout; it bounds the scenario's
# collectives, which both ranks reach within a second or two even on a busy 2-core machine. Each
# stall test waits it out once, so it is kept short: 5 s still leaves that margin more than twice.
STALL_PG_TIMEOUT_S = 5.0


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


@pytest.mark.parametrize("check", ["nonfinite", "clip"])
def test_a_peer_stalled_before_a_step_check_fails_the_others_naming_the_all_reduce(
    short_timeout_pool2, check
):
    results = short_timeout_pool2.run(
        stalled_peer_fails_the_step_checks, stalled_rank=1, check=check, deadline_s=60
    )
    waited = results[0]
    assert waited["error"] is not None, waited
    # (the non-finite check reduces one flag; the clip, the norms of masters and TP chunks)
    named = r"dmuon: the all-reduce of [12] elements over ranks \[0, 1\]"
    assert re.search(named, waited["error"]), waited
    assert waited["seconds"] < 6 * STALL_PG_TIMEOUT_S, waited


def test_a_boundary_skipped_on_one_rank_is_named_there_and_fails_every_rank_within_the_timeout(
    short_timeout_pool2,
):
    # See [Note: a boundary skipped on some ranks only] in dmuon.hooks: no rank hangs for good,
    # the skipping rank names the boundary at once, every error names its boundary and the cause.
    results = short_timeout_pool2.run(boundary_skipped_on_one_rank, skipping_rank=0, deadline_s=90)
    (warning,) = [w for w in results[0]["warnings"] if "did not run" in w]
    assert warning.startswith(
        "dmuon: boundary 'layers.1' did not run in this forward on rank 0, though it comes "
        "before 'layers.2' in the forward order the first forward recorded."
    )
    assert not any("did not run" in w for w in results[1]["warnings"])
    for result in results:
        assert result["error"] is not None, result
        assert re.search(
            r"over ranks \[0, 1\] for the \w+ of boundary 'layers\.\d'", result["error"]
        )
        assert "A hook boundary that ran on some ranks only" in result["error"]
        assert result["seconds"] < 6 * STALL_PG_TIMEOUT_S, result
        assert result["finite"]  # nothing half-reduced reached the weights
