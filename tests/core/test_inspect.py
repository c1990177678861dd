"""``dmuon.inspect``: read-only views of owners, boundaries and segments, in one process and on
4 gloo ranks (scenarios in ``tests/core/scenarios_inspect.py``)."""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch
from torch import nn

import dmuon
import dmuon.checkpoint
import dmuon.partition
from dmuon.hooks import get_dedicated_state
from dmuon.inspect import OwnerCoord, make_param_specs, plan_ownership, what_if_grid
from tests.core.scenarios_inspect import (
    view_of_a_one_dimensional_mesh,
    views_before_and_after_adoption,
)
from tests.distributed.models import TinyDecoder, batches, loss_fn
from tests.distributed.test_protocol import message_entry

BF16_COMPUTE_FP32_REDUCE = {
    "defaults": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
}


def proj_and_bias(name: str, param: nn.Parameter) -> bool:
    return "proj" in name  # the matrices and the o_proj biases


def prepared(**kwargs) -> nn.Module:
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_and_bias, **kwargs)
    return model


def reference_shapes() -> dict[str, tuple[int, ...]]:
    return {
        name: tuple(p.shape)
        for name, p in TinyDecoder().named_parameters()
        if proj_and_bias(name, p)
    }


# ---- one process ----------------------------------------------------------------------------------


def test_view_of_a_model_without_dedicated_parameters_says_to_call_dedicate_params():
    model = TinyDecoder()
    assert dmuon.inspect.is_prepared(model) is False
    with pytest.raises(ValueError, match=r"call dmuon.dedicate_params\(model, mesh, predicate\)"):
        dmuon.inspect.view(model)
    with pytest.raises(ValueError, match=r"call dmuon.dedicate_params\(model, mesh, predicate\)"):
        dmuon.inspect.forward_waits(model)


def test_every_dedicated_parameter_shows_its_owner_route_dtypes_and_boundary():
    model = prepared(param_policy=BF16_COMPUTE_FP32_REDUCE)
    optimizer = dmuon.Muon(model, no_decay=None)  # two groups: Muon and AdamW
    view = dmuon.inspect.view(model)

    assert dmuon.inspect.is_prepared(model) is True
    assert list(view.params) == list(reference_shapes())
    muon_group, adamw_group = optimizer.param_groups
    for name, shape in reference_shapes().items():
        p = view.params[name]
        assert (p.name, p.shape, p.numel) == (name, shape, math.prod(shape))
        assert (p.owner, p.owner_rank, p.is_owner) == (OwnerCoord(0, 0), 0, True)
        assert p.boundary == name.rpartition(".")[0].rpartition(".")[0]  # layers.N
        assert (p.param_dtype, p.reduce_dtype, p.master_dtype) == (
            torch.bfloat16,
            torch.float32,
            torch.float32,
        )
        assert p.requires_grad is True
        expected_route, group = ("muon", muon_group) if len(shape) == 2 else ("adamw", adamw_group)
        assert p.route == expected_route
        assert any(t is p.master for t in group["params"]), name


def test_the_reduce_dtype_is_the_compute_dtype_when_the_policy_names_none():
    view = dmuon.inspect.view(prepared(param_policy={"defaults": {"param_dtype": torch.bfloat16}}))
    for p in view.params.values():
        assert (p.param_dtype, p.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    for segment in (s for b in view.boundaries for s in b.segments):
        assert segment.reduce_dtype == torch.bfloat16
        entries = sum(message_entry(view.params[name].numel) for name in segment.params)
        assert segment.message_bytes == 2 * entries


def test_each_boundary_has_one_segment_per_owner_shard_covering_its_parameters_once():
    shapes = reference_shapes()
    view = dmuon.inspect.view(prepared(param_policy=BF16_COMPUTE_FP32_REDUCE))

    assert [b.name for b in view.boundaries] == ["layers.0", "layers.1", "layers.2"]
    for boundary in view.boundaries:
        members = [name for name in shapes if name.startswith(boundary.name + ".")]
        assert boundary.params == tuple(members)
        assert (boundary.reshard_after_forward, boundary.broadcasts_per_step) == (True, 2)
        (segment,) = boundary.segments
        numel = sum(math.prod(shapes[name]) for name in members)
        assert (segment.shard, segment.root_rank, segment.is_local) == (0, 0, True)
        assert sorted(segment.params) == sorted(members)
        assert (segment.dtype, segment.reduce_dtype) == (torch.bfloat16, torch.float32)
        entries = sum(message_entry(math.prod(shapes[name])) for name in members)
        assert (segment.numel, segment.message_numel) == (numel, entries)
        assert (segment.value_bytes, segment.message_bytes) == (2 * numel, 4 * entries)
        (owned,) = segment.slices
        assert (owned.owner, owned.owner_rank, owned.params) == (
            OwnerCoord(0, 0),
            0,
            segment.params,
        )
        assert (owned.numel, owned.value_bytes, owned.message_bytes) == (
            numel,
            segment.value_bytes,
            segment.message_bytes,
        )
        assert (boundary.value_bytes, boundary.message_bytes) == (
            segment.value_bytes,
            segment.message_bytes,
        )


def test_z2_boundaries_broadcast_once_per_step():
    view = dmuon.inspect.view(prepared(reshard_after_forward=False))
    assert {(b.reshard_after_forward, b.broadcasts_per_step) for b in view.boundaries} == {
        (False, 1)
    }


def test_views_are_frozen_and_their_parameter_mapping_is_read_only():
    view = dmuon.inspect.view(prepared())
    some = next(iter(view.params.values()))
    for frozen, field in (
        (view, "is_adopted"),
        (view.grid, "num_shards"),
        (some, "owner"),
        (view.boundaries[0], "segments"),
        (view.boundaries[0].segments[0], "numel"),
        (view.boundaries[0].segments[0].slices[0], "owner_rank"),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(frozen, field, None)
    with pytest.raises(TypeError):
        view.params["extra"] = some


def test_a_meta_model_shows_before_adoption_the_segments_it_gets_and_stays_untouched():
    with torch.device("meta"):
        model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_and_bias, param_policy=BF16_COMPUTE_FP32_REDUCE)
    before = dmuon.inspect.view(model)
    state = get_dedicated_state(model)
    # Viewing built nothing: no segment, no unsharded parameter, no offset moved.
    assert all(group.segments == [] for group in state.boundaries)
    assert all(p.unsharded is None and p.segment_offset == 0 for p in state.params.values())
    assert all(p.master is None for p in before.params.values())
    assert {p.master_dtype for p in before.params.values()} == {torch.float32}

    model.to_empty(device="cpu")
    dmuon.Muon(model)  # adopts
    after = dmuon.inspect.view(model)

    assert (before.is_adopted, after.is_adopted) == (False, True)
    assert before.boundaries == after.boundaries
    assert before.params == after.params  # masters are not compared


def test_a_view_is_a_snapshot_of_the_state_when_taken():
    with torch.device("meta"):
        model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_and_bias)
    before = dmuon.inspect.view(model)
    model.to_empty(device="cpu")
    dmuon.Muon(model)
    assert before.is_adopted is False
    assert dmuon.inspect.view(model).is_adopted is True


def test_the_plan_is_the_partition_of_the_same_pure_functions_reexported():
    model = prepared()
    for name in ("plan_ownership", "make_param_specs", "ns_cost", "param_cost", "layer_id_of"):
        assert getattr(dmuon.inspect, name) is getattr(dmuon.partition, name)
    assert dmuon.inspect.OwnerCoord is dmuon.OwnerCoord
    shapes = reference_shapes()
    what_if = plan_ownership(make_param_specs(shapes.items()), 1, 1)
    assert dmuon.inspect.view(model).plan == what_if


def test_what_if_grid_numbers_owners_replicate_major_as_init_device_mesh_and_the_plan_slots():
    grid = what_if_grid(4, 3)
    assert (grid.num_shards, grid.num_replicas, grid.num_slots, grid.coord) == (4, 3, 12, None)
    assert grid.rank_grid == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))
    plan = plan_ownership(make_param_specs([("w", (8, 8))]), 4, 3)
    assert [grid.owner_rank(plan.owner_of_slot(slot)) for slot in range(12)] == list(range(12))
    assert grid.owner_rank(OwnerCoord(shard=1, replicate=2)) == 9


def test_what_if_grid_of_ten_thousand_owners_is_cheap_to_build_and_read():
    grid = what_if_grid(10_000)
    assert grid.owner_rank(OwnerCoord(9_999)) == 9_999


def test_an_owner_outside_the_grid_is_refused_showing_the_grid():
    with pytest.raises(
        ValueError,
        match=r"OwnerCoord\(shard=4, replicate=0\) is outside the owner grid of 4 shards x 2 "
        r"replicas; shard must be in \[0, 4\) and replicate in \[0, 2\)",
    ):
        what_if_grid(4, 2).owner_rank(OwnerCoord(4, 0))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0,), r"what_if_grid: num_shards must be an int >= 1, got 0; pass the size of the shard"),
        ((2, 0), r"num_replicas must be an int >= 1, got 0; pass the size of the replicate"),
        ((True,), r"num_shards must be an int >= 1, got True"),
        ((2.0,), r"num_shards must be an int >= 1, got 2.0"),
    ],
)
def test_what_if_grid_refuses_sizes_that_are_not_positive_ints(args, message):
    with pytest.raises(ValueError, match=message):
        what_if_grid(*args)


def test_model_of_gives_the_model_a_muon_was_built_on():
    model, other = prepared(), prepared()
    optimizer = dmuon.Muon(model)
    assert dmuon.inspect.model_of(optimizer) is model
    assert dmuon.inspect.model_of(optimizer) is not other


def test_muon_model_state_is_the_state_of_the_model_it_was_built_on_and_read_only():
    model, other = prepared(), prepared()
    optimizer = dmuon.Muon(model)
    assert optimizer.model_state is get_dedicated_state(model)
    assert optimizer.model_state is not get_dedicated_state(other)
    with pytest.raises(AttributeError):
        optimizer.model_state = get_dedicated_state(other)
    assert optimizer.model_state is get_dedicated_state(model)


def test_every_muon_matrixs_state_is_keyed_by_the_public_momentum_buffer_name():
    model = prepared()
    optimizer = dmuon.Muon(model)
    for batch in batches(1, 1):
        loss_fn(model, batch).backward()
        optimizer.step()
    state = optimizer.state_dict()
    muon = [i for g in state["param_groups"] if g["route"] == "muon" for i in g["params"]]
    assert len(muon) == 15
    assert {i: sorted(state["state"][i]) for i in muon} == {
        i: [dmuon.checkpoint.MOMENTUM_BUFFER] for i in muon
    }
    assert dmuon.checkpoint.MOMENTUM_BUFFER == "momentum_buffer"  # torch.optim.Muon's name


def test_model_of_refuses_an_optimizer_that_is_not_dmuon_muon():
    sgd = torch.optim.SGD(TinyDecoder().parameters(), lr=0.1)
    with pytest.raises(
        TypeError, match=r"dmuon.inspect.model_of takes a dmuon.Muon, got SGD; build the"
    ):
        dmuon.inspect.model_of(sgd)


def test_forward_waits_are_none_unless_the_profile_was_requested(monkeypatch):
    monkeypatch.delenv("DMUON_RECORD_FORWARD_PROFILE", raising=False)
    assert dmuon.inspect.forward_waits(prepared()) is None


def test_forward_waits_count_every_boundary_in_first_wait_order(monkeypatch):
    monkeypatch.setenv(dmuon.inspect.FORWARD_PROFILE_ENV, "1")
    model = prepared()
    untouched = dmuon.inspect.forward_waits(model)
    assert [(w.boundary, w.waits) for w in untouched] == [
        ("layers.0", 0),
        ("layers.1", 0),
        ("layers.2", 0),
    ]
    optimizer = dmuon.Muon(model)
    for batch in batches(2, 1):
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    waits = dmuon.inspect.forward_waits(model)
    assert [(w.boundary, w.waits, w.cuda_events) for w in waits] == [
        ("layers.0", 2, ()),
        ("layers.1", 2, ()),
        ("layers.2", 2, ()),
    ]
    assert all(w.host_ms >= 0.0 for w in waits)


def test_every_name_in_all_exists_and_dmuon_exports_the_module():
    assert dmuon.inspect is importlib.import_module("dmuon.inspect")
    assert "inspect" in dmuon.__all__
    for name in dmuon.inspect.__all__:
        assert hasattr(dmuon.inspect, name), name


# ---- 4 gloo ranks -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hsdp_ranks(pool4):
    return pool4.run(views_before_and_after_adoption, replicas=2)


def test_on_hsdp_every_parameter_has_one_owner_rank_and_its_master_in_its_route_group(hsdp_ranks):
    names = list(hsdp_ranks[0]["params"])
    assert names
    for name in names:
        entries = [r["params"][name] for r in hsdp_ranks]
        owner_rank = entries[0]["owner_rank"]
        assert all(e["owner_rank"] == owner_rank for e in entries), name
        assert [r["rank"] for r in hsdp_ranks if r["params"][name]["is_owner"]] == [owner_rank]
        for rank, entry in zip((r["rank"] for r in hsdp_ranks), entries):
            if rank == owner_rank:
                assert (entry["group"], entry["master_dtype"]) == (entry["route"], torch.float32)
            else:
                assert (entry["group"], entry["master_dtype"]) == (None, None)


def test_on_hsdp_owner_ranks_follow_the_mesh_and_equal_the_what_if_grid(hsdp_ranks):
    for result in hsdp_ranks:
        assert result["rank_grid"] == ((0, 1), (2, 3))
        coord = result["coord"]
        assert result["rank_grid"][coord.replicate][coord.shard] == result["rank"]
        assert result["what_if_ranks_agree"] is True
        for entry in result["params"].values():
            owner = entry["owner"]
            assert entry["owner_rank"] == result["rank_grid"][owner.replicate][owner.shard]


def test_on_hsdp_segments_are_rooted_in_each_rank_replica_and_sliced_by_owner(hsdp_ranks):
    for result in hsdp_ranks:
        coord, rank_grid = result["coord"], result["rank_grid"]
        for boundary in result["boundaries_after"]:
            assert sorted(p for s in boundary.segments for p in s.params) == sorted(boundary.params)
            for segment in boundary.segments:
                assert segment.root_rank == rank_grid[coord.replicate][segment.shard]
                assert segment.is_local == (segment.shard == coord.shard)
                assert segment.shard_ranks == tuple(rank_grid[coord.replicate])
                assert segment.replicate_ranks == tuple(row[segment.shard] for row in rank_grid)
                assert [p for s in segment.slices for p in s.params] == list(segment.params)
                assert sum(s.numel for s in segment.slices) == segment.numel
                for owned in segment.slices:
                    assert owned.owner.shard == segment.shard
                    assert owned.owner_rank == rank_grid[owned.owner.replicate][segment.shard]
                    for name in owned.params:
                        assert result["params"][name]["owner"] == owned.owner


def test_on_hsdp_every_rank_sees_the_same_layout_but_for_its_own_roots(hsdp_ranks):
    def layout(result):
        return [
            [
                dataclasses.replace(s, root_rank=-1, is_local=False, shard_ranks=())
                for s in b.segments
            ]
            for b in result["boundaries_after"]
        ]

    first = layout(hsdp_ranks[0])
    assert all(layout(result) == first for result in hsdp_ranks[1:])


def test_on_hsdp_a_meta_model_shows_before_adoption_the_segments_it_gets(hsdp_ranks):
    for result in hsdp_ranks:
        assert result["adopted"] == (False, True)
        assert result["boundaries_before"] == result["boundaries_after"]


def test_a_one_dimensional_mesh_is_one_replica_of_every_rank(pool4):
    for result in pool4.run(view_of_a_one_dimensional_mesh):
        assert result["grid"] == (4, 1, OwnerCoord(result["rank"], 0), ((0, 1, 2, 3),))


def test_a_3d_parameter_is_an_expert_stack_by_default_unless_it_is_a_convolutions_weight():
    stack = nn.Module()
    stack.w1 = nn.Parameter(torch.zeros(4, 3, 2))
    conv = nn.Conv1d(3, 5, kernel_size=2)
    linear = nn.Linear(3, 5)
    assert dmuon.inspect.is_expert_stack_by_default(stack, stack.w1) is True
    assert dmuon.inspect.is_expert_stack_by_default(conv, conv.weight) is False
    assert dmuon.inspect.is_expert_stack_by_default(linear, linear.weight) is False
