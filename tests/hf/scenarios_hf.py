"""Trainer scenarios run on every rank of a gloo pool (see tests/distributed/pool.py).

Each rank trains the same tiny Llama, prepared with dmuon.dedicate_params + fully_shard, through
``DMuonTrainer`` on CPU, and a single-process reference of it (plain model, reference Muon/AdamW,
torch's own clip_grad_norm_) on the whole dataset. The dataset is exactly one optimizer step's
worth of rows, so every step of both sees all of it: their gradients, losses and weights must
agree whatever order the sampler deals the rows in.

The checkpoint scenario compares ``DMuonTrainer`` with itself instead: a run interrupted at a
checkpoint and resumed must repeat the uninterrupted one exactly.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainingArguments

import dmuon
import dmuon.checkpoint as dckpt
from dmuon_hf import DMuonTrainer, default_predicate
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.comm_counter import count_collectives
from tests.distributed.scenarios_protocol import current_weights, relative_errors
from tests.hf.tiny_models import tiny_llama, token_batch
from tests.reference_optim import ReferenceMuonAdamW

_FULL_ON_FIRST_RANK = StateDictOptions(full_state_dict=True, cpu_offload=True)
MUON_LR = 0.02
ADAMW_LR = 1e-2
SEQ_LEN = 16


def _dataset(rows: int) -> list[dict[str, torch.Tensor]]:
    tokens = token_batch(rows, seq_len=SEQ_LEN)
    return [{"input_ids": row, "labels": row} for row in tokens]


def _prepared_llama():
    """The tiny Llama, dedicated and ``fully_shard``-ed over every rank, and its ``dmuon.Muon``."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    model = tiny_llama(seed=0)
    dmuon.dedicate_params(model, mesh, default_predicate(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(
        model,
        lr=MUON_LR,
        adamw_lr=ADAMW_LR,
        ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas"),
    )
    return model, optimizer


def _reference_run(steps: int, rows: int, max_grad_norm: float) -> dict:
    model = tiny_llama(seed=0)
    optimizer = ReferenceMuonAdamW(
        model.named_parameters(),
        default_predicate(model),
        lr=MUON_LR,
        adamw_lr=ADAMW_LR,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
    )
    tokens = token_batch(rows, seq_len=SEQ_LEN)
    losses, grad_norms = [], []
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        eval_loss = model(input_ids=tokens, labels=tokens).loss.item()
    return {"model": model, "losses": losses, "grad_norms": grad_norms, "eval_loss": eval_loss}


def train_with_dmuon_trainer(
    *, steps: int, per_device_batch: int, accumulation: int, max_grad_norm: float
) -> dict:
    """Train through DMuonTrainer; report what Trainer did to the model and the errors."""
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # one host: local = global rank
    world = dist.get_world_size()
    rows = world * per_device_batch * accumulation
    model, optimizer = _prepared_llama()
    output_dir = tempfile.mkdtemp(prefix="dmuon-hf-trainer-")
    try:
        args = TrainingArguments(
            output_dir=output_dir,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            max_steps=steps,
            per_device_train_batch_size=per_device_batch,
            per_device_eval_batch_size=per_device_batch * accumulation,
            gradient_accumulation_steps=accumulation,
            max_grad_norm=max_grad_norm,
            lr_scheduler_type="constant",
            logging_steps=1,
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
        )
        dataset = _dataset(rows)
        trainer = DMuonTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            eval_dataset=dataset,
            optimizers=(optimizer, None),
        )
        with count_collectives() as log:
            trainer.train()
        # Read the weights before evaluate(): FSDP2 keeps the root's parameters unsharded
        # after a forward with no backward.
        weights = current_weights(model)
        eval_loss = trainer.evaluate()["eval_loss"]
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)

    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    reference = _reference_run(steps, rows, max_grad_norm)
    errors = relative_errors(weights, reference["model"])
    return {
        "model_wrapped_is_model": trainer.model_wrapped is model and trainer.model is model,
        "model_wrapped_type": type(trainer.model_wrapped).__name__,
        "ddp_anywhere": any(isinstance(m, DistributedDataParallel) for m in model.modules()),
        "losses": [entry["loss"] for entry in history],
        "grad_norms": [entry["grad_norm"] for entry in history],
        "eval_loss": eval_loss,
        "reference": {key: reference[key] for key in ("losses", "grad_norms", "eval_loss")},
        "max_weight_error": max(errors.values()),
        # dmuon reduces gradients to their owners with c10d reduce, FSDP2 with reduce_scatter.
        "reduces_per_step": log.count("reduce") / steps,
        "reduce_scatters_per_step": log.count("reduce_scatter") / steps,
    }


# ---- checkpoints --------------------------------------------------------------------------------

CHECKPOINT_STEPS = 6
SAVE_STEPS = 2
RESUME_STEP = 4  # one step into the second epoch: Trainer skips that epoch's first batch
STEPS_PER_EPOCH = 3
PER_DEVICE_BATCH = 2


def probe_tokens() -> torch.Tensor:
    """(2, SEQ_LEN) tokens the trained models are compared on."""
    return token_batch(2, seq_len=SEQ_LEN, seed=1)


def _checkpoint_arguments(output_dir: str, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=output_dir,
        use_cpu=True,
        report_to=[],
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        save_total_limit=2,
        max_steps=CHECKPOINT_STEPS,
        per_device_train_batch_size=PER_DEVICE_BATCH,
        # A decaying rate: a resume that lost the scheduler's position would step at another one.
        lr_scheduler_type="linear",
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


def _eval_logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe_tokens()).logits
    model.train()
    return logits


def _logged(trainer, key: str) -> dict[int, float]:
    return {entry["step"]: entry[key] for entry in trainer.state.log_history if key in entry}


def train_save_and_resume(*, output_dir: str) -> dict:
    """An uninterrupted checkpointed run, its export, and a run resumed from its step-4 checkpoint.

    ``output_dir`` is shared by every rank. The resumed run starts from a fresh model and
    optimizer, in an output folder holding only a copy of ``checkpoint-4``, with
    ``resume_from_checkpoint=True``.
    """
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    rows = dist.get_world_size() * PER_DEVICE_BATCH * STEPS_PER_EPOCH
    dataset = _dataset(rows)
    run_dir = os.path.join(output_dir, "run")
    resumed_dir = os.path.join(output_dir, "resumed")
    export_dir = os.path.join(output_dir, "export")

    model, optimizer = _prepared_llama()
    trainer = DMuonTrainer(
        model=model,
        args=_checkpoint_arguments(run_dir),
        train_dataset=dataset,
        optimizers=(optimizer, None),
    )
    trainer.train()
    checkpoints = sorted(os.listdir(run_dir))
    last_checkpoint_files = sorted(os.listdir(os.path.join(run_dir, checkpoints[-1])))
    trainer.save_model(export_dir)
    logits = _eval_logits(model)

    if dist.get_rank() == 0:
        name = f"checkpoint-{RESUME_STEP}"
        shutil.copytree(os.path.join(run_dir, name), os.path.join(resumed_dir, name))
    dist.barrier()
    model, optimizer = _prepared_llama()
    resumed = DMuonTrainer(
        model=model,
        args=_checkpoint_arguments(resumed_dir),
        train_dataset=dataset,
        optimizers=(optimizer, None),
    )
    resumed.train(resume_from_checkpoint=True)
    resumed_logits = _eval_logits(model)

    # The full weights alone (save_only_model checkpoints, load_best_model_at_end) load too.
    model, optimizer = _prepared_llama()
    from_export = DMuonTrainer(
        model=model,
        args=_checkpoint_arguments(os.path.join(output_dir, "unused")),
        optimizers=(optimizer, None),
    )
    from_export._load_from_checkpoint(export_dir)
    return {
        "checkpoints": checkpoints,
        "last_checkpoint_files": last_checkpoint_files,
        "export_files": sorted(os.listdir(export_dir)),
        "losses": _logged(trainer, "loss"),
        "grad_norms": _logged(trainer, "grad_norm"),
        "learning_rates": _logged(trainer, "learning_rate"),
        "logits": logits,
        "resumed_losses": _logged(resumed, "loss"),
        "resumed_grad_norms": _logged(resumed, "grad_norm"),
        "resumed_learning_rates": _logged(resumed, "learning_rate"),
        "resumed_logits": resumed_logits,
        "export_loaded_logits": _eval_logits(model),
    }


# ---- sharded by DMuonTrainer from TrainingArguments(fsdp=...) ------------------------------------


def _fsdp_arguments(
    output_dir: str, fsdp_config: dict | None = None, *, fsdp: bool = True, **overrides
) -> TrainingArguments:
    settings = dict(
        output_dir=output_dir,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        lr_scheduler_type="constant",
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    if fsdp:
        settings.update(fsdp=True, fsdp_config={"fsdp_version": 2, **(fsdp_config or {})})
    settings.update(overrides)
    return TrainingArguments(**settings)


_MUON_FP32 = (
    dmuon.Muon,
    dict(
        lr=MUON_LR,
        adamw_lr=ADAMW_LR,
        ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas"),
    ),
)


def train_with_fsdp_arguments(
    *,
    steps: int,
    per_device_batch: int,
    accumulation: int = 1,
    max_grad_norm: float = 0.0,
    fsdp_config: dict | None = None,
    gradient_checkpointing: bool = False,
    replicas: int = 1,
    launcher_environment: dict[str, str] | None = None,
    fsdp: bool = True,
    bf16: bool = False,
) -> dict:
    """A plain tiny Llama through DMuonTrainer with TrainingArguments(fsdp=...): what the trainer
    made of the model, and the run against the single-process reference. ``replicas`` > 1: HSDP
    through ``parallelism_config``. ``launcher_environment``: no fsdp argument, the FSDP2 config
    in the variables ``accelerate launch`` sets (restored afterwards)."""
    if launcher_environment is not None:
        saved = {name: os.environ.get(name) for name in launcher_environment}
        os.environ.update(launcher_environment)
        try:
            return train_with_fsdp_arguments(
                steps=steps, per_device_batch=per_device_batch, fsdp=False
            )
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    from accelerate import ParallelismConfig

    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    world = dist.get_world_size()
    rows = world * per_device_batch * accumulation
    model = tiny_llama(seed=0)
    output_dir = tempfile.mkdtemp(prefix="dmuon-hf-fsdp-")
    hsdp = {}
    if replicas > 1:
        hsdp["parallelism_config"] = ParallelismConfig(
            dp_replicate_size=replicas, dp_shard_size=world // replicas
        )
    try:
        args = _fsdp_arguments(
            output_dir,
            fsdp_config,
            fsdp=fsdp,
            **hsdp,
            max_steps=steps,
            per_device_train_batch_size=per_device_batch,
            gradient_accumulation_steps=accumulation,
            max_grad_norm=max_grad_norm,
            gradient_checkpointing=gradient_checkpointing,
            bf16=bf16,
        )
        trainer = DMuonTrainer(
            model=model,
            args=args,
            train_dataset=_dataset(rows),
            optimizer_cls_and_kwargs=_MUON_FP32,
        )
        view = dmuon.inspect.view(model)
        units = sorted(
            name for name, module in model.named_modules() if isinstance(module, FSDPModule)
        )
        dtypes = {
            "dedicated_compute": {p.param_dtype for p in view.params.values()},
            "dedicated_reduce": {p.reduce_dtype for p in view.params.values()},
            "masters": {p.master_dtype for p in view.params.values() if p.is_owner},
            "fsdp_compute": {
                module._get_fsdp_state()._mp_policy.param_dtype
                for module in model.modules()
                if isinstance(module, FSDPModule)
            },
            "fsdp_sharded": {p.dtype for p in model.parameters() if p.numel() > 0},
        }
        trainer.train()
        # What save_pretrained gets: the full model on the first rank, keyed by canonical names
        # (no checkpoint-wrapper segments), every parameter of the reference present.
        full = dckpt.get_model_state_dict(model, options=_FULL_ON_FIRST_RANK)
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    reference = _reference_run(steps, rows, max_grad_norm)
    worst = [None]
    if dist.get_rank() == 0:
        expected = dict(reference["model"].named_parameters())
        assert sorted(full) == sorted(expected), sorted(set(full) ^ set(expected))
        worst[0] = max(relative_errors(full, reference["model"]).values())
    dist.broadcast_object_list(worst, src=0)
    return {
        "owner_grid": (view.grid.num_shards, view.grid.num_replicas),
        "dtypes": {key: sorted(str(d) for d in value) for key, value in dtypes.items()},
        "dedicated": sorted(view.params),
        "reshard_after_forward": {b.reshard_after_forward for b in view.boundaries},
        "fsdp_units": units,
        "accelerator_distributed_type": str(trainer.accelerator.distributed_type),
        "losses": [entry["loss"] for entry in history],
        "grad_norms": [entry["grad_norm"] for entry in history],
        "reference": {key: reference[key] for key in ("losses", "grad_norms")},
        "max_weight_error": worst[0],
    }


# ---- resuming on another world size ------------------------------------------------------------

GLOBAL_BATCH = 4  # rows a step over all ranks: the same data whatever the world size


def checkpointed_run_any_world(*, output_dir: str, resume_from: str | None = None) -> dict:
    """Six steps with a checkpoint every two, ``GLOBAL_BATCH // world`` rows per rank, resumed
    from ``resume_from`` if given. Two or more ranks: the plain model sharded by DMuonTrainer from
    TrainingArguments(fsdp=...); one rank (where Trainer refuses fsdp): hand-sharded over a mesh
    of one. Both write the same dmuon_state/, which reshards on load."""
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    world = dist.get_world_size()
    dataset = _dataset(GLOBAL_BATCH * STEPS_PER_EPOCH)
    settings = dict(
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        save_total_limit=2,
        max_steps=CHECKPOINT_STEPS,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        lr_scheduler_type="linear",
    )
    if world > 1:
        trainer = DMuonTrainer(
            model=tiny_llama(seed=0),
            args=_fsdp_arguments(output_dir, **settings),
            train_dataset=dataset,
            optimizer_cls_and_kwargs=_MUON_FP32,
        )
    else:
        model, optimizer = _prepared_llama()
        trainer = DMuonTrainer(
            model=model,
            args=_checkpoint_arguments(output_dir, **settings),
            train_dataset=dataset,
            optimizers=(optimizer, None),
        )
    trainer.train(resume_from_checkpoint=resume_from)
    return {
        "losses": _logged(trainer, "loss"),
        "learning_rates": _logged(trainer, "learning_rate"),
        "logits": _eval_logits(trainer.model),
        "checkpoints": sorted(os.listdir(output_dir)),
    }
