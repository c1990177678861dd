"""Mixture-of-experts stacks on gloo: an (E, m, n) parameter is E matrices.

The tiny MoE decoder (router + two expert stacks per block, used through ``torch.bmm`` and
per-expert matmuls on slices) trains against the single-process reference that runs Muon on each
expert slice as its own matrix, on 1, 2 and 4 ranks, HSDP 2x2, Z2, activation checkpointing,
no_sync accumulation and DDP.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import scenarios_moe as scenarios
from tests.distributed.models_moe import DIM, HIDDEN, NUM_EXPERTS, MoEDecoder
from tests.distributed.test_protocol import message_entry

# fp32 Newton-Schulz: dmuon and the reference differ only by the order of float additions.
FP32_TOLERANCE = 1e-5
STACKS = ("layers.0.w_in", "layers.0.w_out", "layers.1.w_in", "layers.1.w_out")
EXPERT_MATRICES = len(STACKS) * NUM_EXPERTS
PROJECTIONS = 2  # layers.{0,1}.q_proj.weight


def assert_matches_reference(results):
    for rank, result in enumerate(results):
        worst = max(result["max_errors"])
        assert worst < FP32_TOLERANCE, f"rank {rank}: max relative error {worst:.3e}"


def assert_one_newton_schulz_per_expert(results):
    """Every expert matrix is orthogonalised once, on one rank, as an (m, n) matrix."""
    shapes = [shape for result in results for shape in result["orthogonalised"]]
    expert_shape = (min(DIM, HIDDEN), max(DIM, HIDDEN))
    assert shapes.count(expert_shape) == EXPERT_MATRICES
    assert shapes.count((DIM, DIM)) == PROJECTIONS
    assert len(shapes) == EXPERT_MATRICES + PROJECTIONS


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_expert_stacks_train_like_the_per_expert_reference(gloo_pool, world_size):
    results = gloo_pool(world_size).run(scenarios.train_against_reference)
    assert_matches_reference(results)
    assert_one_newton_schulz_per_expert(results)
    for result in results:
        assert result["stack_is_leaf_in_forward"] == {
            "shape": (NUM_EXPERTS, HIDDEN, DIM),
            "is_leaf": True,
        }


def test_each_stack_of_eight_experts_gives_two_experts_to_each_of_four_owners(pool4):
    result = pool4.run(scenarios.train_against_reference, steps=1)[0]
    for stack in STACKS:
        assert result["expert_slices"][stack] == ((0, 2), (2, 4), (4, 6), (6, 8))
        owners = {result["owners"][f"{stack}[{e}:{e + 2}]"] for e in (0, 2, 4, 6)}
        assert owners == {(0, 0), (1, 0), (2, 0), (3, 0)}


def test_expert_stacks_in_hsdp_2x2_train_like_the_reference(pool4):
    results = pool4.run(scenarios.train_against_reference, replicas=2)
    assert_matches_reference(results)
    assert_one_newton_schulz_per_expert(results)
    owners = {results[0]["owners"][f"layers.0.w_in[{e}:{e + 2}]"] for e in (0, 2, 4, 6)}
    assert owners == {(0, 0), (1, 0), (0, 1), (1, 1)}


@pytest.mark.parametrize(
    "options",
    [
        {"reshard_after_forward": False},
        {"checkpoint_layers": True},
        {"micro_batches": 2},
        {"ddp": True},
        {"clip_max_norm": 0.05},
        {"compile_backend": "aot_eager"},
    ],
    ids=["z2", "activation-checkpointing", "no_sync-accumulation", "ddp", "clip", "compiled"],
)
def test_expert_stacks_train_like_the_reference_on_every_path(pool2, options):
    assert_matches_reference(pool2.run(scenarios.train_against_reference, steps=4, **options))


# ---- checkpoints ----------------------------------------------------------------------------

# (world size, replicas); replicas 0 is one process without torch.distributed.
# On 1d-3 some ranks own two pieces of one stack (two chunks in one sharded value).
CHECKPOINT_LAYOUTS = {
    "1d-4": (4, 1),
    "1d-3": (3, 1),
    "1d-2": (2, 1),
    "hsdp-2x2": (4, 2),
    "one-process": (1, 0),
}


def run_layout(gloo_pool, layout: str, scenario, **kwargs):
    world, replicas = CHECKPOINT_LAYOUTS[layout]
    if replicas == 0:
        return scenario(replicas=0, **kwargs)
    return gloo_pool(world).run(scenario, replicas=replicas, **kwargs)[0]


def max_relative_difference(actual: dict, expected: dict) -> float:
    assert actual.keys() == expected.keys()
    return max(
        ((actual[k] - expected[k]).norm() / expected[k].norm().clamp_min(1e-30)).item()
        for k in expected
    )


@pytest.fixture(scope="module")
def moe_checkpoints(gloo_pool, tmp_path_factory):
    """Per saving layout: the checkpoint midway and the uninterrupted run's final state."""
    made = {}

    def checkpoint_of(layout: str):
        if layout not in made:
            path = str(tmp_path_factory.mktemp("moe-checkpoints") / layout)
            made[layout] = (
                path,
                run_layout(gloo_pool, layout, scenarios.save_midway_and_finish, path=path),
            )
        return made[layout]

    return checkpoint_of


def test_expert_stacks_resume_on_the_same_layout_bit_identically(gloo_pool, moe_checkpoints):
    path, uninterrupted = moe_checkpoints("1d-4")
    resumed = run_layout(gloo_pool, "1d-4", scenarios.resume_and_finish, path=path)
    for part in ("model", "optim"):
        assert resumed[part].keys() == uninterrupted[part].keys()
    for key, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][key], value), key


@pytest.mark.parametrize(
    ("saved_on", "resumed_on"),
    [
        ("1d-4", "1d-2"),
        ("1d-4", "one-process"),
        ("1d-2", "hsdp-2x2"),
        ("one-process", "1d-4"),
        ("1d-4", "1d-3"),
        ("1d-3", "1d-2"),
    ],
)
def test_expert_stacks_resume_on_another_layout_like_the_uninterrupted_run(
    gloo_pool, moe_checkpoints, saved_on, resumed_on
):
    path, uninterrupted = moe_checkpoints(saved_on)
    resumed = run_layout(gloo_pool, resumed_on, scenarios.resume_and_finish, path=path)
    assert max_relative_difference(resumed["model"], uninterrupted["model"]) < FP32_TOLERANCE
    for stack in STACKS:
        momentum = resumed["optim"][stack]["momentum_buffer"]
        expected = uninterrupted["optim"][stack]["momentum_buffer"]
        assert ((momentum - expected).norm() / expected.norm()).item() < FP32_TOLERANCE


def test_a_stack_keeps_the_plain_models_key_and_shape_in_every_state_dict(pool4):
    results = pool4.run(scenarios.state_dict_layout)
    plain = {name: tuple(p.shape) for name, p in MoEDecoder().named_parameters()}
    assert results[0]["full_model"] == plain
    assert results[0]["full_momentum"] == {stack: plain[stack] for stack in STACKS}
    for rank, result in enumerate(results):
        # Sharded: each rank holds its own two experts of every stack, in a DTensor of the
        # stack's full shape.
        expected = {
            stack: ("DTensor", plain[stack], [(2 * rank, 2 * rank + 2)]) for stack in STACKS
        }
        assert result["sharded_model"] == expected
        assert result["sharded_momentum"] == {stack: [(2 * rank, 2 * rank + 2)] for stack in STACKS}
        assert all(stack in result["groups"][0] for stack in STACKS)
        assert not any("[" in name for group in result["groups"] for name in group)


# ---- the routing table and errors -----------------------------------------------------------


def test_the_routing_table_of_an_moe_model_shows_each_stack_with_its_slices_owners(pool4):
    from dmuon_tools import format_routing_table

    rows = pool4.run(scenarios.train_against_reference, steps=1)[0]["routing"]
    by_name = {row.fqn: row for row in rows}
    for stack in STACKS:
        row = by_name[stack]
        assert row.route == "muon" and row.why == "predicate"
        assert [(s.start, s.stop) for s in row.owner_rank] == [(0, 2), (2, 4), (4, 6), (6, 8)]
        assert sorted(s.rank for s in row.owner_rank) == [0, 1, 2, 3]
    owners = " ".join(str(s) for s in by_name["layers.0.w_in"].owner_rank)
    text = " ".join(format_routing_table(rows).split())
    assert f"layers.0.w_in 8x36x20 muon {owners} 0.02 0.01 predicate" in text
    assert by_name["layers.0.router.weight"].route == "sharded_adamw"


def test_a_dtensor_stack_and_a_sharded_value_of_another_layout_raise_with_the_fix(pool2):
    messages = pool2.run(scenarios.error_messages)[0]
    assert messages["dtensor"] == (
        "dedicate_params: moe.w of shape (4, 6, 5) is an expert stack and a DTensor on mesh dims "
        "('tp',) with placements (Shard(dim=1),). dmuon dedicates a DTensor stack only when it is "
        "expert-parallel: Shard(0) over the ep_mesh given to dedicate_params (none was given); "
        "tensor-parallel expert stacks are not dedicated yet. Otherwise leave it out of the "
        "predicate (FSDP2 and AdamW keep it), or make expert_stacks= return False for it (one "
        "matrix, trailing dims flattened into columns)."
    )
    assert messages["other_layout"] == (
        "dmuon.checkpoint: the sharded value given for layers.0.w_in holds no shard of experts "
        "[4, 8) on this rank; load sharded checkpoints into the state dict "
        "dmuon.checkpoint.get_state_dict returns on this layout, or pass a full tensor."
    )


def test_inspect_and_the_parameter_summary_show_a_stack_with_the_owner_of_each_slice(pool4):
    results = pool4.run(scenarios.train_against_reference, steps=1)
    for rank, result in enumerate(results):
        view = result["stack_view"]
        assert view.shape == (NUM_EXPERTS, HIDDEN, DIM)
        assert view.experts == ((0, 2), (2, 4), (4, 6), (6, 8))
        assert view.pieces == tuple(f"layers.0.w_in[{s}:{e}]" for s, e in view.experts)
        summary = result["summary"]
        assert (summary["route"], summary["dedicated"], summary["shape"]) == (
            "muon",
            True,
            [NUM_EXPERTS, HIDDEN, DIM],
        )
        slices = summary["expert_slices"]
        assert [entry["experts"] for entry in slices] == [[0, 2], [2, 4], [4, 6], [6, 8]]
        assert [entry["owner_rank"] for entry in slices if entry["is_owner"]] == [rank]
        assert summary["group"] == 0 and summary["master_dtype"] == "float32"


@pytest.mark.parametrize(
    ("replicas", "reshard_after_forward", "broadcasts_per_step"),
    [(1, True, 2), (1, False, 1), (2, True, 2)],
    ids=["z3-1d", "z2-1d", "z3-hsdp-2x2"],
)
def test_a_stack_moves_exactly_the_bytes_of_its_expert_pieces(
    pool4, replicas, reshard_after_forward, broadcasts_per_step
):
    """Each expert range travels once per broadcast and once per reduce (plus its flag), as any
    dedicated matrix does: assembling the stack and splitting its gradient cost no traffic."""
    results = pool4.run(
        scenarios.count_step_communication,
        replicas=replicas,
        reshard_after_forward=reshard_after_forward,
    )
    shards = 4 // replicas
    numels = results[0]["numels"]
    assert sum(numels) == len(STACKS) * NUM_EXPERTS * HIDDEN * DIM + PROJECTIONS * DIM * DIM
    weights = sum(numels) * 4
    messages = sum(message_entry(n) for n in numels) * 4  # per piece
    broadcast = broadcasts_per_step * replicas * (shards - 1) * weights + (replicas - 1) * weights
    reduce = replicas * (shards - 1) * messages + (replicas - 1) * messages
    assert sum(r["broadcast_received"] for r in results) == broadcast
    assert sum(r["reduce_sent"] for r in results) == reduce


def test_expert_stacks_that_differ_between_ranks_raise_on_every_rank(pool2):
    for message in pool2.run(scenarios.rank_dependent_expert_stacks):
        assert message.startswith("dmuon: ranks [1] use different expert stacks (expert_stacks=)")
        assert "layers.0.w_in" in message
