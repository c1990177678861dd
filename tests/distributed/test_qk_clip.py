"""QK-clip (``dmuon.QKClip``, MuonClip's, Kimi K2 arXiv 2507.20534) on gloo: weights after a few
clipping steps match the single-process reference that applies the clip from the formula, on a
1-D mesh, HSDP 2x2 and dp x tp, grouped-query attention in both conventions (per query head,
per key group); a threshold no head reaches changes no bit."""

from __future__ import annotations

import pytest

from tests.distributed.scenarios_qk_clip import (
    max_logits_reduce_over_ranks,
    never_reached_threshold_is_bitwise_no_clip,
    train_with_qk_clip,
    unrecorded_layer_raises_everywhere,
)
from tests.distributed.test_protocol import FP32_TOLERANCE


def assert_clips_like_the_reference(results):
    for rank, result in enumerate(results):
        worst = max(result["max_errors"])
        assert worst < FP32_TOLERANCE, f"rank {rank}: max relative error {worst:.3e}"
        assert result["clipped"] == result["reference_clipped"], rank
        assert max(result["max_logit_errors"]) < 1e-4, rank
    clipped = results[0]["clipped"]
    # The clip runs (8 heads over the threshold at the first step), and spares some heads later.
    assert clipped[0] > 0 and min(clipped) < 2 * 4, clipped


@pytest.mark.parametrize(
    "model", [dict(kv_heads=4), dict(kv_heads=2), dict(kv_heads=4, qk_norm=True, bias=False)],
    ids=["mha", "gqa", "qk-norm"],
)  # fmt: skip
def test_1d_clips_like_the_single_process_reference(pool2, model):
    assert_clips_like_the_reference(
        pool2.run(train_with_qk_clip, mesh_kind="1d", threshold=1.5, alpha=0.3, **model)
    )


def test_hsdp_2x2_clips_like_the_single_process_reference(pool4):
    assert_clips_like_the_reference(
        pool4.run(train_with_qk_clip, mesh_kind="hsdp", threshold=1.5, kv_heads=4)
    )


def test_k_proj_on_the_adamw_route_is_clipped_on_fsdp2_shards(pool2):
    results = pool2.run(train_with_qk_clip, mesh_kind="1d", threshold=1.5, kv_heads=4,
                        k_on_adamw=True)  # fmt: skip
    assert "layers.0.attn.k_proj.weight" not in results[0]["dedicated"]
    assert_clips_like_the_reference(results)


@pytest.mark.parametrize("k_on_adamw", [False, True], ids=["k-dedicated", "k-on-fsdp2"])
def test_per_key_group_gqa_clips_like_its_reference_one_gamma_per_key_group(pool2, k_on_adamw):
    assert_clips_like_the_reference(
        pool2.run(
            train_with_qk_clip,
            mesh_kind="1d",
            threshold=1.5,
            alpha=0.3,
            kv_heads=2,
            gqa="per_key_group",
            k_on_adamw=k_on_adamw,
        )
    )


@pytest.mark.parametrize(
    "options", [dict(kv_heads=4), dict(kv_heads=2), dict(kv_heads=2, gqa="per_key_group")],
    ids=["mha", "gqa", "gqa-per-key-group"],
)  # fmt: skip
def test_tensor_parallel_heads_are_clipped_on_each_tp_rank(pool4, options):
    # dp 2 x tp 2: q/k/v colwise, each TP rank records and clips its own heads; k_proj is left
    # to FSDP2 over TP (a 2-D DTensor), q_proj dedicated (the owner's TP chunk).
    results = pool4.run(train_with_qk_clip, mesh_kind="tp", threshold=1.5, k_on_adamw=True,
                        **options)  # fmt: skip
    assert_clips_like_the_reference(results)


@pytest.mark.parametrize("mesh_kind", ["1d", "hsdp"])
def test_a_threshold_never_reached_leaves_every_weight_bitwise_unchanged(pool4, mesh_kind):
    for result in pool4.run(never_reached_threshold_is_bitwise_no_clip, mesh_kind=mesh_kind):
        assert result["bitwise_equal"]
        assert result["clipped_heads"] == 0 and result["max_logit"] > 1.0


def test_a_layer_no_rank_recorded_raises_on_every_rank_before_the_update(pool2):
    for result in pool2.run(unrecorded_layer_raises_everywhere):
        assert result["unchanged"]
        assert result["message"].startswith(
            "dmuon.QKClip: no rank recorded the attention logits of 1 layers (layers.1.attn)"
        )


def test_the_max_logits_are_the_maximum_over_ranks(pool4):
    for result in pool4.run(max_logits_reduce_over_ranks):
        assert all(result.values())
