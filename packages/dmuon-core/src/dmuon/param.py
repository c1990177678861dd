"""A dedicated parameter: one matrix (or vector) with one owner rank.

Owns the per-parameter state: where the parameter lives on its module, its owner coordinate, the
0-element placeholder that stays registered on the module outside forward/backward, the unsharded
parameter that autograd sees during forward/backward, and — on the owner only — the fp32 master
copy the optimizer updates. It must not issue collectives.

[Note: placeholder and unsharded parameter]
Outside forward and backward the module holds a 0-element ``nn.Parameter`` (the placeholder): it
keeps ``named_parameters()`` and ``state_dict()`` keys intact while holding no memory, and FSDP2
is told to ignore it. During forward (and backward) the module holds the *unsharded parameter*: an
``nn.Parameter`` of the full shape whose storage is a slice of its boundary's segment buffer.
It is built with ``set_`` rather than as a view so that it has its own version counter: refilling
the segment for backward (Z3) must not trip autograd's check on tensors it saved in forward.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon._torch_internals import (
    disabled_torch_function_impl,
    torch_clipping_function_at,
    torch_optimizer_at,
)
from dmuon.partition import OwnerCoord
from dmuon.routing import ADAMW_ROUTE, MUON_ROUTE
from dmuon.storage import tensor_over
from dmuon.tp import TensorParallelLayout

# Attribute set on every placeholder (and on a dedicated parameter awaiting adoption) so that
# FSDP2 and the optimizer leave it alone.
DEDICATED_TAG = "_dmuon_dedicated"


PLACEHOLDER_VALUE_ERROR = (
    "{what} on the placeholder of a dedicated parameter: dmuon keeps this parameter's full "
    "value on its owner rank, and the module holds a 0-element placeholder outside forward and "
    "backward, so this would silently read or write nothing. To save or load weights use "
    "dmuon.checkpoint.get_model_state_dict / set_model_state_dict (or get_state_dict / "
    "set_state_dict with the optimizer); to move or cast the model, do it before "
    "dmuon.dedicate_params."
)


PLACEHOLDER_USE_ERROR = (
    "{name}() failed with the placeholder of a dedicated parameter among its arguments: "
    "{error}\nOutside its hook boundary's forward and backward a module holds a 0-element "
    "placeholder for each dedicated parameter. If this call uses the weight outside that "
    "module's forward (a tied output head calling F.linear(h, self.embed.weight) from the "
    "parent's forward, say), choose a hook boundary that encloses every use "
    "(dmuon.dedicate_params(..., hook_boundary_predicate=lambda module: ...)) or leave the "
    "parameter out of the predicate."
)


PLACEHOLDER_WRITE_ERROR = (
    "{name}() writes into the placeholder of a dedicated parameter, which holds no value: dmuon "
    "adopted the weights when dmuon.Muon was constructed or the first forward ran, and since "
    "then each lives in its owner's fp32 master, so this write would change nothing. Initialise "
    "a model built on the meta device after model.to_empty(device=...) and before "
    "dmuon.Muon(...) and the first forward (model.init_weights(), model.apply(...) and "
    "nn.init.*_ then write into the real weights, which dmuon adopts). To set weights later use "
    "dmuon.checkpoint.set_model_state_dict."
)

PLACEHOLDER_GRAD_CLIP_ERROR = (
    "{name} read the gradient of a dedicated parameter, which dmuon keeps on its owner rank's "
    "fp32 master: the module holds a 0-element placeholder with no gradient, so torch's "
    "function would leave the dedicated matrices out of the norm and unscaled, a silently "
    "different clip. Clip with dmuon.clip_grad_norm_(model, optimizer, max_norm) (norm_type, "
    "error_if_nonfinite and foreach as in torch), which counts every gradient the optimizer "
    "updates (max_norm=float('inf') only returns the norm); clip by value over the optimizer's "
    "parameters: torch.nn.utils.clip_grad_value_([p for group in optimizer.param_groups for p "
    "in group['params']], clip_value, foreach=False). See [Note: torch's clipping on a dmuon "
    "model] in dmuon.clip."
)

PLACEHOLDER_GRAD_OPTIMIZER_ERROR = (
    "{name} read the gradient of a dedicated parameter, which dmuon keeps on its owner rank's "
    "fp32 master: the module holds a 0-element placeholder with no gradient, so this optimizer "
    "would never update the dedicated matrices. Train a model dmuon.dedicate_params prepared "
    "with dmuon.Muon(model, ...): Muon on the dedicated matrices, AdamW on the rest "
    "(adamw_lr=...), and routes={{fqn: 'adamw'}} in dedicate_params for AdamW on a dedicated "
    "one; or leave the parameter out of dedicate_params' predicate."
)

_DATA_GETTER = torch.Tensor.data.__get__  # type: ignore[attr-defined]
_GRAD_GETTER = torch.Tensor.grad.__get__  # type: ignore[attr-defined]
# In-place methods that change metadata, not the (empty) value.
_METADATA_WRITES = frozenset({"requires_grad_", "share_memory_"})


class DedicatedPlaceholder(nn.Parameter):
    """The 0-element parameter a module holds for a dedicated parameter outside forward/backward.

    It answers metadata queries (dtype, device, requires_grad, grad) like any parameter, but
    refuses to hand out, pickle or overwrite its (empty) value: a ``named_parameters()``-based
    saver, a cast of the model or an initialisation run after adoption (``nn.init.*_``) would
    otherwise go through with nothing, without a word. For the same reason its gradient (None)
    refuses to be read by torch's clipping functions (``torch.nn.utils.clip_grad_norm_`` and
    its siblings), which name ``dmuon.clip_grad_norm_`` instead (see [Note: torch's clipping on
    a dmuon model] in ``dmuon.clip``).
    """

    _VALUE_READS = frozenset(
        {
            torch.Tensor.detach,
            torch.Tensor.clone,
            torch.Tensor.cpu,
            torch.Tensor.cuda,
            torch.Tensor.to,
            torch.Tensor.numpy,
            torch.Tensor.tolist,
            torch.Tensor.item,
            torch.Tensor.contiguous,
            torch.Tensor.__getitem__,
            torch.Tensor.float,
            torch.Tensor.half,
            torch.Tensor.bfloat16,
            torch.Tensor.double,
            _DATA_GETTER,
            torch.clone,
        }
    )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch's clipping reads this gradient: [Note: torch's clipping on a dmuon model]
        if func == _GRAD_GETTER:
            _refuse_torch_gradient_reader(sys._getframe(1), args[0])
        if func in cls._VALUE_READS:
            what = "reading .data" if func is _DATA_GETTER else f"{func.__name__}()"
            raise RuntimeError(PLACEHOLDER_VALUE_ERROR.format(what=what))
        if _writes_into_placeholder(func, args, kwargs or {}):
            raise RuntimeError(PLACEHOLDER_WRITE_ERROR.format(name=func.__name__))
        try:
            return disabled_torch_function_impl(func, types, args, kwargs or {})
        except RuntimeError as error:  # most likely torch's shape error on the empty value
            name = getattr(func, "__name__", repr(func))
            raise RuntimeError(PLACEHOLDER_USE_ERROR.format(name=name, error=error)) from error

    def __reduce_ex__(self, protocol):
        raise RuntimeError(PLACEHOLDER_VALUE_ERROR.format(what="pickling (torch.save)"))

    def __deepcopy__(self, memo):
        raise RuntimeError(PLACEHOLDER_VALUE_ERROR.format(what="copy.deepcopy"))


def _refuse_torch_gradient_reader(frame, placeholder: nn.Parameter) -> None:
    """Raise where torch's clipping or a torch optimizer reads a trainable placeholder's
    gradient, which would silently leave the dedicated matrix out ([Note: torch's clipping on a
    dmuon model] in ``dmuon.clip``); any other reader gets None."""
    if (reader := torch_clipping_function_at(frame)) is not None:
        error = PLACEHOLDER_GRAD_CLIP_ERROR
    elif (reader := torch_optimizer_at(frame)) is not None:
        error = PLACEHOLDER_GRAD_OPTIMIZER_ERROR
    else:
        return
    if placeholder.requires_grad:  # a frozen one has no gradient anywhere: None is the truth
        raise RuntimeError(error.format(name=reader))


def _writes_into_placeholder(func, args: tuple, kwargs: dict) -> bool:
    """An in-place function (``fill_``, ``copy_``, ``nn.init.normal_``, ...) called on a
    placeholder; not one on metadata, nor the placeholder loading itself, which
    ``load_state_dict`` does once dmuon's hook has taken the value (see ``module_state``)."""
    name = getattr(func, "__name__", "")
    target = args[0] if args else kwargs.get("tensor")  # nn.init's functions pass it by name
    if not isinstance(target, DedicatedPlaceholder):
        return False
    if not name.endswith("_") or name.startswith("_") or name in _METADATA_WRITES:
        return False
    return not (name == "copy_" and len(args) > 1 and args[1] is args[0])


def make_placeholder(like: nn.Parameter) -> nn.Parameter:
    placeholder = DedicatedPlaceholder(
        torch.empty(0, dtype=like.dtype, device=like.device), requires_grad=like.requires_grad
    )
    mark_dedicated(placeholder)
    return placeholder


def mark_dedicated(param: nn.Parameter) -> None:
    setattr(param, DEDICATED_TAG, True)


def is_dedicated(param: torch.Tensor) -> bool:
    """True for placeholders and for dedicated parameters not yet adopted."""
    return getattr(param, DEDICATED_TAG, False)


class ParameterSlot(Protocol):
    """A module parameter that dmuon fills in turn with a placeholder (outside forward and
    backward) and an unsharded parameter (inside): a dedicated parameter's own, or an expert
    stack's (``dmuon.experts.ExpertStack``), which all its expert pieces share."""

    fqn: str
    module: nn.Module
    attr: str  # name of the parameter on ``module``
    requires_grad: bool  # when ``dedicate_params`` ran
    placeholder: nn.Parameter
    unsharded: nn.Parameter | None


def register_unsharded(slot: ParameterSlot) -> None:
    slot.module._parameters[slot.attr] = slot.unsharded


def register_placeholder(slot: ParameterSlot) -> None:
    slot.module._parameters[slot.attr] = slot.placeholder


def follow_requires_grad(slot: ParameterSlot) -> None:
    """Give the unsharded parameter the placeholder's ``requires_grad``.

    User code freezes a dedicated parameter through the module's parameter, which is the
    placeholder outside forward. One frozen when ``dedicate_params`` ran has no state in the
    optimizer, so unfreezing it is refused rather than ignored.
    """
    wanted = slot.placeholder.requires_grad
    if wanted == slot.unsharded.requires_grad:
        return
    if wanted and not slot.requires_grad:
        raise RuntimeError(
            f"{slot.fqn} was frozen (requires_grad=False) when dmuon.dedicate_params ran, "
            "so dmuon.Muon keeps no state for it and cannot train it. Unfreeze it before "
            "dmuon.dedicate_params; to freeze it for a while, freeze it after "
            "dedicate_params (requires_grad_ then works both ways)."
        )
    slot.unsharded.requires_grad_(wanted)


class MasterHome(Protocol):
    """Where an offloaded master's value lives between steps: ``dmuon.offload.MasterOffload``
    (named here by what it answers, so this module does not import what is built on it)."""

    def home_of(self, p: DedicatedParam) -> torch.Tensor: ...

    def value_for_segment(self, p: DedicatedParam) -> torch.Tensor | None: ...


@dataclass(eq=False, slots=True, kw_only=True)
class DedicatedParam:
    fqn: str
    module: nn.Module
    attr: str  # name of the parameter on ``module``
    shape: torch.Size
    param_dtype: torch.dtype  # forward compute dtype
    reduce_dtype: torch.dtype  # of its gradient on the way to the owner (ParamDefaults.dtypes_of)
    requires_grad: bool
    owner: OwnerCoord
    is_owner: bool
    placeholder: nn.Parameter
    # Offset (in elements) into the segment of the owner's shard index within its boundary.
    segment_offset: int = 0
    # Set once the boundary allocates its segments.
    unsharded: nn.Parameter | None = None
    # fp32 master copy; on the owner only, once adopted.
    master: nn.Parameter | None = None
    # The original full parameter, kept until adoption (meta-device models are adopted after
    # ``to_empty()`` + init).
    original: nn.Parameter | None = field(default=None, repr=False)
    # ``dedicate_params(..., routes=...)``: "muon" or "adamw" chosen for this parameter (None:
    # by its shape).
    route_override: str | None = None
    # An expert piece (see [Note: expert stacks are pieces] in ``dmuon.experts``): the slot of
    # the stack whose experts [start, stop) it holds (a ``dmuon.experts.ExpertStack``);
    # ``module``/``attr`` and ``placeholder`` are the stack's, ``shape`` is (stop - start, m, n),
    # ``original`` its experts of the stack's weight.
    stack: ParameterSlot | None = field(default=None, repr=False)
    experts: tuple[int, int] | None = None
    # A DTensor of ``parallelize_module``: this rank stores, reduces and updates its TP chunk
    # (``local_shape``); ``shape`` stays the global shape (see ``dmuon.tp``).
    tp: TensorParallelLayout | None = None
    # ``dedicate_params(row_blocks=...)``: the sizes of the row blocks Newton-Schulz runs on
    # separately ([Note: row blocks] in ``dmuon.row_blocks``); None: the whole matrix.
    row_blocks: tuple[int, ...] | None = None
    # ``dmuon.Muon(offload_masters=True)``: the ``dmuon.offload.MasterOffload`` that keeps the
    # master's value in CPU memory between steps (see ``master_value``); None: it is ``master``.
    offload: MasterHome | None = field(default=None, repr=False)
    # The step's update wrote the new master, rounded, into the local segment, so the publish
    # after it skips the copy (``BoundaryGroup.refresh_from_masters`` consumes it). Set by
    # ``dmuon.muon_route``, forgotten by ``master_value()`` and at each step's start: see
    # [Note: the step writes the segments] in ``dmuon.muon_route``.
    segment_fresh: bool = field(default=False, repr=False)
    # The shape this rank stores (its TP chunk, or the whole parameter) and its element count:
    # fixed at construction, read on every pack and accumulate.
    local_shape: tuple[int, ...] = field(init=False)
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.local_shape = self.tp.local_shape() if self.tp is not None else tuple(self.shape)
        self.numel = math.prod(self.local_shape)

    def master_value(self) -> torch.Tensor | None:
        """The master's value for whoever reads or writes it outside the optimizer's update
        (checkpoints, ``state_dict``, QK-clip, loads): ``master`` itself, or its CPU home while
        ``offload_masters`` keeps it there (see [Note: offloaded masters] in
        ``dmuon.offload``). None off the owner. A write through it reaches the segment at
        the next publish: the step's segment copy no longer counts."""
        self.segment_fresh = False
        if self.master is None or self.offload is None:
            return self.master
        return self.offload.home_of(self)

    @property
    def is_tp_sharded(self) -> bool:
        return self.tp is not None and self.tp.is_sharded

    @property
    def route(self) -> str:
        if self.route_override is not None:
            return self.route_override
        # Muon orthogonalises matrices; trailing dims of >2-D weights are flattened into columns.
        return MUON_ROUTE if len(self.shape) >= 2 else ADAMW_ROUTE

    def bind_unsharded(self, segment: torch.Tensor) -> None:
        """Create the unsharded parameter over ``segment[offset : offset + numel]`` (a DTensor
        of its TP layout under tensor parallelism, as ``parallelize_module`` made it)."""
        data = tensor_over(segment, self.segment_offset, self.local_shape)
        if self.tp is not None:
            data = self.tp.as_dtensor(data)
        self.unsharded = nn.Parameter(data, requires_grad=self.requires_grad)

    def local_value(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of a value of the parameter: the value itself, or under tensor
        parallelism its TP chunk (of a full tensor, or of a DTensor in any placement)."""
        if self.tp is None:
            return value
        if isinstance(value, DTensor):
            if tuple(value.placements) != (self.tp.placement,):
                value = value.redistribute(self.tp.mesh, [self.tp.placement])
            return value.to_local()
        return self.tp.local_part(value)

    def local_grad(self) -> torch.Tensor | None:
        """This rank's part of the unsharded parameter's gradient."""
        grad = self.unsharded.grad if self.unsharded is not None else None
        if grad is None or self.tp is None:
            return grad
        return self.tp.local_grad(grad)
