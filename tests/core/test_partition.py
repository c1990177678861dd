"""The ownership partition: layer ids, cost model, units, global LPT placement, validation."""

import math
import random

import pytest

from dmuon.partition import (
    OwnerCoord,
    ParamSpec,
    layer_id_of,
    make_param_specs,
    ns_cost,
    param_cost,
    plan_ownership,
)

# --- model shapes (weights are (out, in)) ---------------------------------------------------


def llama_named_shapes(num_layers, hidden, kv_dim, ffn, *, norms=True):
    shapes = []
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        shapes += [
            (prefix + "self_attn.q_proj.weight", (hidden, hidden)),
            (prefix + "self_attn.k_proj.weight", (kv_dim, hidden)),
            (prefix + "self_attn.v_proj.weight", (kv_dim, hidden)),
            (prefix + "self_attn.o_proj.weight", (hidden, hidden)),
            (prefix + "mlp.gate_proj.weight", (ffn, hidden)),
            (prefix + "mlp.up_proj.weight", (ffn, hidden)),
            (prefix + "mlp.down_proj.weight", (hidden, ffn)),
        ]
        if norms:
            shapes += [
                (prefix + "input_layernorm.weight", (hidden,)),
                (prefix + "post_attention_layernorm.weight", (hidden,)),
            ]
    return shapes


LLAMA_3_8B = dict(num_layers=32, hidden=4096, kv_dim=1024, ffn=14336)
LLAMA_3_70B = dict(num_layers=80, hidden=8192, kv_dim=1024, ffn=28672)
MODELS = {"llama-3-8b": LLAMA_3_8B, "llama-3-70b": LLAMA_3_70B}
# (num_shards, num_replicas): 8, 64 and 512 slots, and the same sizes as HSDP grids.
GRIDS = [(8, 1), (64, 1), (512, 1), (8, 8), (4, 2), (64, 8)]


def llama_specs(model, *, norms=True):
    return make_param_specs(llama_named_shapes(**MODELS[model], norms=norms))


def lower_bound(plan):
    """max(total/S, c1, c_S + c_{S+1}) over unit costs c sorted descending."""
    costs = sorted((unit.cost for unit in plan.units), reverse=True)
    slots = plan.num_slots
    bound = max(math.fsum(costs) / slots, costs[0])
    if len(costs) > slots:
        bound = max(bound, costs[slots - 1] + costs[slots])
    return bound


# --- layer ids ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "layer_id"),
    [
        ("model.layers.3.self_attn.q_proj.weight", "model.layers.3"),
        ("visual.blocks.5.attn.qkv.weight", "visual.blocks.5"),
        ("encoder.layer.2.attention.self.query.weight", "encoder.layer.2"),
        ("transformer.h.7.mlp.c_fc.weight", "transformer.h.7"),
        ("model.layers.12.mlp.down_proj.weight", "model.layers.12"),
        ("lm_head.weight", None),
        ("model.embed_tokens.weight", None),
        ("model.norm.weight", None),
    ],
)
def test_layer_id_of_finds_the_block_of_each_name_family(name, layer_id):
    assert layer_id_of(name) == layer_id


def test_t5_sublayers_resolve_to_their_enclosing_block():
    assert layer_id_of("block.1.layer.0.SelfAttention.q.weight") == "block.1"
    assert layer_id_of("encoder.block.1.layer.1.DenseReluDense.wi.weight") == "encoder.block.1"
    assert layer_id_of("decoder.block.0.layer.2.DenseReluDense.wo.weight") == "decoder.block.0"


def test_nested_stages_resolve_to_the_innermost_block():
    name = "swin.encoder.layers.0.blocks.1.attention.self.query.weight"
    assert layer_id_of(name) == "swin.encoder.layers.0.blocks.1"


def test_layer_id_needs_whole_components_and_an_ancestor_module():
    assert layer_id_of("model.mylayers.3.weight") is None
    assert layer_id_of("model.layers.3x.weight") is None
    assert layer_id_of("model.layers.weight") is None
    # A parameter stored directly in a ParameterList has no ancestor block.
    assert layer_id_of("model.layers.3") is None


def test_layer_id_fn_result_replaces_the_default_rule():
    def by_expert(name):
        return "experts" if ".experts." in name else None

    assert layer_id_of("model.layers.0.mlp.experts.3.w1", by_expert) == "experts"
    assert layer_id_of("model.layers.0.self_attn.q_proj.weight", by_expert) is None


def test_layer_id_fn_returning_a_non_string_is_rejected_with_the_fix():
    with pytest.raises(TypeError) as error:
        layer_id_of("model.layers.0.q.weight", lambda name: 3)
    message = str(error.value)
    assert "layer_id_fn('model.layers.0.q.weight') returned 3 (int)" in message
    assert "as a str (e.g. 'model.layers.3') or None" in message


# --- cost model -----------------------------------------------------------------------------


def test_ns_cost_follows_the_formula_and_ignores_orientation():
    assert ns_cost((1024, 4096)) == 6 * 1024**2 * 4096 + 14 * 1024**3
    assert ns_cost((4096, 1024)) == ns_cost((1024, 4096))
    assert ns_cost((4096, 4096)) == 20 * 4096**3


def test_ns_cost_flattens_trailing_dims_into_columns():
    assert ns_cost((64, 3, 3, 3)) == ns_cost((64, 27))
    assert ns_cost((8, 4, 32)) == ns_cost((8, 128))


def test_ns_cost_of_a_row_vector_matrix_is_linear_in_its_length():
    assert ns_cost((1, 5000)) == 6 * 5000 + 14


def test_ns_cost_rejects_vectors_and_points_to_param_cost():
    with pytest.raises(ValueError) as error:
        ns_cost((4096,))
    assert "ns_cost needs a matrix shape (2 or more dims), got (4096,)" in str(error.value)
    assert "use param_cost" in str(error.value)


def test_param_cost_uses_numel_for_vectors_and_ns_cost_for_matrices():
    assert param_cost((4096,)) == 4096
    assert param_cost((1024, 4096)) == ns_cost((1024, 4096))


# --- balance and spreading on real model shapes ---------------------------------------------


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize(("num_shards", "num_replicas"), GRIDS)
def test_heaviest_owner_is_within_5_percent_of_the_lower_bound(model, num_shards, num_replicas):
    plan = plan_ownership(llama_specs(model), num_shards, num_replicas)
    assert max(plan.loads) <= 1.05 * lower_bound(plan)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize(("num_shards", "num_replicas"), GRIDS)
def test_same_layer_matrices_land_on_distinct_owners(model, num_shards, num_replicas):
    # 7 matrices per layer; S >= 8 everywhere here.
    plan = plan_ownership(llama_specs(model, norms=False), num_shards, num_replicas)
    assert plan.crowded_layers == ()
    by_layer = {}
    for name, owner in plan.owners.items():
        unit_owners = by_layer.setdefault(layer_id_of(name), {})
        unit_owners.setdefault(owner, []).append(name)
    for layer, owners in by_layer.items():
        shared = {owner: names for owner, names in owners.items() if len(names) > 1}
        # Only small parameters packed into one unit may share an owner.
        for names in shared.values():
            assert all(n.endswith(("k_proj.weight", "v_proj.weight")) for n in names), (
                layer,
                names,
            )


@pytest.mark.parametrize(("num_shards", "num_replicas"), [(8, 1), (2, 4)])
def test_layer_units_including_packed_norms_spread_when_slots_equal_units(num_shards, num_replicas):
    # Llama-3-70B with norms: 8 units per layer on exactly 8 slots.
    plan = plan_ownership(llama_specs("llama-3-70b"), num_shards, num_replicas)
    assert plan.crowded_layers == ()
    assert max(plan.loads) <= 1.05 * lower_bound(plan)


def plain_lpt(plan):
    """Reference: the same units, heaviest first (ties by smallest name), on the least-loaded
    slot (ties by lowest slot), with no layer spreading."""
    loads = [0.0] * plan.num_slots
    crowded = set()
    seen = set()
    for unit in sorted(plan.units, key=lambda u: (-u.cost, min(u.names))):
        slot = min(range(plan.num_slots), key=lambda s: (loads[s], s))
        loads[slot] += unit.cost
        if unit.layer_id is not None:
            if (unit.layer_id, slot) in seen:
                crowded.add(unit.layer_id)
            seen.add((unit.layer_id, slot))
    return max(loads), crowded


@pytest.mark.parametrize("seed", range(12))
def test_spreading_never_makes_the_heaviest_owner_heavier_than_plain_lpt(seed):
    rng = random.Random(seed)
    num_layers = rng.randint(1, 12)
    named_shapes = [
        (
            f"blocks.{rng.randrange(num_layers)}.w{i}.weight",
            (rng.choice([1, 16, 64, 96, 128]), rng.choice([16, 64, 128, 256])),
        )
        for i in range(rng.randint(1, 80))
    ]
    num_shards, num_replicas = rng.choice([(1, 1), (2, 1), (3, 1), (8, 1), (4, 2), (16, 1)])
    plan = plan_ownership(
        make_param_specs(named_shapes), num_shards, num_replicas, small_param_numel=4096
    )
    lpt_heaviest, lpt_crowded = plain_lpt(plan)
    assert max(plan.loads) <= lpt_heaviest
    assert set(plan.crowded_layers) <= lpt_crowded
    assert math.fsum(plan.loads) == pytest.approx(math.fsum(u.cost for u in plan.units))


def test_loads_add_up_to_the_cost_of_every_parameter():
    named_shapes = llama_named_shapes(**LLAMA_3_8B)
    plan = plan_ownership(make_param_specs(named_shapes), 8, 8)
    expected = math.fsum(param_cost(shape) for _, shape in named_shapes)
    assert math.fsum(plan.loads) == pytest.approx(expected, rel=1e-12)
    for slot, load in enumerate(plan.loads):
        owner = plan.owner_of_slot(slot)
        on_slot = math.fsum(unit.cost for unit in plan.units if unit.owner == owner)
        assert load == pytest.approx(on_slot, rel=1e-12)


def test_small_params_of_a_layer_share_one_unit_and_one_owner():
    # In Llama-3-8B k/v (1024x4096 = 4.2M elements) and the norms are small.
    plan = plan_ownership(llama_specs("llama-3-8b"), 8)
    assert len(plan.units) == 32 * 6
    prefix = "model.layers.5."
    small = [
        prefix + "self_attn.k_proj.weight",
        prefix + "self_attn.v_proj.weight",
        prefix + "input_layernorm.weight",
        prefix + "post_attention_layernorm.weight",
    ]
    assert len({plan.owners[name] for name in small}) == 1
    (unit,) = [u for u in plan.units if small[0] in u.names]
    assert unit.names == tuple(small)
    assert unit.layer_id == "model.layers.5"
    assert unit.cost == math.fsum(param_cost(s) for s in [(1024, 4096)] * 2 + [(4096,)] * 2)


def test_small_param_threshold_is_configurable():
    specs = llama_specs("llama-3-8b")
    assert len(plan_ownership(specs, 8, small_param_numel=0).units) == len(specs)
    every_layer_one_unit = plan_ownership(specs, 8, small_param_numel=10**9)
    assert len(every_layer_one_unit.units) == 32


def test_unlayered_params_are_listed_and_never_packed_together():
    specs = make_param_specs(
        [
            ("model.embed_tokens.weight", (1000, 64)),
            ("model.layers.0.mlp.w.weight", (64, 64)),
            ("model.norm.weight", (64,)),
            ("lm_head.weight", (1000, 64)),
        ]
    )
    plan = plan_ownership(specs, 4)
    assert plan.unlayered == ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    assert len(plan.units) == 4
    assert len(set(plan.owners.values())) == 4


def test_balance_wins_when_spreading_a_layer_would_raise_the_heaviest_owner():
    specs = [
        ParamSpec(name="big", shape=(100, 100), layer_id=None),
        ParamSpec(name="a1", shape=(60, 60), layer_id="a"),
        ParamSpec(name="a2", shape=(50, 50), layer_id="a"),
    ]
    plan = plan_ownership(specs, 2, small_param_numel=0)
    # Spreading would put a2 next to "big" (cost 20e6 + 2.5e6); stacking gives 4.32e6 + 2.5e6.
    assert plan.owners["a1"] == plan.owners["a2"] == OwnerCoord(1)
    assert plan.crowded_layers == ("a",)
    assert max(plan.loads) == ns_cost((100, 100))


def test_a_layer_spreads_onto_a_busier_owner_when_the_heaviest_does_not_grow():
    specs = [
        ParamSpec(name="big", shape=(100, 100), layer_id=None),
        ParamSpec(name="b1", shape=(45, 45), layer_id="b"),
        ParamSpec(name="a1", shape=(40, 40), layer_id="a"),
        ParamSpec(name="a2", shape=(30, 30), layer_id="a"),
    ]
    plan = plan_ownership(specs, 3, small_param_numel=0)
    assert plan.owners["a1"] == OwnerCoord(2)
    # LPT alone stacks a2 on a1's owner (the least loaded); b1's owner is busier but stays below
    # "big", so a2 moves there.
    assert plan.owners["a2"] == plan.owners["b1"] == OwnerCoord(1)
    assert plan.crowded_layers == ()


def test_fewer_units_than_slots_leaves_owners_empty():
    specs = make_param_specs(
        [
            ("layers.0.q.weight", (512, 512)),
            ("layers.0.k.weight", (256, 512)),
            ("layers.1.q.weight", (512, 512)),
        ]
    )
    plan = plan_ownership(specs, 8, small_param_numel=0)
    assert len(set(plan.owners.values())) == 3
    assert sum(1 for load in plan.loads if load == 0.0) == 5
    assert plan.imbalance == pytest.approx(max(plan.loads) / (sum(plan.loads) / 8))


def test_a_row_vector_matrix_is_placed_with_its_ns_cost():
    plan = plan_ownership([ParamSpec(name="w", shape=(1, 8192), layer_id=None)], 2)
    assert plan.units[0].cost == ns_cost((1, 8192))
    assert plan.loads == (ns_cost((1, 8192)), 0.0)


def test_hsdp_slots_map_to_replicate_major_owner_coords():
    plan = plan_ownership(llama_specs("llama-3-8b"), 8, 8)
    assert len(plan.loads) == 64
    assert plan.owner_of_slot(0) == OwnerCoord(0, 0)
    assert plan.owner_of_slot(9) == OwnerCoord(shard=1, replicate=1)
    assert all(plan.slot_of(plan.owner_of_slot(slot)) == slot for slot in range(64))
    owners = set(plan.owners.values())
    assert {owner.replicate for owner in owners} == set(range(8))
    assert {owner.shard for owner in owners} == set(range(8))


def test_the_same_input_gives_the_same_plan():
    specs = llama_specs("llama-3-70b")
    assert plan_ownership(specs, 64, 2) == plan_ownership(list(specs), 64, 2)


def test_owners_do_not_depend_on_input_order():
    specs = list(llama_specs("llama-3-8b")) + list(
        make_param_specs([("lm_head.weight", (128256, 4096)), ("model.norm.weight", (4096,))])
    )
    reference = plan_ownership(specs, 8, 2)
    shuffled = specs[:]
    random.Random(0).shuffle(shuffled)
    plan = plan_ownership(shuffled, 8, 2)
    assert plan.owners == reference.owners
    assert plan.loads == reference.loads
    assert list(plan.owners) == [spec.name for spec in shuffled]


def test_empty_input_gives_an_empty_balanced_plan():
    plan = plan_ownership([], 4)
    assert plan.owners == {}
    assert plan.loads == (0.0,) * 4
    assert plan.imbalance == 1.0
    assert "0 params in 0 units over 4 owners" in plan.describe()


# --- describe -------------------------------------------------------------------------------


def test_describe_is_one_line_with_counts_loads_and_imbalance():
    specs = list(llama_specs("llama-3-8b")) + list(make_param_specs([("lm_head.weight", (8, 8))]))
    plan = plan_ownership(specs, 8)
    line = plan.describe()
    assert "\n" not in line
    assert line.startswith("dmuon partition: 289 params in 193 units over 8 owners (G=8 x R=1); ")
    loads = [load / 1e9 for load in plan.loads]
    mean = sum(loads) / 8
    assert f"load min/mean/max = {min(loads):,.1f}/{mean:,.1f}/{max(loads):,.1f} GFLOP" in line
    assert f"imbalance {plan.imbalance:.3f}" in line
    assert "per owner GFLOP " + " ".join(f"{x:,.1f}" for x in loads) in line
    assert "0 owners own nothing" in line
    assert "32/32 layers on distinct owners" in line
    assert "1 params without a layer id (lm_head.weight)" in line


def test_describe_summarises_many_owners_instead_of_listing_them():
    plan = plan_ownership(llama_specs("llama-3-70b"), 512, 4)
    line = plan.describe()
    assert "over 2048 owners (G=512 x R=4)" in line
    assert "per owner" not in line
    assert f"{2048 - len(plan.units)} owners own nothing" in line
    assert len(line) < 400


def test_describe_names_the_crowded_layers_count_and_heaviest_owner():
    specs = [
        ParamSpec(name="big", shape=(100, 100), layer_id=None),
        ParamSpec(name="a1", shape=(60, 60), layer_id="a"),
        ParamSpec(name="a2", shape=(50, 50), layer_id="a"),
    ]
    line = plan_ownership(specs, 2, small_param_numel=0).describe()
    assert "0/1 layers on distinct owners" in line
    assert "heaviest owner (shard=0, replicate=0)" in line


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            dict(num_shards=0),
            ValueError,
            "plan_ownership: num_shards must be >= 1, got 0; pass the size of the shard mesh dim",
        ),
        (
            dict(num_shards=2.0),
            TypeError,
            "plan_ownership: num_shards must be an int >= 1, got 2.0",
        ),
        (
            dict(num_shards=2, num_replicas=0),
            ValueError,
            "num_replicas must be >= 1, got 0; pass the size of the replicate mesh dim (1 = no HSDP)",
        ),
        (
            dict(num_shards=2, small_param_numel=-1),
            ValueError,
            "small_param_numel must be >= 0, got -1; use 0 to give every parameter its own unit",
        ),
    ],
)
def test_bad_grid_arguments_are_rejected_with_the_fix(kwargs, error, message):
    with pytest.raises(error) as raised:
        plan_ownership([], **kwargs)
    assert message in str(raised.value)


def test_duplicate_names_are_rejected_with_both_positions():
    specs = make_param_specs([("a.weight", (4, 4)), ("b.weight", (4, 4)), ("a.weight", (4, 4))])
    with pytest.raises(ValueError) as error:
        plan_ownership(specs, 2)
    assert "duplicate parameter name 'a.weight' at specs[0] and specs[2]" in str(error.value)
    assert "unique fully-qualified name" in str(error.value)


def test_empty_shape_is_rejected_with_the_fix():
    with pytest.raises(ValueError) as error:
        ParamSpec(name="scale", shape=(), layer_id=None)
    assert "ParamSpec 'scale': empty shape (); a scalar parameter cannot be dedicated" in str(
        error.value
    )
    assert "Exclude it with the predicate" in str(error.value)


def test_bad_shapes_are_rejected_with_the_value():
    with pytest.raises(ValueError, match=r"negative dimension in shape \(4, -1\)"):
        ParamSpec(name="w", shape=(4, -1), layer_id=None)
    with pytest.raises(TypeError, match=r"shape must contain only ints, got \(4, 2.5\)"):
        ParamSpec(name="w", shape=(4, 2.5), layer_id=None)


def test_spec_shape_sequences_are_normalised_to_tuples():
    assert ParamSpec(name="w", shape=[4, 8], layer_id=None).shape == (4, 8)


def test_non_spec_entries_are_rejected():
    with pytest.raises(TypeError, match=r"specs\[0\] is tuple \('w', \(4, 4\)\), not a ParamSpec"):
        plan_ownership([("w", (4, 4))], 2)


def test_tensor_parallel_slots_spread_the_newton_schulz_work_over_dp_x_tp():
    # 2 shards x 2 TP ranks: 4 slots; Llama-shaped matrices spread over all four, each TP
    # coordinate takes half the work, and slot i is (i % 2, 0, i // 2).
    specs = make_param_specs(llama_named_shapes(8, 1024, 256, 2816, norms=False))
    plan = plan_ownership(specs, 2, num_tp=2, small_param_numel=0)
    assert plan.num_slots == 4 and len(plan.loads) == 4
    assert [plan.owner_of_slot(i) for i in range(4)] == [
        OwnerCoord(0, 0, 0), OwnerCoord(1, 0, 0), OwnerCoord(0, 0, 1), OwnerCoord(1, 0, 1)
    ]  # fmt: skip
    assert all(plan.slot_of(plan.owner_of_slot(i)) == i for i in range(4))
    assert {owner.tp for owner in plan.owners.values()} == {0, 1}
    assert plan.imbalance < 1.1
    assert "G=2 x R=1 x TP=2" in plan.describe()
    # Without TP the coordinate reads as before.
    assert repr(plan_ownership(specs, 2).owners[specs[0].name]).endswith("replicate=0)")


def test_num_tp_is_checked_like_the_grid_sizes():
    with pytest.raises(ValueError, match="num_tp must be >= 1, got 0; pass the size of the tensor"):
        plan_ownership([], 2, num_tp=0)
