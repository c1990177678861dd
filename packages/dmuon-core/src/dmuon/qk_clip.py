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

- Grouped-query attention (several query heads share one key head): the shared key head is left
  alone and each query head over the threshold takes gamma_h whole (Kimi's own rule for MLA's
  shared rotary key, "so the clip does not couple across heads"): the logits of head h scale by
  exactly gamma_h, so they end at tau, and no head under the threshold changes. With one key
  head per query head, alpha splits gamma_h between them as the paper writes it.
- Biases (Qwen2's q_proj / k_proj): q^h = W_q^h x + b_q^h scales by a factor only if b_q^h does
  too, so a named bias is scaled with its head's rows; a bias left out would break the bound.
- RoPE rotates q and k after the projections; a rotation is linear, so scaling the rows scales
  the rotated q and k alike and the logits by the same product.
- QK-norm (Qwen3's q_norm / k_norm, an RMSNorm over each head's head_dim with one gain vector
  shared by every head): the norm undoes any scale of the projection's rows, so those are left
  alone; the two gains are scaled instead, q_norm by gamma^alpha and k_norm by gamma^(1 - alpha)
  with gamma = tau / max_h S_h, one factor for the layer (the gains are shared by its heads).

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
from collections.abc import Sequence
from dataclasses import dataclass, replace

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
    ``LOGITS_BLOCK_NUMEL`` logits, with no autograd graph.
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
    rows = max(1, LOGITS_BLOCK_NUMEL // max(1, batch * num_heads * kv_len))
    result = torch.full((num_heads,), -math.inf, dtype=torch.float32, device=query.device)
    for start in range(0, q_len, rows):
        stop = min(q_len, start + rows)
        logits = (grouped[:, :, :, start:stop] @ keys_t) * scaling
        logits = logits.reshape(batch, num_heads, stop - start, kv_len).float()
        if attention_mask is not None:
            mask = attention_mask[..., start:stop, :]
            if mask.dtype == torch.bool:
                logits = logits.masked_fill(~mask, -math.inf)
            else:
                logits = logits + mask.float()
        elif is_causal:
            query_pos = torch.arange(start, stop, device=query.device)[:, None]
            key_pos = torch.arange(kv_len, device=query.device)[None, :]
            logits = logits.masked_fill(key_pos > query_pos + (kv_len - q_len), -math.inf)
        result = torch.maximum(result, logits.amax(dim=(0, 2, 3)))
    return result


def clip_factors(
    max_logits: torch.Tensor, *, threshold: float, alpha: float, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of [Note: the clip]: (num_heads,) for the query heads' rows and
    (num_kv_heads,) for the key heads' rows; 1 where a head is under the threshold (or its
    maximum is not finite)."""
    over = torch.isfinite(max_logits) & (max_logits > threshold)
    gamma = torch.where(over, threshold / max_logits, torch.ones_like(max_logits))
    if num_kv_heads != max_logits.numel():  # a shared key head: the query takes gamma whole
        return gamma, torch.ones(num_kv_heads, dtype=gamma.dtype, device=gamma.device)
    return gamma.pow(alpha), gamma.pow(1.0 - alpha)


class QKClip:
    """MuonClip's QK-clip for a model prepared with ``dmuon.dedicate_params`` and its
    ``dmuon.Muon`` (see [Note: the clip] and [Note: where the clip runs] in ``dmuon.qk_clip``).

    Args:
        model: the model ``dedicate_params`` prepared.
        optimizer: its ``dmuon.Muon``.
        attention: one ``AttentionHeads`` per attention layer to clip.
        threshold: tau, the largest logit a head keeps (Kimi K2: 100).
        alpha: the query's share of the clip (0.5: the square root on each side); see
            [Note: the clip] for grouped-query attention and QK-norm.

    Each layer's attention calls ``record(name, max_logits)`` in every training forward (the
    (num_heads,) maxima of ``dmuon.attention_max_logits``, or this TP rank's heads), dmuon_hf's
    ``qk_clip_hf`` does it for HF Llama / Qwen2 / Qwen3. Forwards without grad (evaluation) are
    not recorded. Every ``optimizer.step()`` then all-reduces the maxima (one MAX of
    sum(num_heads) floats over the data-parallel ranks, and one over the TP ranks under tensor
    parallelism), syncs one flag to the host, and rescales the heads over the threshold before
    the weights are published. ``last_max_logits`` holds the reduced maxima of the last step.

    There is no state to checkpoint: the clip only changes weights, which the checkpoints hold.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        attention: Sequence[AttentionHeads],
        *,
        threshold: float = 100.0,
        alpha: float = 0.5,
    ) -> None:
        _check_settings(threshold, alpha, attention)
        attention = [_canonical(layer) for layer in attention]
        self._state = get_dedicated_state(model)
        if getattr(optimizer, "_dedicated", None) is not self._state:
            raise TypeError(
                f"dmuon.QKClip: the optimizer ({type(optimizer).__name__}) is not the dmuon.Muon "
                "of this model; the clip runs inside its step. Pass the dmuon.Muon(model, ...) "
                "built on the same model."
            )
        self.threshold = float(threshold)
        self.alpha = float(alpha)
        self.model = model
        self.layers = {layer.name: layer for layer in attention}
        self._shapes = _check_parameters(model, self._state, attention)
        self._head_dims = {
            layer.name: self._shapes[layer.q_weight][0] // layer.num_heads for layer in attention
        }
        _check_head_shapes(attention, self._shapes, self._head_dims)
        check_ranks_agree(
            self._state.mesh.world_group,
            {
                "qk_clip": (
                    "QK-clip settings (threshold, alpha, attention layers)",
                    (self.threshold, self.alpha, list(attention)),
                )
            },
        )
        # name -> this step's maxima (num_heads,) recorded here, -inf where not observed.
        self._observed: dict[str, torch.Tensor] = {}
        # name -> (first query head, query heads) this rank's attention computes (TP: a chunk).
        self._local_heads: dict[str, tuple[int, int]] = {}
        # name -> (query-row factors, key-row factors) of the step running now.
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
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

    def _heads_of(self, layer: AttentionHeads) -> tuple[int, int]:
        """(first query head, count) that this rank's attention computes: all of them, or the
        chunk of a tensor-parallel q projection (rows split over TP ranks, colwise)."""
        heads = self._local_heads.get(layer.name)
        if heads is None:
            head_dim = self._head_dims[layer.name]
            rows = self._tp_rows(layer.q_weight)
            heads = _head_range(layer, "q_weight", rows, head_dim, layer.num_heads)
            k_heads = _head_range(layer, "k_weight", self._tp_rows(layer.k_weight), head_dim,
                                  layer.kv_heads)  # fmt: skip
            group = layer.num_heads // layer.kv_heads
            if (k_heads[0] * group, k_heads[1] * group) != heads:
                raise ValueError(
                    f"dmuon.QKClip: layer {layer.name!r}: this rank computes query heads "
                    f"[{heads[0]}, {sum(heads)}) but key heads [{k_heads[0]}, {sum(k_heads)}), "
                    f"which do not serve them ({group} query heads per key head). Split q_proj "
                    "and k_proj over the same TP ranks, by whole heads."
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
                layer = self.layers[name]
                self._pending[name] = clip_factors(
                    per_layer[name], threshold=self.threshold, alpha=self.alpha,
                    num_kv_heads=layer.kv_heads,
                )  # fmt: skip
                self.clipped_heads += int((per_layer[name] > self.threshold).sum())

    def _groups(self) -> list[dist.ProcessGroup]:
        """The data-parallel grid, then every TP group a clipped projection is split over."""
        groups = [self._state.mesh.world_group]
        if self._state.mesh.tp_group is not None:
            groups.append(self._state.mesh.tp_group)
        params = _model_parameters(self.model)
        for layer in self.layers.values():
            for fqn in (layer.q_weight, layer.k_weight):
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
        for name, (q_factors, k_factors) in self._pending.items():
            layer = self.layers[name]
            if layer.q_norm is not None:  # QK-norm: one factor for the layer, on the gains
                gamma = clip_factors(
                    self.last_max_logits[name], threshold=self.threshold, alpha=1.0,
                    num_kv_heads=layer.num_heads,
                )[0].min()  # fmt: skip
                self._scale(params, layer.q_norm, gamma.pow(self.alpha))
                self._scale(params, layer.k_norm, gamma.pow(1.0 - self.alpha))
                continue
            head_dim = self._head_dims[name]
            q_rows = q_factors.repeat_interleave(head_dim)
            k_rows = k_factors.repeat_interleave(head_dim)
            self._scale(params, layer.q_weight, q_rows)
            if layer.q_bias is not None:
                self._scale(params, layer.q_bias, q_rows)
            if layer.kv_heads == layer.num_heads:  # a shared key head is left alone
                self._scale(params, layer.k_weight, k_rows)
                if layer.k_bias is not None:
                    self._scale(params, layer.k_bias, k_rows)

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


def _canonical(layer: AttentionHeads) -> AttentionHeads:
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
    layer: AttentionHeads, role: str, rows: torch.Tensor | None, head_dim: int, heads: int
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


def _check_settings(threshold: float, alpha: float, attention: Sequence[AttentionHeads]) -> None:
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not (math.isfinite(threshold) and threshold > 0)
    ):
        raise ValueError(f"dmuon.QKClip: threshold must be a positive number, got {threshold!r}.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"dmuon.QKClip: alpha must be a number in [0, 1], got {alpha!r}.")
    if not attention or not all(isinstance(layer, AttentionHeads) for layer in attention):
        raise TypeError(
            "dmuon.QKClip: attention must be a non-empty list of dmuon.AttentionHeads(name=..., "
            "q_weight=..., k_weight=..., num_heads=...), one per attention layer."
        )
    names = [layer.name for layer in attention]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"dmuon.QKClip: attention layers named twice: {repeated}.")
    for layer in attention:
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
    model: nn.Module, state: DedicatedState, attention: Sequence[AttentionHeads]
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


def _check_head_shapes(attention, shapes, head_dims) -> None:
    for layer in attention:
        head_dim = head_dims[layer.name]
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
