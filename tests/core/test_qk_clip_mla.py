"""QK-clip on multi-head latent attention (``dmuon.MLAHeads``) and grouped-query attention's
per-key-group convention, in one process, against references written from their definitions:
the per-head maxima brute-forced in float64 from q and k computed explicitly from the weights,
the clip applied head by head with Python floats (Kimi K2, arXiv 2507.20534, section 2.1, for
MLA; one gamma per key group for ``gqa="per_key_group"``). One step at learning rate 0 isolates
the clip: heads under the threshold keep every bit, clipped heads end at the threshold."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import dmuon
import dmuon.checkpoint
from dmuon import qk_clip
from dmuon.qk_clip import clip_factors, mla_clip_factors
from tests.distributed import scenarios_qk_clip as gqa_scenarios
from tests.distributed.scenarios_qk_clip_mla import (
    KV_LORA,
    NOPE,
    NUM_HEADS,
    ROPE,
    SCALING,
    V_DIM,
    capture_attention_inputs,
    explicit_max_logits,
    loss_of,
    make_mla_model,
    mla_heads,
    q_name,
    reference_mla_clip,
)

TOKENS = torch.randint(0, gqa_scenarios.VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))


def brute_force_mla(q_nope, q_rope, k_nope, k_rope, scaling, allowed) -> torch.Tensor:
    batch, heads, q_len, _ = q_nope.shape
    result = [-math.inf] * heads
    for b in range(batch):
        for h in range(heads):
            for i in range(q_len):
                for j in range(k_nope.shape[2]):
                    if allowed(b, i, j):
                        logit = float(q_nope[b, h, i].double() @ k_nope[b, h, j].double())
                        logit += float(q_rope[b, h, i].double() @ k_rope[b, 0, j].double())
                        result[h] = max(result[h], scaling * logit)
    return torch.tensor(result, dtype=torch.float64)


@pytest.mark.parametrize("block_numel", [qk_clip.LOGITS_BLOCK_NUMEL, 20], ids=["one", "blocks"])
@pytest.mark.parametrize("mask_kind", ["causal", "bool"])
def test_mla_max_logits_equal_a_float64_brute_force(monkeypatch, block_numel, mask_kind):
    monkeypatch.setattr(qk_clip, "LOGITS_BLOCK_NUMEL", block_numel)
    generator = torch.Generator().manual_seed(0)
    q_nope, q_rope = torch.randn(2, 3, 4, 5, generator=generator), torch.randn(2, 3, 4, 2)
    k_nope = torch.randn(2, 3, 6, 5, generator=generator)  # 6 keys: a cache of 2
    k_rope = torch.randn(2, 1, 6, 2, generator=generator)  # shared by the 3 heads
    keep = torch.rand(2, 1, 4, 6, generator=generator) > 0.3
    keep[..., 0] = True
    if mask_kind == "causal":
        got = dmuon.mla_max_logits(q_nope, q_rope, k_nope, k_rope, scaling=0.7, is_causal=True)
        expected = brute_force_mla(q_nope, q_rope, k_nope, k_rope, 0.7, lambda b, i, j: j <= i + 2)
    else:
        got = dmuon.mla_max_logits(q_nope, q_rope, k_nope, k_rope, scaling=0.7, attention_mask=keep)
        expected = brute_force_mla(
            q_nope, q_rope, k_nope, k_rope, 0.7, lambda b, i, j: bool(keep[b, 0, i, j])
        )
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    # The same maxima from the concatenated q and k an attention kernel takes.
    q = torch.cat([q_nope, q_rope], dim=-1)
    k = torch.cat([k_nope, k_rope.expand(-1, 3, -1, -1)], dim=-1)
    mask = {"is_causal": True} if mask_kind == "causal" else {"attention_mask": keep}
    torch.testing.assert_close(dmuon.attention_max_logits(q, k, scaling=0.7, **mask), got)


def test_mla_max_logits_refuse_a_rotary_key_per_head():
    q_nope, q_rope = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 2)
    k_nope, k_rope = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 2)
    with pytest.raises(
        ValueError, match=r"k_rope \(1, 2, 3, 2\) must be .* the rotary key is shared"
    ):
        dmuon.mla_max_logits(q_nope, q_rope, k_nope, k_rope, scaling=1.0)


def test_mla_and_per_key_group_factors_follow_their_definitions():
    maxima = torch.tensor([50.0, 200.0, 400.0, float("nan")])
    q_content, q_rope, k_content = mla_clip_factors(maxima, threshold=100.0, alpha=0.5)
    torch.testing.assert_close(q_content, torch.tensor([1.0, 0.5**0.5, 0.25**0.5, 1.0]))
    torch.testing.assert_close(q_rope, torch.tensor([1.0, 0.5, 0.25, 1.0]))
    torch.testing.assert_close(k_content, q_content)
    # Two key groups, {50, 200} and {400, nan}: gamma 0.5 and 0.25 (the NaN is left out).
    q, k = clip_factors(maxima, threshold=100.0, alpha=0.25, num_kv_heads=2, gqa="per_key_group")
    torch.testing.assert_close(q, torch.tensor([0.5, 0.5, 0.25, 0.25]) ** 0.25)
    torch.testing.assert_close(k, torch.tensor([0.5, 0.25]) ** 0.75)
    # One key head per query head: both conventions are the paper's rule.
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            clip_factors(maxima, threshold=100.0, alpha=0.3, num_kv_heads=4, gqa="per_key_group"),
            clip_factors(maxima, threshold=100.0, alpha=0.3, num_kv_heads=4),
        )
    )


def threshold_between(values: list[float]) -> float:
    """A threshold with about half the values over it (the midpoint of the two middle ones)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return (ordered[middle - 1] + ordered[middle]) / 2


def one_step_at_lr_zero(model, heads, tokens, **clip_options):
    """dmuon.Muon at lr 0 plus the clip, one step in one process: the weights after it."""
    dmuon.dedicate_params(model, None, lambda name, p: "proj" in name and p.ndim == 2)
    optimizer = dmuon.Muon(model, lr=0.0, adamw_lr=0.0, weight_decay=0.0)
    clip = dmuon.QKClip(model, optimizer, heads, **clip_options)
    for i, layer in enumerate(model.layers):
        layer.attn.record = lambda maxima, i=i: clip.record(f"layers.{i}.attn", maxima)
    loss_of(model, tokens).backward()
    optimizer.step()
    return clip, dmuon.checkpoint.get_model_state_dict(model)


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_b_proj", "q_proj"])
def test_one_mla_clip_matches_the_report_head_by_head(q_lora):
    model = make_mla_model(q_lora)
    inputs = capture_attention_inputs(model)
    with torch.no_grad():
        model(TOKENS[:, :-1])
    maxima = explicit_max_logits(model, inputs)  # float64, from q and k computed explicitly
    tau = threshold_between([s for values in maxima.values() for s in values])
    reference = copy.deepcopy(model)
    assert reference_mla_clip(reference, maxima, tau, 0.5) > 0

    inputs.clear()
    clip, weights = one_step_at_lr_zero(model, mla_heads(model), TOKENS, threshold=tau)

    for i, layer in enumerate(reference.layers):
        name, attn = f"layers.{i}.attn", layer.attn
        torch.testing.assert_close(
            clip.last_max_logits[name].double(),
            torch.tensor(maxima[i], dtype=torch.float64),
            rtol=1e-5,
            atol=1e-6,
        )
        q_weight = getattr(attn, q_name(attn)).weight
        got_q, got_kv = (
            weights[f"{name}.{q_name(attn)}.weight"],
            weights[f"{name}.kv_b_proj.weight"],
        )
        assert torch.equal(weights[f"{name}.kv_a_proj.weight"], attn.kv_a_proj.weight)  # k^R
        for h, s_max in enumerate(maxima[i]):
            q_rows = slice(h * (NOPE + ROPE), (h + 1) * (NOPE + ROPE))
            k_rows = slice(h * (NOPE + V_DIM), h * (NOPE + V_DIM) + NOPE)
            v_rows = slice(h * (NOPE + V_DIM) + NOPE, (h + 1) * (NOPE + V_DIM))
            assert torch.equal(got_kv[v_rows], attn.kv_b_proj.weight[v_rows]), (name, h)
            if s_max <= tau:  # not clipped: every bit as before
                assert torch.equal(got_q[q_rows], q_weight[q_rows]), (name, h)
                assert torch.equal(got_kv[k_rows], attn.kv_b_proj.weight[k_rows]), (name, h)
            else:
                torch.testing.assert_close(got_q[q_rows], q_weight[q_rows], rtol=1e-6, atol=0)
                torch.testing.assert_close(got_kv[k_rows], attn.kv_b_proj.weight[k_rows],
                                           rtol=1e-6, atol=0)  # fmt: skip

    # The same inputs through the clipped weights: clipped heads at tau, the others unchanged.
    model_after = make_mla_model(q_lora)
    model_after.load_state_dict(weights)
    after = explicit_max_logits(model_after, inputs)  # the step's forward: one input per layer
    for i in maxima:
        for h, (before, now) in enumerate(zip(maxima[i], after[i])):
            if before <= tau:
                assert now == before, (i, h)
            else:
                assert now == pytest.approx(tau, rel=1e-5), (i, h, before, now)


# ---- grouped-query attention, one factor per key group ----------------------------------------


def explicit_gqa_max_logits(model, inputs) -> dict[int, list[float]]:
    """Layer -> per query head max over (b, i, j <= i) of scaling * q_h[b, i] . k_{g(h)}[b, j],
    q and k computed in float64 from the attention's input, its weights and biases, head by
    head (rows [h * d, (h + 1) * d)), then RoPE."""
    d, heads = gqa_scenarios.HEAD_DIM, gqa_scenarios.NUM_HEADS
    maxima = {}
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        kv_heads = attn.k_proj.out_features // d
        result = [-math.inf] * heads
        for x in inputs[i]:
            x = x.double()

            def head(proj, h, x=x):
                rows = slice(h * d, (h + 1) * d)
                out = x @ proj.weight.detach().double()[rows].T + proj.bias.detach().double()[rows]
                return gqa_scenarios.rope(out[:, None])[:, 0]  # (batch, seq, d)

            keys = [head(attn.k_proj, g) for g in range(kv_heads)]
            for h in range(heads):
                q, k = head(attn.q_proj, h), keys[h // (heads // kv_heads)]
                for b in range(x.shape[0]):
                    for t in range(x.shape[1]):
                        for j in range(t + 1):
                            logit = d**-0.5 * float(q[b, t] @ k[b, j])
                            result[h] = max(result[h], logit)
        maxima[i] = result
    return maxima


@torch.no_grad()
def reference_per_key_group_clip(model, maxima, tau, alpha) -> list[tuple[int, int]]:
    """gamma_g = tau / max_{h in g} S_h for each key group g over tau: the group's query rows
    (and biases) by gamma_g^alpha, its key rows by gamma_g^(1 - alpha). The groups clipped."""
    d, heads = gqa_scenarios.HEAD_DIM, gqa_scenarios.NUM_HEADS
    clipped = []
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        kv_heads = attn.k_proj.out_features // d
        group = heads // kv_heads
        for g in range(kv_heads):
            worst = max(maxima[i][g * group : (g + 1) * group])
            if worst <= tau:
                continue
            clipped.append((i, g))
            gamma = tau / worst
            for h in range(g * group, (g + 1) * group):
                attn.q_proj.weight[h * d : (h + 1) * d] *= gamma**alpha
                attn.q_proj.bias[h * d : (h + 1) * d] *= gamma**alpha
            attn.k_proj.weight[g * d : (g + 1) * d] *= gamma ** (1 - alpha)
            attn.k_proj.bias[g * d : (g + 1) * d] *= gamma ** (1 - alpha)
    return clipped


def test_per_key_group_clip_matches_its_brute_force_reference():
    alpha, d = 0.3, gqa_scenarios.HEAD_DIM
    model = gqa_scenarios.make_model(kv_heads=2, bias=True)  # 4 query heads, 2 key groups
    inputs = capture_attention_inputs(model)
    with torch.no_grad():
        model(TOKENS[:, :-1])
    maxima = explicit_gqa_max_logits(model, inputs)
    group_worst = [max(values[g * 2 : g * 2 + 2]) for values in maxima.values() for g in (0, 1)]
    tau = threshold_between(group_worst)  # about half the groups clip
    reference = copy.deepcopy(model)
    clipped = reference_per_key_group_clip(reference, maxima, tau, alpha)
    assert 0 < len(clipped) < 4, clipped

    inputs.clear()
    clip, weights = one_step_at_lr_zero(
        model, gqa_scenarios.attention_heads(model), TOKENS, threshold=tau, alpha=alpha,
        gqa="per_key_group",
    )  # fmt: skip

    for i, layer in enumerate(reference.layers):
        name, attn = f"layers.{i}.attn", layer.attn
        torch.testing.assert_close(
            clip.last_max_logits[name].double(),
            torch.tensor(maxima[i], dtype=torch.float64),
            rtol=1e-5,
            atol=1e-6,
        )
        for g in (0, 1):
            q_rows, k_rows = slice(2 * g * d, 2 * (g + 1) * d), slice(g * d, (g + 1) * d)
            pairs = [
                (weights[f"{name}.q_proj.weight"][q_rows], attn.q_proj.weight[q_rows]),
                (weights[f"{name}.q_proj.bias"][q_rows], attn.q_proj.bias[q_rows]),
                (weights[f"{name}.k_proj.weight"][k_rows], attn.k_proj.weight[k_rows]),
                (weights[f"{name}.k_proj.bias"][k_rows], attn.k_proj.bias[k_rows]),
            ]
            for got, expected in pairs:
                if (i, g) in clipped:
                    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
                else:  # a group under the threshold: every bit as before
                    assert torch.equal(got, expected), (name, g)

    model_after = gqa_scenarios.make_model(kv_heads=2, bias=True)
    model_after.load_state_dict(weights)
    after = explicit_gqa_max_logits(model_after, inputs)
    for i in maxima:
        for g in (0, 1):
            before_g, after_g = maxima[i][2 * g : 2 * g + 2], after[i][2 * g : 2 * g + 2]
            if (i, g) not in clipped:
                assert after_g == before_g, (i, g)
                continue
            # The group's worst head ends at tau; its other head scales by the same gamma_g.
            gamma = tau / max(before_g)
            assert max(after_g) == pytest.approx(tau, rel=1e-5), (i, g)
            for before, now in zip(before_g, after_g):
                assert now == pytest.approx(before * gamma, rel=1e-5), (i, g)


def test_mla_setup_errors_say_what_is_wrong_and_the_fix():
    model = make_mla_model()
    dmuon.dedicate_params(model, None, lambda name, p: "proj" in name and p.ndim == 2)
    optimizer = dmuon.Muon(model)
    heads = mla_heads(model)
    with pytest.raises(
        ValueError, match=r"gqa must be one of \('per_query_head', 'per_key_group'\)"
    ):
        dmuon.QKClip(model, optimizer, heads, gqa="per_group")
    wrong = [dmuon.MLAHeads(name="a", q_weight="layers.0.attn.q_b_proj.weight",
                            kv_weight="layers.0.attn.kv_a_proj.weight", num_heads=NUM_HEADS,
                            qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM)]  # fmt: skip
    with pytest.raises(
        ValueError,
        match=rf"kv_weight layers.0.attn.kv_a_proj.weight has shape \({KV_LORA + ROPE}, 24\); "
        r"with num_heads=4 and qk_nope_head_dim \+ v_head_dim = 7 it should be \(28, in\)",
    ):
        dmuon.QKClip(model, optimizer, wrong)
    with pytest.raises(ValueError, match=r"every one must be positive"):
        dmuon.QKClip(model, optimizer, [dmuon.MLAHeads(
            name="a", q_weight="x", kv_weight="y", num_heads=4, qk_nope_head_dim=4,
            qk_rope_head_dim=0, v_head_dim=3)])  # fmt: skip
    assert SCALING != (NOPE + ROPE) ** -0.5  # the tests clip with YaRN's mscale in the scale
