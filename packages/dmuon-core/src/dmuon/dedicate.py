"""The setup of a model for dmuon: ``dedicate_params`` and its companions.

Only wires. It checks the arguments, asks the three independent decisions for one model —
the routes (``routing.select_dedicated``: which parameters, on which route), the partition
(``partition``: who owns each) and the hook boundaries (``boundaries``: which module's hooks
move each) — checks that every rank decided alike, builds the dedicated parameters (expert
pieces in ``experts``) and hands them to the protocol's state (``hooks.DedicatedState``, looked
up with ``get_dedicated_state``), which the owner step (``optim``) then asks.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dmuon import data_parallel, fsdp2
from dmuon._log import log_once
from dmuon._text import preview_names
from dmuon._torch_internals import prepare_tensor_parallel_model_for_ddp
from dmuon.boundaries import group_by_boundary
from dmuon.consistency import check_ranks_agree, ranks_fail_together
from dmuon.ddp import ddp_wrappers, ignore_dedicated_in_ddp
from dmuon.experts import (
    ExpertStackPredicate,
    agreed_name,
    expert_stack_names,
    global_stack_shape,
    is_expert_parallel,
    make_expert_pieces,
)
from dmuon.float8 import refuse_modules_swapped_later
from dmuon.group import BoundaryGroup
from dmuon.hooks import DedicatedState, attach_state, find_dedicated_state, get_dedicated_state
from dmuon.mesh import (
    ExpertLayout,
    ExpertMeshes,
    OwnershipLayout,
    OwnershipMesh,
    build_expert_mesh,
    build_ownership_mesh,
    resolve_expert_layout,
    resolve_ownership_layout,
)
from dmuon.module_state import register_state_dict_hooks
from dmuon.param import DedicatedParam, is_dedicated, make_placeholder, mark_dedicated
from dmuon.partition import OwnerCoord, OwnershipPlan, ParamSpec, layer_id_of, plan_ownership
from dmuon.policy import ParamPolicy, resolve_param_policy
from dmuon.profile import ForwardUnshardProfile, forward_profile_requested
from dmuon.routing import Predicate, Routes, select_dedicated
from dmuon.row_blocks import RowBlocks, resolve_row_blocks
from dmuon.tp import (
    TensorParallelLayout,
    exchange_mesh,
    find_tensor_parallel_layout,
    model_parallel_dims,
)

NO_MATCH_WARNING = (
    "dedicate_params: no parameters matched the predicate. Print the 2-D parameters to see their "
    "names and adjust the predicate:\n"
    "    for name, param in model.named_parameters():\n"
    "        if param.ndim == 2:\n"
    "            print(name, param.shape)"
)


def dedicate_params(
    model: nn.Module,
    mesh,
    predicate: Predicate,
    *,
    replicate_mesh=None,
    reshard_after_forward: bool = True,
    hook_boundary_predicate: Callable[[nn.Module], bool] | None = None,
    param_policy=None,
    compute_dtype: torch.dtype | None = None,
    process_group_policy: str = "isolated",
    layer_id_fn: Callable[[str], str | None] | None = None,
    timeout: timedelta | None = None,
    routes: Routes | None = None,
    expert_stacks: ExpertStackPredicate | None = None,
    row_blocks: RowBlocks | None = None,
    ep_mesh=None,
    expert_mesh=None,
) -> dict[str, OwnerCoord]:
    """Give every parameter selected by ``predicate`` one owner rank; returns FQN -> owner.

    Call once on the whole model, after TP ``parallelize_module`` (its DTensor matrices are
    dedicated too: see [Note: tensor-parallel matrices] in ``dmuon.tp``) and before
    ``fully_shard`` (which then skips the dedicated parameters by itself) or
    ``DistributedDataParallel(model)`` (which likewise averages only the other gradients,
    without ``find_unused_parameters``). ``mesh`` is the 1-D data-parallel DeviceMesh (the
    ``"shard"`` dim under HSDP, with ``replicate_mesh`` its ``"replicate"`` dim), or None when
    torch.distributed is not initialised (everything is owned locally). It may be a dim of a
    larger named mesh (``mesh["dp"]`` of a ("dp", "tp") or ("pp", "dp") mesh): every rank of
    the world calls ``dedicate_params`` (pipeline stages with their own models included), since
    the process groups are created collectively; each rank's ownership spans its own slice.

    Args:
        predicate: ``(name, param) -> bool`` choosing the dedicated parameters. ``name`` is
            the canonical FQN, as on the plain model: the segments that activation-checkpoint
            and ``torch.compile`` wrappers insert (``_checkpoint_wrapped_module``,
            ``_orig_mod``) are left out (see [Note: canonical FQNs] in ``dmuon.fqn``), so a
            predicate written for the plain model selects the same parameters with them on.
            Every name dmuon returns, logs or writes (owners, ``optimizer.routing()``,
            checkpoint keys) is canonical too, and so must be the names given to it
            (``routes=``, ``param_groups``; spellings with wrapper segments are accepted).
        reshard_after_forward: True (Z3) frees the broadcast weights after forward and
            broadcasts them again for backward; False (Z2) keeps them through backward.
        hook_boundary_predicate: picks, for each parameter, the lowest ancestor module for
            which it is True as the module whose hooks move it (default: the ``layers.N`` /
            ``blocks.N`` module around it, else its parent module).
        param_policy: ``ParamPolicy`` or dict; ``defaults.param_dtype`` is the forward compute
            dtype (None inherits the parameter's), ``defaults.reduce_dtype`` the gradient
            reduce dtype (None: the gradient's).
        compute_dtype: legacy spelling of ``param_policy.defaults.param_dtype``.
        process_group_policy: ``"isolated"`` clones the mesh's process groups so dmuon's
            asynchronous collectives never interleave with the trainer's; ``"shared"`` reuses them.
        layer_id_fn: ``canonical name -> layer id`` for models whose names the default
            ``(layers|blocks|layer|h|block).N`` rule does not understand.
        timeout: timeout of the process groups dmuon creates (default: the default group's).
        routes: per-parameter route overrides, ``{fqn: route}`` or ``(name, param) -> route |
            None`` (None: the predicate decides). ``"muon"`` and ``"adamw"`` dedicate the
            parameter whatever the predicate says (Muon, or AdamW on the owner's fp32 master);
            ``"sharded_adamw"`` leaves it to FSDP2 and AdamW on its shards (a huge embedding,
            say). A 1-D parameter cannot take ``"muon"``. ``optimizer.routing()`` shows the result.
        expert_stacks: which selected 3-D parameters are mixture-of-experts stacks (E, m, n),
            ``(name, param) -> bool``. A stack is E matrices (m, n): one Newton-Schulz, one
            momentum and the learning-rate scale of (m, n) per expert, its experts cut into
            contiguous slices ``[start, stop)`` with one owner each (the returned map lists
            them as ``<fqn>[start:stop]``), while the module still sees its whole (E, m, n)
            parameter in forward and backward and checkpoints keep its FQN and shape. Default
            (None): every selected 3-D parameter is a stack, except the weight of a torch
            convolution (``nn.Conv1d``: (out, in, k)), which is one matrix with its trailing
            dims flattened into columns, like any parameter of 4 or more dims.
        row_blocks: Muon matrices whose Newton-Schulz runs per block of rows, each block
            updated as a matrix of its own (per attention head, or q / k / v of a fused QKV):
            ``{fqn or glob pattern: rows per block | [block sizes]}`` or ``(name, param) ->
            rows per block | [sizes] | None``, e.g. ``{"layers.*.q_proj.weight": head_dim,
            "layers.*.qkv_proj.weight": [q_rows, kv_rows, kv_rows]}``. The partition counts
            the cheaper work. Not for expert stacks or tensor-parallel matrices; see
            ``docs/update-rules.md``.
        ep_mesh, expert_mesh: expert parallelism (both or neither): the ``ep`` dim the expert
            stacks' experts are split over and the expert-FSDP dim (torchtitan's ``efsdp``)
            whose ranks hold the same experts; together they split ``mesh``'s ranks
            (``ep_mesh.size() * expert_mesh.size() == mesh.size()``), and ``replicate_mesh``
            replicates both. Each rank's stack holds its EP slot's experts, as a DTensor
            sharded ``Shard(0)`` over ``ep_mesh`` (torchtitan's ``ExpertParallel``) or as a
            local (E / ep, m, n) tensor; each expert piece is owned by a rank that holds its
            experts, so its broadcast and reduce stay among them, while the other parameters
            keep owners over the whole grid. The returned map lists every EP slot's pieces
            by their global experts. See [Note: expert-parallel stacks] in ``dmuon.experts``.
            The token dispatch over ``ep`` stays the model's.
    """
    # The phases, in order: what the arguments ask for (raised on every rank before any process
    # group exists: none is left waiting for a failed rank), the groups, who owns what, the
    # dedicated parameters and their boundaries, the ranks' agreement, the state on the model.
    with ranks_fail_together("dedicate_params"):
        _check_timeout(timeout)
        _check_call_order(model, mesh)
        request = _resolve_request(
            model,
            mesh,
            predicate,
            replicate_mesh=replicate_mesh,
            param_policy=param_policy,
            compute_dtype=compute_dtype,
            process_group_policy=process_group_policy,
            routes=routes,
            expert_stacks=expert_stacks,
            row_blocks=row_blocks,
            ep_mesh=ep_mesh,
            expert_mesh=expert_mesh,
        )
    if not request.selected:
        warnings.warn(NO_MATCH_WARNING, UserWarning, stacklevel=2)
    ownership_mesh, experts = _create_meshes(request, timeout)
    plan = _plan_owners(request, ownership_mesh, experts, layer_id_fn)
    params = _make_dedicated_params(request, plan, ownership_mesh, experts)
    boundaries = group_by_boundary(
        model, params, hook_boundary_predicate, ownership_mesh, reshard_after_forward
    )
    _check_ranks_agree_on_decisions(ownership_mesh, plan, params, boundaries, reshard_after_forward)
    _install_state(
        model,
        DedicatedState(
            model=model,
            mesh=ownership_mesh,
            plan=plan,
            params=params,
            boundaries=boundaries,
            route_overrides=request.overrides,
            gradient_divisor=data_parallel.gradient_divisor,
            profile=ForwardUnshardProfile() if forward_profile_requested() else None,
        ),
    )
    return dict(plan.owners)


@dataclass(frozen=True, slots=True)
class _Request:
    """What this rank's arguments ask for, validated, before any process group exists: the
    selected parameters and their routes, stacks, TP layouts and row blocks, and the meshes'
    layouts."""

    policy: ParamPolicy
    # (canonical FQN, module, attribute, parameter) of every dedicated parameter.
    selected: list[tuple[str, nn.Module, str, nn.Parameter]]
    overrides: dict[str, str]  # FQN -> route, for those routes= set
    stacked: list[str]  # FQNs of the expert stacks
    tp_layouts: dict[str, TensorParallelLayout]
    blocks: dict[str, tuple[int, ...]]  # FQN -> its row blocks
    layout: OwnershipLayout
    expert_layout: ExpertLayout | None


def _resolve_request(
    model: nn.Module,
    mesh,
    predicate: Predicate,
    *,
    replicate_mesh,
    param_policy,
    compute_dtype: torch.dtype | None,
    process_group_policy: str,
    routes: Routes | None,
    expert_stacks: ExpertStackPredicate | None,
    row_blocks: RowBlocks | None,
    ep_mesh,
    expert_mesh,
) -> _Request:
    """Which parameters are dedicated, on which route, stacked, TP-sharded or cut into row
    blocks, and the layouts of the meshes: local, no collective (raises on a bad argument)."""
    policy = resolve_param_policy(param_policy, compute_dtype)
    selected, overrides = select_dedicated(model, predicate, routes)
    stacked = expert_stack_names(selected, expert_stacks, ep_mesh)
    tp_layouts, parallel_dims = _tensor_parallel_layouts(
        model,
        [item for item in selected if not is_expert_parallel(item[3], ep_mesh)],
        mesh,
        replicate_mesh,
    )
    tp_mesh = exchange_mesh(tp_layouts)
    blocks = resolve_row_blocks(
        row_blocks,
        selected,
        overrides,
        stacked,
        [name for name, layout in tp_layouts.items() if layout.is_sharded],
    )
    layout = resolve_ownership_layout(
        mesh, replicate_mesh, process_group_policy, tp_mesh, parallel_dims
    )
    return _Request(
        policy=policy,
        selected=selected,
        overrides=overrides,
        stacked=stacked,
        tp_layouts=tp_layouts,
        blocks=blocks,
        layout=layout,
        expert_layout=resolve_expert_layout(layout, ep_mesh, expert_mesh),
    )


def _create_meshes(
    request: _Request, timeout: timedelta | None
) -> tuple[OwnershipMesh, ExpertMeshes | None]:
    """dmuon's process groups (collective), and the expert meshes under expert parallelism once
    every rank is known to ask for the same parameters: the partition that follows must come
    out the same everywhere."""
    ownership_mesh = build_ownership_mesh(request.layout, timeout)
    expert_layout = request.expert_layout
    check_ranks_agree(
        ownership_mesh.world_group,
        {
            "dedicated": (
                "dedicated parameters (names and shapes)",
                [(name, tuple(param.shape)) for name, _, _, param in request.selected],
            ),
            "routes": ("route overrides (routes=)", sorted(request.overrides.items())),
            "expert_stacks": ("expert stacks (expert_stacks=)", request.stacked),
            "row_blocks": ("row blocks (row_blocks=)", sorted(request.blocks.items())),
            "expert_parallel": (
                "expert parallelism (ep_mesh=, expert_mesh=)",
                None
                if expert_layout is None
                else (expert_layout.num_ep, expert_layout.expert_mesh.size()),
            ),
        },
    )
    experts = (
        build_expert_mesh(expert_layout, request.layout, ownership_mesh, timeout)
        if expert_layout is not None
        else None
    )
    return ownership_mesh, experts


def _plan_owners(
    request: _Request,
    ownership_mesh: OwnershipMesh,
    experts: ExpertMeshes | None,
    layer_id_fn: Callable[[str], str | None] | None,
) -> OwnershipPlan:
    """Who owns each matrix (``partition.plan_ownership``, a pure function of names, shapes and
    mesh sizes); warns where layers could not be told apart."""
    specs = [
        ParamSpec(
            name=name,
            shape=tuple(
                global_stack_shape(param, experts) if name in request.stacked else param.shape
            ),
            layer_id=layer_id_of(name, layer_id_fn),
            expert_stack=name in request.stacked,
            row_blocks=request.blocks.get(name),
        )
        for name, _, _, param in request.selected
    ]
    plan = plan_ownership(
        specs,
        ownership_mesh.num_shards,
        ownership_mesh.num_replicas,
        num_tp=ownership_mesh.tp_size,
        expert_groups=experts.expert_groups if experts is not None else None,
    )
    if plan.unlayered and len(plan.unlayered) > 1:
        warnings.warn(
            f"dedicate_params: no layer id found for {len(plan.unlayered)} parameters "
            f"({preview_names(plan.unlayered)}); each is placed on its own (balanced, never "
            "piled onto one owner), but the rule that puts one layer's matrices on distinct "
            "owners, so that a layer's broadcasts run concurrently, cannot apply to them. Name "
            "layers like 'layers.N' / 'blocks.N', or pass layer_id_fn=lambda name: ...",
            UserWarning,
            stacklevel=3,  # the caller of dedicate_params
        )
    log_once("[DMuon] %s", plan.describe())
    return plan


def _make_dedicated_params(
    request: _Request,
    plan: OwnershipPlan,
    ownership_mesh: OwnershipMesh,
    experts: ExpertMeshes | None,
) -> dict[str, DedicatedParam]:
    """One ``DedicatedParam`` per matrix (an expert stack's pieces from ``experts``), its
    original parameter marked dedicated; FQN (a piece's ``<fqn>[start:stop]``) -> it."""
    policy, overrides = request.policy, request.overrides
    params: dict[str, DedicatedParam] = {}
    for name, module, attr, param in request.selected:
        if name in plan.expert_slices:
            params.update(
                make_expert_pieces(
                    name=name,
                    module=module,
                    attr=attr,
                    param=param,
                    plan=plan,
                    mesh=ownership_mesh,
                    policy=policy,
                    route_override=overrides.get(name),
                    experts=experts,
                )
            )
            continue
        owner = plan.owners[name]
        mark_dedicated(param)
        param_dtype, reduce_dtype = policy.defaults.dtypes_of(param)
        params[name] = DedicatedParam(
            fqn=name,
            module=module,
            attr=attr,
            shape=param.shape,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            requires_grad=param.requires_grad,
            owner=owner,
            is_owner=ownership_mesh.is_me(owner),
            placeholder=make_placeholder(param),
            original=param,
            route_override=overrides.get(name),
            tp=request.tp_layouts.get(name),
            row_blocks=request.blocks.get(name),
        )
    return params


def _check_ranks_agree_on_decisions(
    ownership_mesh: OwnershipMesh,
    plan: OwnershipPlan,
    params: dict[str, DedicatedParam],
    boundaries: list[BoundaryGroup],
    reshard_after_forward: bool,
) -> None:
    """What the options made of the agreed inputs must match too, or the ranks' collectives
    would not pair up: owners (a rank-dependent layer_id_fn), hook boundaries, Z2/Z3 and
    dtypes. Raises on every rank."""
    check_ranks_agree(
        ownership_mesh.world_group,
        {
            "owners": (
                "owners (layer_id_fn=, the partition)",
                sorted((name, repr(owner)) for name, owner in plan.owners.items()),
            ),
            "boundaries": (
                "hook boundaries (hook_boundary_predicate=)",
                [(group.name, [agreed_name(p) for p in group.params]) for group in boundaries],
            ),
            "options": (
                "dedicate_params options (reshard_after_forward, param_dtype, reduce_dtype)",
                [
                    (
                        agreed_name(p),
                        reshard_after_forward,
                        str(p.param_dtype),
                        str(p.reduce_dtype),
                    )
                    for p in params.values()
                ],
            ),
        },
    )


def _install_state(model: nn.Module, state: DedicatedState) -> None:
    """The state takes the model: its hooks, the state-dict hooks, DDP's ignore list; the
    weights move into the owners' segments now unless the model is still on the meta device
    (then at the first forward or ``dmuon.Muon``)."""
    params = state.params
    state.register_hooks()
    register_state_dict_hooks(state)
    ignore_dedicated_in_ddp(model, params)
    attach_state(model, state)
    refuse_modules_swapped_later(model, params)
    if not any(p.original.is_meta for p in params.values()):
        state.ensure_adopted()


def _check_timeout(timeout: object) -> None:
    if timeout is None:
        return
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"dedicate_params: timeout must be a datetime.timedelta, got {type(timeout).__name__} "
            f"{timeout!r}; e.g. timeout=datetime.timedelta(minutes=10)."
        )
    if timeout.total_seconds() <= 0:
        raise ValueError(
            f"dedicate_params: timeout must be positive, got {timeout!r}; e.g. "
            "timeout=datetime.timedelta(minutes=10), or leave it out to take the default group's."
        )


def _check_call_order(model: nn.Module, mesh) -> None:
    if find_dedicated_state(model) is not None:
        raise RuntimeError(
            "dedicate_params was already called on this model; call it once, on the whole model."
        )
    if fsdp2.is_fully_sharded(model):
        raise RuntimeError(
            "dedicate_params must be called before fully_shard: this model already has FSDP2 "
            "modules. Call dmuon.dedicate_params(model, ...) first, then fully_shard each layer "
            "and the root."
        )
    if mesh is not None:
        fsdp2.require_fully_shard_integration()


def dedicated_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters FSDP2 must ignore (for ``fully_shard(..., ignored_params=...)``)."""
    return {p for p in model.parameters() if is_dedicated(p)}


def wait_all_replicate_broadcasts(model: nn.Module) -> None:
    """Wait for every pending post-step publish (before exit or checkpointing)."""
    get_dedicated_state(model).wait_all_replicate_broadcasts()


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally: no reduce to owners (nor FSDP2 reduce-scatter, nor the
    all-reduce of a ``DistributedDataParallel`` around ``model``) inside; DDP's own
    ``no_sync()`` is then not needed."""
    from torch.distributed.fsdp import FSDPModule

    state = get_dedicated_state(model)
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    ddp_modules = ddp_wrappers(model)
    previous = state.requires_gradient_sync
    previous_ddp = [ddp.require_backward_grad_sync for ddp in ddp_modules]
    for module in fsdp_modules:
        module.set_requires_gradient_sync(False, recurse=False)
    for ddp in ddp_modules:
        ddp.require_backward_grad_sync = False
    try:
        with state.without_gradient_sync():
            yield
    finally:
        for module in fsdp_modules:
            module.set_requires_gradient_sync(previous, recurse=False)
        for ddp, value in zip(ddp_modules, previous_ddp):
            ddp.require_backward_grad_sync = value


def set_gradient_divide_factor(model: nn.Module, factor: float | None) -> None:
    """Divide the gradients of ``model``, summed over its data-parallel ranks, by ``factor``.

    The counterpart of ``FSDPModule.set_gradient_divide_factor`` for a whole dmuon model: the
    owners divide the dedicated gradients by ``factor`` instead of by the number of
    data-parallel ranks, and every FSDP module of the model is given the same factor, so every
    gradient has one scale. ``1.0`` sums (a loss that is a local sum over the global token
    count, as torchtitan's); ``None`` restores the mean. On FSDP2 models setting the factor on
    the FSDP modules is enough (dmuon follows it); this call is for DDP and other models
    without FSDP2, whose own reduction the caller makes match (a DDP comm hook that divides by
    the same factor). See [Note: one gradient scale per model] in ``dmuon.data_parallel``.
    """
    data_parallel.set_gradient_divide_factor(get_dedicated_state(model), factor)


def dedicate_params_ddp(
    model: nn.Module, mesh, predicate: Predicate, *, ddp_kwargs: dict | None = None, **kwargs
) -> torch.nn.parallel.DistributedDataParallel:
    """``dedicate_params`` for replicated training: returns ``DistributedDataParallel(model)``.

    The DDP averages the gradients of every parameter that is not dedicated (the dedicated ones
    go to their owners), over the ranks of ``mesh`` (its group is DDP's ``process_group``
    unless ``ddp_kwargs`` names one). ``kwargs`` are ``dedicate_params``'s. Run forward and
    backward through the returned wrapper; give dmuon the model itself::

        ddp_model = dmuon.dedicate_params_ddp(model, mesh, predicate)
        optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

    It is the same as ``dedicate_params(model, mesh, predicate)`` followed by
    ``DistributedDataParallel(model, process_group=mesh.get_group())``. A tensor-parallel model
    (``parallelize_module`` on a "tp" dim, ``mesh`` its "dp" dim) works too: DDP cannot hold
    DTensors, so the DTensor parameters dmuon leaves to DDP are handed to it as their local
    tensors, as torch's own DDP + TP recipe does (``_pre_dp_module_transform``).
    """
    from torch.nn.parallel import DistributedDataParallel

    if kwargs.get("replicate_mesh") is not None:
        raise ValueError(
            "dmuon.dedicate_params_ddp takes a 1-D mesh: replicated training has no "
            f"(replicate, shard) layout, got replicate_mesh={kwargs['replicate_mesh']!r}. Pass "
            "the whole data-parallel mesh as mesh, or use dedicate_params(..., replicate_mesh=) "
            "with fully_shard for HSDP."
        )
    dedicate_params(model, mesh, predicate, **kwargs)
    if any(isinstance(param, DTensor) for param in model.parameters()):
        prepare_tensor_parallel_model_for_ddp(model)
    ddp_kwargs = dict(ddp_kwargs or {})
    if mesh is not None:
        ddp_kwargs.setdefault("process_group", mesh.get_group())
    return DistributedDataParallel(model, **ddp_kwargs)


# ---- tensor parallelism -----------------------------------------------------------------------


def _tensor_parallel_layouts(
    model: nn.Module, selected, mesh, replicate_mesh
) -> tuple[dict[str, TensorParallelLayout], frozenset[str]]:
    """The TP layout of every selected DTensor, and the model-parallel dims of the model.

    The TP dim is told apart from the data-parallel dims (those of ``mesh`` and
    ``replicate_mesh``, whatever their names: "shard", "dp_shard", a flattened "fsdp") by name:
    it is the DTensor's dim that is not one of them ("tp" in torchtitan)."""
    data_parallel_names: set[str] | None = set()
    for dp_mesh in (mesh, replicate_mesh):
        if isinstance(dp_mesh, DeviceMesh):
            if dp_mesh.mesh_dim_names is None:
                data_parallel_names = None
                break
            data_parallel_names.update(dp_mesh.mesh_dim_names)
    layouts = {}
    for name, _, _, param in selected:
        layout = find_tensor_parallel_layout(name, param, data_parallel_names)
        if layout is not None:
            layouts[name] = layout
    return layouts, model_parallel_dims(model, data_parallel_names)
