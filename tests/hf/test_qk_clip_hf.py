"""dmuon_hf.qk_clip_hf: QK-clip on HF Llama / Qwen2 / Qwen3 / DeepSeek-V3 through transformers'
AttentionInterface. The observing attention leaves the outputs bitwise unchanged, records the
largest logit the softmax sees (checked in float64 against q and k captured from the model, with
padding; DeepSeek-V3's with YaRN's mscale in its scale), and a few clipping steps of dmuon.Muon
match a plain reference model trained with the reference optimizer and clipped from the formula
head by head (DeepSeek-V3: Kimi K2's rule for MLA; one step at lr 0 leaves the heads under the
threshold bitwise and brings the others to it)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import dmuon
from dmuon_hf import default_predicate, qk_clip_hf
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.hf.tiny_models import VOCAB_SIZE, tiny_llama, tiny_qwen2, tiny_qwen3
from tests.reference_optim import ReferenceMuonAdamW

MODELS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}
STEPS = 3


def _capturing(store: list, module, query, key, value, attention_mask, **kwargs):
    store.append((module.layer_idx, query.detach().double(), key.detach().double()))
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def captured_qk(model, tokens, attention_mask=None) -> list:
    """(layer, q, k) of every attention call of one forward, after RoPE and QK-norm."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    store: list = []
    AttentionInterface.register("test_capture", functools.partial(_capturing, store))
    AttentionMaskInterface.register("test_capture", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    previous = model.config._attn_implementation
    model.set_attn_implementation("test_capture")
    try:
        with torch.no_grad():
            model(tokens, attention_mask=attention_mask)
    finally:
        model.set_attn_implementation(previous)
    return store


def brute_force_max_logits(q, k, scaling, attention_mask=None) -> torch.Tensor:
    """max over (b, i, j) of scaling * q[b, h, i] . k[b, h // group, j], for keys j <= i that are
    not padding: the pairs HF's causal mask lets the softmax see."""
    batch, heads, seq, _ = q.shape
    group = heads // k.shape[1]
    result = torch.full((heads,), -torch.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(seq):
                for j in range(i + 1):
                    if attention_mask is not None and attention_mask[b, j] == 0:
                        continue
                    logit = scaling * float(q[b, h, i] @ k[b, h // group, j])
                    result[h] = max(result[h], logit)
    return result


def reference_clip(model, maxima: dict[int, torch.Tensor], tau: float, alpha: float) -> None:
    """Kimi K2's QK-clip head by head (see tests/distributed/scenarios_qk_clip.py)."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            s_max = [float(s) for s in maxima[index]]
            if getattr(attn, "q_norm", None) is not None:
                if max(s_max) > tau:
                    gamma = tau / max(s_max)
                    attn.q_norm.weight.mul_(gamma**alpha)
                    attn.k_norm.weight.mul_(gamma ** (1 - alpha))
                continue
            for h, s in enumerate(s_max):
                if s <= tau:
                    continue
                gamma = tau / s
                rows = slice(h * attn.head_dim, (h + 1) * attn.head_dim)
                q_factor = gamma if kv_heads < heads else gamma**alpha
                attn.q_proj.weight[rows] *= q_factor
                if attn.q_proj.bias is not None:
                    attn.q_proj.bias[rows] *= q_factor
                if kv_heads == heads:
                    attn.k_proj.weight[rows] *= gamma ** (1 - alpha)
                    if attn.k_proj.bias is not None:
                        attn.k_proj.bias[rows] *= gamma ** (1 - alpha)


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), tokens[:, 1:].reshape(-1))


def scale_up_qk(model, factor: float = 8.0) -> None:
    """Larger q/k weights: maxima of 1.4 to 4 at the first step, so a threshold of 2 clips some
    heads (Qwen3's QK-norm bounds its logits by sqrt(head_dim) whatever the weights)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(factor)
            layer.self_attn.k_proj.weight.mul_(factor)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_the_observing_attention_changes_no_output_bit_and_records_the_softmax_max(implementation):
    model = tiny_qwen2()
    model.set_attn_implementation(implementation)
    tokens = torch.randint(0, VOCAB_SIZE, (2, 6), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(2, 6, dtype=torch.long)
    padding[0, :2] = 0  # left padding
    dmuon.dedicate_params(model, None, default_predicate(model))
    optimizer = dmuon.Muon(model)
    expected = model(tokens, attention_mask=padding).logits
    clip = qk_clip_hf(model, optimizer, threshold=1e6)
    assert model.config._attn_implementation == f"dmuon_qk_clip_{implementation}"
    observed = model(tokens, attention_mask=padding).logits
    assert torch.equal(observed, expected)
    optimizer.step()  # reduces the maxima recorded by the forward above
    scaling = model.model.layers[0].self_attn.scaling
    model.set_attn_implementation("sdpa")
    for layer, q, k in captured_qk(model, tokens, padding):
        expected_max = brute_force_max_logits(q, k, scaling, padding)
        torch.testing.assert_close(
            clip.last_max_logits[f"model.layers.{layer}.self_attn"].double(),
            expected_max,
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_clipping_steps_match_the_reference_clipped_from_the_formula(model_type):
    tau, alpha = 2.0, 0.5
    model, reference = MODELS[model_type](), MODELS[model_type]()
    scale_up_qk(model)
    scale_up_qk(reference)
    predicate = default_predicate(model)
    dmuon.dedicate_params(model, None, predicate)
    optimizer = dmuon.Muon(
        model, ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas")
    )
    clip = qk_clip_hf(model, optimizer, threshold=tau, alpha=alpha)
    reference_optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        predicate,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
    )
    generator = torch.Generator().manual_seed(1)
    clipped = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB_SIZE, (2, 8), generator=generator)
        maxima = {
            layer: brute_force_max_logits(q, k, reference.model.layers[0].self_attn.scaling)
            for layer, q, k in captured_qk(reference, tokens[:, :-1])
        }
        lm_loss(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        lm_loss(reference, tokens).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        reference_clip(reference, maxima, tau, alpha)
        clipped.append(clip.clipped_heads)
    assert clipped[0] > 0, clipped  # the test clips
    weights = dmuon.checkpoint.get_model_state_dict(model)
    for name, expected in reference.state_dict().items():
        torch.testing.assert_close(weights[name], expected, rtol=2e-5, atol=2e-6, msg=name)


def test_an_unsupported_attention_implementation_is_refused_with_the_fix():
    model = tiny_llama()
    dmuon.dedicate_params(model, None, default_predicate(model))
    optimizer = dmuon.Muon(model)
    model.config._attn_implementation_internal = "flex_attention"
    with pytest.raises(
        ValueError, match=r"uses 'flex_attention'\. Load it with attn_implementation='sdpa'"
    ):
        qk_clip_hf(model, optimizer)


# ---- DeepSeek-V3: multi-head latent attention ---------------------------------------------------


def tiny_deepseek_v3(q_lora: bool = True, seed: int = 0):
    """Two dense layers (no experts) of DeepSeek-V3's MLA, 4 heads of 4 content + 4 rotary query
    and key dims and 8 value dims, YaRN scaling (its mscale enters the softmax scale)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, first_k_dense_replace=2,
        q_lora_rank=16 if q_lora else None, kv_lora_rank=8, qk_nope_head_dim=4,
        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, n_group=1, topk_group=1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 16, "mscale": 1.0,
                         "mscale_all_dim": 1.0},
    )  # fmt: skip
    return DeepseekV3ForCausalLM(config)


def mla_query(attn):
    return attn.q_b_proj if attn.q_b_proj is not None else attn.q_proj


def scale_up_mla(model, factor: float = 6.0) -> None:
    """Larger up-projections and shared rotary key (the latents are normalised, so the logits
    grow with these alone): maxima of 0.3 to 1.2 in the first steps."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            mla_query(attn).weight.mul_(factor)
            attn.kv_b_proj.weight.mul_(factor)
            attn.kv_a_proj_with_mqa.weight[attn.kv_lora_rank :].mul_(factor)


def reference_mla_clip(model, maxima: dict[int, torch.Tensor], tau: float, alpha: float) -> set:
    """Kimi K2's QK-clip for MLA head by head (arXiv 2507.20534, section 2.1): the head's content
    rows of q_b_proj and kv_b_proj by gamma^alpha and gamma^(1 - alpha), its rotary rows of
    q_b_proj by gamma; the value rows and the shared rotary key (kv_a_proj_with_mqa) untouched.
    The (layer, head) pairs clipped."""
    clipped = set()
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            nope, rope, v = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
            for h, s in enumerate(float(s) for s in maxima[index]):
                if s <= tau:
                    continue
                clipped.add((index, h))
                gamma = tau / s
                q_rows, kv_rows = h * (nope + rope), h * (nope + v)
                mla_query(attn).weight[q_rows : q_rows + nope] *= gamma**alpha
                mla_query(attn).weight[q_rows + nope : q_rows + nope + rope] *= gamma
                attn.kv_b_proj.weight[kv_rows : kv_rows + nope] *= gamma ** (1 - alpha)
    return clipped


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_deepseek_v3_observed_maxima_are_the_softmax_max_with_yarn_scaling(implementation):
    model = tiny_deepseek_v3()
    model.set_attn_implementation(implementation)
    attn = model.model.layers[0].self_attn
    assert attn.scaling != (attn.qk_head_dim) ** -0.5  # YaRN's mscale is in the scale
    tokens = torch.randint(0, VOCAB_SIZE, (2, 6), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(2, 6, dtype=torch.long)
    padding[0, :2] = 0
    dmuon.dedicate_params(model, None, default_predicate(model))
    optimizer = dmuon.Muon(model)
    expected = model(tokens, attention_mask=padding).logits
    clip = qk_clip_hf(model, optimizer, threshold=1e6)
    assert all(isinstance(layer, dmuon.MLAHeads) for layer in clip.layers.values())
    assert torch.equal(model(tokens, attention_mask=padding).logits, expected)
    optimizer.step()
    model.set_attn_implementation("sdpa")
    for layer, q, k in captured_qk(model, tokens, padding):
        torch.testing.assert_close(
            clip.last_max_logits[f"model.layers.{layer}.self_attn"].double(),
            brute_force_max_logits(q, k, attn.scaling, padding),
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_b_proj", "q_proj"])
def test_deepseek_v3_one_clip_leaves_heads_under_tau_bitwise_and_brings_the_others_to_tau(q_lora):
    # One step at learning rate 0: the clip alone changes the weights.
    model, reference = tiny_deepseek_v3(q_lora), tiny_deepseek_v3(q_lora)
    scale_up_mla(model)
    scale_up_mla(reference)
    tokens = torch.randint(0, VOCAB_SIZE, (2, 8), generator=torch.Generator().manual_seed(1))
    scaling = model.model.layers[0].self_attn.scaling
    maxima = {
        layer: brute_force_max_logits(q, k, scaling) for layer, q, k in captured_qk(model, tokens)
    }
    ordered = sorted(float(s) for values in maxima.values() for s in values)
    tau = (ordered[3] + ordered[4]) / 2  # half the 8 heads over it
    before = {name: value.clone() for name, value in model.state_dict().items()}
    clipped = reference_mla_clip(reference, maxima, tau, 0.5)
    dmuon.dedicate_params(model, None, default_predicate(model))
    optimizer = dmuon.Muon(model, lr=0.0, adamw_lr=0.0)
    clip = qk_clip_hf(model, optimizer, threshold=tau)
    model(tokens).logits.sum().backward()
    optimizer.step()
    assert clip.clipped_heads == len(clipped) == 4
    weights = dmuon.checkpoint.get_model_state_dict(model)
    expected = reference.state_dict()
    q_name = "q_b_proj" if q_lora else "q_proj"
    for layer in range(2):
        prefix = f"model.layers.{layer}.self_attn"
        for name in (f"{prefix}.kv_a_proj_with_mqa.weight", f"{prefix}.q_a_proj.weight"):
            if name in before:  # the shared rotary key and the query LoRA stay
                assert torch.equal(weights[name], before[name]), name
        for h in range(4):
            for name, rows in (
                (f"{prefix}.{q_name}.weight", slice(h * 8, (h + 1) * 8)),  # 4 content, 4 rotary
                (f"{prefix}.kv_b_proj.weight", slice(h * 12, (h + 1) * 12)),  # 4 key, 8 value
            ):
                if (layer, h) in clipped:
                    torch.testing.assert_close(weights[name][rows], expected[name][rows],
                                               rtol=1e-6, atol=0)  # fmt: skip
                else:
                    assert torch.equal(weights[name][rows], before[name][rows]), (name, h)
    # The first layer's inputs do not depend on the clip: its heads' maxima through the model's
    # own forward are unchanged under tau and at tau for the clipped ones.
    plain = tiny_deepseek_v3(q_lora)
    plain.load_state_dict(weights)
    after = brute_force_max_logits(*captured_qk(plain, tokens)[0][1:], scaling)
    for h in range(4):
        if (0, h) in clipped:
            assert float(after[h]) == pytest.approx(tau, rel=1e-5), h
        else:
            assert after[h] == maxima[0][h], h


def test_deepseek_v3_clipping_steps_match_the_reference_clipped_from_the_report():
    tau, alpha = 0.6, 0.5  # the first step's maxima are 0.31 to 0.90: 5 of 8 heads clip
    model, reference = tiny_deepseek_v3(), tiny_deepseek_v3()
    scale_up_mla(model)
    scale_up_mla(reference)
    predicate = default_predicate(model)
    dmuon.dedicate_params(model, None, predicate)
    optimizer = dmuon.Muon(
        model, ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas")
    )
    clip = qk_clip_hf(model, optimizer, threshold=tau, alpha=alpha)
    reference_optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        predicate,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
    )
    scaling = reference.model.layers[0].self_attn.scaling
    generator = torch.Generator().manual_seed(1)
    clipped = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB_SIZE, (2, 8), generator=generator)
        maxima = {
            layer: brute_force_max_logits(q, k, scaling)
            for layer, q, k in captured_qk(reference, tokens[:, :-1])
        }
        lm_loss(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        lm_loss(reference, tokens).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        assert clip.clipped_heads == len(reference_mla_clip(reference, maxima, tau, alpha))
        clipped.append(clip.clipped_heads)
    assert clipped[0] > 0 and min(clipped) < 8, clipped  # the test clips, and spares some heads
    weights = dmuon.checkpoint.get_model_state_dict(model)
    for name, expected in reference.state_dict().items():
        torch.testing.assert_close(weights[name], expected, rtol=2e-5, atol=2e-6, msg=name)
