"""QK-clip's pieces in one process: the per-head maxima against a float64 brute force, the clip
factors against the formula, and the setup errors with their fixes."""

from __future__ import annotations

import math

import pytest
import torch

import dmuon
from dmuon import qk_clip
from dmuon.qk_clip import clip_factors
from tests.distributed.scenarios_qk_clip import attention_heads, make_model


def brute_force(q, k, scaling, allowed) -> torch.Tensor:
    """max over (b, i, j) with allowed(b, i, j) of scaling * q[b, h, i] . k[b, kv(h), j]."""
    batch, heads, q_len, _ = q.shape
    group = heads // k.shape[1]
    result = [-math.inf] * heads
    for b in range(batch):
        for h in range(heads):
            for i in range(q_len):
                for j in range(k.shape[2]):
                    if allowed(b, i, j):
                        logit = scaling * float(q[b, h, i].double() @ k[b, h // group, j].double())
                        result[h] = max(result[h], logit)
    return torch.tensor(result, dtype=torch.float64)


@pytest.mark.parametrize("block_numel", [qk_clip.LOGITS_BLOCK_NUMEL, 20], ids=["one", "blocks"])
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive"])
def test_max_logits_equal_a_float64_brute_force(monkeypatch, block_numel, mask_kind):
    monkeypatch.setattr(qk_clip, "LOGITS_BLOCK_NUMEL", block_numel)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 3, 4, generator=generator)  # 6 query heads, 3 queries
    k = torch.randn(2, 2, 5, 4, generator=generator)  # 2 key heads, 5 keys (a cache of 2)
    keep = torch.rand(2, 1, 3, 5, generator=generator) > 0.3
    keep[..., 0] = True
    if mask_kind == "causal":
        got = dmuon.attention_max_logits(q, k, scaling=0.5, is_causal=True)
        expected = brute_force(q, k, 0.5, lambda b, i, j: j <= i + 2)
    else:
        mask = (
            keep if mask_kind == "bool" else torch.where(keep, 0.0, torch.finfo(torch.float32).min)
        )
        got = dmuon.attention_max_logits(q, k, scaling=0.5, attention_mask=mask)
        expected = brute_force(q, k, 0.5, lambda b, i, j: bool(keep[b, 0, i, j]))
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)


def test_clip_factors_follow_the_formula():
    maxima = torch.tensor([50.0, 200.0, 400.0, float("nan")])
    q, k = clip_factors(maxima, threshold=100.0, alpha=0.25, num_kv_heads=4)
    torch.testing.assert_close(q, torch.tensor([1.0, 0.5**0.25, 0.25**0.25, 1.0]))
    torch.testing.assert_close(k, torch.tensor([1.0, 0.5**0.75, 0.25**0.75, 1.0]))
    # Grouped-query: the query takes gamma whole, the shared key heads stay.
    q, k = clip_factors(maxima, threshold=100.0, alpha=0.25, num_kv_heads=2)
    torch.testing.assert_close(q, torch.tensor([1.0, 0.5, 0.25, 1.0]))
    torch.testing.assert_close(k, torch.ones(2))


def prepared():
    model = make_model(kv_heads=2)
    dmuon.dedicate_params(model, None, lambda name, p: "proj" in name and p.ndim == 2)
    return model, dmuon.Muon(model)


def test_a_dmuon_muon_of_another_model_is_refused_with_the_fix():
    model, _ = prepared()
    _, other_optimizer = prepared()
    with pytest.raises(
        TypeError, match=r"the optimizer \(Muon\) is not the dmuon.Muon of this model; the clip"
    ):
        dmuon.QKClip(model, other_optimizer, attention_heads(model))


def test_setup_errors_say_what_is_wrong_and_the_fix():
    model, optimizer = prepared()
    heads = attention_heads(model)
    with pytest.raises(ValueError, match=r"threshold must be a positive number, got 0"):
        dmuon.QKClip(model, optimizer, heads, threshold=0)
    with pytest.raises(ValueError, match=r"alpha must be a number in \[0, 1\], got 2"):
        dmuon.QKClip(model, optimizer, heads, alpha=2)
    with pytest.raises(TypeError, match=r"the optimizer \(SGD\) is not the dmuon.Muon"):
        dmuon.QKClip(model, torch.optim.SGD([torch.zeros(1)], lr=0.1), heads)
    wrong = [dmuon.AttentionHeads(name="a", q_weight="layers.0.attn.q_proj.weight",
                                  k_weight="layers.0.attn.k_proj.weight", num_heads=4)]  # fmt: skip
    with pytest.raises(
        ValueError, match=r"k_weight layers.0.attn.k_proj.weight has shape \(8, 24\)"
    ):
        dmuon.QKClip(model, optimizer, wrong)
    missing = [dmuon.AttentionHeads(name="a", q_weight="layers.0.q_proj.weight",
                                    k_weight="layers.0.attn.k_proj.weight", num_heads=4)]  # fmt: skip
    with pytest.raises(ValueError, match=r"the model has no parameter 'layers.0.q_proj.weight'"):
        dmuon.QKClip(model, optimizer, missing)
    clip = dmuon.QKClip(model, optimizer, heads)
    with pytest.raises(KeyError, match=r"no attention layer named 'layers.9.attn'"):
        clip.record("layers.9.attn", torch.zeros(4))
    with pytest.raises(ValueError, match=r"got 3 maxima; it has 4 query heads"):
        clip.record("layers.0.attn", torch.zeros(3))


def test_records_without_grad_are_ignored_and_removed_clip_stops():
    model, optimizer = prepared()
    clip = dmuon.QKClip(model, optimizer, attention_heads(model), threshold=1.0)
    with torch.no_grad():
        clip.record("layers.0.attn", torch.full((4,), 9.0))
    clip.record("layers.0.attn", torch.full((4,), 0.5))
    clip.record("layers.1.attn", torch.full((4,), 0.5))
    optimizer.step()
    assert clip.last_max_logits["layers.0.attn"].tolist() == [0.5] * 4
    clip.remove()
    optimizer.step()  # nothing recorded, nothing raised
