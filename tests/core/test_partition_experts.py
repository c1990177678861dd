"""The partition of mixture-of-experts stacks: an (E, m, n) spec is cut into expert slices that
LPT places like any other unit (see [Note: expert stacks] in ``dmuon.partition``)."""

import math
import random

import pytest

from dmuon.partition import (
    OwnerCoord,
    ParamSpec,
    expert_parallel_groups,
    expert_piece_name,
    expert_slices,
    ns_cost,
    plan_ownership,
)


def moe_specs(num_layers, experts, hidden, ffn, *, attention=True):
    """A Mixtral-like model: per layer, attention projections and three (E, m, n) stacks."""
    specs = []
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        if attention:
            specs += [
                ParamSpec(
                    name=f"{layer}.attn.q_proj.weight", shape=(hidden, hidden), layer_id=layer
                ),
                ParamSpec(
                    name=f"{layer}.attn.o_proj.weight", shape=(hidden, hidden), layer_id=layer
                ),
            ]
        specs += [
            ParamSpec(name=f"{layer}.moe.{w}", shape=shape, layer_id=layer, expert_stack=True)
            for w, shape in (
                ("w1", (experts, ffn, hidden)),
                ("w3", (experts, ffn, hidden)),
                ("w2", (experts, hidden, ffn)),
            )
        ]
    return specs


@pytest.mark.parametrize(
    ("num_experts", "num_slots", "expected"),
    [
        (8, 4, ((0, 2), (2, 4), (4, 6), (6, 8))),
        (8, 3, ((0, 3), (3, 6), (6, 8))),
        (3, 8, ((0, 1), (1, 2), (2, 3))),
        (5, 1, ((0, 5),)),
        (7, 7, tuple((e, e + 1) for e in range(7))),
    ],
)
def test_expert_slices_are_contiguous_ranges_of_sizes_differing_by_at_most_one(
    num_experts, num_slots, expected
):
    assert expert_slices(num_experts, num_slots) == expected


def test_a_stack_of_eight_experts_on_four_owners_gives_two_experts_to_each_owner():
    spec = ParamSpec(
        name="layers.0.moe.w1", shape=(8, 64, 32), layer_id="layers.0", expert_stack=True
    )
    plan = plan_ownership([spec], 4)
    assert plan.expert_slices == {"layers.0.moe.w1": ((0, 2), (2, 4), (4, 6), (6, 8))}
    owners = {name: owner.shard for name, owner in plan.owners.items()}
    assert list(owners) == [expert_piece_name("layers.0.moe.w1", e, e + 2) for e in (0, 2, 4, 6)]
    assert sorted(owners.values()) == [0, 1, 2, 3]
    assert plan.loads == (2 * ns_cost((64, 32)),) * 4
    assert plan.imbalance == 1.0


def test_small_stacks_are_spread_even_below_the_small_parameter_packing_size():
    """A layer's small matrices share one owner; its expert slices do not join that unit."""
    specs = [
        ParamSpec(name="layers.0.q.weight", shape=(16, 16), layer_id="layers.0"),
        ParamSpec(name="layers.0.o.weight", shape=(16, 16), layer_id="layers.0"),
        ParamSpec(name="layers.0.moe.w1", shape=(3, 16, 8), layer_id="layers.0", expert_stack=True),
    ]
    plan = plan_ownership(specs, 4)
    packed = [unit for unit in plan.units if "layers.0.q.weight" in unit.names]
    assert packed[0].names == ("layers.0.q.weight", "layers.0.o.weight")
    slice_owners = {plan.owners[f"layers.0.moe.w1[{e}:{e + 1}]"] for e in range(3)}
    assert len(slice_owners | {packed[0].owner}) == 4  # the layer's 4 units on 4 owners


def test_a_three_dimensional_spec_without_the_flag_is_one_flattened_matrix():
    spec = ParamSpec(name="conv.weight", shape=(8, 4, 3), layer_id=None)
    plan = plan_ownership([spec], 4)
    assert list(plan.owners) == ["conv.weight"]
    assert plan.units[0].cost == ns_cost((8, 12))
    assert plan.expert_slices == {}


@pytest.mark.parametrize(("num_shards", "num_replicas"), [(4, 1), (8, 1), (2, 2), (4, 4)])
def test_moe_model_partition_is_balanced_within_the_lpt_bound(num_shards, num_replicas):
    specs = moe_specs(num_layers=6, experts=8, hidden=512, ffn=1408)
    plan = plan_ownership(specs, num_shards, num_replicas)
    slots = num_shards * num_replicas
    total = math.fsum(plan.loads)
    largest = max(unit.cost for unit in plan.units)
    assert max(plan.loads) <= total / slots + largest
    # Every expert of every stack has exactly one owner, through exactly one slice.
    for spec in specs:
        if spec.expert_stack:
            ranges = plan.expert_slices[spec.name]
            assert [e for start, stop in ranges for e in range(start, stop)] == list(range(8))
            for start, stop in ranges:
                owner = plan.owners[expert_piece_name(spec.name, start, stop)]
                assert isinstance(owner, OwnerCoord)
                assert owner.shard < num_shards and owner.replicate < num_replicas


def test_one_stack_is_spread_over_every_owner_where_its_experts_balance():
    """A model of one (16, m, n) stack on 8 owners: 2 experts on each, perfectly balanced."""
    spec = ParamSpec(name="moe.w", shape=(16, 256, 128), layer_id=None, expert_stack=True)
    plan = plan_ownership([spec], 4, 2)
    assert len(set(plan.owners.values())) == 8
    assert plan.imbalance == 1.0


def test_expert_slices_and_owners_do_not_depend_on_spec_order():
    specs = moe_specs(num_layers=4, experts=6, hidden=256, ffn=704)
    reference = plan_ownership(specs, 4)
    shuffled = list(specs)
    random.Random(3).shuffle(shuffled)
    plan = plan_ownership(shuffled, 4)
    assert dict(plan.owners) == dict(reference.owners)
    assert plan.expert_slices == reference.expert_slices


def test_owners_list_a_stack_as_its_slices_in_input_order():
    specs = [
        ParamSpec(name="a.weight", shape=(8, 8), layer_id=None),
        ParamSpec(name="moe.w", shape=(3, 8, 4), layer_id=None, expert_stack=True),
        ParamSpec(name="b.weight", shape=(8, 8), layer_id=None),
    ]
    plan = plan_ownership(specs, 2)
    assert list(plan.owners) == ["a.weight", "moe.w[0:2]", "moe.w[2:3]", "b.weight"]
    assert "1 expert stacks in 2 slices" in plan.describe()


def test_an_expert_stack_spec_that_is_not_three_dimensional_is_refused_with_the_shape():
    with pytest.raises(ValueError) as error:
        ParamSpec(name="w", shape=(8, 4), layer_id=None, expert_stack=True)
    assert str(error.value) == (
        "ParamSpec 'w': expert_stack=True needs a 3-D shape (num_experts, m, n), got (8, 4); "
        "set expert_stack=False for other shapes"
    )


# ---- expert parallelism ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_shards", "num_replicas", "num_ep", "expected"),
    [
        (4, 1, 2, ((0, 2), (1, 3))),
        (2, 2, 2, ((0, 2), (1, 3))),
        (4, 2, 2, ((0, 2, 4, 6), (1, 3, 5, 7))),
        (4, 1, 4, ((0,), (1,), (2,), (3,))),
        (4, 1, 1, ((0, 1, 2, 3),)),
    ],
)
def test_expert_parallel_groups_follow_torchtitans_layout_with_ep_varying_fastest(
    num_shards, num_replicas, num_ep, expected
):
    assert expert_parallel_groups(num_shards, num_replicas, num_ep) == expected


def owner_slot(plan, name):
    return plan.slot_of(plan.owners[name])


@pytest.mark.parametrize(
    ("num_shards", "num_replicas", "num_ep"), [(4, 1, 2), (2, 2, 2), (8, 1, 4), (4, 2, 2)]
)
def test_under_expert_parallelism_each_slice_is_owned_inside_its_ep_slot(
    num_shards, num_replicas, num_ep
):
    specs = moe_specs(num_layers=4, experts=8, hidden=256, ffn=704)
    groups = expert_parallel_groups(num_shards, num_replicas, num_ep)
    plan = plan_ownership(specs, num_shards, num_replicas, expert_groups=groups)
    assert plan.num_ep == num_ep and plan.expert_groups == groups
    per_slot = 8 // num_ep
    for spec in specs:
        if not spec.expert_stack:
            continue
        ranges = plan.expert_slices[spec.name]
        assert [e for start, stop in ranges for e in range(start, stop)] == list(range(8))
        for ep, slots in enumerate(groups):
            first, last = plan.ep_experts(spec.name, ep)
            assert (first, last) == (ep * per_slot, (ep + 1) * per_slot)
            mine = [(start, stop) for start, stop in ranges if first <= start < last]
            assert all(stop <= last for _, stop in mine)
            assert len(mine) == min(per_slot, len(slots))
            for start, stop in mine:
                assert owner_slot(plan, expert_piece_name(spec.name, start, stop)) in slots


def test_the_owners_inside_each_ep_slot_are_balanced():
    """Stacks only, 16 experts on ep=2 x efsdp=4: each EP slot's 8 experts give 2 to each of its
    4 owners, every owner carries the same load."""
    specs = [
        ParamSpec(
            name=f"layers.{i}.moe.w", shape=(16, 64, 32), layer_id=f"layers.{i}", expert_stack=True
        )
        for i in range(3)
    ]
    plan = plan_ownership(specs, 8, expert_groups=expert_parallel_groups(8, 1, 2))
    assert plan.imbalance == 1.0
    assert plan.loads == (3 * 2 * ns_cost((64, 32)),) * 8


def test_non_expert_matrices_keep_the_whole_grid_and_fill_around_the_pinned_slices():
    """One heavy dense matrix and a stack on ep=2: the dense matrix takes an owner of either EP
    slot and the experts of that slot go to its other owner."""
    specs = [
        ParamSpec(name="dense.weight", shape=(256, 256), layer_id=None),
        ParamSpec(name="moe.w", shape=(4, 64, 64), layer_id=None, expert_stack=True),
    ]
    plan = plan_ownership(specs, 4, expert_groups=expert_parallel_groups(4, 1, 2))
    dense = owner_slot(plan, "dense.weight")
    assert dense == 0
    # EP slot 0 (slots 0, 2) keeps its two experts off the dense matrix's slot.
    assert owner_slot(plan, "moe.w[0:1]") == 2 and owner_slot(plan, "moe.w[1:2]") == 2
    assert {owner_slot(plan, "moe.w[2:3]"), owner_slot(plan, "moe.w[3:4]")} == {1, 3}


@pytest.mark.parametrize("seed", range(20))
def test_random_models_under_expert_parallelism_pin_every_slice_and_keep_the_lpt_bound(seed):
    rng = random.Random(seed)
    num_ep = rng.choice([1, 2, 4])
    num_shards = num_ep * rng.choice([1, 2, 3])
    num_replicas = rng.choice([1, 2])
    experts = num_ep * rng.choice([1, 2, 3])
    specs = []
    for i in range(rng.randint(1, 5)):
        layer = f"layers.{i}"
        specs.append(
            ParamSpec(name=f"{layer}.q.weight", shape=(rng.randint(4, 96),) * 2, layer_id=layer)
        )
        specs.append(
            ParamSpec(
                name=f"{layer}.moe.w",
                shape=(experts, rng.randint(4, 64), rng.randint(4, 64)),
                layer_id=layer,
                expert_stack=True,
            )
        )
    groups = expert_parallel_groups(num_shards, num_replicas, num_ep)
    plan = plan_ownership(
        specs, num_shards, num_replicas, small_param_numel=0, expert_groups=groups
    )
    group_of = {slot: ep for ep, slots in enumerate(groups) for slot in slots}
    for spec in specs:
        if spec.expert_stack:
            for start, stop in plan.expert_slices[spec.name]:
                ep = start // (experts // num_ep)
                assert group_of[owner_slot(plan, expert_piece_name(spec.name, start, stop))] == ep
    # Every unit went to the least-loaded slot it could take when placed: the heaviest owner
    # exceeds the lightest owner of its own group by at most the largest unit.
    largest = max(unit.cost for unit in plan.units)
    for slots in groups:
        loads = [plan.loads[slot] for slot in slots]
        assert max(loads) - min(loads) <= largest
    shuffled = list(specs)
    rng.shuffle(shuffled)
    again = plan_ownership(
        shuffled, num_shards, num_replicas, small_param_numel=0, expert_groups=groups
    )
    assert dict(again.owners) == {name: plan.owners[name] for name in again.owners}
    assert set(again.owners) == set(plan.owners)


@pytest.mark.parametrize(
    ("expert_groups", "problem"),
    [
        ([[0, 2], [1]], "its groups differ in size ([2, 1])"),
        ([[0, 1], [1, 2]], "a slot is in two groups (or twice in one)"),
        ([[0, 4], [1, 3]], "it names slots outside the grid's 0..3"),
        ([], "it is empty or holds an empty group"),
    ],
)
def test_expert_groups_that_do_not_split_the_grid_are_refused_with_the_problem(
    expert_groups, problem
):
    spec = ParamSpec(name="moe.w", shape=(4, 8, 8), layer_id=None, expert_stack=True)
    with pytest.raises(ValueError) as error:
        plan_ownership([spec], 4, expert_groups=expert_groups)
    assert str(error.value) == (
        f"plan_ownership: expert_groups={expert_groups} is not a split of the 4 owner slots into "
        f"EP slots: {problem}; pass one group of owner slots per EP slot, all of one size "
        "(expert_parallel_groups gives torchtitan's)"
    )


def test_a_stack_whose_experts_do_not_split_evenly_over_ep_is_refused():
    spec = ParamSpec(name="moe.w", shape=(6, 8, 8), layer_id=None, expert_stack=True)
    with pytest.raises(ValueError) as error:
        plan_ownership([spec], 4, expert_groups=expert_parallel_groups(4, 1, 4))
    assert str(error.value) == (
        "plan_ownership: expert stack 'moe.w' has 6 experts, not a multiple of the "
        "expert-parallel degree 4; each EP slot must hold as many experts as the others (the "
        "model's experts are split evenly over ep)"
    )


def test_expert_parallel_groups_refuse_an_ep_degree_that_does_not_divide_the_shards():
    with pytest.raises(ValueError) as error:
        expert_parallel_groups(6, 1, 4)
    assert str(error.value) == (
        "expert_parallel_groups: num_ep=4 does not divide num_shards=6; the ep dim splits the "
        "shard dim, so pass an ep degree that divides it"
    )
