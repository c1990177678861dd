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

[Note: expert-parallel stacks]
Under expert parallelism (``dedicate_params(..., ep_mesh=, expert_mesh=)``) a rank's stack holds
only its EP slot's experts ``[first, first + E / ep)``: either a DTensor of the global shape
(E, m, n) sharded ``Shard(0)`` over the ep mesh (what torchtitan's ``ExpertParallel`` makes) or
a plain local tensor (E / ep, m, n). The partition cuts every EP slot's experts inside that
slot ([Note: expert parallelism] in ``partition``); this rank's stack has the pieces of its own
slot only, named by their global experts (``w1[4:6]`` on EP slot 1 of 2, E = 8), and its buffer
holds the local experts: a piece's experts sit at ``start - first`` in it. The module sees what
it was given: the same DTensor layout over the buffer (``DTensor.from_local``, whose gradient is
read back as its local tensor) or the local tensor. The stack's ``shape`` stays the global
(E, m, n), the shape its checkpoint entries keep. The pieces' segments travel on the stack's
expert ``OwnershipMesh`` (``mesh``, [Note: expert meshes] in ``dmuon.mesh``), not on the
boundary's.

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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dmuon._torch_internals import ConvNd
from dmuon.mesh import ExpertMeshes, OwnershipMesh
from dmuon.param import DedicatedParam, make_placeholder, mark_dedicated
from dmuon.partition import OwnershipPlan, expert_piece_name
from dmuon.policy import ParamPolicy
from dmuon.storage import allocate_storage, free_storage, tensor_over

ExpertStackPredicate = Callable[[str, nn.Parameter], bool]

# Set on the fp32 master of an expert piece: the optimizer sees it as (k, m, n) = k matrices.
EXPERT_PIECE_TAG = "_dmuon_expert_piece"

_CONVOLUTIONS = (ConvNd,)


def is_expert_stack_by_default(module: nn.Module, param: torch.Tensor) -> bool:
    """Whether ``dedicate_params`` without ``expert_stacks=`` takes ``param`` of ``module`` for
    an (E, m, n) expert stack: every 3-D parameter but a torch convolution's weight (see [Note:
    which 3-D parameters are expert stacks])."""
    return param.ndim == 3 and not isinstance(module, _CONVOLUTIONS)


@dataclass(frozen=True, slots=True)
class ExpertRange:
    """One piece of a stack as every rank knows it, under expert parallelism also the pieces of
    other EP slots: its name, its experts ``[start, stop)`` and its owner's global rank."""

    fqn: str
    start: int
    stop: int
    owner_rank: int


@dataclass(eq=False, slots=True, kw_only=True)
class ExpertStack:
    """One (E, m, n) module parameter and the expert pieces it is dedicated as."""

    fqn: str
    module: nn.Module
    attr: str  # name of the parameter on ``module``
    shape: torch.Size  # (E, m, n): every expert, also under expert parallelism
    param_dtype: torch.dtype  # forward compute dtype
    requires_grad: bool
    placeholder: nn.Parameter  # shared by the pieces
    pieces: list[DedicatedParam] = field(default_factory=list)  # in expert order
    # (E_local * m * n,) in the compute dtype; its storage exists only while the boundary is
    # unsharded.
    buffer: torch.Tensor | None = None
    # What the module holds during forward/backward: (E_local, m, n) over ``buffer``'s storage
    # (a DTensor sharded over ``ep_mesh`` when the stack was one).
    unsharded: nn.Parameter | None = None
    # Expert parallelism (see [Note: expert-parallel stacks]): the experts this rank holds
    # start at ``first_expert``; ``mesh`` is the expert ownership mesh its pieces travel on;
    # ``ep_mesh`` is set when the module's stack is a DTensor sharded Shard(0) over it.
    first_expert: int = 0
    local_experts: int | None = None  # None: every expert
    mesh: OwnershipMesh | None = None
    ep_mesh: DeviceMesh | None = None
    # Every piece of the stack, of every EP slot, in expert order (a full state dict gathers
    # them all); the same ranges as ``pieces`` without expert parallelism.
    every_piece: tuple[ExpertRange, ...] = ()

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def local_shape(self) -> torch.Size:
        """The experts this rank's module holds: (E, m, n), or (E / ep, m, n) under EP."""
        if self.local_experts is None:
            return self.shape
        return torch.Size((self.local_experts, *self.shape[1:]))

    @property
    def route(self) -> str:
        return self.pieces[0].route

    @property
    def route_override(self) -> str | None:
        return self.pieces[0].route_override

    def bind(self, device: torch.device) -> None:
        """Create the buffer (freed) and the unsharded parameter over it."""
        shape = self.local_shape
        self.buffer = torch.empty(shape.numel(), dtype=self.param_dtype, device=device)
        data = tensor_over(self.buffer, 0, shape)
        if self.ep_mesh is not None:
            data = DTensor.from_local(
                data,
                self.ep_mesh,
                [Shard(0)],
                run_check=False,
                shape=self.shape,
                stride=_contiguous_stride(self.shape),
            )
        self.unsharded = nn.Parameter(data, requires_grad=self.requires_grad)
        free_storage(self.buffer)

    def fill_from_pieces(self) -> None:
        """Copy every piece's weights (their segments, broadcast) into the stack buffer."""
        allocate_storage(self.buffer)
        with torch.no_grad():
            experts = self.buffer.view(self.local_shape)
            for piece in self.pieces:
                start, stop = self.local_range(piece)
                experts[start:stop].copy_(piece.unsharded)

    def free(self) -> None:
        if self.buffer is not None:
            free_storage(self.buffer)

    def split_gradient(self) -> None:
        """Hand each piece its experts' part of the stack's gradient (before the reduce)."""
        grad = self.unsharded.grad if self.unsharded is not None else None
        if grad is None:
            return
        if isinstance(grad, DTensor):
            grad = grad.to_local()
        for piece in self.pieces:
            start, stop = self.local_range(piece)
            piece.unsharded.grad = grad[start:stop]
        self.unsharded.grad = None

    def local_range(self, piece: DedicatedParam) -> tuple[int, int]:
        """Where a piece's experts sit among this rank's experts."""
        start, stop = piece_experts(piece)
        return start - self.first_expert, stop - self.first_expert

    def owned_pieces(self) -> list[DedicatedParam]:
        """The pieces whose fp32 master this rank holds."""
        return [piece for piece in self.pieces if piece.master is not None]


def expert_stack_names(
    selected: Iterable[tuple[str, nn.Module, str, nn.Parameter]],
    expert_stacks: ExpertStackPredicate | None,
    ep_mesh: DeviceMesh | None = None,
) -> list[str]:
    """The selected ``(name, module, attr, param)`` that are expert stacks, in order (see
    [Note: which 3-D parameters are expert stacks]). A DTensor stack must be expert-parallel:
    sharded Shard(0) over ``ep_mesh``."""
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
            decided = is_expert_stack_by_default(module, param)
        if decided and isinstance(param, DTensor) and not is_expert_parallel(param, ep_mesh):
            placements = tuple(param.placements)
            if ep_mesh is None and placements == (Shard(0),):
                fix = (
                    "If it is expert-parallel (its experts split over this mesh), pass that dim "
                    "and the expert-FSDP dim: dedicate_params(..., ep_mesh=mesh['ep'], "
                    "expert_mesh=mesh['efsdp'])."
                )
            else:
                given = (
                    "none was given"
                    if ep_mesh is None
                    else f"dims {ep_mesh.mesh_dim_names}, ranks {ep_mesh.mesh.tolist()}"
                )
                fix = (
                    "dmuon dedicates a DTensor stack only when it is expert-parallel: Shard(0) "
                    f"over the ep_mesh given to dedicate_params ({given}); tensor-parallel expert "
                    "stacks are not dedicated yet."
                )
            raise ValueError(
                f"dedicate_params: {name} of shape {tuple(param.shape)} is an expert stack and a "
                f"DTensor on mesh dims {param.device_mesh.mesh_dim_names} with placements "
                f"{placements}. {fix} Otherwise leave it out of the predicate (FSDP2 and AdamW "
                "keep it), or make expert_stacks= return False for it (one matrix, trailing dims "
                "flattened into columns)."
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
    experts: ExpertMeshes | None = None,
) -> dict[str, DedicatedParam]:
    """The expert pieces of the stack ``name`` as the partition cut it, by piece name (see
    [Note: expert stacks are pieces]); under expert parallelism (``experts``) those of this
    rank's EP slot (see [Note: expert-parallel stacks])."""
    mark_dedicated(param)
    param_dtype, reduce_dtype = policy.defaults.dtypes_of(param)
    local = param.to_local() if isinstance(param, DTensor) else param
    stack = ExpertStack(
        fqn=name,
        module=module,
        attr=attr,
        shape=global_stack_shape(param, experts),
        param_dtype=param_dtype,
        requires_grad=param.requires_grad,
        placeholder=make_placeholder(param),
    )
    slices = plan.expert_slices[name]
    names = [expert_piece_name(name, start, stop) for start, stop in slices]
    stack.every_piece = tuple(
        ExpertRange(piece, start, stop, mesh.global_rank(plan.owners[piece]))
        for piece, (start, stop) in zip(names, slices)
    )
    if experts is not None:
        first, last = plan.ep_experts(name, experts.ep_index)
        stack.first_expert, stack.local_experts = first, last - first
        stack.mesh = experts.mesh
        stack.ep_mesh = param.device_mesh if isinstance(param, DTensor) else None
        slices = tuple((start, stop) for start, stop in slices if first <= start < last)
    pieces = {}
    for start, stop in slices:
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
            original=expert_original(local, start - stack.first_expert, stop - stack.first_expert),
            route_override=route_override,
            stack=stack,
            experts=(start, stop),
        )
        stack.pieces.append(piece)
        pieces[piece_name] = piece
    return pieces


def is_expert_parallel(param: torch.Tensor, ep_mesh: DeviceMesh | None) -> bool:
    """A DTensor stack sharded Shard(0) over ``ep_mesh`` (its experts split over ep)."""
    return (
        ep_mesh is not None
        and isinstance(param, DTensor)
        and tuple(param.placements) == (Shard(0),)
        and param.device_mesh.mesh.tolist() == ep_mesh.mesh.tolist()
    )


def global_stack_shape(param: torch.Tensor, experts: ExpertMeshes | None) -> torch.Size:
    """Every expert's (E, m, n): a DTensor's own shape, or a local stack's times the EP degree."""
    if experts is None or isinstance(param, DTensor):
        return param.shape
    return torch.Size((param.shape[0] * experts.num_ep, *param.shape[1:]))


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


def expert_original(stack_value: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Experts ``[start, stop)`` of the stack's original weight, as a piece's original: a view
    that keeps ``requires_grad`` (the master inherits it) without recording autograd history."""
    return stack_value.detach()[start:stop].requires_grad_(stack_value.requires_grad)


def agreed_name(p: DedicatedParam) -> str:
    """``p``'s name as every rank's cross-rank checks must see it: its FQN, except for the
    piece of an expert-parallel stack, whose name holds its EP slot's experts (ranks of other
    slots have other pieces): its stack and its place among this rank's pieces of it (every EP
    slot has as many, of the same sizes)."""
    stack = p.stack
    if not isinstance(stack, ExpertStack) or stack.mesh is None:
        return p.fqn
    return f"{stack.fqn} piece {stack.pieces.index(p)}"


def piece_original(piece: DedicatedParam, stack_value: torch.Tensor) -> torch.Tensor:
    """The piece's experts of the module's current stack value (the whole stack, this rank's EP
    slot of it, or a DTensor sharded over ep), as ``expert_original`` makes them."""
    local = stack_value.to_local() if isinstance(stack_value, DTensor) else stack_value
    first = piece.stack.first_expert if piece.stack is not None else 0
    start, stop = piece_experts(piece)
    return expert_original(local, start - first, stop - first)


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
