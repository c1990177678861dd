"""dmuon's phases by name in a profiler trace (issue 45, item 5; [Note: profiler labels] in
``dmuon._profiler_labels``): one training step on gloo, with and without HSDP and with the
overlapped step, records each label exactly as often as the protocol runs that phase: per hook
boundary, its broadcast in each forward and again in backward (Z3), its reduce once, the publish
waited for by the next forward on the ranks that publish; per step, one end of backward, one
clip, one owner step and one Newton-Schulz call per shape this rank owns.
"""

from __future__ import annotations

import pytest

from dmuon import _profiler_labels as labels
from tests.distributed import scenarios_profiler_labels as scenarios


def expected_counts(result: dict, overlap_step: bool = False) -> dict[str, int]:
    """What one profiled step (``scenarios.profiled_step``) records, from this rank's layout:
    two forwards (one with grad) and one backward through every boundary under Z3."""
    expected: dict[str, int] = {}
    for name in result["boundaries"]:
        per_boundary = {
            labels.PRE_FORWARD: 2,
            labels.BROADCAST: 3,  # forward, backward (freed after forward), the next forward
            labels.BROADCAST_WAIT: 3,
            labels.PRE_BACKWARD: 1,
            labels.POST_BACKWARD: 1,
            labels.REDUCE: 1,
            # The overlapped step lands the local reduces during backward, then the others.
            labels.REDUCE_WAIT: 2 if overlap_step else 1,
        }
        if name in result["publishing"]:  # the last step's publish, then this step's
            per_boundary[labels.WAIT_PUBLISH] = 2
        for label, count in per_boundary.items():
            expected[labels.of_boundary(label, name)] = count
    expected[labels.FINALIZE_BACKWARD] = 1
    expected[labels.CLIP_GRAD_NORM] = 1
    expected[labels.OWNER_STEP] = result["routes"].count("muon")
    expected[labels.ADAMW_STEP] = result["routes"].count("adamw")
    expected[labels.PUBLISH] = 1
    if result["ns_shapes"] and not overlap_step:
        expected[labels.NEWTON_SCHULZ] = result["ns_shapes"]
    return expected


@pytest.mark.parametrize(("world_size", "replicas"), [(2, 1), (4, 2)], ids=["1d-2", "hsdp-2x2"])
def test_one_step_records_every_phase_label_once_per_boundary_and_pass(
    gloo_pool, world_size, replicas
):
    results = gloo_pool(world_size).run(scenarios.profiled_step, replicas=replicas)
    for rank, result in enumerate(results):
        assert result["counts"] == expected_counts(result), rank
    seen = {label for result in results for label in result["counts"]}
    bare = {label.split(" (")[0] for label in seen}
    assert bare == set(labels.ALL_LABELS) - {labels.SPECULATE, labels.COMMIT} - (
        set() if replicas > 1 else {labels.WAIT_PUBLISH}
    )


def test_the_overlapped_step_labels_its_speculation_and_commits_each_unit_it_speculated(pool2):
    results = pool2.run(
        scenarios.profiled_step, replicas=1, overlap_step=True, max_norm=float("inf")
    )
    for rank, result in enumerate(results):
        counts = dict(result["counts"])
        speculated = counts.pop(labels.SPECULATE)
        assert speculated >= 1 and counts.pop(labels.COMMIT) == speculated, (rank, counts)
        # Newton-Schulz runs in the speculation (one call per shape of each unit), not in step.
        assert counts.pop(labels.NEWTON_SCHULZ) >= speculated, rank
        assert counts == expected_counts(result, overlap_step=True), rank
