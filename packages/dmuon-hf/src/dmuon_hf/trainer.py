"""``DMuonTrainer``: ``transformers.Trainer`` for a model prepared by dmuon (and FSDP2).

Owns what a stock ``Trainer`` (transformers 5.x with Accelerate) does wrong with a model on
which ``dmuon.dedicate_params`` and ``fully_shard`` were called, and a ``dmuon.Muon``
optimizer. It must not change the training math beyond that list; everything else is
``Trainer``'s.

Two ways in. Hand-sharded: the model comes dedicated and sharded, with its ``dmuon.Muon``.
From ``TrainingArguments(fsdp=..., fsdp_config={"fsdp_version": 2, ...})`` (or an ``accelerate
launch`` FSDP2 config): the model comes plain, and DMuonTrainer takes the FSDP2 configuration
over from Accelerate (see [Note: FSDP2 configuration taken over]), dedicates and shards the model
with ``dmuon_hf.sharding`` at the end of construction, then builds the optimizer from
``optimizer_cls_and_kwargs=(dmuon.Muon, {...})``, ``optimizers=(model -> dmuon.Muon, None)`` or
the default ``dmuon.Muon`` (AdamW route from ``learning_rate``, ``weight_decay`` and the Adam
betas/epsilon of the arguments). From there on both ways are the same.

[Note: FSDP2 configuration taken over]
Accelerate applies FSDP2 inside ``accelerator.prepare(model, optimizer)``: it swaps the
optimizer's parameters for placeholders keyed by ``data_ptr`` and maps them back onto the
sharded model's parameters, which cannot work for dmuon (the owners' fp32 masters are not module
parameters), and its checkpoints key the optimizer state by the module's parameters, which cannot
name the masters' state (``dmuon.checkpoint`` can).
So the Accelerator DMuonTrainer builds gets neither the FSDP plugin nor the
``ParallelismConfig`` (and ``ACCELERATE_USE_FSDP`` is hidden from it while it is built): to
Accelerate the model is an already-distributed one, exactly as in the hand-sharded way, and the
plugin's settings are applied by ``dmuon_hf.sharding`` instead. On CPU Accelerate ignores FSDP
plugins anyway, so CPU/gloo tests run the very code path of a GPU job.

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
- saving: ``model.state_dict()`` of a distributed dmuon model is sharded as FSDP2's is (each
  dedicated weight only on its owner), so saving the first rank's would write part of the model,
  and ``torch.save(optimizer.state_dict())`` on one rank would hold one rank's share. Here ``_save`` (``save_model`` and the model of every checkpoint) gathers the full model
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
from collections.abc import Callable, Iterator
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
from dmuon_hf.launch import check_world_is_seen
from dmuon_hf.predicates import Predicate
from dmuon_hf.sharding import ShardingRequest, dedicate_and_shard, require_fsdp2

logger = logging.getLogger("dmuon_hf")

# The sharded checkpoint of the model and the optimizer inside each ``checkpoint-N`` folder.
DMUON_STATE_DIR = "dmuon_state"
# The whole model, on the CPU of the first rank (the others get {}): what save_pretrained writes.
_FULL_ON_FIRST_RANK = StateDictOptions(full_state_dict=True, cpu_offload=True)


class DMuonTrainer(Trainer):
    """``Trainer`` that trains a model with dmuon on FSDP2, sharded by you or by it.

    From the FSDP2 training arguments (the model plain, as for ``Trainer``)::

        trainer = DMuonTrainer(
            model=AutoModelForCausalLM.from_pretrained(...),
            args=TrainingArguments(..., bf16=True, fsdp=True,
                                   fsdp_config={"fsdp_version": 2, "reshard_after_forward": True}),
            train_dataset=dataset,
            optimizer_cls_and_kwargs=(dmuon.Muon, {"lr": 0.02, "adamw_lr": 1e-4}),
            predicate=None,  # default_predicate(model); or (name, param) -> bool
        )

    Or hand-sharded, with the optimizer passed in::

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

    Requirements (each checked, with a message saying the fix): the optimizer is a
    ``dmuon.Muon`` built on this model; no ``deepspeed``, ``torch_compile``, ``model_init`` or
    ``save_on_each_node`` (every rank writes into one checkpoint folder); ``fsdp`` only with a
    plain model. See the module docstring for what differs from ``Trainer``.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *trainer_args: Any,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None = None,
        predicate: Predicate | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        if trainer_kwargs.get("model_init") is not None or model is None:
            raise ValueError(
                "DMuonTrainer needs the model itself (model=...), not model_init: pass the plain "
                "model with TrainingArguments(fsdp=...), or a model prepared with "
                "dmuon.dedicate_params and fully_shard."
            )
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")
        # [Note: an unseen world] (dmuon_hf.launch): before transformers' own fsdp check.
        check_world_is_seen(
            "DMuonTrainer", "TrainingArguments", args.world_size,
            cpu_fix="TrainingArguments(use_cpu=True, ...)",
        )  # fmt: skip
        build_optimizer = _optimizer_builder(optimizers[0], optimizer_cls_and_kwargs, args)
        self._sharding: ShardingRequest | None = None
        if not dmuon.inspect.is_prepared(model) and _fsdp_requested(args):
            self._sharding = ShardingRequest(
                plugin=_fsdp_plugin(args),
                parallelism_config=getattr(args, "parallelism_config", None),
                mixed_precision=args.mixed_precision,
                predicate=predicate,
            )
            self._sharding.check()
            _check_training_arguments(args, sharded_by_trainer=True)
            _check_no_scheduler_before_optimizer(optimizers[1])
            optimizer = None
        else:
            _check_training_arguments(args, sharded_by_trainer=False)
            if predicate is not None:
                raise ValueError(
                    "DMuonTrainer: predicate= chooses what DMuonTrainer dedicates when it shards "
                    "the model (TrainingArguments(fsdp=...)); this model is "
                    + ("already dedicated: pass the predicate to dmuon.dedicate_params."
                       if dmuon.inspect.is_prepared(model) else "not sharded by it.")
                )  # fmt: skip
            dmuon.inspect.view(model)  # raises, saying to call dmuon.dedicate_params first
            optimizer = build_optimizer(model)
            _check_optimizer(optimizer, model)
        self._dmuon_optimizer: dmuon.Muon | None = optimizer
        self._masters_need_zero_grad = True
        super().__init__(
            model, args, *trainer_args, optimizers=(optimizer, optimizers[1]), **trainer_kwargs
        )
        if self._sharding is not None:
            dedicate_and_shard(self.model, self._sharding, self.args.device)
            optimizer = build_optimizer(self.model)
            _check_optimizer(optimizer, self.model)
            self.optimizer = self._dmuon_optimizer = optimizer
            self.callback_handler.optimizer = optimizer
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            wrapper = "FSDP" if self.is_fsdp_enabled else "DeepSpeed"
            raise ValueError(
                f"DMuonTrainer: Accelerate has {wrapper} enabled (from TrainingArguments or the "
                "accelerate launcher config); it would shard the model again. The model is "
                "already sharded by dmuon.dedicate_params and fully_shard: launch without an "
                "FSDP/DeepSpeed config, or pass the plain model and let DMuonTrainer shard it "
                "from the FSDP2 config."
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

    # ---- the accelerator --------------------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        if self._sharding is None:
            return super().create_accelerator_and_postprocess()
        # [Note: FSDP2 configuration taken over]: an accelerate-launch FSDP config is read from
        # the environment by Accelerator(); hide it while Trainer builds it.
        with _environment_without("ACCELERATE_USE_FSDP"):
            super().create_accelerator_and_postprocess()

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        accelerator_args = super()._build_accelerator_args(**kwargs)
        if self._sharding is not None:  # [Note: FSDP2 configuration taken over]
            accelerator_args.pop("fsdp_plugin", None)
            accelerator_args.pop("parallelism_config", None)
        return accelerator_args

    # ---- device placement -----------------------------------------------------------------------

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if not dmuon.inspect.is_prepared(model):  # a plain model DMuonTrainer will shard
            if self._sharding is not None and self._sharding.loads_on_first_rank:
                return None  # the first rank's weights are loaded onto the device when sharded
            return super()._move_model_to_device(model, device)
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


def _fsdp_requested(args: TrainingArguments | None) -> bool:
    """TrainingArguments(fsdp=...) or an ``accelerate launch`` FSDP config."""
    from_launcher = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    return bool(args is not None and args.fsdp) or from_launcher


def _fsdp_plugin(args: TrainingArguments):
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin_args = getattr(args, "fsdp_plugin_args", None) or {}
    # Without TrainingArguments(fsdp=...) the plugin reads the launcher's FSDP_* variables.
    # Accelerate cannot even build an FSDP1 plugin without a GPU: refuse it first.
    require_fsdp2(int(plugin_args.get("fsdp_version", os.environ.get("FSDP_VERSION", "1"))))
    return FullyShardedDataParallelPlugin(**plugin_args)


def _optimizer_builder(
    optimizer: Any, optimizer_cls_and_kwargs: tuple | None, args: TrainingArguments
) -> Callable[[nn.Module], Any]:
    """``model -> optimizer`` from what was passed: a built optimizer, a factory, a class with
    its keyword arguments, or nothing (``dmuon.Muon`` with the AdamW settings of ``args``)."""
    if optimizer is not None and optimizer_cls_and_kwargs is not None:
        raise ValueError(
            "DMuonTrainer: pass either optimizers=(...) or optimizer_cls_and_kwargs=(...), not both."
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return lambda model: optimizer
    if optimizer is not None:
        if not callable(optimizer):
            raise ValueError(
                f"DMuonTrainer: optimizers[0] is a {type(optimizer).__name__}; pass a "
                "dmuon.Muon, a function model -> dmuon.Muon, or None."
            )
        return optimizer
    if optimizer_cls_and_kwargs is not None:
        optimizer_cls, kwargs = optimizer_cls_and_kwargs
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, dmuon.Muon)):
            raise ValueError(
                f"DMuonTrainer: optimizer_cls_and_kwargs names {optimizer_cls!r}; it must be "
                "dmuon.Muon (or a subclass), built as dmuon.Muon(model, **kwargs): "
                "optimizer_cls_and_kwargs=(dmuon.Muon, {'lr': 0.02, 'adamw_lr': 1e-4})."
            )
        return lambda model: optimizer_cls(model, **kwargs)
    return lambda model: dmuon.Muon(
        model,
        adamw_lr=args.learning_rate,
        adamw_betas=(args.adam_beta1, args.adam_beta2),
        adamw_eps=args.adam_epsilon,
        adamw_weight_decay=args.weight_decay,
    )


def _check_optimizer(optimizer: Any, model: nn.Module) -> None:
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


def _check_no_scheduler_before_optimizer(scheduler: Any) -> None:
    if scheduler is not None:
        raise ValueError(
            "DMuonTrainer: with TrainingArguments(fsdp=...) the optimizer is built after "
            "DMuonTrainer shards the model, so a scheduler built beforehand cannot drive it. "
            "Use TrainingArguments(lr_scheduler_type=...), or shard the model yourself and pass "
            "optimizers=(dmuon.Muon(model, ...), scheduler)."
        )


@contextlib.contextmanager
def _environment_without(name: str) -> Iterator[None]:
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def _check_training_arguments(args: TrainingArguments | None, *, sharded_by_trainer: bool) -> None:
    if args is None:
        return  # Trainer's defaults
    if args.save_on_each_node:
        raise ValueError(
            "DMuonTrainer: TrainingArguments(save_on_each_node=True) is not supported: every "
            "rank writes its shard into one checkpoint folder and the first rank writes the "
            "full model, so output_dir must be on a filesystem every node shares. Remove "
            "save_on_each_node."
        )
    if args.fsdp and not sharded_by_trainer:
        raise ValueError(
            f"DMuonTrainer: TrainingArguments(fsdp={args.fsdp!r}) would shard the model again: "
            "it is already dedicated. Pass the plain model and let DMuonTrainer dedicate and "
            "shard it, or remove fsdp/fsdp_config."
        )
    checkpointing = getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing
    if sharded_by_trainer and checkpointing and _fsdp_plugin(args).activation_checkpointing:
        raise ValueError(
            "DMuonTrainer: fsdp_config['activation_checkpointing'] and the gradient_checkpointing "
            "training argument would checkpoint every layer twice; set one of them."
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
