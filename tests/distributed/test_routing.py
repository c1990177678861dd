"""param_groups=, no_decay= and routes= on gloo, against the single-process reference."""

import pytest

from tests.distributed import scenarios_routing as scenarios

# fp32 Newton-Schulz: as in test_protocol, parameters agree to a few fp32 roundings per step.
FP32_TOLERANCE = 1e-5
LAYOUTS = [(2, 1), (4, 2)]
LAYOUT_IDS = ["1d-2", "hsdp-2x2"]


def assert_matches_reference(results):
    for rank, result in enumerate(results):
        worst = max(result["max_errors"])
        assert worst < FP32_TOLERANCE, f"rank {rank}: max relative error {worst:.3e}"


@pytest.mark.parametrize(("world_size", "replicas"), LAYOUTS, ids=LAYOUT_IDS)
def test_a_layer_with_its_own_lr_and_the_no_decay_rule_match_the_reference(
    gloo_pool, world_size, replicas
):
    results = gloo_pool(world_size).run(scenarios.train_against_reference, replicas=replicas)
    assert_matches_reference(results)
    assert all(result["routing"] == results[0]["routing"] for result in results)


def test_an_lr_scheduler_scales_every_group_like_the_reference(pool2):
    assert_matches_reference(pool2.run(scenarios.train_against_reference, scheduler=True))


@pytest.mark.parametrize(("world_size", "replicas"), LAYOUTS, ids=LAYOUT_IDS)
def test_routes_moving_matrices_between_all_three_routes_match_the_reference(
    gloo_pool, world_size, replicas
):
    routes = {
        "layers.0.q_proj.weight": "adamw",
        "layers.2.down_proj.weight": "sharded_adamw",
        "lm_head.weight": "muon",
    }
    results = gloo_pool(world_size).run(
        scenarios.train_against_reference, replicas=replicas, routes=routes
    )
    assert_matches_reference(results)
    rows = {row.fqn: row for row in results[0]["routing"]}
    assert [rows[name].route for name in routes] == ["adamw", "sharded_adamw", "muon"]
    assert rows["layers.0.q_proj.weight"].owner_rank in range(world_size)
    assert rows["layers.2.down_proj.weight"].owner_rank is None


def test_a_checkpoint_loads_into_other_routes_with_a_warning_and_trains_on(pool2, tmp_path):
    results = pool2.run(scenarios.routes_moved_in_a_checkpoint, path=str(tmp_path / "ckpt"))
    result = results[0]
    assert result["routes"] == {
        "layers.0.q_proj.weight": "adamw",
        "layers.1.up_proj.weight": "sharded_adamw",
        "lm_head.weight": "muon",
    }
    assert len(result["warnings"]) == 1
    for name in ("layers.0.q_proj.weight", "layers.1.up_proj.weight", "lm_head.weight"):
        assert name in result["warnings"][0]
    assert "starts fresh" in result["warnings"][0]
    assert result["group_routes"][:2] == ["muon", "adamw"]
    assert all(loss == loss and loss < 10 for r in results for loss in r["losses"])


def test_param_groups_that_differ_between_ranks_raise_on_every_rank(pool2):
    messages = pool2.run(scenarios.rank_dependent_param_groups)
    for message in messages:
        assert message.startswith("dmuon: ranks [1] use different hyperparameters"), message
