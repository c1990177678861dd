"""``DMuonAccelerator``: Accelerate's ``Accelerator`` for dmuon on FSDP2, without the Trainer.

Owns the four places where a stock ``Accelerator`` with an FSDP2 plugin cannot handle a dmuon
model and its ``dmuon.Muon``, and nothing else (data loaders, schedulers, RNG, gradient
accumulation and mixed-precision autocast stay Accelerate's):

- ``prepare``: a plain model is dedicated and sharded by ``dmuon_hf.sharding`` from the FSDP2
  plugin (and ``ParallelismConfig`` for HSDP) given at construction; a model already prepared by
  hand is taken as it is. Accelerate only marks it prepared (autocast); it never wraps it. The
  plugin is kept from Accelerate for the reasons of [Note: FSDP2 configuration taken over] in
  ``dmuon_hf.trainer``. ``dmuon.Muon`` is built after the model is prepared, then prepared like
  any optimizer.
- ``clip_grad_norm_(model.parameters(), max_norm, norm_type=2)``: torch's clip over the module
  parameters would miss the owners' fp32 masters (they are not module parameters) without a
  word; here the parameters of a dmuon model are clipped by ``dmuon.clip_grad_norm_`` over every
  gradient its ``dmuon.Muon`` updates, with the same ``norm_type`` (any p > 0, inf included).
  Part of a dmuon model's parameters is refused.
- ``save_state`` / ``load_state``: each dmuon model and its optimizer go into one sharded
  ``dmuon.checkpoint`` (``dmuon_state/`` in the checkpoint folder, written and read by every
  rank, reshardable onto another world size); Accelerate saves and loads everything else as usual
  and never sees them (its ``optimizer.bin`` would hold one rank's share).
- ``get_state_dict(model)``: the full model on the first rank (``{}`` elsewhere), gathered by
  ``dmuon.checkpoint``.

And ``no_sync`` (so ``accumulate``) uses ``dmuon.no_sync`` for a dmuon model: one gradient reduce
per window, as DDP's ``no_sync`` gives a DDP model.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

import dmuon
import dmuon.checkpoint as dckpt
from dmuon_hf.launch import check_world_is_seen
from dmuon_hf.predicates import Predicate
from dmuon_hf.sharding import ShardingRequest, dedicate_and_shard

# The sharded checkpoint of each dmuon model and its optimizer inside a save_state folder.
DMUON_STATE_DIR = "dmuon_state"
_FULL_ON_FIRST_RANK = StateDictOptions(full_state_dict=True, cpu_offload=True)


class DMuonAccelerator(Accelerator):
    """``Accelerator`` that trains a model with dmuon on FSDP2::

        accelerator = DMuonAccelerator(
            mixed_precision="bf16",
            fsdp_plugin=FullyShardedDataParallelPlugin(
                fsdp_version=2, auto_wrap_policy="transformer_based_wrap"
            ),
        )
        model = accelerator.prepare(model)  # dedicated (default_predicate) and sharded
        optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-4)
        optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)
        ...
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # dmuon.clip_grad_norm_
        accelerator.save_state("ckpt")  # and load_state("ckpt"), on any world size

    ``predicate`` (default ``dmuon_hf.default_predicate(model)``) chooses what is dedicated.
    Without an FSDP plugin (nor an ``accelerate launch`` FSDP config) only models already
    prepared by hand are accepted. Every save and load is collective.
    """

    def __init__(
        self,
        *args: Any,
        fsdp_plugin: Any = None,
        parallelism_config: Any = None,
        predicate: Predicate | None = None,
        **kwargs: Any,
    ) -> None:
        from accelerate.utils import FullyShardedDataParallelPlugin

        if fsdp_plugin is None and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            fsdp_plugin = FullyShardedDataParallelPlugin()  # the launcher's FSDP_* variables
        saved = os.environ.pop("ACCELERATE_USE_FSDP", None)
        try:
            super().__init__(*args, **kwargs)
        finally:
            if saved is not None:
                os.environ["ACCELERATE_USE_FSDP"] = saved
        # [Note: an unseen world] (dmuon_hf.launch)
        check_world_is_seen(
            "DMuonAccelerator", "the Accelerator", self.num_processes,
            cpu_fix="DMuonAccelerator(cpu=True, ...)",
        )  # fmt: skip
        self._sharding: ShardingRequest | None = None
        if fsdp_plugin is not None:
            self._sharding = ShardingRequest(
                plugin=fsdp_plugin,
                parallelism_config=parallelism_config,
                mixed_precision=self.mixed_precision,
                predicate=predicate,
            )
            self._sharding.check()
        elif parallelism_config is not None:
            raise ValueError(
                "DMuonAccelerator: parallelism_config (HSDP) needs an FSDP2 plugin: pass "
                "fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...) as well."
            )
        self._set_aside: list[tuple[nn.Module, dmuon.Muon]] = []
        self.register_save_state_pre_hook(self._save_dmuon_state)
        self.register_load_state_pre_hook(self._load_dmuon_state)

    # ---- prepare ----------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None):
        prepared = [
            self._prepare_dmuon_model(obj) if isinstance(obj, nn.Module) else obj for obj in args
        ]
        return super().prepare(*prepared, device_placement=device_placement)

    def _prepare_dmuon_model(self, model: nn.Module) -> nn.Module:
        if getattr(model, "_is_accelerate_prepared", False):
            return model
        if not dmuon.inspect.is_prepared(model):
            if self._sharding is None:
                raise ValueError(
                    f"DMuonAccelerator: {type(model).__name__} is neither dedicated nor can it be "
                    "sharded here: pass fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, "
                    "...) to DMuonAccelerator, or call dmuon.dedicate_params and fully_shard first."
                )
            if not self._sharding.loads_on_first_rank:  # else the other ranks' are on meta
                model.to(self.device)
            dedicate_and_shard(model, self._sharding, self.device)
        # Autocast only: Accelerate marks it prepared and never wraps or moves it.
        return self.prepare_model(model, device_placement=False, evaluation_mode=True)

    # ---- gradient accumulation ----------------------------------------------------------------------

    def no_sync(self, model: nn.Module):
        # accumulate() calls this for every micro-batch but a window's last: dmuon's own no_sync
        # (a dmuon model has no DDP no_sync, so Accelerate's would reduce every micro-batch).
        if dmuon.inspect.is_prepared(model):
            return dmuon.no_sync(model)
        return super().no_sync(model)

    # ---- clipping ---------------------------------------------------------------------------------

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        model = self._dmuon_model_among(parameters)
        if model is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        if {id(p) for p in parameters} != {id(p) for p in model.parameters()}:
            raise ValueError(
                "DMuonAccelerator.clip_grad_norm_: got part of a dmuon model's parameters; dmuon "
                "clips with one norm over every gradient its optimizer updates (the owners' fp32 "
                "masters included). Pass model.parameters()."
            )
        self.unscale_gradients()
        return dmuon.clip_grad_norm_(model, self._optimizer_of(model), max_norm, norm_type)

    def _dmuon_model_among(self, parameters: list[torch.Tensor]) -> nn.Module | None:
        ids = {id(p) for p in parameters}
        for model in self._models:
            if dmuon.inspect.is_prepared(model) and any(
                id(p) in ids for p in dmuon.dedicated_parameters(model)
            ):
                return model
        return None

    def _optimizer_of(self, model: nn.Module) -> dmuon.Muon:
        for optimizer in self._optimizers:
            inner = (
                optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
            )
            if isinstance(inner, dmuon.Muon) and dmuon.inspect.model_of(inner) is model:
                return inner
        raise ValueError(
            "DMuonAccelerator: no prepared dmuon.Muon belongs to this model; build it with "
            "dmuon.Muon(model, ...) and pass it to accelerator.prepare first."
        )

    # ---- saving and loading -----------------------------------------------------------------------

    def get_state_dict(self, model: nn.Module, unwrap: bool = True):
        if dmuon.inspect.is_prepared(model):
            return dckpt.get_model_state_dict(model, options=_FULL_ON_FIRST_RANK)
        return super().get_state_dict(model, unwrap=unwrap)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs):
        with self._dmuon_objects_set_aside():
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs):
        with self._dmuon_objects_set_aside():
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)

    @contextlib.contextmanager
    def _dmuon_objects_set_aside(self) -> Iterator[None]:
        """Inside, Accelerate's lists hold no dmuon model or optimizer: its save_state and
        load_state handle the rest, and the pre-hooks below the set-aside pairs."""
        pairs = [(m, self._optimizer_of(m)) for m in self._models if dmuon.inspect.is_prepared(m)]
        models, optimizers = self._models, self._optimizers
        self._models = [m for m in models if not dmuon.inspect.is_prepared(m)]
        self._optimizers = [
            o for o in optimizers if not isinstance(getattr(o, "optimizer", o), dmuon.Muon)
        ]
        self._set_aside = pairs
        try:
            yield
        finally:
            self._models, self._optimizers, self._set_aside = models, optimizers, []

    def _save_dmuon_state(self, models, weights, output_dir: str) -> None:
        for index, (model, optimizer) in enumerate(self._set_aside):
            model_state, optim_state = dckpt.get_state_dict(model, optimizer)
            dckpt.save({"model": model_state, "optim": optim_state}, _state_dir(output_dir, index))

    def _load_dmuon_state(self, models, input_dir: str) -> None:
        for index, (model, optimizer) in enumerate(self._set_aside):
            model_state, optim_state = dckpt.get_state_dict(model, optimizer)
            dckpt.load({"model": model_state, "optim": optim_state}, _state_dir(input_dir, index))
            dckpt.set_state_dict(
                model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state
            )


def _state_dir(folder: str, index: int) -> str:
    return os.path.join(folder, DMUON_STATE_DIR if index == 0 else f"{DMUON_STATE_DIR}_{index}")
