"""The dmuon-tools summaries on 4 gloo ranks, against the collectives one training step issues.

The communication estimate of ``summarize_comm_plan`` must equal, per rank and per collective
kind, what the c10d ops counted by ``tests/distributed/comm_counter.py`` carried; its all-ranks
totals must equal the sum over ranks.
"""

import json

import pytest

from dmuon_tools.comm_plan import COLLECTIVE_KINDS
from tests.tools.scenarios_tools import (
    fsdp2_compute_dtypes_of_a_mixed_precision_model,
    one_step_against_the_summaries,
)

CASES = [
    pytest.param({"replicas": 2, "reshard_after_forward": True}, id="hsdp-2x2-z3"),
    pytest.param({"replicas": 1, "reshard_after_forward": False}, id="1d-4-z2"),
]


@pytest.fixture(scope="module", params=CASES)
def ranks(request, pool4):
    results = pool4.run(one_step_against_the_summaries, **request.param)
    for result in results:
        for key in ("comm_plan", "param_groups", "profile"):
            result[key] = json.loads(result[key])
    return results


def test_comm_plan_estimate_equals_the_collectives_each_rank_issues_in_one_step(ranks):
    for result in ranks:
        assert result["measured"]["unexpected"] == []
        estimated = result["comm_plan"]["this_rank"]["per_kind"]
        measured = result["measured"]["per_kind"]
        for kind in COLLECTIVE_KINDS:
            assert estimated[kind] == measured[kind], f"rank {result['rank']}, {kind}"


def test_comm_plan_all_ranks_totals_equal_the_sum_of_every_rank_measured(ranks):
    for kind in COLLECTIVE_KINDS:
        measured_sum = {
            field: sum(r["measured"]["per_kind"][kind][field] for r in ranks)
            for field in ("collectives", "payload_bytes", "sent_bytes", "received_bytes")
        }
        for result in ranks:
            assert result["comm_plan"]["all_ranks"]["per_kind"][kind] == measured_sum, kind


def test_comm_plan_lists_each_segment_root_and_the_hsdp_axes(ranks):
    for result in ranks:
        plan = result["comm_plan"]
        grid = result["param_groups"]["mesh"]["rank_grid"]
        replicate = plan["coord"]["replicate"]
        assert plan["estimate"] is True and "not measured" in plan["note"]
        assert [b["name"] for b in plan["boundaries"]] == ["layers.0", "layers.1", "layers.2"]
        for boundary in plan["boundaries"]:
            for segment in boundary["segments"]:
                assert segment["root_rank"] == grid[replicate][segment["shard"]]
                assert segment["is_local"] == (segment["shard"] == plan["coord"]["shard"])
                assert sum(o["num_params"] for o in segment["owners"]) == segment["num_params"]
        kinds = plan["all_ranks"]["per_kind"]
        has_replicas = plan["num_replicas"] > 1
        assert (kinds["replicate_publish"]["collectives"] > 0) == has_replicas
        assert kinds["shard_broadcast"]["collectives"] > 0


def test_every_dedicated_parameter_has_exactly_one_owner_rank_across_the_summaries(ranks):
    summaries = [r["param_groups"] for r in ranks]
    dedicated = [name for name, p in summaries[0]["params"].items() if p["dedicated"]]
    assert dedicated
    for name in dedicated:
        owners = [s["rank"] for s in summaries if s["params"][name]["is_owner"]]
        assert owners == [summaries[0]["params"][name]["owner_rank"]], name
        assert all(s["params"][name]["route"] == "muon" for s in summaries)
    # Each rank's Muon group holds exactly the matrices it owns.
    for summary in summaries:
        owned = [n for n in dedicated if summary["params"][n]["is_owner"]]
        muon = next(g for g in summary["groups"] if g["route"] == "muon")
        assert muon["num_params"] == len(owned)
        assert muon["numel"] == sum(summary["params"][n]["numel"] for n in owned)


def test_fsdp2_parameters_are_reported_with_their_global_shape(ranks):
    for result in ranks:
        params = result["param_groups"]["params"]
        assert params["embed.weight"]["fsdp2"] is True
        assert params["embed.weight"]["shape"] == [37, 30]
        assert params["embed.weight"]["route"] == "adamw"
        assert params["embed.weight"]["owner"] is None


def test_forward_profile_counts_one_wait_per_boundary_and_forward_on_every_rank(ranks):
    for result in ranks:
        profile = result["profile"]
        assert profile["enabled"] is True and profile["rank"] == result["rank"]
        boundaries = profile["boundaries"]
        assert [b["name"] for b in boundaries] == ["layers.0", "layers.1", "layers.2"]
        assert [b["waits"] for b in boundaries] == [2, 2, 2]  # two training steps
        # Once the forward order is known (second step), each later boundary was prefetched.
        assert [b["prefetched"] for b in boundaries] == [0, 1, 1]
        assert all(b["cuda_wait_ms"]["events"] == 0 for b in boundaries)  # CPU: host clock only


def test_fsdp2_parameters_are_reported_in_the_dtype_fsdp2s_mixed_precision_computes_them_in(
    pool2,
):
    cast = {
        f"layers.{index}.{name}"
        for index in range(3)
        for name in (
            "attn_norm.weight",
            "attn_norm.bias",
            "o_proj.bias",
            "mlp_norm.weight",
            "mlp_norm.bias",
        )
    }
    uncast = {"embed.weight", "norm.weight", "norm.bias", "lm_head.weight"}
    for result in pool2.run(fsdp2_compute_dtypes_of_a_mixed_precision_model):
        assert result["inspect"] == dict.fromkeys(sorted(cast), "torch.bfloat16")
        assert result["summary"] == {
            **dict.fromkeys(cast, "bfloat16"),
            **dict.fromkeys(uncast, "float32"),
        }
