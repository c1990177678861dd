"""A DMuonTrainer checkpoint resumes on another world size: 2 gloo ranks -> 1 and 1 -> 2.

The same six steps (scenarios_hf.checkpointed_run_any_world: 4 rows a step over all ranks, a
checkpoint every 2) run uninterrupted on one world size and resumed from step 4 on the other.
dmuon_state/ reshards the fp32 masters, FSDP2's shards and the Muon/AdamW state onto the new
layout; the data order is the seeded sampler's, the same on any world size. Steps 5 and 6 and the
final logits must match the uninterrupted run to fp32 rounding (summation order differs).
"""

from __future__ import annotations

import pytest
import torch

from tests.hf import scenarios_hf

RTOL = 1e-4
RESUMED_STEPS = (5, 6)


def resumed_matches(uninterrupted: dict, resumed: dict) -> None:
    assert sorted(resumed["losses"]) == list(range(1, scenarios_hf.CHECKPOINT_STEPS + 1))
    for step in RESUMED_STEPS:
        assert resumed["losses"][step] == pytest.approx(uninterrupted["losses"][step], rel=RTOL)
        assert resumed["learning_rates"][step] == uninterrupted["learning_rates"][step]
    torch.testing.assert_close(resumed["logits"], uninterrupted["logits"], rtol=RTOL, atol=1e-5)


def test_a_two_rank_checkpoint_resumes_on_one_rank(gloo_pool, tmp_path):
    run = gloo_pool(2).run(
        scenarios_hf.checkpointed_run_any_world, output_dir=str(tmp_path / "two")
    )
    assert run[0]["checkpoints"] == ["checkpoint-4", "checkpoint-6"]
    (resumed,) = gloo_pool(1).run(
        scenarios_hf.checkpointed_run_any_world,
        output_dir=str(tmp_path / "one"),
        resume_from=str(tmp_path / "two" / "checkpoint-4"),
    )
    resumed_matches(run[0], resumed)


def test_a_one_rank_checkpoint_resumes_on_two_ranks(gloo_pool, tmp_path):
    (run,) = gloo_pool(1).run(
        scenarios_hf.checkpointed_run_any_world, output_dir=str(tmp_path / "one")
    )
    resumed = gloo_pool(2).run(
        scenarios_hf.checkpointed_run_any_world,
        output_dir=str(tmp_path / "two"),
        resume_from=str(tmp_path / "one" / "checkpoint-4"),
    )
    for rank_result in resumed:
        resumed_matches(run, rank_result)
