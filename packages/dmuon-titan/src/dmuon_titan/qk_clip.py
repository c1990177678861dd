"""QK-clip for torchtitan's DeepSeek-V3 / Kimi K2 attention (multi-head latent attention):
``mla_attention_heads(model)`` and ``qk_clip_titan(model, optimizer)``.

Owns the description of torchtitan's MLA layers for ``dmuon.QKClip`` (each attention module with
a query up-projection ``wq_b``, or ``wq`` when ``q_lora_rank`` is 0, and a key-value
up-projection ``wkv_b``: ``dmuon.MLAHeads`` with the module's head counts and dims; the shared
rotary key, the last ``qk_rope_head_dim`` rows of ``wkv_a``, is never clipped) and the
observation of their logits: a forward pre-hook on each one's ``inner_attention`` reads the
query and key it is handed ((batch, seq, heads, dim), the content and rotary parts concatenated,
the rotary key repeated per head) and the ``scale`` (DeepSeek's softmax scale with YaRN's mscale)
and records ``dmuon.attention_max_logits`` under the module's name. Causal attention
(``ScaledDotProductAttention``, no mask) and flex attention's ``BlockMask`` (made dense with its
own ``mask_mod``) are observed; varlen attention is refused. It must not change the attention's
inputs or outputs, and it does not wire the clip into dmuon-titan's trainer or options (the
trainer does, from ``--dmuon.qk_clip_threshold``). Inside ``unobserved()`` nothing is recorded:
forwards that are not training forwards although gradients are on (a pipeline stage's metadata
inference, see [Note: the pipeline's metadata inference] in ``dmuon_titan.trainer``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

import dmuon
from dmuon.inspect import canonical_fqn

# Set on each observed inner attention: records the maxima of one forward under its layer name.
_RECORD_ATTR = "_dmuon_qk_clip_record"
# How many ``unobserved()`` blocks are open (the training loop's thread runs every forward).
_unobserved_depth = 0


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """No attention logits recorded inside: for forwards that are not training forwards though
    gradients are on (a pipeline stage's metadata inference on uninitialized inputs)."""
    global _unobserved_depth
    _unobserved_depth += 1
    try:
        yield
    finally:
        _unobserved_depth -= 1


def mla_attention_heads(model: nn.Module) -> list[dmuon.MLAHeads]:
    """One ``dmuon.MLAHeads`` per MLA attention module of a torchtitan model (DeepSeek-V3, Kimi
    K2: modules with ``wkv_b`` and ``wq_b`` or ``wq``), named by its canonical FQN."""
    return [_heads_of(name, module) for name, module in _mla_modules(model).items()]


def qk_clip_titan(
    model: nn.Module,
    optimizer: dmuon.Muon,
    *,
    threshold: float = 100.0,
    alpha: float = 0.5,
    gqa: dmuon.GQAClip = "per_query_head",
) -> dmuon.QKClip:
    """``dmuon.QKClip`` on every MLA layer of a torchtitan model part prepared with dmuon
    (``mla_attention_heads``), observed through a forward pre-hook on each layer's
    ``inner_attention``. Call it after building the part's ``dmuon.Muon``; ``clip.remove()``
    stops the clip (the observing hooks stay). Under pipeline parallelism, one per model part,
    each with its part's optimizer."""
    modules = _mla_modules(model)
    if not modules:
        raise ValueError(
            f"dmuon_titan.qk_clip_titan found no multi-head latent attention (a module with "
            f"wkv_b and wq_b or wq) in this {type(model).__name__}. For other attention, list "
            "its layers with dmuon.AttentionHeads and record from it with dmuon.QKClip.record."
        )
    clip = dmuon.QKClip(
        model,
        optimizer,
        [_heads_of(name, module) for name, module in modules.items()],
        threshold=threshold,
        alpha=alpha,
        gqa=gqa,
    )
    for name, module in modules.items():
        inner = module.inner_attention
        if getattr(inner, _RECORD_ATTR, None) is None:
            inner.register_forward_pre_hook(_observe, with_kwargs=True)
        inner.__dict__[_RECORD_ATTR] = functools.partial(clip.record, name)
    return clip


def _mla_modules(model: nn.Module) -> dict[str, nn.Module]:
    modules = {}
    for name, module in model.named_modules():
        query = getattr(module, "wq_b", None) or getattr(module, "wq", None)
        if (
            isinstance(query, nn.Linear)
            and isinstance(getattr(module, "wkv_b", None), nn.Linear)
            and isinstance(getattr(module, "inner_attention", None), nn.Module)
        ):
            modules[canonical_fqn(name)] = module
    return modules


def _heads_of(name: str, module: nn.Module) -> dmuon.MLAHeads:
    query = "wq_b" if isinstance(getattr(module, "wq_b", None), nn.Linear) else "wq"
    return dmuon.MLAHeads(
        name=name,
        q_weight=f"{name}.{query}.weight",
        kv_weight=f"{name}.wkv_b.weight",
        num_heads=module.n_heads,
        qk_nope_head_dim=module.qk_nope_head_dim,
        qk_rope_head_dim=module.qk_rope_head_dim,
        v_head_dim=module.v_head_dim,
    )


def _observe(inner: nn.Module, args: tuple, kwargs: dict) -> None:
    record = inner.__dict__.get(_RECORD_ATTR)
    if record is None or not torch.is_grad_enabled() or _unobserved_depth:
        return
    query, key = args[0].transpose(1, 2), args[1].transpose(1, 2)  # (batch, heads, seq, dim)
    scale = kwargs.get("scale")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    masks = kwargs.get("attention_masks")
    if masks is None:  # ScaledDotProductAttention: causal unless told otherwise
        maxima = dmuon.attention_max_logits(
            query, key, scaling=scale, is_causal=kwargs.get("is_causal", True)
        )
    else:
        from torch.nn.attention.flex_attention import BlockMask, create_mask

        if not isinstance(masks, BlockMask):
            raise TypeError(
                f"dmuon_titan.qk_clip_titan observes causal SDPA and flex attention's BlockMask; "
                f"this layer's inner attention ({type(inner).__name__}) got "
                f"{type(masks).__name__} masks. Use attn_backend 'flex', or record the maxima "
                "from your attention with dmuon.QKClip.record."
            )
        batch, heads = masks.shape[0], masks.shape[1]
        dense = create_mask(
            masks.mask_mod, batch, heads, query.shape[2], key.shape[2], device=query.device
        )
        maxima = dmuon.attention_max_logits(query, key, scaling=scale, attention_mask=dense)
    record(maxima)
