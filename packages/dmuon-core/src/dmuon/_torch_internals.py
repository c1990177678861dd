"""The one place dmuon-core uses torch's private APIs.

Some of what dmuon needs torch keeps private (a leading underscore, or a private module), so a
release may change it without notice. Every such use in dmuon-core goes through this module,
each function one private call with the reason no public API serves, so a new torch release is
checked here and only here; ``tests/core/test_torch_internals.py`` keeps it the one place.
dmuon-core is tested with torch ``TESTED_TORCH``. The internals that dmuon needs whatever the
model are looked up when dmuon is imported: a missing one raises ImportError there, naming it,
the installed torch and the tested range (``missing_internal``), instead of an AttributeError
inside a step. Those of optional paths are looked up when first used, with the same message;
FSDP2's parameter collection, which only ``fully_shard`` needs, is replaced by
``replace_fsdp_managed_states``, which returns why it cannot be on this torch rather than raise
(``dmuon.fsdp2`` then refuses with that reason).

Not wrapped, by decision: ``nn.Module``'s slot dictionaries (``_parameters``, ``_modules``,
``_buffers``, ``_non_persistent_buffers_set``). Every torch release has had them, torch's own
``parametrize`` and FSDP2 write them the same way, and dmuon swaps a module's parameters there
on every forward, where a wrapper would cost a call for nothing.

Must not: hold dmuon's logic. What is here is the private call and the least glue around it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
from collections.abc import Callable
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

TESTED_TORCH = "2.11 to 2.13"


def missing_internal(what: str, error: BaseException | str) -> ImportError:
    """The error for an internal this torch lacks: what, which torch, the tested range, the fix."""
    return ImportError(
        f"dmuon-core uses torch's private {what}, which torch {torch.__version__} does not have "
        f"({error}). dmuon-core is tested with torch {TESTED_TORCH}: install one of those "
        "(pip install 'torch>=2.11,<2.14'), or a dmuon-core release that supports this torch."
    )


def _load(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise missing_internal(f"{module}.{name}", error) from error


def _member(owner: type, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError as error:
        raise missing_internal(f"{owner.__qualname__}.{name}", error) from error


# ---- autograd: pytrees, the backward pass, tensor subclasses ----------------------------------

# Walking module inputs and outputs of any structure (tuples, dicts, dataclasses, HF ModelOutput)
# without rebuilding them; torch has no public pytree module yet.
tree_flatten = _load("torch.utils._pytree", "tree_flatten")
tree_unflatten = _load("torch.utils._pytree", "tree_unflatten")

# What a ``__torch_function__`` override runs to call the op on the plain tensor.
disabled_torch_function_impl = _load("torch._C", "_disabled_torch_function_impl")

_current_graph_task_id = _load("torch._C", "_current_graph_task_id")
_execution_engine = _member(torch.autograd.Variable, "_execution_engine")


def in_backward() -> bool:
    """True while autograd runs a backward on this thread (activation-checkpoint recomputes)."""
    return _current_graph_task_id() != -1


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward has finished (as FSDP2's root does)."""
    _execution_engine.queue_callback(callback)


# ---- the profiler ----------------------------------------------------------------------------------

_NO_RANGE = contextlib.nullcontext()


def profiler_range(name: str | Callable[[], str]) -> contextlib.AbstractContextManager:
    """``torch.profiler.record_function(name)`` while a profiler (or NVTX emission) is on, else a
    shared no-op: a ``record_function`` costs microseconds of host time even with no profiler
    running ([Note: profiler labels] in ``dmuon._profiler_labels``), and dmuon opens about ten a
    boundary a step. ``name`` may be a function, called only when a range is opened."""
    if not torch._C._autograd._profiler_enabled():
        return _NO_RANGE
    return torch.profiler.record_function(name() if callable(name) else name)


# ---- multi-tensor ops (one kernel launch for a list; no public API) ----------------------------

foreach_div_ = _load("torch", "_foreach_div_")  # (tensors, scalar): each divided in place
foreach_add_ = _load("torch", "_foreach_add_")  # (tensors, others): pairwise sums in place
_foreach_norm = _load("torch", "_foreach_norm")


def foreach_max_abs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``max |t|`` of each tensor: NaN or inf exactly when it holds one (it cannot overflow)."""
    return list(_foreach_norm(tensors, math.inf))


# ---- a tensor's version counter and view base (the overlapped step's "unchanged since") -------


def tensor_version(tensor: torch.Tensor) -> int:
    """How many in-place changes ``tensor`` (and every view sharing its storage's counter) has
    seen: autograd's version counter, ``Tensor._version``."""
    return tensor._version


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of (None if it is not a view): ``Tensor._base``."""
    return tensor._base


# ---- torch's gradient clipping -----------------------------------------------------------------

# The module that defines ``torch.nn.utils.clip_grad_norm_``, ``clip_grads_with_norm_``,
# ``clip_grad_value_`` and the deprecated ``clip_grad_norm``; each reads ``p.grad`` of every
# parameter it is given there, in its own body or a comprehension of it (torch 2.11 to 2.13).
# ``tests/core/test_torch_habits.py`` checks that the public names still come from it.
TORCH_CLIPPING_MODULE = "torch.nn.utils.clip_grad"


def torch_clipping_function_at(frame: FrameType | None) -> str | None:
    """The public name of the ``torch.nn.utils`` clipping function ``frame`` runs in (or a
    comprehension of it), e.g. ``"torch.nn.utils.clip_grad_norm_"``; None for any other code."""
    while frame is not None and frame.f_globals.get("__name__") == TORCH_CLIPPING_MODULE:
        name = frame.f_code.co_name
        if not name.startswith("<"):  # not a comprehension: the function itself
            # torch.nn.utils exports _clip_grads_with_norm_ as clip_grads_with_norm_.
            return f"torch.nn.utils.{name.lstrip('_')}"
        frame = frame.f_back
    return None


def torch_optimizer_at(frame: FrameType | None) -> str | None:
    """The class of the optimizer whose ``torch.optim`` code ``frame`` runs (its ``step``'s
    ``_init_group``, ``zero_grad``, ...), e.g. ``"torch.optim.AdamW"``; None for any other code.
    torch's optimizers read ``p.grad`` of their parameters in methods of the optimizer, so the
    frame's ``self`` (or a caller's within ``torch.optim``) names it."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch.optim."):
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.optim.Optimizer):
            cls = type(owner)
            module = "torch.optim" if cls.__module__.startswith("torch.optim.") else cls.__module__
            return f"{module}.{cls.__qualname__}"
        frame = frame.f_back
    return None


# ---- meshes and process groups ------------------------------------------------------------------


_get_root_mesh = _member(DeviceMesh, "_get_root_mesh")
_get_default_group = _load("torch.distributed.distributed_c10d", "_get_default_group")


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced or flattened from (itself for a root)."""
    return _get_root_mesh(mesh)


def default_group() -> dist.ProcessGroup:
    """The default process group itself (``dist.group.WORLD`` is a sentinel in some releases)."""
    return _get_default_group()


def process_group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout torch applies to ``group``'s collectives, as its backend reports it.

    None where no backend of the group says (torch then gives new groups its own default).
    """
    # ProcessGroupGloo and ProcessGroupNCCL keep the timeout they were created with in
    # ``options._timeout`` (torch 2.11 to 2.13); ``init_process_group`` passes its ``timeout``
    # there. No public API returns it.
    for device in getattr(group, "_device_types", ()):
        try:
            backend = group._get_backend(device)
        except (RuntimeError, AttributeError):
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def nccl_high_priority_options(timeout: timedelta | None) -> object | None:
    """Fresh NCCL options for a group on a high-priority stream, with ``timeout`` (None off
    NCCL). A new object per group: ``new_group`` writes the group's name and ranks into it."""
    if dist.get_backend() != "nccl" or not hasattr(dist, "ProcessGroupNCCL"):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    if timeout is not None:
        options._timeout = timeout  # the public constructor argument of Options has no timeout
    return options


# ---- DistributedDataParallel ---------------------------------------------------------------------

# The name list ``DistributedDataParallel.__init__`` reads from the module it wraps, and DDP's
# own setter of it.
DDP_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"
_set_ddp_ignore_list = _member(
    DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model"
)


def ddp_ignored_names(module: nn.Module) -> list[str]:
    """The names a later ``DistributedDataParallel(module)`` will skip."""
    return list(getattr(module, DDP_IGNORE_ATTR, ()))


def set_ddp_ignored(module: nn.Module, names: list[str], params: list[nn.Parameter]) -> None:
    """Make a later ``DistributedDataParallel(module)`` skip ``names``, through DDP's own setter,
    and mark ``params`` (registered later under those names) as that setter marks what is
    registered now: compiled DDP reads the mark."""
    for param in params:
        param._ddp_ignored = True
    _set_ddp_ignore_list(module, names)


def ddp_reduced_parameters(ddp: DistributedDataParallel) -> list[nn.Parameter]:
    """What the DDP's reducer averages: the parameters it collected at construction (set by
    ``__init__`` in every torch since 1.x; the ignore list as the fallback)."""
    parameters = getattr(ddp, "_module_parameters", None)
    if parameters is not None:
        return list(parameters)
    ignored = getattr(ddp, "parameters_to_ignore", set())
    return [p for name, p in ddp.module.named_parameters() if name not in ignored]


def composable_api_names(module: nn.Module) -> set[str]:
    """The composable APIs (``replicate``, ``fully_shard``, ...) applied to ``module``."""
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # a torch without composable APIs cannot have used them
        return set()
    registry = _get_registry(module)
    return set(registry) if registry is not None else set()


def prepare_tensor_parallel_model_for_ddp(model: nn.Module) -> None:
    """torch's DDP + TP recipe: the DTensor parameters become local tensors that remember their
    layout (``tensor_parallel_layout``), since DDP cannot hold DTensors."""
    _load("torch.distributed.tensor.parallel.ddp", "_pre_dp_module_transform")(model)


def tensor_parallel_layout(param: torch.Tensor):
    """The DTensor layout a TP parameter made a local tensor by the DDP + TP recipe remembers
    (None for any other parameter)."""
    return getattr(param, "_st_info", None)


# ---- state dicts and checkpoints ----------------------------------------------------------------

# ``load_state_dict``'s result type, and the key suffix of a module's extra state.
IncompatibleKeys = _load("torch.nn.modules.module", "_IncompatibleKeys")
EXTRA_STATE_KEY_SUFFIX = _load("torch.nn.modules.module", "_EXTRA_STATE_KEY_SUFFIX")

# The checkpoint protocol's holder of arbitrary local chunks of a tensor (DCP reads chunks and
# their offsets from it); ``ShardedTensor``, the public one, is deprecated.
LocalShardsWrapper = _load("torch.distributed.tensor._shards_wrapper", "LocalShardsWrapper")


def local_shards(value: torch.Tensor):
    """The ``LocalShardsWrapper`` a DTensor holds as its local tensor, else None."""
    local = value._local_tensor if isinstance(value, DTensor) else None
    return local if isinstance(local, LocalShardsWrapper) else None


class ExpertShards(LocalShardsWrapper):
    """torch's ``LocalShardsWrapper`` for an expert stack's state-dict entry, plus what torch's
    lacks and checkpoint code does with an entry (torchtitan's ``ModelWrapper`` compares each
    entry's storage with its cached one and copies into the cached one when they differ):

    - the identity view ``DTensor.from_local`` makes of it, for (e, m, n) chunks too (torch's
      takes it only for 1-D and 2-D chunks when a rank holds several), keeping the class;
    - ``untyped_storage()`` and ``data_ptr()``: those of its first chunk (torch's wrapper has no
      storage and raises), so two entries over the same chunks share storage, as two state dicts
      of one plain model do;
    - ``copy_`` from another wrapper with the same chunks, chunk by chunk; ``_to_copy`` and
      ``clone`` keep the class.
    """

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            return cls._copy_chunks(args[0], args[1])
        result = LocalShardsWrapper.__torch_dispatch__.__func__(cls, func, types, args, kwargs)
        if type(result) is LocalShardsWrapper:  # torch's handlers build the base class
            return ExpertShards(result.local_shards(), result.local_offsets())
        return result

    @staticmethod
    def handle_view(args, kwargs):
        wrapper, shape = args[0], args[1]
        if len(wrapper.local_shards()) > 1 and tuple(shape) == tuple(wrapper.shape):
            # DTensor.from_local's view_as(itself): a view of each chunk, as torch does in 2-D.
            views = [
                torch.ops.aten.view.default(shard, shard.shape) for shard in wrapper.local_shards()
            ]
            return ExpertShards(views, wrapper.local_offsets())
        return LocalShardsWrapper.handle_view(args, kwargs)

    @staticmethod
    def _copy_chunks(target: ExpertShards, source: torch.Tensor) -> ExpertShards:
        if not isinstance(source, LocalShardsWrapper) or list(source.local_offsets()) != list(
            target.local_offsets()
        ):
            raise ValueError(
                "copy_ into an expert stack's state-dict entry takes the entry of the same "
                f"stack on the same layout (chunks at {list(target.local_offsets())}), got "
                f"{type(source).__name__}"
                + (
                    f" with chunks at {list(source.local_offsets())}"
                    if isinstance(source, LocalShardsWrapper)
                    else ""
                )
                + "; load other layouts with dmuon.checkpoint.set_model_state_dict."
            )
        for mine, theirs in zip(target.local_shards(), source.local_shards(), strict=True):
            mine.copy_(theirs)
        return target

    def untyped_storage(self) -> torch.UntypedStorage:
        shards = self.local_shards()
        return shards[0].untyped_storage() if shards else torch.UntypedStorage(0)

    def data_ptr(self) -> int:
        shards = self.local_shards()
        return shards[0].data_ptr() if shards else 0


class ExpertStackEntry(DTensor):
    """The DTensor of an expert stack's state-dict entry (its local tensor an ``ExpertShards``),
    whose ``full_tensor()`` gathers the stack: each rank's chunks sit at their offsets, which a
    ``Shard(0)`` redistribute (even chunks in rank order) cannot describe. Collective over the
    entry's mesh, as ``DTensor.full_tensor``. ``detach()`` keeps the class (``state_dict()``
    detaches every entry)."""

    def detach(self) -> ExpertStackEntry:
        return ExpertStackEntry(self._local_tensor, self._spec, requires_grad=False)

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        chunks = self._local_tensor
        full = torch.zeros(self.shape, dtype=self.dtype, device=chunks.device)
        for chunk, offsets in zip(chunks.local_shards(), chunks.local_offsets(), strict=True):
            full[offsets[0] : offsets[0] + chunk.shape[0]] = chunk
        # Each element is held by one rank and zero elsewhere: the sum is exact.
        dist.all_reduce(full, group=self.device_mesh.get_group())
        return full


def expert_stack_entry(
    chunks: list[torch.Tensor], offsets: list[tuple[int, ...]], mesh: DeviceMesh, shape
) -> ExpertStackEntry:
    """The ``ExpertStackEntry`` of global ``shape`` whose local ``chunks`` (e, m, n) start at
    ``offsets``, over ``mesh``. ``DTensor.from_local`` builds it; the class is then the entry's
    (torch's constructor, which ``from_local`` calls, is private)."""
    local = ExpertShards(chunks, offsets)
    value = DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=shape, stride=_contiguous_strides(shape)
    )
    return ExpertStackEntry(value._local_tensor, value._spec, requires_grad=False)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def flatten_state_dict(state_dict: dict) -> tuple[dict, dict]:
    """DCP's own flattening of a nested state dict (the keys it saves), and the paths back."""
    return _load("torch.distributed.checkpoint._nested_dict", "flatten_state_dict")(state_dict)


# ---- modules ----------------------------------------------------------------------------------

# The base class of torch's convolutions (a Conv1d weight is (out, in, k): one matrix, not a stack).
ConvNd = _load("torch.nn.modules.conv", "_ConvNd")


# ---- FSDP2 ----------------------------------------------------------------------------------------


def fsdp_input_cast_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype FSDP2 casts ``module``'s floating forward inputs to before its forward (its
    ``MixedPrecisionPolicy``'s ``param_dtype`` with ``cast_forward_inputs``); None when it casts
    none or does not manage ``module``. FSDP2 keeps the policy on the module's state, and no
    public getter returns it; a torch without it gives None (dmuon then looks at the inputs as
    they are)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    policy = getattr(get_state(), "_mp_policy", None) if get_state is not None else None
    if policy is None or not policy.cast_forward_inputs:
        return None
    return policy.param_dtype


def fsdp_param_dtypes(module: nn.Module) -> dict[int, torch.dtype]:
    """id(sharded parameter) -> the dtype FSDP2 computes it in, for the parameters ``module``'s
    own FSDP2 parameter groups manage whose ``MixedPrecisionPolicy`` casts them. FSDP2 keeps the
    groups and their policy on the module's state, with no public getter; on a layout this torch
    does not have, what was found so far (the storage dtype then stands for the compute
    dtype)."""
    found: dict[int, torch.dtype] = {}
    try:
        fsdp_state = module._get_fsdp_state()
        groups = getattr(fsdp_state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g for g in [fsdp_state._fsdp_param_group] if g is not None]
        for group in groups:
            param_dtype = group.mp_policy.param_dtype
            if param_dtype is None:
                continue
            for fsdp_param in group.fsdp_params:
                if fsdp_param.sharded_param.dtype.is_floating_point:
                    found[id(fsdp_param.sharded_param)] = param_dtype
    except (AttributeError, AssertionError):
        pass
    return found


_FSDP_INIT = "torch.distributed.fsdp._fully_shard._fsdp_init"
_MANAGED_STATES_PARAMETERS = ["modules", "ignored_params"]


def replace_fsdp_managed_states(wrap: Callable[[Callable], Callable]) -> str | None:
    """Replace FSDP2's ``_get_managed_states(modules, ignored_params)``, which ``fully_shard``
    calls to collect the parameters it will manage, by ``wrap(original)``. Returns None when
    replaced (or already), else why it cannot be on this torch."""
    try:
        fsdp_init = importlib.import_module(_FSDP_INIT)
    except ImportError as error:
        return f"cannot import FSDP2's _fsdp_init ({error})"
    original = getattr(fsdp_init, "_get_managed_states", None)
    if original is None:
        return f"{_FSDP_INIT} has no _get_managed_states"
    if getattr(original, "_dmuon_wrapped", False):
        return None
    names = list(inspect.signature(original).parameters)
    if names != _MANAGED_STATES_PARAMETERS:
        return f"_get_managed_states takes {names}, expected {_MANAGED_STATES_PARAMETERS}"
    replacement = wrap(original)
    replacement.__dict__["_dmuon_wrapped"] = True
    fsdp_init._get_managed_states = replacement
    return None
