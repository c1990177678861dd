"""Expert parallelism on gloo: expert stacks split over an ``ep`` dim, owned inside their group.

The tiny MoE decoder with its experts split over ep (a real all-to-all token dispatch, see
``models_moe``) is dedicated with ``dedicate_params(..., ep_mesh=, expert_mesh=)``: ep=2 x
efsdp=2 on 4 ranks (DTensor stacks as torchtitan's ``ExpertParallel`` makes them, and plain
local stacks) and ep=2 with HSDP replicas. Each expert piece is owned by a rank of its EP slot,
its broadcasts and reduces stay among the ranks of that slot, and the gradients its owner
receives are the single-process reference's on the full model, also for experts that got no
token.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import scenarios_expert_parallel as scenarios
from tests.distributed.models_moe import DIM, HIDDEN, NUM_EXPERTS
from tests.distributed.test_protocol import message_entry

FP32_TOLERANCE = 1e-5  # only the order of float additions differs from the reference
STACKS = ("layers.0.w_in", "layers.0.w_out", "layers.1.w_in", "layers.1.w_out")
PROJECTIONS = ("layers.0.q_proj.weight", "layers.1.q_proj.weight")


def ep_slot_of(rank: int, ep: int = 2) -> int:
    """torchtitan's layout: the ep dim varies fastest, so EP slot e is ranks e, e + ep, ..."""
    return rank % ep


def first_expert_of(piece: str) -> int:
    return int(piece.split("[")[1].split(":")[0])


def assert_gradients_match(results):
    for rank, result in enumerate(results):
        assert result["errors"], f"rank {rank} owns nothing"
        worst = max(result["errors"].values())
        assert worst < FP32_TOLERANCE, f"rank {rank}: max relative error {worst:.3e}"
    owned = sorted(name for result in results for name in result["owned"])
    # Every expert of every stack and every projection has exactly one owner.
    assert owned == sorted(
        [f"{stack}[{start}:{start + 2}]" for stack in STACKS for start in range(0, 8, 2)]
        + list(PROJECTIONS)
    )


@pytest.mark.parametrize("as_dtensor", [True, False], ids=["dtensor-stacks", "local-stacks"])
def test_ep2_x_efsdp2_owners_receive_the_reference_gradients_of_their_experts(pool4, as_dtensor):
    results = pool4.run(scenarios.gradients_against_reference, as_dtensor=as_dtensor)
    assert_gradients_match(results)
    for rank, result in enumerate(results):
        slot = ep_slot_of(rank)
        # This rank holds its EP slot's four experts of every stack, as two pieces of two.
        assert result["pieces"] == sorted(
            [f"{stack}[{s}:{s + 2}]" for stack in STACKS for s in (4 * slot, 4 * slot + 2)]
            + list(PROJECTIONS)
        )
        for piece in result["owned"]:
            if "[" in piece:
                assert first_expert_of(piece) // 4 == slot, f"rank {rank} owns {piece}"
        # dmuon.inspect shows each expert segment rooted in this rank's EP slot, and every
        # slice at the owner the owner map names.
        for root, parts in result["segments"]:
            for owner_rank, params in parts:
                assert all(result["owners"][name] == owner_rank for name in params)
                if any("[" in name for name in params):
                    assert ep_slot_of(root) == slot
    owners = results[0]["owners"]
    for stack in STACKS:  # EP slot 0 is ranks 0 and 2, slot 1 ranks 1 and 3: one piece each
        assert {owners[f"{stack}[{s}:{s + 2}]"] for s in (0, 2)} == {0, 2}
        assert {owners[f"{stack}[{s}:{s + 2}]"] for s in (4, 6)} == {1, 3}


def test_ep2_with_hsdp_replicas_owns_each_ep_slots_experts_across_its_replicas(pool4):
    """2 replicas x (ep=2, efsdp=1): an EP slot's two pieces of a stack go to its two replicas."""
    results = pool4.run(scenarios.gradients_against_reference, replicas=2)
    assert_gradients_match(results)
    owners = results[0]["owners"]
    for stack in STACKS:  # dense (replicate, shard): rank = 2 * replica + shard
        assert {owners[f"{stack}[{s}:{s + 2}]"] for s in (0, 2)} == {0, 2}
        assert {owners[f"{stack}[{s}:{s + 2}]"] for s in (4, 6)} == {1, 3}


@pytest.mark.parametrize(
    "options",
    [
        {"reshard_after_forward": False},
        {"ep": 4},
        {"meta": True},
        {"meta": True, "as_dtensor": False},
    ],
    ids=["z2-ep2-x-efsdp2", "ep4-without-expert-fsdp", "meta-dtensor-stacks", "meta-local-stacks"],
)
def test_expert_parallel_gradients_match_the_reference_on_every_path(pool4, options):
    """Z2 keeps the broadcast experts through backward; ep=4 on 4 ranks gives every rank its
    own two experts of each stack, owned there with no expert collective at all; a model built
    on the meta device is adopted from the weights written after ``to_empty``."""
    results = pool4.run(scenarios.gradients_against_reference, **options)
    assert_gradients_match(results)
    if options.get("ep") == 4:
        for rank, result in enumerate(results):
            assert [p for p in result["owned"] if "[" in p] == sorted(
                f"{stack}[{2 * rank}:{2 * rank + 2}]" for stack in STACKS
            )


def test_experts_that_get_no_token_get_the_references_zero_gradient(pool4):
    """Experts 1, 2 and 5 are routed no token on any rank (the others get uneven shares): their
    owners still receive a gradient, zero, as one process has for an unused slice."""
    results = pool4.run(scenarios.gradients_against_reference, blocked={0: (1, 2, 5)})
    assert_gradients_match(results)
    zero = {}
    for result in results:
        for stack, experts in result["zero_experts"].items():
            zero.setdefault(stack, []).extend(experts)
    # w_out's unused experts take no gradient; w_in feeds every expert through one bmm, whose
    # rows for unrouted tokens are unused too.
    assert {stack: sorted(experts) for stack, experts in zero.items()} == {
        stack: [1, 2, 5] for stack in STACKS
    }


def test_expert_broadcasts_and_reduces_stay_inside_the_ep_slots_ranks(pool4):
    """One Z3 forward and backward on ep=2 x efsdp=2: every expert byte moves on the two ranks
    of its EP slot, the projections on all four, and the tokens through the model's
    all-to-all."""
    results = pool4.run(scenarios.count_step_communication)
    expert_bytes = len(STACKS) * NUM_EXPERTS * HIDDEN * DIM * 4
    piece_messages = len(STACKS) * (NUM_EXPERTS // 2) * message_entry(2 * HIDDEN * DIM) * 4
    projection_bytes = len(PROJECTIONS) * DIM * DIM * 4
    projection_messages = len(PROJECTIONS) * message_entry(DIM * DIM) * 4
    received = {"expert": 0, "dense": 0}
    sent = {"expert": 0, "dense": 0}
    for rank, result in enumerate(results):
        expert_group = (ep_slot_of(rank), ep_slot_of(rank) + 2)
        assert result["all_to_all"] > 0
        for kind, group, nbytes, is_root in result["calls"]:
            assert group in (expert_group, (0, 1, 2, 3)), f"rank {rank}: {kind} on {group}"
            which = "expert" if group == expert_group else "dense"
            if not is_root:
                (received if kind == "broadcast" else sent)[which] += nbytes
    # Z3: two broadcasts (forward, backward), each piece received by the other rank of its slot.
    assert received == {"expert": 2 * expert_bytes, "dense": 2 * 3 * projection_bytes}
    assert sent == {"expert": piece_messages, "dense": 3 * projection_messages}


@pytest.mark.parametrize(
    ("cpu_offload", "replicas"),
    [(True, 1), (False, 1), (True, 2)],
    ids=["first-rank-ep2-x-efsdp2", "every-rank-ep2-x-efsdp2", "first-rank-ep2-hsdp"],
)
def test_a_full_state_dict_of_an_ep_model_holds_every_expert_of_every_ep_slot(
    pool4, cpu_offload, replicas
):
    """Each stack's entry has the plain model's (E, m, n) shape and value: the pieces of both EP
    slots, each gathered from its owner."""
    results = pool4.run(scenarios.full_model_state, cpu_offload=cpu_offload, replicas=replicas)
    holders = [0] if cpu_offload else range(4)
    for rank in holders:
        full, plain = results[rank]["full"], results[rank]["plain"]
        assert full.keys() == plain.keys()
        for name, value in plain.items():
            assert torch.equal(full[name], value), (rank, name)
    if cpu_offload:
        assert all(result["full"] == {} for result in results[1:])


def test_expert_parallel_setup_errors_say_what_was_wrong_and_the_fix(pool4):
    messages = pool4.run(scenarios.error_messages)[0]
    assert messages["no_ep_mesh"] == (
        "dedicate_params: layers.0.w_in of shape (8, 36, 20) is an expert stack and a DTensor on "
        "mesh dims ('ep',) with placements (Shard(dim=0),). If it is expert-parallel (its experts "
        "split over this mesh), pass that dim and the expert-FSDP dim: dedicate_params(..., "
        "ep_mesh=mesh['ep'], expert_mesh=mesh['efsdp']). Otherwise leave it out of the predicate "
        "(FSDP2 and AdamW keep it), or make expert_stacks= return False for it (one matrix, "
        "trailing dims flattened into columns)."
    )
    assert messages["same_dims"].startswith(
        "dedicate_params: expert parallelism: ep_mesh (ranks [0, 1]) and expert_mesh (ranks "
        "[0, 1]) are the same dim or overlapping dims.\nPass the ep dim and the expert-FSDP dim"
    )
    assert messages["one_dim"].startswith(
        "dedicate_params: expert parallelism: ep_mesh was given without expert_mesh; expert "
        "parallelism needs both.\n"
    )
