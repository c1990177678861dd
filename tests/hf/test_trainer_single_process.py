"""DMuonTrainer in one process (no torch.distributed): training, checkpoints, and every
construction check."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainingArguments

import dmuon
from dmuon_hf import DMuonTrainer, default_predicate
from dmuon_kernels.newton_schulz import NewtonSchulz
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
    with pytest.raises(ValueError, match="needs the model itself"):
        DMuonTrainer(model_init=tiny_llama, args=training_arguments(tmp_path))


def test_save_on_each_node_is_rejected_with_the_fix(tmp_path):
    model = dedicated_llama()
    with pytest.raises(ValueError) as error:
        DMuonTrainer(
            model=model,
            args=training_arguments(tmp_path, save_on_each_node=True),
            optimizers=(dmuon.Muon(model), None),
        )
    assert str(error.value) == (
        "DMuonTrainer: TrainingArguments(save_on_each_node=True) is not supported: every rank "
        "writes its shard into one checkpoint folder and the first rank writes the full model, "
        "so output_dir must be on a filesystem every node shares. Remove save_on_each_node."
    )


def test_a_folder_without_dmuon_state_or_weights_is_rejected_on_resume(tmp_path):
    model = dedicated_llama()
    trainer = DMuonTrainer(
        model=model, args=training_arguments(tmp_path), optimizers=(dmuon.Muon(model), None)
    )
    with pytest.raises(ValueError) as error:
        trainer._load_from_checkpoint(str(tmp_path))
    assert str(error.value) == (
        f"DMuonTrainer: {tmp_path} is not a checkpoint DMuonTrainer wrote: it has neither "
        "dmuon_state/ nor model.safetensors (or model.safetensors.index.json). Pass a "
        "checkpoint-N folder from a DMuonTrainer output_dir."
    )


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


def test_fsdp_training_argument_with_an_already_dedicated_model_is_rejected(tmp_path):
    model = dedicated_llama()
    with pytest.raises(ValueError) as error:
        DMuonTrainer(
            model=model,
            args=training_arguments(tmp_path, fsdp=True),
            optimizers=(dmuon.Muon(model), None),
        )
    assert str(error.value) == (
        "DMuonTrainer: TrainingArguments(fsdp=True) would shard the model again: it is already "
        "dedicated. Pass the plain model and let DMuonTrainer dedicate and shard it, or remove "
        "fsdp/fsdp_config."
    )


# ---- checkpoints --------------------------------------------------------------------------------


def checkpointed_trainer(output_dir, **overrides) -> DMuonTrainer:
    """8 rows, 4 a step: 2 steps an epoch. fp32 Newton-Schulz, so a resume repeats bit for bit."""
    model = dedicated_llama()
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        adamw_lr=1e-2,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
    )
    settings = dict(
        save_strategy="steps", save_steps=3, max_steps=4, lr_scheduler_type="linear", seed=0
    )
    return DMuonTrainer(
        model=model,
        args=training_arguments(output_dir, **{**settings, **overrides}),
        train_dataset=dataset(rows=8),
        eval_dataset=dataset(rows=8),
        optimizers=(optimizer, None),
    )


def logits_of(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=token_batch(2, seq_len=16, seed=1)).logits


def logged_losses(trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def test_single_process_resume_mid_epoch_repeats_the_last_step_and_the_export_loads(tmp_path):
    trainer = checkpointed_trainer(tmp_path / "run")
    trainer.train()
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-3", "checkpoint-4"]
    assert "rng_state.pth" in os.listdir(tmp_path / "run" / "checkpoint-3")
    trainer.save_model(str(tmp_path / "export"))

    resumed = checkpointed_trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))

    assert logged_losses(resumed) == logged_losses(trainer)
    expected = logits_of(trainer.model)
    assert torch.equal(logits_of(resumed.model), expected)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert torch.equal(logits_of(exported), expected)


def test_save_only_model_checkpoint_resumes_the_model_and_starts_the_optimizer_fresh(
    tmp_path, caplog
):
    trainer = checkpointed_trainer(
        tmp_path / "run", save_only_model=True, save_steps=2, max_steps=2
    )
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    files = os.listdir(checkpoint)
    assert "model.safetensors" in files and "trainer_state.json" in files
    assert not {"dmuon_state", "scheduler.pt", "rng_state.pth"} & set(files)

    # max_steps=2: nothing left to train, the model is exactly what the checkpoint holds.
    resumed = checkpointed_trainer(tmp_path / "resumed", max_steps=2)
    with caplog.at_level(logging.WARNING, logger="dmuon_hf"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert f"{checkpoint} has no dmuon_state/ (written with save_only_model=True?)" in caplog.text
    assert torch.equal(logits_of(resumed.model), logits_of(trainer.model))


def test_load_best_model_at_end_loads_the_best_checkpoint_not_the_last_step(tmp_path):
    # A checkpoint and an evaluation per epoch (2 steps). greater_is_better on the eval loss:
    # the best checkpoint is the first one (the loss falls).
    trainer = checkpointed_trainer(
        tmp_path / "run",
        save_strategy="epoch",
        eval_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "run" / "checkpoint-2")
    best = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-2")
    last = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-4")
    assert not torch.equal(logits_of(last), logits_of(best))
    assert torch.equal(logits_of(trainer.model), logits_of(best))


# ---- the FSDP2-arguments way: what is refused before any process group is needed ----------------


def fsdp_arguments(tmp_path, **fsdp_config) -> TrainingArguments:
    return training_arguments(tmp_path, fsdp=True, fsdp_config={"fsdp_version": 2, **fsdp_config})


@pytest.mark.parametrize(
    ("fsdp_config", "message"),
    [
        ({"fsdp_version": 1}, "dmuon_hf: fsdp_version=1 asks for FSDP1; dmuon works with FSDP2 only."),
        ({"cpu_offload": True}, "dmuon_hf: cpu_offload is not supported with dmuon"),
        ({"fp16": True}, "dmuon_hf: fp16 is not supported yet"),
    ],
    ids=["fsdp1", "cpu_offload", "fp16"],
)  # fmt: skip
def test_fsdp_settings_dmuon_does_not_support_are_refused_with_the_fix(
    tmp_path, fsdp_config, message
):
    arguments = {"fp16": fsdp_config.pop("fp16")} if "fp16" in fsdp_config else {}
    args = training_arguments(
        tmp_path, fsdp=True, fsdp_config={"fsdp_version": 2, **fsdp_config}, **arguments
    )
    with pytest.raises(ValueError) as error:
        DMuonTrainer(model=tiny_llama(), args=args)
    assert str(error.value).startswith(message)


def test_a_scheduler_cannot_come_before_the_optimizer_the_trainer_builds(tmp_path):
    with pytest.raises(ValueError, match="a scheduler built beforehand cannot drive it"):
        DMuonTrainer(model=tiny_llama(), args=fsdp_arguments(tmp_path), optimizers=(None, object()))


def test_both_activation_checkpointings_are_refused(tmp_path):
    args = training_arguments(
        tmp_path,
        fsdp=True,
        fsdp_config={"fsdp_version": 2, "activation_checkpointing": True},
        gradient_checkpointing=True,
    )
    with pytest.raises(ValueError, match="would checkpoint every layer twice"):
        DMuonTrainer(model=tiny_llama(), args=args)


def test_an_optimizer_class_other_than_dmuon_muon_is_refused(tmp_path):
    with pytest.raises(ValueError) as error:
        DMuonTrainer(
            model=dedicated_llama(),
            args=training_arguments(tmp_path),
            optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": 1e-3}),
        )
    assert "it must be dmuon.Muon (or a subclass)" in str(error.value)


def test_a_predicate_for_a_model_dedicated_by_hand_is_refused(tmp_path):
    with pytest.raises(
        ValueError, match=r"already dedicated: pass the predicate to dmuon\.dedicate_params"
    ):
        DMuonTrainer(
            model=dedicated_llama(),
            args=training_arguments(tmp_path),
            predicate=default_predicate(tiny_llama()),
        )


def test_a_hand_dedicated_model_takes_its_muon_from_optimizer_cls_and_kwargs(tmp_path):
    model = dedicated_llama()
    trainer = DMuonTrainer(
        model=model,
        args=training_arguments(tmp_path, max_steps=2),
        train_dataset=dataset(),
        optimizer_cls_and_kwargs=(dmuon.Muon, {"lr": 0.01, "adamw_lr": 1e-2}),
    )
    assert isinstance(trainer.optimizer, dmuon.Muon)
    assert dmuon.inspect.model_of(trainer.optimizer) is model
    assert {group["lr"] for group in trainer.optimizer.param_groups} == {0.01}
    trainer.train()
