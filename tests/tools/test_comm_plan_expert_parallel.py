"""``summarize_comm_plan`` under expert parallelism on 4 gloo ranks (issue 42, item 4): the
expert segments are reported on their EP slot's group (its ranks, size, root and bytes), and the
estimate equals, per rank and per collective kind, what one training step really issues; its
all-ranks totals equal the sum over ranks."""

import json

import pytest

from dmuon_tools.comm_plan import COLLECTIVE_KINDS
from tests.tools.scenarios_comm_plan_expert_parallel import FIELDS, one_step_against_the_comm_plan

CASES = [
    pytest.param({}, id="ep2-x-efsdp2-z3"),
    pytest.param({"reshard_after_forward": False}, id="ep2-x-efsdp2-z2"),
    pytest.param({"replicas": 2}, id="hsdp-2-x-ep2"),
]


@pytest.fixture(scope="module", params=CASES)
def ranks(request, pool4):
    results = pool4.run(one_step_against_the_comm_plan, **request.param)
    for result in results:
        result["comm_plan"] = json.loads(result["comm_plan"])
    return results


def test_the_estimate_equals_the_collectives_each_rank_issues_in_one_expert_parallel_step(ranks):
    for result in ranks:
        assert result["unexpected"] == []
        estimated = result["comm_plan"]["this_rank"]["per_kind"]
        for kind in COLLECTIVE_KINDS:
            assert estimated[kind] == result["measured"][kind], f"rank {result['rank']}, {kind}"


def test_the_all_ranks_totals_equal_the_sum_of_every_rank_measured_under_expert_parallelism(ranks):
    for kind in COLLECTIVE_KINDS:
        measured_sum = {field: sum(r["measured"][kind][field] for r in ranks) for field in FIELDS}
        for result in ranks:
            assert result["comm_plan"]["all_ranks"]["per_kind"][kind] == measured_sum, kind


def test_expert_segments_are_reported_on_their_ep_slots_group_and_the_others_on_the_main_grid(
    ranks,
):
    for result in ranks:
        groups = result["groups"]
        expert_segments = 0
        for boundary in result["comm_plan"]["boundaries"]:
            for segment in boundary["segments"]:
                experts = ["[" in name for name in segment["params"]]
                assert len(set(experts)) == 1, segment["params"]  # never mixed
                group = groups["expert_shard" if experts[0] else "dense_shard"]
                expert_segments += experts[0]
                assert tuple(segment["group_ranks"]) == group, (result["rank"], segment)
                assert segment["root_rank"] == group[segment["shard"]]
                assert segment["is_local"] == (segment["root_rank"] == result["rank"])
                assert len(segment["replicate_ranks"]) == len(groups["replicate"])
                assert segment["root_rank"] in segment["replicate_ranks"]
        assert expert_segments > 0
