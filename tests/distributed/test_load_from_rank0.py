"""``set_model_state_dict(..., broadcast_from_rank0=True)``: a big model loads from one full dict.

Only rank 0 holds the dict; each owner receives only its matrices (expert pieces, TP chunks),
every other value goes to every rank as torch sends it, each keeping its shard. The model loaded
so equals the one loaded with the full dict on every rank, bit for bit, and trains the same; and
a rank other than 0 holds, beyond its own share of the model, at most one value of the dict at a
time (counted by ``dmuon.checkpoint._from_source.recording_received``).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import scenarios_load_from_rank0 as scenarios

# (world size, replicas, tensor-parallel size)
LAYOUTS = {
    "1d-2": (2, 1, 1),
    "1d-4": (4, 1, 1),
    "hsdp-2x2": (4, 2, 1),
    "dp2-tp2": (4, 1, 2),
    "dp1-tp2": (2, 1, 2),  # one owner slot per TP rank: no grid group, TP forwarding only
}


def run(gloo_pool, layout: str, **kwargs) -> list[dict]:
    world, replicas, tp = LAYOUTS[layout]
    return gloo_pool(world).run(
        scenarios.loaded_like_every_rank, replicas=replicas, tp=tp, **kwargs
    )


def assert_equal(weights: dict, expected: dict) -> None:
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(weights[key], value), key


@pytest.mark.parametrize(
    ("layout", "kind", "meta", "for_load"),
    [
        ("1d-2", "decoder", False, False),
        ("1d-4", "decoder", True, False),
        ("1d-4", "decoder", True, True),
        ("hsdp-2x2", "decoder", True, True),
        ("dp2-tp2", "decoder", False, False),
        ("dp2-tp2", "decoder", True, True),
        ("dp1-tp2", "decoder", True, True),
        ("1d-4", "moe", False, False),
        ("hsdp-2x2", "moe", True, True),
    ],
)
def test_a_model_loaded_from_rank0_equals_one_loaded_on_every_rank_and_trains_the_same(
    gloo_pool, layout, kind, meta, for_load
):
    first, *others = run(gloo_pool, layout, kind=kind, meta=meta, for_load=for_load)
    assert first["incompatible"] == ([], [])
    assert first["loaded"].keys() == scenarios.checkpoint_values(kind).keys()
    assert_equal(first["loaded"], first["reference_loaded"])
    assert_equal(first["loaded"], scenarios.checkpoint_values(kind))
    assert_equal(first["trained"], first["reference_trained"])
    assert all(not other["loaded"] and not other["trained"] for other in others)


@pytest.mark.parametrize(
    ("layout", "kind"), [("1d-2", "decoder"), ("1d-4", "decoder"), ("hsdp-2x2", "moe")]
)
def test_each_owner_receives_only_its_matrices_and_holds_one_value_at_a_time(
    gloo_pool, layout, kind
):
    first, *others = run(gloo_pool, layout, kind=kind, meta=True, for_load=True)
    assert first["received"] == {"received": 0, "peak": 0}  # the source reads its own dict
    for rank, report in enumerate(others, start=1):
        received = report["received"]
        # Its dedicated matrices (expert pieces) and every other value whole, nothing more.
        assert received["received"] == report["owned"] + report["not_dedicated"], rank
        # Beyond its own share, one value at a time: far from the whole model.
        assert 0 < received["peak"] <= report["largest_value"], rank
        assert report["own_share"] + received["peak"] < report["whole_model"], rank


def test_tensor_parallel_ranks_hold_one_value_at_a_time(gloo_pool):
    for report in run(gloo_pool, "dp2-tp2", meta=True, for_load=True)[1:]:
        assert 0 < report["received"]["peak"] <= report["largest_value"]


def test_to_empty_allocates_every_dedicated_weight_and_to_empty_for_load_none(pool4):
    # The dedicated weights in full, on every rank, until adoption; or a stand-in of one element.
    whole = pool4.run(scenarios.loaded_like_every_rank, meta=True)
    stand_ins = pool4.run(scenarios.loaded_like_every_rank, meta=True, for_load=True)
    values = scenarios.checkpoint_values("decoder")
    dedicated = [value for key, value in values.items() if "proj" in key and value.ndim == 2]
    whole_bytes = sum(value.numel() * value.element_size() for value in dedicated)
    assert [report["dedicated_storage"] for report in whole] == [whole_bytes] * 4
    for report in stand_ins:  # one fp32 element each
        assert report["dedicated_storage"] == 4 * len(dedicated)


def test_a_mis_shaped_value_on_rank0_raises_on_every_rank_and_misplaced_options_name_the_fix(
    pool2,
):
    for messages in pool2.run(scenarios.errors):
        assert messages["mis-shaped"] == (
            "dmuon.checkpoint: the model state dict does not fit the model:\n  rank 0: size "
            "mismatch for layers.0.q_proj.weight: the state dict has shape (3, 5), the model "
            "(30, 30)"
        )
        assert messages["reading"].startswith(
            "StateDictOptions(broadcast_from_rank0=True) is for loading a model state dict: "
            "dmuon.checkpoint.set_model_state_dict takes it"
        )
        assert messages["set_state_dict"].startswith(
            "dmuon.checkpoint.set_state_dict does not take StateDictOptions(broadcast_from_rank0"
        )


def test_keys_missing_on_rank0_are_reported_on_every_rank_and_other_ranks_dicts_are_ignored(
    pool2,
):
    first, second = pool2.run(scenarios.partial_dict_and_other_ranks_dicts)
    for report in (first, second):
        assert report["missing"] == ["embed.weight", "layers.0.q_proj.weight"]
        assert report["unexpected"] == []
    assert_equal(first["weights"], first["expected"])  # the missing ones keep their values


@pytest.mark.parametrize("as_dtensor", [True, False])
def test_expert_parallel_pieces_go_to_the_owner_each_piece_names(pool4, as_dtensor):
    first, *others = pool4.run(
        scenarios.expert_parallel_loaded_like_every_rank, ep=2, as_dtensor=as_dtensor
    )
    assert_equal(first["loaded"], scenarios.checkpoint_values("moe"))
    assert_equal(first["loaded"], first["reference_loaded"])
    assert all(0 < other["received"] < other["whole_model"] for other in others)
