"""``DMuonTrainer``: ``transformers.Trainer`` for a model prepared by dmuon (and FSDP2).

Owns what a stock ``Trainer`` (transformers 5.x with Accelerate) does wrong with a model on
which ``dmuon.dedicate_params`` and ``fully_shard`` were called, and a ``dmuon.Muon``
optimizer. It must not change the training math beyond that list; everything else is
``Trainer``'s.

What a stock ``Trainer`` does, and what this subclass does instead:

- ``accelerator.prepare(model, optimizer)`` wraps the model in DistributedDataParallel when the
  world size is above 1; DDP's initial broadcast then fails on FSDP2's DTensors ("got mixed
  torch.Tensor and DTensor"), and would double-reduce gradients if it did not. Here the model is
  handed to ``accelerator.prepare_model(..., evaluation_mode=True)`` once at construction:
  mixed-precision autocast only, and Accelerate then sees it as prepared and never wraps it.
- ``model.zero_grad()`` after each step clears the module's gradients but not the owners' fp32
  masters (they are not module parameters), which would then accumulate across steps. Here the
  optimizer's ``zero_grad()`` runs at the start of every accumulation window.
- gradient clipping over ``model.parameters()`` misses the masters. Here ``max_grad_norm`` clips
  with one norm over every gradient (``dmuon.clip_grad_norm_``), and that norm is what is logged.
- gradient accumulation: Accelerate's ``no_sync`` does nothing for an unwrapped model, so every
  micro-batch would reduce; here the non-final micro-batches run under ``dmuon.no_sync``.
- ``place_model_on_device``: ``model.to(device)`` is never called; the model must already be on
  ``args.device``. ``Trainer._wrap_model`` (DataParallel when one process sees several GPUs)
  returns the model unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import SaveStrategy

import dmuon
from dmuon.api import get_dedicated_state
from dmuon.clip import clip_grad_norm_


class DMuonTrainer(Trainer):
    """``Trainer`` that trains a dmuon-dedicated (and ``fully_shard``-ed) model as it is.

    Use it exactly like ``Trainer``, with the optimizer passed in::

        trainer = DMuonTrainer(
            model=model,  # after dmuon.dedicate_params(...) and fully_shard(...)
            args=TrainingArguments(..., save_strategy="no"),
            train_dataset=dataset,
            optimizers=(dmuon.Muon(model, lr=0.02, adamw_lr=1e-3), None),  # or a scheduler
        )
        trainer.train()

    Requirements (each checked, with a message saying the fix): ``optimizers[0]`` is the
    ``dmuon.Muon`` built on this model; ``save_strategy="no"`` (checkpointing a dmuon model
    through ``Trainer`` is not supported yet); no ``fsdp``, ``deepspeed``, ``torch_compile``
    or ``model_init`` (the model is sharded and compiled by you, before the trainer sees it).
    See the module docstring for what differs from ``Trainer``.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *trainer_args: Any,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        **trainer_kwargs: Any,
    ) -> None:
        _check_model_and_optimizer(model, optimizers, trainer_kwargs)
        _check_training_arguments(args)
        self._dmuon_optimizer: dmuon.Muon = optimizers[0]
        self._masters_need_zero_grad = True
        super().__init__(model, args, *trainer_args, optimizers=optimizers, **trainer_kwargs)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            wrapper = "FSDP" if self.is_fsdp_enabled else "DeepSpeed"
            raise ValueError(
                f"DMuonTrainer: Accelerate has {wrapper} enabled (from TrainingArguments or the "
                "accelerate launcher config); it would shard the model again. Launch with "
                "torchrun (or accelerate without an FSDP/DeepSpeed config): the model is already "
                "sharded by dmuon.dedicate_params and fully_shard."
            )
        # Autocast only (evaluation_mode skips every DDP/FSDP wrap); the model is marked as
        # prepared, so the prepare() inside train() returns it unchanged.
        prepared = self.accelerator.prepare_model(
            self.model, device_placement=False, evaluation_mode=True
        )
        if prepared is not self.model:
            raise RuntimeError(
                "DMuonTrainer: accelerator.prepare_model returned a different object "
                f"({type(prepared).__name__}) for the model; DMuonTrainer relies on Accelerate "
                "leaving a model it does not wrap in place. Please report this with your "
                "transformers and accelerate versions."
            )

    # ---- device placement -----------------------------------------------------------------------

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # The dedicated weights live in owner segments and the rest in FSDP2 shards: .to() must
        # not touch them. The user places the model before dedicate_params.
        target = torch.device(device)
        devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
        misplaced = sorted(str(d) for d in devices if not _same_device(d, target))
        if misplaced:
            raise ValueError(
                f"DMuonTrainer: the model has tensors on {misplaced} but TrainingArguments put "
                f"training on {target}. Move the model to {target} before "
                "dmuon.dedicate_params and fully_shard (DMuonTrainer never moves it)."
            )

    # ---- wrapping -------------------------------------------------------------------------------

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None):
        # Trainer's own wraps (DataParallel on several visible GPUs, SageMaker, XLA FSDP) would
        # replicate or shard a model that dmuon and FSDP2 already distribute.
        return model

    # ---- one micro-batch ------------------------------------------------------------------------

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        if model is not self.model:
            raise RuntimeError(
                f"DMuonTrainer: Trainer handed training_step a {type(model).__name__} wrapping "
                "the model; dmuon and FSDP2 already reduce every gradient, so a wrapper would "
                "reduce them twice. Please report this with your transformers and accelerate "
                "versions."
            )
        if self._masters_need_zero_grad:
            # Trainer's model.zero_grad() cannot reach the owners' fp32 masters.
            self._dmuon_optimizer.zero_grad()
            self._masters_need_zero_grad = False
        # Trainer sets sync_gradients before each micro-batch: True on the last of a window.
        last_micro_batch = (
            self.accelerator.sync_gradients
            or self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        )
        sync = contextlib.nullcontext() if last_micro_batch else dmuon.no_sync(self.model)
        with sync:
            loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:
            self._masters_need_zero_grad = True
        return loss

    # ---- gradient norm --------------------------------------------------------------------------

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return clip_grad_norm_(self.model, self._dmuon_optimizer, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | None = None):
        if grad_norm is None:
            grad_norm = clip_grad_norm_(self.model, self._dmuon_optimizer, float("inf"))
        return grad_norm

    # ---- end of training ------------------------------------------------------------------------

    def train(self, *args: Any, **kwargs: Any):
        result = super().train(*args, **kwargs)
        # Under HSDP the last step's publish may still be in flight.
        dmuon.wait_all_replicate_broadcasts(self.model)
        return result


# ---- checks -------------------------------------------------------------------------------------


def _check_model_and_optimizer(
    model: nn.Module | None, optimizers: tuple, trainer_kwargs: dict[str, Any]
) -> None:
    if trainer_kwargs.get("model_init") is not None or model is None:
        raise ValueError(
            "DMuonTrainer needs the prepared model itself (model=...), not model_init: build the "
            "model, call dmuon.dedicate_params and fully_shard, then pass it."
        )
    get_dedicated_state(model)  # raises, saying to call dmuon.dedicate_params first
    optimizer = optimizers[0] if optimizers else None
    if not isinstance(optimizer, dmuon.Muon):
        raise ValueError(
            "DMuonTrainer needs optimizers=(dmuon.Muon(model, ...), scheduler_or_None), got "
            f"optimizers[0]={type(optimizer).__name__}. Build the optimizer yourself: "
            "optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)."
        )
    built_on = getattr(optimizer, "_dedicated", None)
    if built_on is not None and built_on is not get_dedicated_state(model):
        raise ValueError(
            "DMuonTrainer: the dmuon.Muon optimizer was built on another model than the one "
            "passed as model=. Build it with dmuon.Muon(model, ...) on the same model."
        )


def _check_training_arguments(args: TrainingArguments | None) -> None:
    if args is None:
        raise ValueError(
            "DMuonTrainer needs TrainingArguments with save_strategy='no', e.g. "
            "TrainingArguments(output_dir=..., save_strategy='no')."
        )
    if args.save_strategy != SaveStrategy.NO:
        raise ValueError(
            f"DMuonTrainer: save_strategy={_plain(args.save_strategy)!r} is not supported: "
            "saving a dmuon model's checkpoint through Trainer is not implemented yet. Pass "
            "TrainingArguments(..., save_strategy='no')."
        )
    if args.fsdp:
        raise ValueError(
            f"DMuonTrainer: TrainingArguments(fsdp={args.fsdp!r}) would shard the model again. "
            "Remove fsdp/fsdp_config: call fully_shard yourself after dmuon.dedicate_params."
        )
    if args.deepspeed:
        raise ValueError(
            "DMuonTrainer: TrainingArguments(deepspeed=...) is not supported with dmuon; remove "
            "it (dmuon + FSDP2 already shard the model and its optimizer state)."
        )
    if args.torch_compile:
        raise ValueError(
            "DMuonTrainer: TrainingArguments(torch_compile=True) is not supported (compiling "
            "the whole model would trace through dmuon's hooks). Remove it, and compile the "
            "layers yourself after fully_shard: for layer in model.model.layers: layer.compile()."
        )


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index
