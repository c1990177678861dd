"""One global gradient norm (and clip) over everything ``dmuon.Muon`` optimizers update.

Owns ``dmuon.clip_grad_norm_``, the dmuon counterpart of ``torch.nn.utils.clip_grad_norm_``
(dmuon-hf's Trainer logs and clips with it). It must not move weights or gradients between
ranks: it reads the gradients where they already are and scales them in place.

The gradients of a dmuon model live in four kinds of places, each counted exactly once:

- the owners' fp32 masters of the dedicated parameters: plain tensors, each on exactly one rank
  of dmuon's world group, so their norms are combined over that group; the master of a
  tensor-parallel matrix holds one chunk on each TP rank of its owner, so those are combined
  over the TP ranks too (a plain matrix's master is the same on every TP rank: counted once);
- FSDP2's sharded gradients: DTensors, whose norm each mesh reduces by itself;
- on the DDP + TP path, the local chunks of the parameters ``parallelize_module`` sharded:
  torch's DDP recipe (``_pre_dp_module_transform``) keeps them as plain tensors that remember
  their DTensor layout (``_st_info``), so their norm is taken as that DTensor's;
- plain tensors of parameters neither dedicated nor sharded: the same on every rank, counted
  once.

``model.parameters()`` alone would miss the masters (they are not module parameters), which is
why ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` is wrong for a dmuon model: it
raises instead, see [Note: torch's clipping on a dmuon model].

[Note: torch's clipping on a dmuon model]
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``, the habit of every torch loop,
would see the dedicated parameters' 0-element placeholders with no gradient and return a smaller
norm, leaving the dedicated gradients unscaled: a silently different clip. Making it right would
take a collective that torch's function does not issue and the optimizer that only
``dmuon.clip_grad_norm_`` is given, so it raises instead, on every rank alike with no
collective: the placeholder's ``grad`` getter (``dmuon.param.DedicatedPlaceholder``) raises when
it is read from torch's clipping module (``_torch_internals.torch_clipping_function_at``). Every
rank holds the same placeholders, and torch reads every parameter's ``grad`` before its first
collective, so every rank raises at the same point and none waits on another. This covers
``clip_grad_norm_``, ``clip_grads_with_norm_``, ``clip_grad_value_`` and the deprecated
``clip_grad_norm``, however they were imported; a frozen dedicated parameter (no gradient
anywhere, so torch's norm is the right one) and a model without dedicated parameters are left to
torch. ``torch.nn.utils.get_total_norm`` takes gradients, not parameters: it cannot tell that a
caller's ``[p.grad for p in model.parameters() if p.grad is not None]`` left the dedicated ones
out (``clip_grads_with_norm_``, its partner, then raises). The same getter refuses a torch
optimizer built over ``model.parameters()`` (``torch.optim.AdamW``, ...; read from
``torch.optim``, ``_torch_internals.torch_optimizer_at``), naming ``dmuon.Muon``: it would step
every parameter but the dedicated matrices, also without a word.

Elsewhere the placeholder's ``grad`` stays None, on purpose. It is the truth about the
placeholder (the gradient lives reduced on one rank, as a master's), and it is what torch means
by "no gradient here": ``model.zero_grad()``, torch's optimizers and ``p.grad is not None``
checks in user and library code read it as such. A gradient that told the truth on every rank
would cost a broadcast of every dedicated gradient each step; one that raised on every read
would break those checks. A user's own loop over ``model.parameters()`` reading ``p.grad`` gets
None for a dedicated parameter; the docs name ``dmuon.clip_grad_norm_(model, optimizer,
float("inf"))`` for the norm.

[Note: parts and pipeline stages]
A model cut into pipeline stages has one dedicated part and one optimizer per stage, and a rank
may hold several (see [Note: one step, several optimizers] in ``dmuon.step_group``). One norm
spans them all, as in one process: the norms are combined as sums of ``|g|^p`` (maxima for the
inf-norm), first over this rank's parts (one reduce per distinct ownership grid and TP group,
not one per part), then over the pipeline group of their ``StepGroup``. The total is the same
on every rank, so ``error_if_nonfinite`` raises on every rank alike, and the step group's
non-finite check reuses it instead of checking again.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from dmuon import _profiler_labels as labels
from dmuon import collectives
from dmuon._torch_internals import profiler_range, tensor_parallel_layout
from dmuon.hooks import DedicatedState, get_dedicated_state
from dmuon.optim import Muon


class _Required:
    """The default of ``clip_grad_norm_``'s required arguments, so that a call with torch's
    arguments (``clip_grad_norm_(model.parameters(), max_norm)``) gets dmuon's message rather
    than Python's bare ``missing 1 required positional argument``."""

    def __repr__(self) -> str:
        return "<required>"


_REQUIRED: Any = _Required()


@torch.no_grad()
def clip_grad_norm_(
    models: nn.Module | Sequence[nn.Module],
    optimizers: Muon | Sequence[Muon] = _REQUIRED,
    max_norm: float = _REQUIRED,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale every gradient the optimizers update by ``min(1, max_norm / total_norm)``; return
    the total norm before clipping (fp32, the same on every rank).

    "Every gradient the optimizers update" is the gradient of each parameter in their param
    groups that has one this step: the owners' fp32 masters of the dedicated parameters (Muon
    and owner-side AdamW routes, each counted on its owner alone), FSDP2's sharded gradients
    (each shard once), tensor-parallel chunks (each once) and plain replicated parameters (once).
    It leaves out frozen parameters, parameters that got no gradient this step (``grad`` None)
    and tensors outside the optimizers, as ``torch.nn.utils.clip_grad_norm_`` on the full model
    in one process would.

    Args:
        models, optimizers: a model ``dedicate_params`` prepared and its ``dmuon.Muon``, or lists
            of them pairwise (the parts of a model this rank holds, e.g. its pipeline stages):
            every optimizer of one ``dmuon.StepGroup``, whose ``pp_mesh`` the norm then also
            spans (the other ranks' stages).
        max_norm: the largest total norm left; ``float("inf")`` only computes the norm.
        norm_type: p of the p-norm, ``float("inf")`` (or ``"inf"``) for the largest absolute
            value; any p > 0.
        error_if_nonfinite: raise RuntimeError (on every rank) before scaling anything when the
            total norm is NaN or infinite; this reads the norm on the host.
        foreach: as in torch: None picks the multi-tensor kernels where they run.

    When the optimizers skip or refuse non-finite steps (``nonfinite="skip"`` or ``"raise"``), a
    non-finite norm leaves the gradients unscaled, so the step's check still names the
    parameters that hold a NaN or an infinity. Collective: every rank must call it.

    ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` raises on a dmuon model,
    naming this function (see [Note: torch's clipping on a dmuon model]).
    """
    with profiler_range(labels.CLIP_GRAD_NORM):
        return _clip_grad_norm(models, optimizers, max_norm, norm_type, error_if_nonfinite, foreach)


def _clip_grad_norm(
    models: nn.Module | Sequence[nn.Module],
    optimizers: Muon | Sequence[Muon],
    max_norm: float,
    norm_type: float | str,
    error_if_nonfinite: bool,
    foreach: bool | None,
) -> torch.Tensor:
    """``clip_grad_norm_``'s work, inside its profiler range."""
    _check_arguments(models, optimizers, max_norm)
    parts = _parts(models, optimizers)
    step_group = parts[0][1].step_group
    p = _check_norm_type(norm_type)
    combine = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    device = _device_of(parts[0][1])

    kinds = _GradientKinds()
    for state, optimizer in parts:
        kinds.add(state, optimizer)

    pieces: list[torch.Tensor] = []  # this rank's stages' terms, each over all its ranks
    for ranks in sorted(kinds.owned):  # one order on every rank
        owned = kinds.owned[ranks]
        both = torch.stack([_power(owned.masters, p, foreach, device),
                            _power(owned.chunks, p, foreach, device)])  # fmt: skip
        # Issued on every rank of the grid, also where this rank owns nothing with a gradient.
        if owned.world_group is not None:
            collectives.all_reduce(
                both, owned.world_group, op=combine, purpose="dmuon.clip_grad_norm_'s norm"
            ).wait()
        chunks = both[1:].clone()
        if owned.tp_group is not None:
            collectives.all_reduce(
                chunks, owned.tp_group, op=combine, purpose="dmuon.clip_grad_norm_'s norm"
            ).wait()
        pieces += [both[0], chunks[0]]
    pieces.append(_power(kinds.replicated, p, foreach, device))
    for params in kinds.sharded.values():
        norm = get_total_norm([_grad_as_dtensor(param) for param in params], p, foreach=foreach)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        pieces.append(_raised(norm.to(device, torch.float32), p))
    stacked = torch.stack(pieces)
    total = stacked.amax() if math.isinf(p) else stacked.sum()
    step_group.all_reduce_over_pipeline(total, combine)
    total_norm = total if math.isinf(p) else total ** (1.0 / p)
    step_group.record_clip_norm(total_norm)
    if error_if_nonfinite and not torch.isfinite(total_norm).item():
        raise RuntimeError(
            f"dmuon.clip_grad_norm_: the total norm of the gradients is {total_norm.item()}, so "
            "they cannot be clipped. Set error_if_nonfinite=False to clip anyway (the gradients "
            "become NaN), or use dmuon.Muon(..., nonfinite='skip') to skip such steps."
        )

    if max_norm != float("inf"):
        clip_by = total_norm
        if parts[0][1].nonfinite != "ignore":  # keep the culprits findable: see the docstring
            clip_by = torch.where(torch.isfinite(total_norm), total_norm, 0.0)
        overlapped = [
            (o, o.before_gradients_scaled()) for _, opt in parts if (o := opt._overlap) is not None
        ]
        # One call per kind of gradient: plain tensors and each mesh's DTensors do not mix.
        for params in kinds.clipped_lists():
            if params:
                clip_grads_with_norm_(params, max_norm, clip_by, foreach)
        for overlap, versions in overlapped:
            overlap.gradients_scaled(versions, _clip_coefficient(max_norm, clip_by))
    return total_norm


def _clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """The factor ``torch.nn.utils.clip_grads_with_norm_`` multiplies every gradient by, by its
    own expression (``tests/core/test_clip.py`` checks they agree bit for bit): the overlapped
    step keeps what it computed during backward only where this is exactly 1.0."""
    return torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)


@dataclass(slots=True)
class _OwnedGradients:
    """The masters' gradients of the parts that share one ownership grid and TP group."""

    world_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None
    masters: list[torch.Tensor] = field(default_factory=list)
    chunks: list[torch.Tensor] = field(default_factory=list)  # masters of TP chunks


@dataclass(slots=True)
class _GradientKinds:
    """This rank's parameters with a gradient, by the ranks their norm is combined over."""

    # (grid ranks, TP ranks) -> the owned masters of the parts on that grid
    owned: dict[tuple[tuple[int, ...], tuple[int, ...]], _OwnedGradients] = field(
        default_factory=dict
    )
    sharded: dict[object, list[torch.Tensor]] = field(
        default_factory=lambda: defaultdict(list)
    )  # DTensor mesh -> params
    replicated: list[torch.Tensor] = field(default_factory=list)

    def add(self, state: DedicatedState, optimizer: Muon) -> None:
        mesh = state.mesh
        key = (_ranks(mesh.world_group), _ranks(mesh.tp_group))
        owned = self.owned.setdefault(key, _OwnedGradients(mesh.world_group, mesh.tp_group))
        master_ids = {id(p.master): p.is_tp_sharded for p in state.iter_owned_masters()}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if id(param) in master_ids:
                    (owned.chunks if master_ids[id(param)] else owned.masters).append(param)
                elif isinstance(param.grad, DTensor):
                    self.sharded[param.grad.device_mesh].append(param)
                elif (spec := _tensor_parallel_spec(param)) is not None:
                    self.sharded[spec.mesh].append(param)
                else:
                    self.replicated.append(param)

    def clipped_lists(self) -> list[list[torch.Tensor]]:
        masters = [p for owned in self.owned.values() for p in owned.masters + owned.chunks]
        return [masters, self.replicated, *self.sharded.values()]


def _check_arguments(models, optimizers, max_norm) -> None:
    """Refuse torch's arguments, ``(parameters, max_norm)``, saying what this function takes."""
    model_given = isinstance(models, nn.Module) or (
        isinstance(models, Sequence)
        and not isinstance(models, str)
        and all(isinstance(model, nn.Module) for model in models)
    )
    optimizer_given = isinstance(optimizers, torch.optim.Optimizer) or (
        isinstance(optimizers, Sequence) and not isinstance(optimizers, str)
    )
    if not (model_given and optimizer_given):
        raise TypeError(
            "dmuon.clip_grad_norm_ takes (model, optimizer, max_norm), not torch's (parameters, "
            f"max_norm): got {_described(models)} as the model and {_described(optimizers)} as "
            "the optimizer. The norm must count the owners' fp32 masters, which are not among "
            "model.parameters() and which only the optimizer knows: call "
            "dmuon.clip_grad_norm_(model, optimizer, max_norm) with the model "
            "dmuon.dedicate_params prepared and its dmuon.Muon (or lists of the parts' models "
            "and optimizers)."
        )
    if max_norm is _REQUIRED:
        raise TypeError(
            "dmuon.clip_grad_norm_ takes (model, optimizer, max_norm): max_norm is missing. Pass "
            "the largest total norm to leave, or float('inf') to only compute the norm."
        )


def _described(value: object) -> str:
    """What a wrong argument is, for a message: ``a generator``, ``a list of Parameter``, ``1.0``."""
    if value is _REQUIRED:
        return "nothing"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(item).__name__ for item in value})
        return (
            f"a {type(value).__name__} of {', '.join(kinds)}"
            if kinds
            else f"an empty {type(value).__name__}"
        )
    return f"a {type(value).__name__}"


def _parts(models, optimizers) -> list[tuple[DedicatedState, Muon]]:
    """(model state, optimizer) pairs, checked: every optimizer of one step group, once."""
    models = [models] if isinstance(models, nn.Module) else list(models)
    optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    if len(models) != len(optimizers) or not models:
        raise ValueError(
            f"dmuon.clip_grad_norm_ got {len(models)} models and {len(optimizers)} optimizers: "
            "pass a model and its dmuon.Muon, or lists of the parts' models and their "
            "optimizers in the same order."
        )
    parts = []
    for index, (model, optimizer) in enumerate(zip(models, optimizers)):
        if not isinstance(optimizer, Muon):
            raise TypeError(
                f"dmuon.clip_grad_norm_ takes dmuon.Muon optimizers, got "
                f"{type(optimizer).__name__}: the norm must count the owners' fp32 masters, "
                "which only dmuon.Muon knows."
            )
        state = get_dedicated_state(model)
        if optimizer.model_state is not state:
            raise ValueError(
                f"dmuon.clip_grad_norm_: optimizers[{index}] is not the optimizer of "
                f"models[{index}] ({type(model).__name__}); pass each part's model and its "
                "dmuon.Muon at the same position."
            )
        parts.append((state, optimizer))
    step_group = optimizers[0].step_group
    given = {id(optimizer) for optimizer in optimizers}
    if any(optimizer.step_group is not step_group for optimizer in optimizers):
        raise ValueError(
            "dmuon.clip_grad_norm_: the optimizers belong to different step groups, so no one "
            "norm spans them. Give every part's dmuon.Muon the same "
            "step_group=dmuon.StepGroup(pp_mesh=...)."
        )
    if len(given) != len(optimizers) or len(given) != len(step_group.members):
        raise ValueError(
            f"dmuon.clip_grad_norm_ got {len(optimizers)} optimizers ({len(given)} distinct) "
            f"for a step group of {len(step_group.members)}: pass every part's model and "
            "optimizer once, so the norm covers all of them."
        )
    return parts


def _check_norm_type(norm_type: float | str) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        p = math.nan
    if not p > 0:
        raise ValueError(
            f"dmuon.clip_grad_norm_: norm_type={norm_type!r} is not supported; use a p-norm "
            "with p > 0 (2.0 by default) or float('inf') for the largest absolute value."
        )
    return p


def _ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return () if group is None else tuple(dist.get_process_group_ranks(group))


def _power(
    params: list[torch.Tensor], p: float, foreach: bool | None, device: torch.device
) -> torch.Tensor:
    """``sum |g|^p`` (or ``max |g|`` for p = inf) over the gradients of ``params``, fp32."""
    if not params:
        return torch.zeros((), dtype=torch.float32, device=device)
    norm = get_total_norm([param.grad for param in params], p, foreach=foreach)
    return _raised(norm.to(device, torch.float32), p)


def _raised(norm: torch.Tensor, p: float) -> torch.Tensor:
    return norm if math.isinf(p) else norm**p


def _tensor_parallel_spec(param: torch.Tensor):
    """The DTensor layout of a TP parameter that torch's DDP + TP recipe made a plain tensor
    (None for any other parameter, and for a replicated one, counted once as it is)."""
    spec = tensor_parallel_layout(param)
    if spec is None or not any(placement.is_shard() for placement in spec.placements):
        return None
    return spec


def _grad_as_dtensor(param: torch.Tensor) -> torch.Tensor:
    """``param.grad`` as the DTensor it is a chunk of (FSDP2's already is one)."""
    spec = None if isinstance(param.grad, DTensor) else _tensor_parallel_spec(param)
    if spec is None:
        return param.grad
    return DTensor.from_local(
        param.grad,
        spec.mesh,
        spec.placements,
        run_check=False,
        shape=spec.shape,
        stride=spec.stride,
    )


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")
