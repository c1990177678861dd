"""Dedicate and shard a plain HuggingFace model the way Accelerate's FSDP2 plugin would.

Owns reading an Accelerate ``FullyShardedDataParallelPlugin`` (``fsdp_version=2``: built by
``TrainingArguments(fsdp=..., fsdp_config=...)``, an ``accelerate launch`` FSDP config, or given
to ``DMuonAccelerator``) and an optional ``ParallelismConfig`` (HSDP), and applying them to a
model with dmuon in the one order that works: decide which modules get their own FSDP2 unit on
the plain model, upcast low-precision trainable parameters to fp32 (what Accelerate does before
mixed precision), ``dmuon.dedicate_params`` (before any ``fully_shard``), activation
checkpointing, then ``fully_shard`` on each unit and on the root.

What each plugin field becomes:

- ``auto_wrap_policy``: ``TRANSFORMER_BASED_WRAP`` shards every module whose class is named in
  ``transformer_cls_names_to_wrap`` (default: the model's ``_no_split_modules``),
  ``SIZE_BASED_WRAP`` every module with more than ``min_num_params`` parameters, ``NO_WRAP``
  only the root; as ``fsdp2_prepare_auto_wrap_policy`` in Accelerate decides (where Accelerate
  fails on a ``_no_split_modules`` class the model lacks, it is skipped here).
- ``reshard_after_forward``: FSDP2's, and dmuon's Z3 (True) or Z2 (False).
- mixed precision (``bf16``): the plugin's ``MixedPrecisionPolicy`` on every ``fully_shard``,
  and the same param/reduce dtypes for the dedicated weights (``param_policy``); trainable
  parameters are fp32 masters.
- ``activation_checkpointing``: each unit wrapped in torch's ``checkpoint_wrapper`` (after
  ``dedicate_params``, so parameter names stay canonical).
- ``ParallelismConfig(dp_replicate_size=R, dp_shard_size=S)``: HSDP, a (R, S) mesh named
  ("replicate", "shard"); dmuon owns over the shard dim and publishes across the replicate dim.
- ``cpu_ram_efficient_loading``: only the first rank holds the weights (transformers'
  ``from_pretrained`` under ``accelerate launch --fsdp_cpu_ram_efficient_loading true`` loads
  them there and leaves the other ranks' on the meta device). The first rank keeps its full
  state dict (after the fp32 upcast), every rank moves the model to the meta device, dedicates
  and shards it there, materialises it with ``dmuon.checkpoint.to_empty_for_load`` (no storage
  for the dedicated weights until the load) and loads that dict with
  ``dmuon.checkpoint.set_model_state_dict(..., broadcast_from_rank0=True)``: each owner
  receives only its matrices, FSDP2's parameters their shards, as Accelerate's
  ``fsdp2_load_full_state_dict`` does. Non-persistent buffers (rotary frequencies), which no
  state dict holds, are the first rank's too (sent once, as objects); tied weights are tied
  again.

Refused with the fix (nothing silently ignored): FSDP1, ``cpu_offload``, ``ignored_modules``,
``fp16`` (its loss scaler's per-rank inf check) and tensor/context/sequence parallel sizes above
1. It must not build the optimizer, touch Accelerate's state, or move data between ranks itself
(the first rank's weights travel through ``dmuon.checkpoint``; only its non-persistent buffers
are sent here).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

import dmuon
import dmuon.checkpoint
from dmuon_hf.predicates import Predicate, default_predicate

_MIXED_PRECISION = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class ShardingRequest:
    """What the user asked for: the FSDP2 plugin, the optional HSDP layout, the mixed precision
    (Accelerate's name: ``"no"`` or ``"bf16"``) and the predicate (None: ``default_predicate``)."""

    plugin: Any  # accelerate.utils.FullyShardedDataParallelPlugin
    parallelism_config: Any = None  # accelerate.ParallelismConfig or None
    mixed_precision: str = "no"
    predicate: Predicate | None = None

    @property
    def loads_on_first_rank(self) -> bool:
        """``cpu_ram_efficient_loading``: only the first rank holds the model's weights."""
        return bool(getattr(self.plugin, "cpu_ram_efficient_loading", False))

    def check(self) -> None:
        """Raise for what dmuon_hf does not do, before any model is touched."""
        plugin = self.plugin
        require_fsdp2(getattr(plugin, "fsdp_version", 1))
        offload = getattr(plugin, "cpu_offload", None)
        if offload is not None and type(offload) is not OffloadPolicy:
            raise ValueError(
                "dmuon_hf: cpu_offload is not supported with dmuon (the owners' fp32 masters and "
                "Newton-Schulz stay on the device). Remove 'cpu_offload' / the 'offload' option."
            )
        if getattr(plugin, "ignored_modules", None) is not None:
            raise ValueError(
                "dmuon_hf: ignored_modules is not supported; leave the parameters out of the "
                "predicate instead (dmuon's AdamW route on FSDP2 shards), or freeze them."
            )
        if self.mixed_precision == "fp16":
            raise ValueError(
                "dmuon_hf: fp16 is not supported yet: its GradScaler decides per rank whether a "
                "step has inf gradients, and with sharded gradients ranks could disagree (some "
                "stepping, some not). Use bf16=True (no loss scaling)."
            )
        if self.mixed_precision not in _MIXED_PRECISION:
            raise ValueError(
                f"dmuon_hf: mixed precision {self.mixed_precision!r} is not supported; use "
                "'bf16' (TrainingArguments(bf16=True)) or none."
            )
        pc = self.parallelism_config
        if pc is not None:
            others = {name: getattr(pc, name, 1) or 1 for name in ("tp_size", "cp_size", "sp_size")}
            if any(size > 1 for size in others.values()):
                raise ValueError(
                    f"dmuon_hf: ParallelismConfig with {others} is not supported; dmuon_hf "
                    "builds data-parallel meshes only (dp_replicate_size x dp_shard_size, HSDP)."
                )


def require_fsdp2(fsdp_version: int) -> None:
    if fsdp_version != 2:
        raise ValueError(
            f"dmuon_hf: fsdp_version={fsdp_version} asks for FSDP1; dmuon works with FSDP2 only. "
            "Pass fsdp_config={'fsdp_version': 2, ...} (or "
            "FullyShardedDataParallelPlugin(fsdp_version=2, ...))."
        )


def dedicate_and_shard(model: nn.Module, request: ShardingRequest, device: torch.device) -> None:
    """Apply ``request`` to ``model`` (on ``device``, torch.distributed initialised); in place.

    Collective: every rank calls it with the same model and request.
    """
    request.check()
    plugin = request.plugin
    replicate_mesh, shard_mesh, fsdp_mesh = _meshes(request.parallelism_config, device)
    units = _units(model, plugin)  # decided on the plain model, as Accelerate sees it
    _upcast_trainable_to_fp32(model, request.mixed_precision)
    first_ranks_weights = None
    if request.loads_on_first_rank:
        first_ranks_weights = _WeightsOnFirstRank.take(model)
    mp_policy = _mixed_precision_policy(plugin, request.mixed_precision)
    predicate = request.predicate or default_predicate(model)
    dmuon.dedicate_params(
        model,
        shard_mesh,
        predicate,
        replicate_mesh=replicate_mesh,
        reshard_after_forward=bool(plugin.reshard_after_forward),
        param_policy={
            "defaults": {
                "param_dtype": mp_policy.param_dtype,
                "reduce_dtype": mp_policy.reduce_dtype,
            }
        },
    )
    if plugin.activation_checkpointing:
        units = [_checkpoint_wrapped(model, unit) for unit in units]
    shard = functools.partial(fully_shard, mesh=fsdp_mesh, mp_policy=mp_policy)
    for unit in units:
        shard(unit, reshard_after_forward=bool(plugin.reshard_after_forward))
    if not isinstance(model, FSDPModule):
        shard(model)
    if first_ranks_weights is not None:
        first_ranks_weights.load_into(model, device)


@dataclass(slots=True)
class _WeightsOnFirstRank:
    """``cpu_ram_efficient_loading``: the first rank's full state dict ({} elsewhere) and each
    rank's non-persistent buffers, taken before the model goes to the meta device."""

    state_dict: dict[str, torch.Tensor]
    non_persistent_buffers: dict[str, torch.Tensor]

    @classmethod
    def take(cls, model: nn.Module) -> _WeightsOnFirstRank:
        first = dist.get_rank() == 0
        state_dict = {key: value.detach() for key, value in model.state_dict().items()}
        if first and any(value.is_meta for value in state_dict.values()):
            meta = [key for key, value in state_dict.items() if value.is_meta][:5]
            raise ValueError(
                f"dmuon_hf: cpu_ram_efficient_loading loads the weights the first rank holds, "
                f"but there {len(meta)}+ are on the meta device ({meta}); load the model with "
                "from_pretrained on the first rank (accelerate launch --fsdp_cpu_ram_efficient_"
                "loading true does so), or leave cpu_ram_efficient_loading off."
            )
        # No state dict holds them, and the other ranks' may be on the meta device too: every
        # rank takes the first rank's (small: rotary frequencies, masks), in one message.
        buffers = [
            {
                name: buffer.detach().cpu().clone()
                for name, buffer in model.named_buffers()
                if name.rsplit(".", 1)[-1] in _non_persistent_names(model, name)
            }
            if first
            else None
        ]
        dist.broadcast_object_list(buffers, src=0)
        model.to(torch.device("meta"))
        _tie_weights(model)
        return cls(state_dict if first else {}, buffers[0])

    def load_into(self, model: nn.Module, device: torch.device) -> None:
        # FSDP2's shards and the buffers get storage; the dedicated weights none until the load
        # gives each owner its own (to_empty would allocate all of them on every rank).
        dmuon.checkpoint.to_empty_for_load(model, device=device)
        dmuon.checkpoint.set_model_state_dict(
            model,
            self.state_dict,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        self.state_dict = {}
        for name, buffer in self.non_persistent_buffers.items():
            module_name, _, attr = name.rpartition(".")
            model.get_submodule(module_name).register_buffer(
                attr, buffer.to(device), persistent=False
            )
        _tie_weights(model)


def _non_persistent_names(model: nn.Module, buffer_name: str) -> set[str]:
    module_name = buffer_name.rpartition(".")[0]
    return model.get_submodule(module_name)._non_persistent_buffers_set


def _tie_weights(model: nn.Module) -> None:
    # Moving to the meta device (and to_empty) makes new parameters: an output head tied to the
    # input embeddings must point at the same one again, as Accelerate re-ties.
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _meshes(parallelism_config, device: torch.device):
    """(replicate_mesh or None, shard_mesh, fsdp_mesh) over every rank of the world."""
    if not dist.is_initialized():
        raise RuntimeError(
            "dmuon_hf: sharding needs torch.distributed: launch with torchrun (or accelerate "
            "launch), one process per device."
        )
    world = dist.get_world_size()
    replicas = (
        (getattr(parallelism_config, "dp_replicate_size", None) or 1) if parallelism_config else 1
    )
    shards = getattr(parallelism_config, "dp_shard_size", None) if parallelism_config else None
    shards = shards or world // replicas
    if replicas * shards != world:
        raise ValueError(
            f"dmuon_hf: ParallelismConfig(dp_replicate_size={replicas}, dp_shard_size={shards}) "
            f"spans {replicas * shards} ranks but the job has {world}; make their product the "
            "number of processes."
        )
    if replicas == 1:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
        return None, mesh, mesh
    mesh = init_device_mesh(device.type, (replicas, shards), mesh_dim_names=("replicate", "shard"))
    return mesh["replicate"], mesh["shard"], mesh


def _units(model: nn.Module, plugin) -> list[nn.Module]:
    """The modules that get their own FSDP2 unit, bottom-up, the root excluded."""
    wraps = _wrap_policy(model, plugin)
    units = [module for module in model.modules() if module is not model and wraps(module)]
    return list(reversed(units))  # children before their parents, as fully_shard needs


def _wrap_policy(model: nn.Module, plugin) -> Callable[[nn.Module], bool]:
    from torch.distributed.fsdp.wrap import (
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    policy = plugin.auto_wrap_policy
    policy = getattr(policy, "func", policy)
    if policy is None:
        return lambda module: False
    if policy is size_based_auto_wrap_policy:
        limit = plugin.min_num_params
        if not limit:  # Accelerate drops a size policy without a size (no units)
            return lambda module: False
        return lambda module: sum(p.numel() for p in module.parameters()) > limit
    if policy is transformer_auto_wrap_policy:
        names = plugin.transformer_cls_names_to_wrap
        if isinstance(names, str):
            names = names.split(",")
        named_by_user = bool(names)
        # A model class declares _no_split_modules for all its configurations (Gemma 3 names
        # SigLIP's text embeddings, absent from its vision tower): only named classes must exist.
        names = list(names or getattr(model, "_no_split_modules", None) or [])
        classes = {type(m) for m in model.modules() if type(m).__name__ in names}
        missing = sorted(set(names) - {cls.__name__ for cls in classes})
        if missing and named_by_user:
            raise ValueError(
                f"dmuon_hf: transformer_layer_cls_to_wrap names {missing}, which "
                f"{type(model).__name__} does not contain. Name its block classes (e.g. "
                f"{sorted(getattr(model, '_no_split_modules', None) or [])}) or leave it unset."
            )
        return lambda module: isinstance(module, tuple(classes))
    raise ValueError(
        f"dmuon_hf: auto_wrap_policy {policy!r} is not supported; use 'TRANSFORMER_BASED_WRAP' "
        "(the default), 'SIZE_BASED_WRAP' or 'NO_WRAP'."
    )


def _upcast_trainable_to_fp32(model: nn.Module, mixed_precision: str) -> None:
    # As Accelerate does for FSDP2 mixed precision: fp32 master weights, low-precision compute.
    if _MIXED_PRECISION[mixed_precision] is None:
        return
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)


def _mixed_precision_policy(plugin, mixed_precision: str) -> MixedPrecisionPolicy:
    if _MIXED_PRECISION[mixed_precision] is not None:
        plugin.set_mixed_precision(mixed_precision)  # keeps a policy the user gave
    policy = plugin.mixed_precision_policy
    return policy if isinstance(policy, MixedPrecisionPolicy) else MixedPrecisionPolicy()


def _checkpoint_wrapped(model: nn.Module, unit: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    name = next(name for name, module in model.named_modules() if module is unit)
    wrapped = checkpoint_wrapper(unit, preserve_rng_state=False)
    model.set_submodule(name, wrapped)
    return wrapped
