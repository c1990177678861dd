"""Mixture-of-experts stacks: one (E, m, n) module parameter dedicated as E matrices.

Owns which selected parameters are expert stacks, the expert pieces a stack is dedicated as, and
the stack's own buffer that the module sees during forward and backward. It must not issue
collectives (the pieces travel in their boundary's segments like any dedicated parameter) nor do
optimizer math.

[Note: expert stacks are pieces]
The partition cuts a stack into contiguous expert slices ``[start, stop)``, each with one owner
([Note: expert stacks] in ``partition``). Each slice is an ordinary ``DedicatedParam`` of shape
(stop - start, m, n), an *expert piece*, named ``<fqn>[start:stop]``: it lives in its owner's
segment, so broadcast, reduce, HSDP publish, the fp32 master and the optimizer all see pieces
with one owner each and need nothing new. Only the module is different: it must see its full
(E, m, n) parameter as one autograd leaf. So while its boundary is unsharded, the stack's
*unsharded parameter* is bound (``set_`` on storage, as ``DedicatedParam.bind_unsharded``) over
a per-stack buffer that is allocated and filled by copying the pieces once their broadcasts have
landed, and freed (storage resized to 0) when the boundary reshards. Before the gradients are
reduced, the stack's gradient is split into the pieces' gradients. The price is one extra
(E, m, n) buffer in the compute dtype while the boundary is unsharded.

[Note: which 3-D parameters are expert stacks]
By default every selected 3-D parameter is an expert stack, except the weight of a torch
convolution module (``nn.Conv1d`` / ``nn.ConvTranspose1d``: (out, in, k)), which is one matrix
with its trailing dims flattened into columns, like every parameter of 4 or more dims.
``dedicate_params(..., expert_stacks=fn)`` decides instead: ``fn(name, param) -> bool`` for each
selected 3-D parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon._torch_internals import ConvNd
from dmuon.mesh import OwnershipMesh
from dmuon.param import DedicatedParam, make_placeholder, mark_dedicated
from dmuon.partition import OwnershipPlan, expert_piece_name
from dmuon.policy import ParamPolicy
from dmuon.storage import allocate_storage, free_storage, tensor_over

ExpertStackPredicate = Callable[[str, nn.Parameter], bool]

# Set on the fp32 master of an expert piece: the optimizer sees it as (k, m, n) = k matrices.
EXPERT_PIECE_TAG = "_dmuon_expert_piece"

_CONVOLUTIONS = (ConvNd,)


@dataclass(eq=False, slots=True, kw_only=True)
class ExpertStack:
    """One (E, m, n) module parameter and the expert pieces it is dedicated as."""

    fqn: str
    module: nn.Module
    attr: str  # name of the parameter on ``module``
    shape: torch.Size  # (E, m, n)
    param_dtype: torch.dtype  # forward compute dtype
    requires_grad: bool
    placeholder: nn.Parameter  # shared by the pieces
    pieces: list[DedicatedParam] = field(default_factory=list)  # in expert order
    # (E * m * n,) in the compute dtype; its storage exists only while the boundary is unsharded.
    buffer: torch.Tensor | None = None
    # What the module holds during forward/backward: (E, m, n) over ``buffer``'s storage.
    unsharded: nn.Parameter | None = None

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def route(self) -> str:
        return self.pieces[0].route

    @property
    def route_override(self) -> str | None:
        return self.pieces[0].route_override

    def bind(self, device: torch.device) -> None:
        """Create the buffer (freed) and the unsharded parameter over it."""
        self.buffer = torch.empty(self.shape.numel(), dtype=self.param_dtype, device=device)
        data = tensor_over(self.buffer, 0, self.shape)
        self.unsharded = nn.Parameter(data, requires_grad=self.requires_grad)
        free_storage(self.buffer)

    def fill_from_pieces(self) -> None:
        """Copy every piece's weights (their segments, broadcast) into the stack buffer."""
        allocate_storage(self.buffer)
        with torch.no_grad():
            experts = self.buffer.view(self.shape)
            for piece in self.pieces:
                start, stop = piece_experts(piece)
                experts[start:stop].copy_(piece.unsharded)

    def free(self) -> None:
        if self.buffer is not None:
            free_storage(self.buffer)

    def split_gradient(self) -> None:
        """Hand each piece its experts' part of the stack's gradient (before the reduce)."""
        grad = self.unsharded.grad if self.unsharded is not None else None
        if grad is None:
            return
        for piece in self.pieces:
            start, stop = piece_experts(piece)
            piece.unsharded.grad = grad[start:stop]
        self.unsharded.grad = None

    def owned_pieces(self) -> list[DedicatedParam]:
        """The pieces whose fp32 master this rank holds."""
        return [piece for piece in self.pieces if piece.master is not None]


def expert_stack_names(
    selected: Iterable[tuple[str, nn.Module, str, nn.Parameter]],
    expert_stacks: ExpertStackPredicate | None,
) -> list[str]:
    """The selected ``(name, module, attr, param)`` that are expert stacks, in order (see
    [Note: which 3-D parameters are expert stacks])."""
    names = []
    for name, module, _, param in selected:
        if param.ndim != 3:
            continue
        if expert_stacks is not None:
            decided = expert_stacks(name, param)
            if not isinstance(decided, bool):
                raise TypeError(
                    f"dedicate_params: expert_stacks({name!r}, param) returned {decided!r}; it "
                    "must return True (an (E, m, n) stack of E expert matrices) or False (one "
                    "matrix, trailing dims flattened into columns)."
                )
        else:
            decided = not isinstance(module, _CONVOLUTIONS)
        if decided and isinstance(param, DTensor):
            raise ValueError(
                f"dedicate_params: {name} of shape {tuple(param.shape)} is an expert stack and a "
                f"DTensor on mesh dims {param.device_mesh.mesh_dim_names}: dmuon does not dedicate "
                "tensor- or expert-parallel expert stacks yet. Leave it out of the predicate "
                "(FSDP2 and AdamW keep it), or make expert_stacks= return False for it (one "
                "matrix, trailing dims flattened into columns)."
            )
        if decided:
            names.append(name)
    return names


def make_expert_pieces(
    *,
    name: str,
    module: nn.Module,
    attr: str,
    param: nn.Parameter,
    plan: OwnershipPlan,
    mesh: OwnershipMesh,
    policy: ParamPolicy,
    route_override: str | None,
) -> dict[str, DedicatedParam]:
    """The expert pieces of the stack ``name`` as the partition cut it, by piece name (see
    [Note: expert stacks are pieces])."""
    mark_dedicated(param)
    param_dtype, reduce_dtype = policy.defaults.dtypes_of(param)
    stack = ExpertStack(
        fqn=name,
        module=module,
        attr=attr,
        shape=param.shape,
        param_dtype=param_dtype,
        requires_grad=param.requires_grad,
        placeholder=make_placeholder(param),
    )
    pieces = {}
    for start, stop in plan.expert_slices[name]:
        piece_name = expert_piece_name(name, start, stop)
        owner = plan.owners[piece_name]
        piece = DedicatedParam(
            fqn=piece_name,
            module=module,
            attr=attr,
            shape=torch.Size((stop - start, *param.shape[1:])),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            requires_grad=param.requires_grad,
            owner=owner,
            is_owner=mesh.is_me(owner),
            placeholder=stack.placeholder,
            original=expert_original(param, start, stop),
            route_override=route_override,
            stack=stack,
            experts=(start, stop),
        )
        stack.pieces.append(piece)
        pieces[piece_name] = piece
    return pieces


def expert_original(stack_value: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Experts ``[start, stop)`` of the stack's original weight, as a piece's original: a view
    that keeps ``requires_grad`` (the master inherits it) without recording autograd history."""
    return stack_value.detach()[start:stop].requires_grad_(stack_value.requires_grad)


def piece_experts(piece: DedicatedParam) -> tuple[int, int]:
    assert piece.experts is not None
    return piece.experts


def stacks_of(params: Iterable[DedicatedParam]) -> dict[str, ExpertStack]:
    """FQN -> stack of the expert pieces among ``params``, in order of their first piece."""
    stacks: dict[str, ExpertStack] = {}
    for p in params:
        if p.stack is not None:
            stacks.setdefault(p.stack.fqn, p.stack)
    return stacks


def mark_expert_piece(master: torch.Tensor) -> None:
    setattr(master, EXPERT_PIECE_TAG, True)


def is_expert_piece(tensor: torch.Tensor) -> bool:
    """True for the fp32 master of an expert piece: (k, m, n) holds k matrices (m, n)."""
    return getattr(tensor, EXPERT_PIECE_TAG, False)
