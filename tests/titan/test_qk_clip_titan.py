"""dmuon_titan.qk_clip_titan on torchtitan 0.3's own DeepSeek-V3 attention (multi-head latent
attention, built from its ``make_mla_attention_config`` with YaRN scaling): the description
names ``wq_b`` / ``wq`` and ``wkv_b`` with the module's dims; the observing pre-hook leaves the
outputs bitwise unchanged and records the largest logit the softmax sees (float64 brute force
over the q and k the inner attention receives, with torchtitan's softmax scale; flex attention's
BlockMask too); and one step at learning rate 0 clips as Kimi K2's report says for MLA (arXiv
2507.20534, section 2.1): heads under the threshold keep every bit, the others' content rows of
q and k scale by sqrt(gamma), their rotary query rows by gamma, wkv_a stays."""

from __future__ import annotations

# First: its import-time workarounds must precede torchtitan's own import (see its docstring).
import tests.titan.titan_on_cpu  # noqa: F401

# isort: split
import dataclasses
import math

import pytest
import torch
from torch import nn
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3 import make_mla_attention_config, model_registry

import dmuon
import dmuon.checkpoint
from dmuon_titan.qk_clip import mla_attention_heads, qk_clip_titan

DIM, HEADS, NOPE, ROPE, V_DIM, KV_LORA = 32, 4, 4, 4, 6, 8


class Block(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention(x, None, None)


class TwoBlocks(nn.Module):
    def __init__(self, q_lora: bool) -> None:
        super().__init__()
        debug = model_registry("debugmodel").model.layers[0].attention  # its inits and YaRN
        config = make_mla_attention_config(
            layer_id=0, dim=DIM, n_heads=HEADS, q_lora_rank=16 if q_lora else 0,
            kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
            v_head_dim=V_DIM, mscale=0.7, attn_backend="flex",
            linear_init=debug.wkv_a.param_init, norm_init=debug.kv_norm.param_init,
            depth_init=lambda layer_id: debug.wo.param_init,
            rope=dataclasses.replace(debug.rope, dim=ROPE, max_seq_len=64),
        )  # fmt: skip
        # FlexAttention has no backward on CPU (tests/titan/titan_on_cpu.py): causal SDPA.
        config.inner_attention = ScaledDotProductAttention.Config()
        self.layers = nn.ModuleList(Block(config.build()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def titan_model(q_lora: bool = True) -> TwoBlocks:
    torch.manual_seed(0)
    model = TwoBlocks(q_lora)
    for layer in model.layers:
        layer.attention.init_states()
    with torch.no_grad():  # larger up-projections and shared rotary key: logits of a few units
        for layer in model.layers:
            attn = layer.attention
            (attn.wq_b if q_lora else attn.wq).weight.mul_(8.0)
            attn.wkv_b.weight.mul_(8.0)
            attn.wkv_a.weight[KV_LORA:].mul_(8.0)
    return model


def predicate(name: str, param: nn.Parameter) -> bool:
    return param.ndim == 2


def captured_qk(model: TwoBlocks, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(q, k) in float64, (batch, heads, seq, dim), as each layer's inner attention gets them."""
    store = []
    handles = [
        layer.attention.inner_attention.register_forward_pre_hook(
            lambda module, args: store.append(
                (
                    args[0].detach().transpose(1, 2).double(),
                    args[1].detach().transpose(1, 2).double(),
                )
            )
        )
        for layer in model.layers
    ]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return store


def brute_force_max_logits(q, k, scale, allowed=lambda b, i, j: j <= i) -> list[float]:
    batch, heads, seq, _ = q.shape
    result = [-math.inf] * heads
    for b in range(batch):
        for h in range(heads):
            for i in range(seq):
                for j in range(k.shape[2]):
                    if allowed(b, i, j):
                        result[h] = max(result[h], scale * float(q[b, h, i] @ k[b, h, j]))
    return result


@pytest.mark.parametrize("q_lora", [True, False], ids=["wq_b", "wq"])
def test_the_description_names_the_up_projections_with_the_modules_dims(q_lora):
    heads = mla_attention_heads(titan_model(q_lora))
    query = "wq_b" if q_lora else "wq"
    assert heads == [
        dmuon.MLAHeads(
            name=f"layers.{i}.attention", q_weight=f"layers.{i}.attention.{query}.weight",
            kv_weight=f"layers.{i}.attention.wkv_b.weight", num_heads=HEADS,
            qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
        )
        for i in range(2)
    ]  # fmt: skip


@pytest.mark.parametrize("q_lora", [True, False], ids=["wq_b", "wq"])
def test_one_step_at_lr_zero_clips_as_the_report_says_for_mla(q_lora):
    model = titan_model(q_lora)
    x = torch.randn(2, 7, DIM, generator=torch.Generator().manual_seed(1))
    scale = model.layers[0].attention.softmax_scale
    assert scale != (NOPE + ROPE) ** -0.5  # YaRN's mscale is in torchtitan's softmax scale
    maxima = [brute_force_max_logits(q, k, scale) for q, k in captured_qk(model, x)]
    ordered = sorted(s for values in maxima for s in values)
    tau = (ordered[3] + ordered[4]) / 2  # half the 8 heads over it
    before = {name: value.clone() for name, value in model.state_dict().items()}
    expected_output = model(x)

    dmuon.dedicate_params(model, None, predicate)
    optimizer = dmuon.Muon(model, lr=0.0, adamw_lr=0.0)
    clip = qk_clip_titan(model, optimizer, threshold=tau)
    output = model(x)
    assert torch.equal(output, expected_output)  # observing changes no bit
    output.square().sum().backward()
    optimizer.step()
    assert clip.clipped_heads == 4
    for i in range(2):
        torch.testing.assert_close(
            clip.last_max_logits[f"layers.{i}.attention"].double(),
            torch.tensor(maxima[i], dtype=torch.float64), rtol=1e-5, atol=1e-6,
        )  # fmt: skip

    weights = dmuon.checkpoint.get_model_state_dict(model)
    query = "wq_b" if q_lora else "wq"
    for i in range(2):
        prefix = f"layers.{i}.attention"
        assert torch.equal(weights[f"{prefix}.wkv_a.weight"], before[f"{prefix}.wkv_a.weight"])
        q_weight, kv_weight = f"{prefix}.{query}.weight", f"{prefix}.wkv_b.weight"
        for h, s_max in enumerate(maxima[i]):
            q_rows, kv_rows = h * (NOPE + ROPE), h * (NOPE + V_DIM)
            parts = [  # (name, rows, the report's factor as a power of gamma)
                (q_weight, slice(q_rows, q_rows + NOPE), 0.5),  # q^C: sqrt(gamma)
                (q_weight, slice(q_rows + NOPE, q_rows + NOPE + ROPE), 1.0),  # q^R: gamma
                (kv_weight, slice(kv_rows, kv_rows + NOPE), 0.5),  # k^C: sqrt(gamma)
                (kv_weight, slice(kv_rows + NOPE, kv_rows + NOPE + V_DIM), 0.0),  # v stays
            ]
            for name, rows, power in parts:
                if s_max <= tau or power == 0.0:
                    assert torch.equal(weights[name][rows], before[name][rows]), (name, h)
                else:
                    torch.testing.assert_close(
                        weights[name][rows], before[name][rows] * (tau / s_max) ** power,
                        rtol=1e-6, atol=0,
                    )  # fmt: skip
    # The first layer's inputs do not depend on the clip: through torchtitan's own forward its
    # clipped heads are at tau now, the others unchanged.
    model_after = titan_model(q_lora)
    model_after.load_state_dict(weights)
    after = brute_force_max_logits(*captured_qk(model_after, x)[0], scale)
    for h, (s_before, s_after) in enumerate(zip(maxima[0], after)):
        if s_before <= tau:
            assert s_after == s_before, h
        else:
            assert s_after == pytest.approx(tau, rel=1e-5), h


def test_flex_attentions_block_mask_is_observed_with_its_mask_mod():
    from torch.nn.attention.flex_attention import create_block_mask

    from dmuon_titan.qk_clip import _RECORD_ATTR, _observe

    generator = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 6, HEADS, 8, generator=generator), torch.randn(2, 6, HEADS, 8)
    documents = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]])

    def block_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (documents[b, kv_idx] == documents[b, q_idx])

    mask = create_block_mask(block_causal, 2, None, 6, 6, device="cpu")
    recorded = []
    inner = nn.Module()
    inner.__dict__[_RECORD_ATTR] = recorded.append
    _observe(inner, (q, k, k), {"attention_masks": mask, "scale": 0.3})
    expected = brute_force_max_logits(
        q.transpose(1, 2).double(), k.transpose(1, 2).double(), 0.3,
        lambda b, i, j: j <= i and bool(documents[b, j] == documents[b, i]),
    )  # fmt: skip
    torch.testing.assert_close(recorded[0].double(), torch.tensor(expected, dtype=torch.float64))
