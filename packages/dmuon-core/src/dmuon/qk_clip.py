"""QK-clip: MuonClip's bound on the attention logits (Kimi Team, "Kimi K2: Open Agentic
Intelligence", arXiv 2507.20534, section 2.1).

Owns the observation of the per-head maximum attention logit (recorded by the attention's
forward, reduced with MAX across ranks once per step), the clip factors and their application to
whatever holds the query and key projections on this rank (an owner's fp32 master, its TP chunk,
FSDP2's shard, a plain tensor). It must not change the optimizer's update (it rescales the
weights after it) nor move weights itself: the step's own publish carries the rescaled masters.

[Note: the clip]
For head h, S_h is the largest logit the attention's softmax saw in the step's forwards on every
rank (``scaling * q_i^h . k_j^h``, masked pairs left out). After the update, if S_h > tau, with
gamma_h = tau / S_h, the rows of head h in W_q are multiplied by gamma_h^alpha and those of its
key head in W_k by gamma_h^(1 - alpha): its logits scale by gamma_h, so S_h becomes tau for the
same inputs. Rows of a projection (its output features) belong to heads: head h owns rows
[h * head_dim, (h + 1) * head_dim).

- Grouped-query attention (several query heads share one key head), two conventions (``gqa=``):
  ``"per_query_head"`` (the default): the shared key head is left alone and each query head over
  the threshold takes gamma_h whole (Kimi's own rule for MLA's shared rotary key, "so the clip
  does not couple across heads"): the logits of head h scale by exactly gamma_h, so they end at
  tau, and no head under the threshold changes. ``"per_key_group"`` (Megatron-LM's): one
  gamma_g = tau / max_{h in g} S_h per key head g, the group's query rows by gamma_g^alpha and
  the key head's rows by gamma_g^(1 - alpha): the group's worst head ends at tau and its other
  heads, over the threshold or not, scale by gamma_g too (the coupling the default avoids; in
  exchange the key's norm shrinks with the queries'). With one key head per query head, both
  are the paper's rule, alpha splitting gamma_h between them.
- Biases (Qwen2's q_proj / k_proj): q^h = W_q^h x + b_q^h scales by a factor only if b_q^h does
  too, so a named bias is scaled with its head's rows; a bias left out would break the bound.
- RoPE rotates q and k after the projections; a rotation is linear, so scaling the rows scales
  the rotated q and k alike and the logits by the same product.
- QK-norm (Qwen3's q_norm / k_norm, an RMSNorm over each head's head_dim with one gain vector
  shared by every head): the norm undoes any scale of the projection's rows, so those are left
  alone; the two gains are scaled instead, q_norm by gamma^alpha and k_norm by gamma^(1 - alpha)
  with gamma = tau / max_h S_h, one factor for the layer (the gains are shared by its heads).

[Note: MLA]
Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) splits each head's query and key into a
content part (no position) and a rotary part: the logit is
``scaling * (q^C_h . k^C_h + q^R_h . k^R)``, where q^C_h, q^R_h are head h's rows of the query
up-projection (``q_b_proj`` / ``wq_b``: per head qk_nope_head_dim content rows, then
qk_rope_head_dim rotary rows), k^C_h head h's first qk_nope_head_dim rows of the key-value
up-projection (``kv_b_proj`` / ``wkv_b``: per head the key content rows, then v_head_dim value
rows), and k^R one rotary key every head shares (the last qk_rope_head_dim rows of
``kv_a_proj_with_mqa`` / ``wkv_a``). Kimi K2 (arXiv 2507.20534, section 2.1, "MuonClip", its
QK-Clip for MLA) clips head h with gamma_h = tau / S_h as: q^C_h and k^C_h each by
sqrt(gamma_h), q^R_h by gamma_h, and k^R not at all ("so the clip does not couple across
heads"): both terms of the logit scale by gamma_h. dmuon writes sqrt as alpha / 1 - alpha for
the content parts (alpha=0.5 is the report's). The value rows and ``wkv_a`` are never touched.
The latent norms before the up-projections (``q_a_layernorm``, ``kv_a_layernorm``) normalise
their inputs, not the heads, so they do not undo the scaling. The logits MLA's softmax sees are
those of its concatenated q and k (the shared rotary key repeated per head), so
``attention_max_logits`` reads them from an attention kernel's inputs; ``mla_max_logits`` takes
the four parts without repeating k^R. DeepSeek's softmax scale (qk_head_dim^-0.5 times YaRN's
mscale squared) is the ``scaling`` to pass.

[Note: where the clip runs]
The optimizer updates the owners' fp32 masters (and FSDP2's shards), then
``DedicatedState.after_step`` refreshes every boundary's weights from the masters and publishes
them across replicas. The clip must write the masters between the two, or the weights the next
forward sees would miss it (and a second publish would be needed): it is a master-update hook of
the state (``register_master_update_hook``). The cross-rank MAX runs in the optimizer's step
pre-hook, before anything changed, so a layer no rank observed raises on every rank with the
weights untouched; a step skipped for non-finite gradients never reaches ``after_step`` and so
clips nothing; the observations are dropped after every step (a step post-hook).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from dmuon import collectives
from dmuon.consistency import check_ranks_agree
from dmuon.fqn import canonical_fqn
from dmuon.hooks import DedicatedState, get_dedicated_state
from dmuon.param import DedicatedParam

# Logits of one block of query rows, at most: the observation's transient memory.
LOGITS_BLOCK_NUMEL = 2**26

# Grouped-query attention's two conventions ([Note: the clip]); the first is the default.
GQAClip = Literal["per_query_head", "per_key_group"]
GQA_CLIPS: tuple[str, ...] = get_args(GQAClip)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionHeads:
    """One attention layer whose query and key projections QK-clip rescales.

    ``name`` is the key its attention records under (``QKClip.record``); the others are
    parameter FQNs of the model (as ``named_parameters`` spells them; wrapper segments such as
    ``_checkpoint_wrapped_module`` may be left out). ``q_weight`` is (num_heads * head_dim, in)
    and ``k_weight`` (num_kv_heads * head_dim, in); ``q_bias`` / ``k_bias`` their biases, if any;
    ``q_norm`` / ``k_norm`` the (head_dim,) gains of a QK-norm applied after them, if any (then
    the gains are clipped instead: see [Note: the clip] in ``dmuon.qk_clip``).
    """

    name: str
    q_weight: str
    k_weight: str
    num_heads: int
    num_kv_heads: int | None = None  # None: num_heads (one key head per query head)
    q_bias: str | None = None
    k_bias: str | None = None
    q_norm: str | None = None
    k_norm: str | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def fqns(self) -> dict[str, str]:
        """role -> FQN of every parameter named."""
        roles = ("q_weight", "k_weight", "q_bias", "k_bias", "q_norm", "k_norm")
        return {role: getattr(self, role) for role in roles if getattr(self, role) is not None}


@dataclass(frozen=True, slots=True, kw_only=True)
class MLAHeads:
    """One multi-head latent attention layer (DeepSeek-V2/V3, Kimi K2) whose query and key
    up-projections QK-clip rescales as the Kimi K2 report does for MLA ([Note: MLA] in
    ``dmuon.qk_clip``).

    ``name`` is the key its attention records under (``QKClip.record``); the others are
    parameter FQNs of the model. ``q_weight`` is the projection whose output is the query heads,
    (num_heads * (qk_nope_head_dim + qk_rope_head_dim), in), each head's rows the content part
    then the rotary part (DeepSeek's ``q_b_proj`` / torchtitan's ``wq_b``, or ``q_proj`` / ``wq``
    without a query LoRA); ``kv_weight`` is the key-value up-projection, (num_heads *
    (qk_nope_head_dim + v_head_dim), kv_lora_rank), each head's rows its key content part then
    its value (``kv_b_proj`` / ``wkv_b``). The shared rotary key (the last qk_rope_head_dim rows
    of ``kv_a_proj_with_mqa`` / ``wkv_a``) is never touched, so it is not named.
    """

    name: str
    q_weight: str
    kv_weight: str
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def kv_heads(self) -> int:
        return self.num_heads  # each query head has its own key content head

    def fqns(self) -> dict[str, str]:
        """role -> FQN of every parameter named."""
        return {"q_weight": self.q_weight, "kv_weight": self.kv_weight}


Heads = AttentionHeads | MLAHeads


def _max_logits_in_blocks(
    block_logits: Callable[[int, int], torch.Tensor],
    *,
    batch: int,
    num_heads: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
    scaling: float,
    attention_mask: torch.Tensor | None,
    is_causal: bool,
) -> torch.Tensor:
    """(num_heads,) float32 maxima of ``scaling * block_logits(start, stop)`` ((batch,
    num_heads, stop - start, kv_len) raw dot products of query rows [start, stop)) over the
    allowed pairs, in blocks of at most ``LOGITS_BLOCK_NUMEL`` logits."""
    rows = max(1, LOGITS_BLOCK_NUMEL // max(1, batch * num_heads * kv_len))
    result = torch.full((num_heads,), -math.inf, dtype=torch.float32, device=device)
    for start in range(0, q_len, rows):
        stop = min(q_len, start + rows)
        logits = (block_logits(start, stop) * scaling).float()
        if attention_mask is not None:
            mask = attention_mask[..., start:stop, :]
            if mask.dtype == torch.bool:
                logits = logits.masked_fill(~mask, -math.inf)
            else:
                logits = logits + mask.float()
        elif is_causal:
            query_pos = torch.arange(start, stop, device=device)[:, None]
            key_pos = torch.arange(kv_len, device=device)[None, :]
            logits = logits.masked_fill(key_pos > query_pos + (kv_len - q_len), -math.inf)
        result = torch.maximum(result, logits.amax(dim=(0, 2, 3)))
    return result


@torch.no_grad()
def attention_max_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """The largest attention logit of each query head, (num_heads,) in float32.

    ``query`` is (batch, num_heads, q_len, head_dim), ``key`` (batch, num_kv_heads, kv_len,
    head_dim) with num_heads a multiple of num_kv_heads (query head h reads key head
    h // (num_heads // num_kv_heads)), both after RoPE. A logit is ``scaling * q . k``, in the
    inputs' dtype as the attention computes it. ``attention_mask`` is broadcastable to (batch,
    num_heads, q_len, kv_len): boolean (True: attended) or additive (added, as eager attention
    does). With no mask and ``is_causal``, query i sees keys j <= i + kv_len - q_len. Costs one
    extra ``q k^T`` (half the attention's matmuls), in blocks of query rows of at most
    ``LOGITS_BLOCK_NUMEL`` logits, with no autograd graph. MLA's query and key (content and
    rotary parts concatenated, the shared rotary key repeated per head, as attention kernels
    take them) are read here too; ``dmuon.mla_max_logits`` takes the parts apart.
    """
    batch, num_heads, q_len, head_dim = query.shape
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    if key.shape[0] != batch or key.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"dmuon.attention_max_logits: query {tuple(query.shape)} and key {tuple(key.shape)} "
            "must be (batch, heads, q_len, head_dim) and (batch, kv_heads, kv_len, head_dim) "
            "with heads a multiple of kv_heads."
        )
    group = num_heads // num_kv_heads
    # (batch, kv_heads, group, q_len, head_dim): the query heads of each key head together.
    grouped = query.reshape(batch, num_kv_heads, group, q_len, head_dim)
    keys_t = key.transpose(-1, -2).unsqueeze(2)  # (batch, kv_heads, 1, head_dim, kv_len)

    def block_logits(start: int, stop: int) -> torch.Tensor:
        logits = grouped[:, :, :, start:stop] @ keys_t
        return logits.reshape(batch, num_heads, stop - start, kv_len)

    return _max_logits_in_blocks(
        block_logits, batch=batch, num_heads=num_heads, q_len=q_len, kv_len=kv_len,
        device=query.device, scaling=scaling, attention_mask=attention_mask, is_causal=is_causal,
    )  # fmt: skip


@torch.no_grad()
def mla_max_logits(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    *,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """The largest attention logit of each head of multi-head latent attention, (num_heads,)
    in float32: ``scaling * (q_nope . k_nope + q_rope . k_rope)``, the logit MLA's softmax sees.

    ``q_nope`` is (batch, num_heads, q_len, qk_nope_head_dim), ``q_rope`` (batch, num_heads,
    q_len, qk_rope_head_dim) after RoPE, ``k_nope`` (batch, num_heads, kv_len,
    qk_nope_head_dim), ``k_rope`` (batch, 1, kv_len, qk_rope_head_dim) after RoPE, the rotary
    key every head shares (never repeated here). ``scaling`` is the softmax scale as the
    attention uses it (DeepSeek-V3: (qk_nope_head_dim + qk_rope_head_dim)^-0.5 times YaRN's
    mscale squared). Masks as in ``dmuon.attention_max_logits``; same cost and blocks.
    """
    batch, num_heads, q_len, nope = q_nope.shape
    kv_len, rope = k_nope.shape[2], k_rope.shape[3]
    if (
        q_rope.shape[:3] != q_nope.shape[:3]
        or tuple(k_nope.shape) != (batch, num_heads, kv_len, nope)
        or tuple(k_rope.shape) != (batch, 1, kv_len, rope)
        or q_rope.shape[3] != rope
    ):
        raise ValueError(
            f"dmuon.mla_max_logits: q_nope {tuple(q_nope.shape)}, q_rope {tuple(q_rope.shape)}, "
            f"k_nope {tuple(k_nope.shape)} and k_rope {tuple(k_rope.shape)} must be (batch, "
            "heads, q_len, nope), (batch, heads, q_len, rope), (batch, heads, kv_len, nope) and "
            "(batch, 1, kv_len, rope): the rotary key is shared by every head."
        )
    k_nope_t, k_rope_t = k_nope.transpose(-1, -2), k_rope.transpose(-1, -2)

    def block_logits(start: int, stop: int) -> torch.Tensor:
        return q_nope[:, :, start:stop] @ k_nope_t + q_rope[:, :, start:stop] @ k_rope_t

    return _max_logits_in_blocks(
        block_logits, batch=batch, num_heads=num_heads, q_len=q_len, kv_len=kv_len,
        device=q_nope.device, scaling=scaling, attention_mask=attention_mask,
        is_causal=is_causal,
    )  # fmt: skip


def _gamma(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """tau / S per head where S is finite and over tau, else 1."""
    over = torch.isfinite(max_logits) & (max_logits > threshold)
    return torch.where(over, threshold / max_logits, torch.ones_like(max_logits))


def clip_factors(
    max_logits: torch.Tensor,
    *,
    threshold: float,
    alpha: float,
    num_kv_heads: int,
    gqa: GQAClip = "per_query_head",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of [Note: the clip]: (num_heads,) for the query heads' rows and
    (num_kv_heads,) for the key heads' rows; 1 where a head is under the threshold (or its
    maximum is not finite). With fewer key heads than query heads, ``gqa`` picks the
    convention: ``"per_query_head"`` (the query takes gamma_h whole, the shared key head 1) or
    ``"per_key_group"`` (one gamma per key head from its group's largest maximum, split by
    alpha between the group's query heads and the key head)."""
    if num_kv_heads == max_logits.numel():
        gamma = _gamma(max_logits, threshold)
        return gamma.pow(alpha), gamma.pow(1.0 - alpha)
    if gqa == "per_query_head":  # a shared key head: the query takes gamma whole
        gamma = _gamma(max_logits, threshold)
        return gamma, torch.ones(num_kv_heads, dtype=gamma.dtype, device=gamma.device)
    finite = torch.where(torch.isfinite(max_logits), max_logits, -math.inf)
    group_gamma = _gamma(finite.view(num_kv_heads, -1).amax(dim=1), threshold)
    group = max_logits.numel() // num_kv_heads
    return group_gamma.pow(alpha).repeat_interleave(group), group_gamma.pow(1.0 - alpha)


def mla_clip_factors(
    max_logits: torch.Tensor, *, threshold: float, alpha: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The factors of [Note: MLA], each (num_heads,): the query content rows (gamma^alpha), the
    query rotary rows (gamma), the key content rows (gamma^(1 - alpha)); 1 where a head is
    under the threshold (or its maximum is not finite)."""
    gamma = _gamma(max_logits, threshold)
    return gamma.pow(alpha), gamma, gamma.pow(1.0 - alpha)


class QKClip:
    """MuonClip's QK-clip for a model prepared with ``dmuon.dedicate_params`` and its
    ``dmuon.Muon`` (see [Note: the clip] and [Note: where the clip runs] in ``dmuon.qk_clip``).

    Args:
        model: the model ``dedicate_params`` prepared.
        optimizer: its ``dmuon.Muon``.
        attention: one ``AttentionHeads`` (or ``MLAHeads`` for multi-head latent attention)
            per attention layer to clip.
        threshold: tau, the largest logit a head keeps (Kimi K2: 100).
        alpha: the query's share of the clip (0.5: the square root on each side); see
            [Note: the clip] for grouped-query attention and QK-norm, [Note: MLA] for MLA.
        gqa: with fewer key heads than query heads, ``"per_query_head"`` (default: each query
            head over tau takes its gamma whole, the shared key head stays) or
            ``"per_key_group"`` (Megatron's: one gamma per key head, from its group's largest
            maximum, on the group's query heads and the key head); see [Note: the clip].

    Each layer's attention calls ``record(name, max_logits)`` in every training forward (the
    (num_heads,) maxima of ``dmuon.attention_max_logits`` or ``dmuon.mla_max_logits``, or this
    TP rank's heads); dmuon_hf's ``qk_clip_hf`` does it for HF Llama / Qwen2 / Qwen3 /
    DeepSeek-V3, dmuon_titan's ``qk_clip_titan`` for torchtitan's MLA. Forwards without grad
    (evaluation) are not recorded. Every ``optimizer.step()`` then all-reduces the maxima (one
    MAX of sum(num_heads) floats over the data-parallel ranks, and one over the TP ranks under
    tensor parallelism), syncs one flag to the host, and rescales the heads over the threshold
    before the weights are published. ``last_max_logits`` holds the reduced maxima of the last step.

    There is no state to checkpoint: the clip only changes weights, which the checkpoints hold.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        attention: Sequence[AttentionHeads | MLAHeads],
        *,
        threshold: float = 100.0,
        alpha: float = 0.5,
        gqa: GQAClip = "per_query_head",
    ) -> None:
        _check_settings(threshold, alpha, gqa, attention)
        attention = [_canonical(layer) for layer in attention]
        self._state = get_dedicated_state(model)
        if getattr(optimizer, "model_state", None) is not self._state:
            raise TypeError(
                f"dmuon.QKClip: the optimizer ({type(optimizer).__name__}) is not the dmuon.Muon "
                "of this model; the clip runs inside its step. Pass the dmuon.Muon(model, ...) "
                "built on the same model."
            )
        self.threshold = float(threshold)
        self.alpha = float(alpha)
        self.gqa = gqa
        self.model = model
        self.layers = {layer.name: layer for layer in attention}
        self._shapes = _check_parameters(model, self._state, attention)
        # name -> (rows per query head in q_weight, rows per key head in k_weight / kv_weight).
        self._head_rows = {layer.name: _rows_per_head(layer, self._shapes) for layer in attention}
        _check_head_shapes(attention, self._shapes, self._head_rows)
        check_ranks_agree(
            self._state.mesh.world_group,
            {
                "qk_clip": (
                    "QK-clip settings (threshold, alpha, gqa, attention layers)",
                    (self.threshold, self.alpha, self.gqa, list(attention)),
                )
            },
        )
        # name -> this step's maxima (num_heads,) recorded here, -inf where not observed.
        self._observed: dict[str, torch.Tensor] = {}
        # name -> (first query head, query heads) this rank's attention computes (TP: a chunk).
        self._local_heads: dict[str, tuple[int, int]] = {}
        # name -> {FQN: factor per row of the full parameter, or one factor} of the step now.
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._local_rows: dict[str, torch.Tensor | None] = {}  # FQN -> this rank's rows
        self.last_max_logits: dict[str, torch.Tensor] = {}
        self.clipped_heads = 0  # heads over the threshold in the last step
        self._reduce_groups = self._groups()  # fixed with the model's layout: found once
        self._handles = [
            optimizer.register_step_pre_hook(lambda *_: self._reduce_observations()),
            self._state.register_master_update_hook(self._clip),
            optimizer.register_step_post_hook(lambda *_: self._forget_step()),
        ]

    def remove(self) -> None:
        """Stop clipping: the hooks go."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---- observation ----------------------------------------------------------------------------

    def record(self, name: str, max_logits: torch.Tensor) -> None:
        """Record the largest logit of each query head of layer ``name`` in this forward:
        (num_heads,), or (num_heads / tp,) for this TP rank's heads. The step takes the maximum
        over every record since the previous step, on every rank."""
        if not torch.is_grad_enabled():
            return
        layer = self.layers.get(name)
        if layer is None:
            raise KeyError(
                f"dmuon.QKClip.record: no attention layer named {name!r}; the layers are "
                f"{sorted(self.layers)[:4]}{'...' if len(self.layers) > 4 else ''} (the names "
                "given to AttentionHeads(name=...))."
            )
        start, count = self._heads_of(layer)
        values = max_logits.detach().float().reshape(-1)
        if values.numel() == layer.num_heads:
            values = values[start : start + count]
        elif values.numel() != count:
            raise ValueError(
                f"dmuon.QKClip.record: layer {name!r} got {values.numel()} maxima; it has "
                f"{layer.num_heads} query heads ({count} on this rank under tensor "
                "parallelism): pass one maximum per query head, of all heads or of this rank's."
            )
        observed = self._observed.get(name)
        if observed is None:
            observed = torch.full(
                (layer.num_heads,), -math.inf, dtype=torch.float32, device=values.device
            )
            self._observed[name] = observed
        torch.maximum(observed[start : start + count], values, out=observed[start : start + count])

    def _heads_of(self, layer: Heads) -> tuple[int, int]:
        """(first query head, count) that this rank's attention computes: all of them, or the
        chunk of a tensor-parallel q projection (rows split over TP ranks, colwise)."""
        heads = self._local_heads.get(layer.name)
        if heads is None:
            q_rows, k_rows = self._head_rows[layer.name]
            rows = self._tp_rows(layer.q_weight)
            heads = _head_range(layer, "q_weight", rows, q_rows, layer.num_heads)
            k_role, k_fqn = _key_projection(layer)
            k_heads = _head_range(layer, k_role, self._tp_rows(k_fqn), k_rows, layer.kv_heads)
            group = layer.num_heads // layer.kv_heads
            if (k_heads[0] * group, k_heads[1] * group) != heads:
                raise ValueError(
                    f"dmuon.QKClip: layer {layer.name!r}: this rank computes query heads "
                    f"[{heads[0]}, {sum(heads)}) but key heads [{k_heads[0]}, {sum(k_heads)}), "
                    f"which do not serve them ({group} query heads per key head). Split "
                    f"{layer.q_weight} and {k_fqn} over the same TP ranks, by whole heads."
                )
            self._local_heads[layer.name] = heads
        return heads

    def _tp_rows(self, fqn: str) -> torch.Tensor | None:
        """Rows of ``fqn`` this rank's forward computes with under tensor parallelism (None:
        all): of its TP layout if dedicated, else of its DTensor's model-parallel dims."""
        p = self._state.params.get(fqn)
        if p is not None:
            if p.tp is None or p.tp.shard_dim != 0:
                return None
            return torch.arange(*p.tp.bounds(p.tp.rank))
        param = _model_parameters(self.model)[fqn]
        if not isinstance(param, DTensor):
            return None
        tp_dims = self._state.mesh.model_parallel_dims
        names = param.device_mesh.mesh_dim_names or ()
        placements = [
            placement if i < len(names) and names[i] in tp_dims else Replicate()
            for i, placement in enumerate(param.placements)
        ]
        return _rows_under(param.shape[0], param.device_mesh, placements)

    # ---- the step -------------------------------------------------------------------------------

    def _reduce_observations(self) -> None:
        """Step pre-hook: MAX over the ranks, then the factors of the heads over the threshold
        (nothing changes yet; see [Note: where the clip runs])."""
        self._pending.clear()
        device = self._state.device
        maxima = torch.cat(
            [
                self._observed[name].to(device)
                if name in self._observed
                else torch.full((layer.num_heads,), -math.inf, device=device)
                for name, layer in self.layers.items()
            ]
        )
        for group in self._reduce_groups:  # in sequence: each reads the previous one's MAX
            collectives.all_reduce(
                maxima, group, dist.ReduceOp.MAX, "QK-clip's maximum attention logits"
            ).wait()
        per_layer = dict(
            zip(self.layers, maxima.split([layer.num_heads for layer in self.layers.values()]))
        )
        over = torch.stack([(m > self.threshold).any() for m in per_layer.values()])
        unseen = torch.stack([(m == -math.inf).any() for m in per_layer.values()])
        nonfinite = torch.stack([(m.isnan() | (m == math.inf)).any() for m in per_layer.values()])
        flags = torch.stack([over, unseen, nonfinite]).cpu()  # the one host sync of the step
        names = list(self.layers)
        missing = [name for name, flag in zip(names, flags[1]) if flag]
        if missing:
            raise RuntimeError(
                f"dmuon.QKClip: no rank recorded the attention logits of {len(missing)} layers "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}) since the last "
                "step, so they cannot be clipped; nothing was updated. Each layer's attention "
                "must call clip.record(name, dmuon.attention_max_logits(q, k, ...)) in every "
                "training forward (dmuon_hf.qk_clip_hf does it for HF models), on every TP rank "
                "for its heads."
            )
        for name in (n for n, flag in zip(names, flags[2]) if flag):
            warnings.warn(
                f"dmuon.QKClip: layer {name!r} has a NaN or inf maximum logit this step; its "
                "heads with a non-finite maximum are not clipped.",
                UserWarning,
                stacklevel=4,
            )
        self.last_max_logits = per_layer
        self.clipped_heads = 0
        for name, flag in zip(names, flags[0]):
            if flag:
                self._pending[name] = self._row_factors(self.layers[name], per_layer[name])
                self.clipped_heads += int((per_layer[name] > self.threshold).sum())

    def _row_factors(self, layer: Heads, max_logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """FQN -> the factor of each row of the full parameter (or one factor for the layer's
        QK-norm gains) that clips ``layer`` with these reduced maxima: [Note: the clip],
        [Note: MLA]. A parameter the clip leaves alone is not listed."""
        q_rows, k_rows = self._head_rows[layer.name]
        if isinstance(layer, MLAHeads):
            q_content, q_rope, k_content = mla_clip_factors(
                max_logits, threshold=self.threshold, alpha=self.alpha
            )
            nope, rope = layer.qk_nope_head_dim, layer.qk_rope_head_dim
            # (num_heads, rows per head) -> one factor per row, head after head.
            q = torch.cat(
                [q_content[:, None].expand(-1, nope), q_rope[:, None].expand(-1, rope)], 1
            )
            value = torch.ones(layer.num_heads, layer.v_head_dim, device=max_logits.device)
            kv = torch.cat([k_content[:, None].expand(-1, nope), value], 1)
            return {layer.q_weight: q.reshape(-1), layer.kv_weight: kv.reshape(-1)}
        if layer.q_norm is not None:  # QK-norm: one factor for the layer, on the gains
            gamma = _gamma(max_logits, self.threshold).min()
            return {layer.q_norm: gamma.pow(self.alpha), layer.k_norm: gamma.pow(1.0 - self.alpha)}
        q_factors, k_factors = clip_factors(
            max_logits, threshold=self.threshold, alpha=self.alpha, num_kv_heads=layer.kv_heads,
            gqa=self.gqa,
        )  # fmt: skip
        factors = {layer.q_weight: q_factors.repeat_interleave(q_rows)}
        if layer.q_bias is not None:
            factors[layer.q_bias] = factors[layer.q_weight]
        # per_query_head leaves a shared key head alone (its factors are all 1).
        if layer.kv_heads == layer.num_heads or self.gqa == "per_key_group":
            factors[layer.k_weight] = k_factors.repeat_interleave(k_rows)
            if layer.k_bias is not None:
                factors[layer.k_bias] = factors[layer.k_weight]
        return factors

    def _groups(self) -> list[dist.ProcessGroup]:
        """The data-parallel grid, then every TP group a clipped projection is split over."""
        groups = [self._state.mesh.world_group]
        if self._state.mesh.tp_group is not None:
            groups.append(self._state.mesh.tp_group)
        params = _model_parameters(self.model)
        for layer in self.layers.values():
            for fqn in (layer.q_weight, _key_projection(layer)[1]):
                param = params.get(fqn)
                if isinstance(param, DTensor) and param.device_mesh.mesh_dim_names:
                    for name in param.device_mesh.mesh_dim_names:
                        if name in self._state.mesh.model_parallel_dims:
                            groups.append(param.device_mesh.get_group(name))
        unique = []
        for group in groups:  # MAX is idempotent: a group reduced twice changes nothing
            if group is not None and all(group is not seen for seen in unique):
                unique.append(group)
        return unique

    @torch.no_grad()
    def _clip(self) -> None:
        """Master-update hook: rescale the heads over the threshold where they live here."""
        if not self._pending:
            return
        params = _model_parameters(self.model)
        for factors in self._pending.values():
            for fqn, row_factors in factors.items():
                self._scale(params, fqn, row_factors)

    def _scale(self, params: dict[str, nn.Parameter], fqn: str, factors: torch.Tensor) -> None:
        """Multiply this rank's rows of ``fqn`` by ``factors`` (one per row of the full
        parameter, or a scalar): an owned master (its TP chunk), FSDP2's shard, or the tensor."""
        p = self._state.params.get(fqn)
        if p is not None:
            if p.master is None:
                return  # another rank owns it
            local, rows = p.master_value(), _dedicated_rows(p)  # offloaded: its CPU home
        else:
            param = params[fqn]
            local = param.to_local() if isinstance(param, DTensor) else param
            if fqn not in self._local_rows:
                self._local_rows[fqn] = (
                    _rows_under(param.shape[0], param.device_mesh, _row_placements(param, fqn))
                    if isinstance(param, DTensor)
                    else None
                )
            rows = self._local_rows[fqn]
        if factors.ndim == 0:
            local.mul_(factors.to(local.device, local.dtype))
            return
        factors = factors if rows is None else factors[rows.to(factors.device)]
        shape = (-1,) + (1,) * (local.ndim - 1)
        local.mul_(factors.to(local.device, local.dtype).view(shape))

    def _forget_step(self) -> None:
        self._observed.clear()
        self._pending.clear()


# ---- helpers ------------------------------------------------------------------------------------


def _model_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {canonical_fqn(name): param for name, param in model.named_parameters()}


def _key_projection(layer: Heads) -> tuple[str, str]:
    """(role, FQN) of the projection whose rows are the key heads' (MLA: the key content
    rows, inside the key-value up-projection)."""
    if isinstance(layer, MLAHeads):
        return "kv_weight", layer.kv_weight
    return "k_weight", layer.k_weight


def _rows_per_head(layer: Heads, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """(rows of one query head in q_weight, rows of one key head in its key projection)."""
    if isinstance(layer, MLAHeads):
        return (layer.qk_nope_head_dim + layer.qk_rope_head_dim,
                layer.qk_nope_head_dim + layer.v_head_dim)  # fmt: skip
    head_dim = shapes[layer.q_weight][0] // layer.num_heads
    return head_dim, head_dim


def _canonical(layer: Heads) -> Heads:
    return replace(layer, **{role: canonical_fqn(fqn) for role, fqn in layer.fqns().items()})


def _dedicated_rows(p: DedicatedParam) -> torch.Tensor | None:
    """Rows of the full parameter that ``p``'s master holds (None: all)."""
    if p.tp is None or p.tp.shard_dim != 0:
        return None
    return torch.arange(*p.tp.bounds(p.tp.rank))


def _row_placements(param: DTensor, fqn: str) -> list:
    """The placements of a (rows,) tensor laid out like ``param``'s rows."""
    placements = []
    for placement in param.placements:
        if placement.is_partial():
            raise ValueError(
                f"dmuon.QKClip: {fqn} is a Partial DTensor ({param.placements}); its rows cannot "
                "be rescaled in place. Keep the q/k projections Shard or Replicate."
            )
        dim = getattr(placement, "dim", None)  # Shard and _StridedShard
        placements.append(placement if dim == 0 else Replicate())
    return placements


def _rows_under(num_rows: int, mesh, placements: list) -> torch.Tensor:
    """Which rows of a (num_rows, ...) DTensor with ``placements`` this rank holds: the
    DTensor's own split, applied to the row indices (no collective)."""
    indices = torch.arange(num_rows, device=mesh.device_type)
    local = distribute_tensor(indices, mesh, placements, src_data_rank=None).to_local()
    return local.cpu()


def _head_range(
    layer: Heads, role: str, rows: torch.Tensor | None, head_dim: int, heads: int
) -> tuple[int, int]:
    if rows is None:
        return 0, heads
    if rows.numel() == 0 or rows.numel() % head_dim or int(rows[0]) % head_dim:
        raise ValueError(
            f"dmuon.QKClip: layer {layer.name!r}: this rank holds rows "
            f"[{int(rows[0]) if rows.numel() else 0}, ...) x {rows.numel()} of {role} "
            f"{getattr(layer, role)}, not whole heads of {head_dim} rows. Split it over the TP "
            "ranks by whole heads (num_heads and num_kv_heads divisible by the TP size)."
        )
    return int(rows[0]) // head_dim, rows.numel() // head_dim


def _check_settings(
    threshold: float, alpha: float, gqa: str, attention: Sequence[AttentionHeads | MLAHeads]
) -> None:
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not (math.isfinite(threshold) and threshold > 0)
    ):
        raise ValueError(f"dmuon.QKClip: threshold must be a positive number, got {threshold!r}.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"dmuon.QKClip: alpha must be a number in [0, 1], got {alpha!r}.")
    if gqa not in GQA_CLIPS:
        raise ValueError(f"dmuon.QKClip: gqa must be one of {GQA_CLIPS}, got {gqa!r}.")
    if not attention or not all(
        isinstance(layer, (AttentionHeads, MLAHeads)) for layer in attention
    ):
        raise TypeError(
            "dmuon.QKClip: attention must be a non-empty list of dmuon.AttentionHeads(name=..., "
            "q_weight=..., k_weight=..., num_heads=...) or, for multi-head latent attention, "
            "dmuon.MLAHeads(name=..., q_weight=..., kv_weight=..., num_heads=..., "
            "qk_nope_head_dim=..., qk_rope_head_dim=..., v_head_dim=...), one per attention layer."
        )
    names = [layer.name for layer in attention]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"dmuon.QKClip: attention layers named twice: {repeated}.")
    for layer in attention:
        if isinstance(layer, MLAHeads):
            dims = {"num_heads": layer.num_heads, "qk_nope_head_dim": layer.qk_nope_head_dim,
                    "qk_rope_head_dim": layer.qk_rope_head_dim, "v_head_dim": layer.v_head_dim}  # fmt: skip
            if any(value < 1 for value in dims.values()):
                raise ValueError(
                    f"dmuon.QKClip: MLA layer {layer.name!r} has {dims}: every one must be "
                    "positive (a layer without rotary part is plain attention: describe it with "
                    "dmuon.AttentionHeads)."
                )
            continue
        if layer.num_heads < 1 or layer.kv_heads < 1 or layer.num_heads % layer.kv_heads:
            raise ValueError(
                f"dmuon.QKClip: layer {layer.name!r} has num_heads={layer.num_heads} and "
                f"num_kv_heads={layer.num_kv_heads}: both must be positive and num_heads a "
                "multiple of num_kv_heads."
            )
        if (layer.q_norm is None) != (layer.k_norm is None):
            raise ValueError(
                f"dmuon.QKClip: layer {layer.name!r} names one QK-norm gain but not the other "
                "(q_norm, k_norm): name both, or neither."
            )


def _check_parameters(
    model: nn.Module, state: DedicatedState, attention: Sequence[AttentionHeads | MLAHeads]
) -> dict[str, tuple[int, ...]]:
    """The full shape of every parameter named; each must exist and not be an expert piece."""
    params = _model_parameters(model)
    shapes = {}
    for layer in attention:
        for role, fqn in layer.fqns().items():
            fqn = canonical_fqn(fqn)
            if fqn in state.stacks:
                raise ValueError(
                    f"dmuon.QKClip: {role} {fqn} is an expert stack, not a projection."
                )
            p = state.params.get(fqn)
            if p is not None:
                shapes[fqn] = tuple(p.shape)
            elif fqn in params:
                shapes[fqn] = tuple(params[fqn].shape)
            else:
                close = [
                    name for name in params if name.endswith(fqn.rsplit(".", 2)[-2] + ".weight")
                ]
                raise ValueError(
                    f"dmuon.QKClip: layer {layer.name!r}: the model has no parameter {fqn!r} "
                    f"({role}). Parameters ending alike: {close[:3]}."
                )
    return shapes


def _check_head_shapes(attention, shapes, head_rows) -> None:
    for layer in attention:
        if isinstance(layer, MLAHeads):
            q_rows, kv_rows = head_rows[layer.name]
            for role, rows, parts in (
                ("q_weight", q_rows, "qk_nope_head_dim + qk_rope_head_dim"),
                ("kv_weight", kv_rows, "qk_nope_head_dim + v_head_dim"),
            ):
                fqn = getattr(layer, role)
                shape = shapes[canonical_fqn(fqn)]
                if len(shape) != 2 or shape[0] != layer.num_heads * rows:
                    raise ValueError(
                        f"dmuon.QKClip: MLA layer {layer.name!r}: {role} {fqn} has shape {shape}; "
                        f"with num_heads={layer.num_heads} and {parts} = {rows} it should be "
                        f"({layer.num_heads * rows}, in). Name the up-projection whose rows are "
                        "the heads (q_b_proj / wq_b, or q_proj / wq; kv_b_proj / wkv_b)."
                    )
            continue
        head_dim = head_rows[layer.name][0]
        expected = {
            "q_weight": layer.num_heads * head_dim,
            "k_weight": layer.kv_heads * head_dim,
            "q_bias": layer.num_heads * head_dim,
            "k_bias": layer.kv_heads * head_dim,
            "q_norm": head_dim,
            "k_norm": head_dim,
        }
        for role, fqn in layer.fqns().items():
            shape = shapes[canonical_fqn(fqn)]
            if shape[0] != expected[role] or (role == "q_weight" and shape[0] % layer.num_heads):
                raise ValueError(
                    f"dmuon.QKClip: layer {layer.name!r}: {role} {fqn} has shape {shape}; with "
                    f"num_heads={layer.num_heads}, num_kv_heads={layer.kv_heads} and head_dim="
                    f"{head_dim} (q_weight's rows / num_heads) its first dim should be "
                    f"{expected[role]}."
                )
