"""DMuonAccelerator: Accelerate without the Trainer, an FSDP2 plugin, dmuon. On 2 gloo ranks the
run (with accelerator.clip_grad_norm_ clipping every step) matches the single-process reference;
save_state / load_state resume bit for bit on 2 ranks and to fp32 rounding on 1 rank."""

from __future__ import annotations

import pytest

from tests.hf import scenarios_accelerate
from tests.hf.test_trainer import LOSS_RTOL

STEPS = 3


@pytest.fixture(scope="module")
def saved_run(pool2, tmp_path_factory) -> tuple[list[dict], str]:
    save_dir = str(tmp_path_factory.mktemp("dmuon-accelerate") / "state")
    return pool2.run(scenarios_accelerate.train_clip_save, steps=STEPS, save_dir=save_dir), save_dir


def test_prepare_train_and_clip_match_the_single_process_reference(saved_run):
    results, _ = saved_run
    for result in results:
        reference = result["reference"]
        assert min(reference["grad_norms"]) > scenarios_accelerate.MAX_GRAD_NORM  # every step clips
        assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=LOSS_RTOL)
        assert result["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL)


def test_clip_grad_norm_takes_norm_type_like_dmuon_clip_grad_norm(saved_run):
    results, _ = saved_run
    for result in results:  # the inf-norm of the first step: the largest absolute gradient
        assert result["max_abs_gradient"] == pytest.approx(
            result["reference_max_abs_gradient"], rel=LOSS_RTOL
        )


def test_clipping_part_of_a_dmuon_models_parameters_is_refused(saved_run):
    results, _ = saved_run
    assert results[0]["partial_clip_error"].startswith(
        "DMuonAccelerator.clip_grad_norm_: got part of a dmuon model's parameters"
    )


def test_save_state_writes_dmuon_state_and_not_accelerates_optimizer_file(saved_run):
    results, _ = saved_run
    files = results[0]["saved_files"]
    assert "dmuon_state" in files and "random_states_0.pkl" in files
    assert "optimizer.bin" not in files and "model.safetensors" not in files


def test_load_state_resumes_bit_for_bit_on_the_same_world_size(saved_run, pool2):
    results, save_dir = saved_run
    resumed = pool2.run(scenarios_accelerate.load_and_continue, save_dir=save_dir)
    for before, after in zip(results, resumed):
        assert after["losses"] == before["after_save"]


def test_load_state_resumes_a_two_rank_state_on_one_rank(saved_run, gloo_pool):
    results, save_dir = saved_run
    (resumed,) = gloo_pool(1).run(scenarios_accelerate.load_and_continue, save_dir=save_dir)
    assert resumed["losses"] == pytest.approx(results[0]["after_save"], rel=LOSS_RTOL)
