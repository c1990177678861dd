"""DMuonTrainer in one process (no torch.distributed): training, and every construction check."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TrainingArguments

import dmuon
from dmuon_hf import DMuonTrainer, default_predicate
from tests.hf.tiny_models import tiny_llama, token_batch


def dedicated_llama():
    model = tiny_llama()
    dmuon.dedicate_params(model, None, default_predicate(model))
    return model


def training_arguments(tmp_path, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        max_steps=5,
        per_device_train_batch_size=4,
        lr_scheduler_type="constant",
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


def dataset(rows: int = 4):
    return [{"input_ids": row, "labels": row} for row in token_batch(rows, seq_len=16)]


def test_single_process_training_lowers_the_loss_and_leaves_the_model_unwrapped(tmp_path):
    model = dedicated_llama()
    trainer = DMuonTrainer(
        model=model,
        args=training_arguments(tmp_path),
        train_dataset=dataset(),
        optimizers=(dmuon.Muon(model, lr=0.02, adamw_lr=1e-2), None),
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 5 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < 0.9 * losses[0]
    assert trainer.model_wrapped is model and trainer.model is model


def test_optimizer_other_than_dmuon_muon_is_rejected(tmp_path):
    model = dedicated_llama()
    with pytest.raises(ValueError) as error:
        DMuonTrainer(
            model=model,
            args=training_arguments(tmp_path),
            optimizers=(torch.optim.AdamW(model.parameters()), None),
        )
    assert str(error.value) == (
        "DMuonTrainer needs optimizers=(dmuon.Muon(model, ...), scheduler_or_None), got "
        "optimizers[0]=AdamW. Build the optimizer yourself: "
        "optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)."
    )


def test_muon_built_on_another_model_is_rejected(tmp_path):
    model, other = dedicated_llama(), dedicated_llama()
    with pytest.raises(ValueError, match="built on another model than the one passed as model="):
        DMuonTrainer(
            model=model, args=training_arguments(tmp_path), optimizers=(dmuon.Muon(other), None)
        )


def test_model_without_dedicate_params_is_rejected_with_the_core_message(tmp_path):
    with pytest.raises(ValueError, match=r"call dmuon.dedicate_params\(model, mesh, predicate\)"):
        DMuonTrainer(model=tiny_llama(), args=training_arguments(tmp_path))


def test_model_init_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="needs the prepared model itself"):
        DMuonTrainer(model_init=tiny_llama, args=training_arguments(tmp_path))


def test_checkpoint_saving_is_rejected_with_the_fix(tmp_path):
    model = dedicated_llama()
    with pytest.raises(ValueError) as error:
        DMuonTrainer(
            model=model,
            args=training_arguments(tmp_path, save_strategy="steps"),
            optimizers=(dmuon.Muon(model), None),
        )
    assert str(error.value) == (
        "DMuonTrainer: save_strategy='steps' is not supported: saving a dmuon model's "
        "checkpoint through Trainer is not implemented yet. Pass "
        "TrainingArguments(..., save_strategy='no')."
    )


def test_missing_training_arguments_are_rejected(tmp_path):
    model = dedicated_llama()
    with pytest.raises(ValueError, match="needs TrainingArguments with save_strategy='no'"):
        DMuonTrainer(model=model, optimizers=(dmuon.Muon(model), None))


def test_torch_compile_argument_is_rejected(tmp_path):
    model = dedicated_llama()
    with pytest.raises(ValueError, match=r"torch_compile=True\) is not supported"):
        DMuonTrainer(
            model=model,
            args=training_arguments(tmp_path, torch_compile=True),
            optimizers=(dmuon.Muon(model), None),
        )


def test_model_on_another_device_than_training_is_rejected_instead_of_moved(tmp_path):
    model = dedicated_llama()
    trainer = DMuonTrainer(
        model=model, args=training_arguments(tmp_path), optimizers=(dmuon.Muon(model), None)
    )
    with pytest.raises(ValueError) as error:
        trainer._move_model_to_device(model, torch.device("meta"))
    assert str(error.value) == (
        "DMuonTrainer: the model has tensors on ['cpu'] but TrainingArguments put training on "
        "meta. Move the model to meta before dmuon.dedicate_params and fully_shard "
        "(DMuonTrainer never moves it)."
    )


def test_fsdp_training_argument_is_rejected(tmp_path):
    model = dedicated_llama()
    with pytest.raises(ValueError) as error:
        DMuonTrainer(
            model=model,
            args=training_arguments(tmp_path, fsdp=True),
            optimizers=(dmuon.Muon(model), None),
        )
    assert str(error.value) == (
        "DMuonTrainer: TrainingArguments(fsdp=True) would shard the model again. Remove "
        "fsdp/fsdp_config: call fully_shard yourself after dmuon.dedicate_params."
    )
