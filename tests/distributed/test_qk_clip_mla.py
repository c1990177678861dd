"""QK-clip on multi-head latent attention (``dmuon.MLAHeads``, Kimi K2 arXiv 2507.20534, section
2.1) on gloo: weights after a few clipping steps of dmuon.Muon match the single-process reference
that clips from the report head by head (content query and key by sqrt(gamma), rotary query by
gamma, the shared rotary key untouched), with maxima brute-forced from explicit q and k; on a 1-D
mesh (the owners hold the masters) and dp x tp (each TP rank clips its heads' rows)."""

from __future__ import annotations

import pytest

from tests.distributed.scenarios_qk_clip_mla import train_mla_with_qk_clip
from tests.distributed.test_protocol import FP32_TOLERANCE


def assert_clips_like_the_reference(results):
    for rank, result in enumerate(results):
        worst = max(result["max_errors"])
        assert worst < FP32_TOLERANCE, f"rank {rank}: max relative error {worst:.3e}"
        assert result["clipped"] == result["reference_clipped"], rank
        assert max(result["max_logit_errors"]) < 1e-4, rank
    clipped = results[0]["clipped"]
    # The clip runs at the first step, and spares some heads at some step (2 layers x 4 heads).
    assert clipped[0] > 0 and min(clipped) < 2 * 4, clipped


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_b_proj", "q_proj"])
def test_mla_on_a_1d_mesh_clips_like_the_report(pool2, q_lora):
    assert_clips_like_the_reference(
        pool2.run(train_mla_with_qk_clip, mesh_kind="1d", threshold=2.0, q_lora=q_lora)
    )


def test_mla_with_kv_b_proj_on_the_adamw_route_is_clipped_on_fsdp2_shards(pool2):
    results = pool2.run(train_mla_with_qk_clip, mesh_kind="1d", threshold=2.0, kv_on_adamw=True)
    assert "layers.0.attn.kv_b_proj.weight" not in results[0]["dedicated"]
    assert "layers.0.attn.q_b_proj.weight" in results[0]["dedicated"]
    assert_clips_like_the_reference(results)


def test_mla_alpha_splits_only_the_content_parts(pool2):
    assert_clips_like_the_reference(
        pool2.run(train_mla_with_qk_clip, mesh_kind="1d", threshold=2.0, alpha=0.3)
    )


def test_mla_under_tensor_parallelism_clips_each_tp_ranks_heads(pool4):
    assert_clips_like_the_reference(
        pool4.run(train_mla_with_qk_clip, mesh_kind="tp", threshold=2.0)
    )
