"""QK-clip for HuggingFace Llama, Qwen2, Qwen3 and DeepSeek-V3: ``qk_clip_hf(model, optimizer)``.

Owns finding an HF decoder's attention layers (q/k projections, Qwen2's biases, Qwen3's QK-norm
gains, head counts; DeepSeek-V3's multi-head latent attention as ``dmuon.MLAHeads``: its query
up-projection ``q_b_proj``, or ``q_proj`` without a query LoRA, and its key-value up-projection
``kv_b_proj``) and observing their logits through transformers' ``AttentionInterface``:
the model's attention implementation (``"sdpa"`` or ``"eager"``) is replaced by a registered one,
``"dmuon_qk_clip_<impl>"``, that computes each head's largest logit
(``dmuon.attention_max_logits``, with the mask the implementation gets) and then calls the
original unchanged, so the outputs are bitwise those of the original. DeepSeek-V3 hands that
function its query and key with the content and rotary parts concatenated (the shared rotary key
repeated per head) and its softmax scale, YaRN's mscale included, as ``scaling``: the logits
observed are the ones its softmax sees. The clip itself is ``dmuon.QKClip``'s.

Cost: one extra ``q k^T`` per attention call in training forwards (half the attention's two
matmuls; eager attention computes it too, but returns the softmax, not the logits), in blocks of
bounded memory and without autograd. Flash and flex attention are not observed (their masks and
packed sequences differ): use sdpa or eager, or record from your own attention with
``dmuon.QKClip.record``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch import nn

import dmuon
from dmuon.inspect import canonical_fqn

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "deepseek_v3")
OBSERVED_IMPLEMENTATIONS = ("sdpa", "eager")
IMPLEMENTATION_PREFIX = "dmuon_qk_clip_"
# Set on each observed attention module: records the maxima of one forward under its name.
_RECORD_ATTR = "_dmuon_qk_clip_record"


def qk_clip_hf(
    model: nn.Module,
    optimizer: dmuon.Muon,
    *,
    threshold: float = 100.0,
    alpha: float = 0.5,
    gqa: dmuon.GQAClip = "per_query_head",
) -> dmuon.QKClip:
    """``dmuon.QKClip`` on every attention layer of an HF Llama / Qwen2 / Qwen3 / DeepSeek-V3
    model prepared with ``dmuon.dedicate_params``, observed through its attention implementation
    (switched to ``"dmuon_qk_clip_sdpa"`` or ``"dmuon_qk_clip_eager"``). DeepSeek-V3's attention
    is clipped as Kimi K2 clips MLA (``dmuon.MLAHeads``); ``gqa`` picks grouped-query attention's
    convention (``dmuon.QKClip``). Call it after building the ``dmuon.Muon``; ``clip.remove()``
    stops the clip (the observing implementation stays)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"dmuon_hf.qk_clip_hf supports model types {SUPPORTED_MODEL_TYPES}, got "
            f"{model_type!r}. For another model, list its layers with dmuon.AttentionHeads and "
            "call clip.record(name, dmuon.attention_max_logits(q, k, scaling=...)) from its "
            "attention (see the core README)."
        )
    implementation = config._attn_implementation
    if implementation.startswith(IMPLEMENTATION_PREFIX):
        raise RuntimeError(
            f"dmuon_hf.qk_clip_hf was already applied to this model (its attention is "
            f"{implementation!r}); keep the QKClip it returned, or clip.remove() it and build "
            "a new one with dmuon.QKClip."
        )
    if implementation not in OBSERVED_IMPLEMENTATIONS:
        raise ValueError(
            f"dmuon_hf.qk_clip_hf observes the logits of attn_implementation "
            f"{OBSERVED_IMPLEMENTATIONS}, but this model uses {implementation!r}. Load it with "
            "attn_implementation='sdpa' (or model.set_attn_implementation('sdpa')), or record "
            "the maxima from your attention with dmuon.QKClip.record."
        )
    attention = _attention_modules(model)
    if not attention:
        raise ValueError(
            f"dmuon_hf.qk_clip_hf found no attention module with q_proj and k_proj (or, for "
            f"MLA, q_b_proj or q_proj and kv_b_proj) in this {type(model).__name__}."
        )
    heads = [_heads_of(name, module, config) for name, module in attention.items()]
    clip = dmuon.QKClip(model, optimizer, heads, threshold=threshold, alpha=alpha, gqa=gqa)
    for name, module in attention.items():
        module.__dict__[_RECORD_ATTR] = functools.partial(clip.record, name)
    model.set_attn_implementation(_register(implementation))
    return clip


def _attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Canonical name -> attention module (one with q_proj and k_proj projections, or MLA's)."""
    return {
        canonical_fqn(name): module
        for name, module in model.named_modules()
        if (
            isinstance(getattr(module, "q_proj", None), nn.Linear)
            and isinstance(getattr(module, "k_proj", None), nn.Linear)
        )
        or _is_mla(module)
    }


def _is_mla(module: nn.Module) -> bool:
    """DeepSeek-V3's multi-head latent attention: a query up-projection (``q_b_proj``, or
    ``q_proj`` without a query LoRA) and a key-value up-projection ``kv_b_proj``."""
    query = getattr(module, "q_b_proj", None) or getattr(module, "q_proj", None)
    return isinstance(query, nn.Linear) and isinstance(
        getattr(module, "kv_b_proj", None), nn.Linear
    )


def _heads_of(name: str, module: nn.Module, config) -> dmuon.AttentionHeads | dmuon.MLAHeads:
    if _is_mla(module):
        query = "q_b_proj" if isinstance(getattr(module, "q_b_proj", None), nn.Linear) else "q_proj"
        return dmuon.MLAHeads(
            name=name,
            q_weight=f"{name}.{query}.weight",
            kv_weight=f"{name}.kv_b_proj.weight",
            num_heads=config.num_attention_heads,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
        )
    has_norm = getattr(module, "q_norm", None) is not None
    return dmuon.AttentionHeads(
        name=name,
        q_weight=f"{name}.q_proj.weight",
        k_weight=f"{name}.k_proj.weight",
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        q_bias=f"{name}.q_proj.bias" if module.q_proj.bias is not None else None,
        k_bias=f"{name}.k_proj.bias" if module.k_proj.bias is not None else None,
        q_norm=f"{name}.q_norm.weight" if has_norm else None,
        k_norm=f"{name}.k_norm.weight" if has_norm else None,
    )


def _register(implementation: str) -> str:
    """Register the observing attention (and the original's mask) under their name, once."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = IMPLEMENTATION_PREFIX + implementation
    AttentionInterface.register(name, functools.partial(_observed_attention, implementation))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    return name


def _observed_attention(
    implementation: str,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
):
    record = module.__dict__.get(_RECORD_ATTR)
    if record is not None and torch.is_grad_enabled():
        # sdpa reads no mask as causal attention (transformers' own rule); eager always gets one.
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        is_causal = (
            implementation == "sdpa" and attention_mask is None and query.shape[2] > 1 and causal
        )
        record(
            dmuon.attention_max_logits(
                query,
                key,
                scaling=kwargs.get("scaling", module.scaling),
                attention_mask=attention_mask,
                is_causal=is_causal,
            )
        )
    return _original(implementation, module)(module, query, key, value, attention_mask, **kwargs)


def _original(implementation: str, module: nn.Module) -> Callable:
    if implementation == "eager":  # each model's own function, beside its attention class
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[implementation]
