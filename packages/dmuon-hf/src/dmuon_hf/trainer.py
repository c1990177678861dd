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
- saving: ``model.state_dict()`` raises on a distributed dmuon model (the dedicated weights live
  on their owners), and ``torch.save(optimizer.state_dict())`` on one rank would hold one rank's
  share. Here ``_save`` (``save_model`` and the model of every checkpoint) gathers the full model
  onto the first rank with ``dmuon.checkpoint`` on every rank and writes it with
  ``save_pretrained(state_dict=...)``; each checkpoint also holds ``dmuon_state/``, one sharded
  ``dmuon.checkpoint`` of the model (the fp32 masters) and the optimizer, written by every rank.
  The scheduler, RNG and trainer state are written as ``Trainer`` writes them.
- resuming: ``Trainer`` loads ``model.safetensors`` with ``load_state_dict`` and the optimizer
  with ``optimizer.load_state_dict``. Here the model and the optimizer both come from
  ``dmuon_state/`` in ``_load_optimizer_and_scheduler``: after Accelerate has wrapped the
  optimizer (its wrap round-trips ``optimizer.state_dict()``, so state loaded earlier would be
  replaced by copies) and before the first step. ``load_best_model_at_end`` and checkpoints
  written with ``save_only_model=True`` (no ``dmuon_state/``) load the model from the full
  weights, through ``dmuon.checkpoint.set_model_state_dict``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

import dmuon
import dmuon.checkpoint as dckpt

logger = logging.getLogger("dmuon_hf")

# The sharded checkpoint of the model and the optimizer inside each ``checkpoint-N`` folder.
DMUON_STATE_DIR = "dmuon_state"
# The whole model, on the CPU of the first rank (the others get {}): what save_pretrained writes.
_FULL_ON_FIRST_RANK = StateDictOptions(full_state_dict=True, cpu_offload=True)


class DMuonTrainer(Trainer):
    """``Trainer`` that trains a dmuon-dedicated (and ``fully_shard``-ed) model as it is.

    Use it exactly like ``Trainer``, with the optimizer passed in::

        trainer = DMuonTrainer(
            model=model,  # after dmuon.dedicate_params(...) and fully_shard(...)
            args=TrainingArguments(..., save_strategy="steps", save_steps=500),
            train_dataset=dataset,
            optimizers=(dmuon.Muon(model, lr=0.02, adamw_lr=1e-3), None),  # or a scheduler
        )
        trainer.train()  # or trainer.train(resume_from_checkpoint=True)
        trainer.save_model("out/final")  # on every rank: from_pretrained("out/final") loads it

    Checkpoints (``save_strategy``, ``save_total_limit``, ``resume_from_checkpoint``) hold the
    full model for ``from_pretrained`` and a sharded ``dmuon_state/`` (model and optimizer) for
    resuming. ``save_model`` and every save and load are collective: call them on every rank.

    Requirements (each checked, with a message saying the fix): ``optimizers[0]`` is the
    ``dmuon.Muon`` built on this model; no ``fsdp``, ``deepspeed``, ``torch_compile``,
    ``model_init`` (the model is sharded and compiled by you, before the trainer sees it) or
    ``save_on_each_node`` (every rank writes into one checkpoint folder). See the module
    docstring for what differs from ``Trainer``.
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
        return dmuon.clip_grad_norm_(self.model, self._dmuon_optimizer, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | None = None):
        if grad_norm is None:
            grad_norm = dmuon.clip_grad_norm_(self.model, self._dmuon_optimizer, float("inf"))
        return grad_norm

    # ---- saving -----------------------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # Trainer returns early on every rank but the first; the gather below needs them all.
        if state_dict is None:
            state_dict = dckpt.get_model_state_dict(self.model, options=_FULL_ON_FIRST_RANK)
        if not self.args.should_save:
            return
        if not state_dict:
            raise RuntimeError(
                f"DMuonTrainer: process {self.args.process_index} writes the model but "
                "dmuon.checkpoint gathered it on another rank (the lowest rank of the mesh "
                "passed to dmuon.dedicate_params). Build that mesh over every rank of the job."
            )
        # save_pretrained writes the given state dict; it never reads the module's placeholders.
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        model_state, optim_state = dckpt.get_state_dict(self.model, self._dmuon_optimizer)
        dckpt.save(
            {"model": model_state, "optim": optim_state}, os.path.join(output_dir, DMUON_STATE_DIR)
        )
        if self.args.should_save:
            with warnings.catch_warnings(record=True) as caught_warnings:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught_warnings)

    # ---- resuming ---------------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None):
        # Trainer.train calls this before the optimizer is prepared, and
        # _load_optimizer_and_scheduler after: a dmuon_state/ loads there, model and optimizer
        # together (one checkpoint, one checked load).
        if not _exists_on_every_rank(os.path.join(resume_from_checkpoint, DMUON_STATE_DIR)):
            self._load_full_model(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state_dir = os.path.join(checkpoint, DMUON_STATE_DIR)
        if not _exists_on_every_rank(state_dir):
            logger.warning(
                f"{checkpoint} has no {DMUON_STATE_DIR}/ (written with save_only_model=True?): "
                "the model was loaded from its full weights; the optimizer and the scheduler "
                "start fresh."
            )
            return
        model_state, optim_state = dckpt.get_state_dict(self.model, self._dmuon_optimizer)
        dckpt.load({"model": model_state, "optim": optim_state}, state_dir)
        dckpt.set_state_dict(
            self.model,
            self._dmuon_optimizer,
            model_state_dict=model_state,
            optim_state_dict=optim_state,
        )
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler_file):
            with warnings.catch_warnings(record=True) as caught_warnings:
                self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
            reissue_pt_warnings(caught_warnings)

    def _load_best_model(self) -> None:
        logger.info(
            f"Loading best model from {self.state.best_model_checkpoint} "
            f"(score: {self.state.best_metric})."
        )
        self._load_full_model(self.state.best_model_checkpoint)

    def _load_full_model(self, checkpoint: str) -> None:
        """Load the full weights ``save_pretrained`` wrote into ``checkpoint`` (every rank reads
        them on its CPU, as ``Trainer`` does; each keeps its own part)."""
        full = _read_full_weights(checkpoint, self.model)
        result = dckpt.set_model_state_dict(
            self.model, full, options=StateDictOptions(strict=False)
        )
        del full
        self._issue_warnings_after_load(result)

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
    dmuon.inspect.view(model)  # raises, saying to call dmuon.dedicate_params first
    optimizer = optimizers[0] if optimizers else None
    if not isinstance(optimizer, dmuon.Muon):
        raise ValueError(
            "DMuonTrainer needs optimizers=(dmuon.Muon(model, ...), scheduler_or_None), got "
            f"optimizers[0]={type(optimizer).__name__}. Build the optimizer yourself: "
            "optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)."
        )
    if dmuon.inspect.model_of(optimizer) is not model:
        raise ValueError(
            "DMuonTrainer: the dmuon.Muon optimizer was built on another model than the one "
            "passed as model=. Build it with dmuon.Muon(model, ...) on the same model."
        )


def _check_training_arguments(args: TrainingArguments | None) -> None:
    if args is None:
        return  # Trainer's defaults
    if args.save_on_each_node:
        raise ValueError(
            "DMuonTrainer: TrainingArguments(save_on_each_node=True) is not supported: every "
            "rank writes its shard into one checkpoint folder and the first rank writes the "
            "full model, so output_dir must be on a filesystem every node shares. Remove "
            "save_on_each_node."
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


# ---- files ----------------------------------------------------------------------------------------


def _exists_on_every_rank(path: str) -> bool:
    """Whether ``path`` is a folder, agreed by every rank (one collective when distributed)."""
    exists = os.path.isdir(path)
    if not dist.is_initialized():
        return exists
    everyone: list[bool | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, exists)
    if len(set(everyone)) > 1:
        blind = [rank for rank, seen in enumerate(everyone) if not seen]
        raise RuntimeError(
            f"DMuonTrainer: ranks {blind} do not see {path}, the other ranks do. Every rank "
            "reads the checkpoint: put output_dir on a filesystem every node shares."
        )
    return exists


def _read_full_weights(checkpoint: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full weights in ``checkpoint``, keyed and shaped like its own state dict."""
    single = os.path.join(checkpoint, SAFE_WEIGHTS_NAME)
    index = os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    if isinstance(model, PreTrainedModel) and (os.path.isfile(single) or os.path.isfile(index)):
        # save_pretrained writes some weights in another layout than the model's (transformers 5
        # saves a fused (E, m, n) expert stack as one tensor per expert) and from_pretrained
        # converts them back: let it read its own format, into a plain copy on the CPU.
        plain = type(model).from_pretrained(checkpoint, config=model.config, device_map="cpu")
        return plain.state_dict()
    if os.path.isfile(single):
        return safetensors.torch.load_file(single, device="cpu")
    if os.path.isfile(index):
        with open(index) as file:
            shards = sorted(set(json.load(file)["weight_map"].values()))
        weights: dict[str, torch.Tensor] = {}
        for shard in shards:
            weights.update(
                safetensors.torch.load_file(os.path.join(checkpoint, shard), device="cpu")
            )
        return weights
    raise ValueError(
        f"DMuonTrainer: {checkpoint} is not a checkpoint DMuonTrainer wrote: it has neither "
        f"{DMUON_STATE_DIR}/ nor {SAFE_WEIGHTS_NAME} (or {SAFE_WEIGHTS_INDEX_NAME}). Pass a "
        "checkpoint-N folder from a DMuonTrainer output_dir."
    )


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index
