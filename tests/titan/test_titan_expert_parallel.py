"""dmuon-titan under torchtitan's expert parallelism (``expert_parallel_degree`` 2 of a
``dp_shard`` of 4, so ``efsdp`` 2) on 4 gloo ranks, with qwen3's MoE debug model (4 small
experts) and a DistMuon recipe: torchtitan's ``ExpertParallel`` splits each expert stack over
``ep``, dmuon owns each slice of experts on a rank of its EP slot, and the run trains like the
single-process reference written from the recipe (the whole stacks, each expert its own matrix)
and resumes from torchtitan's checkpoint bit for bit."""

import pytest
import torch

from tests.titan.scenarios_titan import EXPERT_PROJECTIONS, LAYERS, train, train_reference
from tests.titan.test_titan_training import BF16_UPDATE_TOLERANCE, assert_like_reference

EXPERTS, EP = 4, 2
# torchtitan's sparse mesh is (efsdp, ep) with ep varying fastest: rank r holds the experts of
# EP slot r % EP, EXPERTS // EP of them.
EP_JOB = {
    "model": "qwen3_moe",
    "distmuon_recipe": True,
    "ns": "fp32",
    "ep": EP,
    "dp_shard": 4,
    # 256 tokens a step, as the 2-rank recipe test's (full-rank expert gradients).
    "seq_len": 64,
    "local_batch": 1,
}
STACKS = [
    f"layers.{layer}.moe.routed_experts.inner_experts.{projection}"
    for layer in range(LAYERS)
    for projection in EXPERT_PROJECTIONS
]


def assert_experts_owned_inside_their_ep_slot(run: dict) -> None:
    per_slot = EXPERTS // EP
    owned: dict[tuple[str, int], int] = {}
    for rank, slices in enumerate(run["owned_experts"]):
        slot = range(rank % EP * per_slot, (rank % EP + 1) * per_slot)
        for stack, start, stop in slices:
            assert start in slot and stop - 1 in slot, (rank, stack, start, stop)
            for expert in range(start, stop):
                assert (stack, expert) not in owned, (rank, stack, expert)
                owned[(stack, expert)] = rank
    assert sorted(owned) == sorted((stack, e) for stack in STACKS for e in range(EXPERTS))


@pytest.mark.parametrize("full_ac", [False, True], ids=["selective_ac", "full_ac"])
def test_expert_parallel_stacks_are_owned_in_their_ep_slot_and_train_like_the_reference(
    pool4, full_ac
):
    # The recipe test's bounds (test_titan_training.py): the experts compute in bfloat16
    # (torchtitan's grouped matmul), so the dedicated matrices are compared by their updates.
    run = pool4.run(train, job_options={**EP_JOB, "full_ac": full_ac})[0]
    assert len(run["dedicated"]) == 2 * 6  # per block: wqkv, wo, router gate, three stacks
    assert_experts_owned_inside_their_ep_slot(run)
    reference = train_reference(run)
    assert_like_reference(
        run, reference, weights=1e-2, losses=1e-3, matrix_updates=BF16_UPDATE_TOLERANCE
    )


def test_an_expert_parallel_job_resumed_at_step_3_repeats_steps_4_to_6(pool4, tmp_path):
    saving = {**EP_JOB, "steps": 6, "checkpoint_folder": "ckpt", "checkpoint_interval": 3}
    run = pool4.run(train, job_options=saving, checkpoint_root=str(tmp_path))[0]
    resumed = pool4.run(
        train, job_options={**saving, "load_step": 3}, checkpoint_root=str(tmp_path)
    )[0]
    assert resumed["first_step"] == 4
    assert resumed["logged"] == run["logged"][3:]
    assert resumed["final"].keys() == run["final"].keys()
    different = [k for k, v in resumed["final"].items() if not torch.equal(v, run["final"][k])]
    assert not different, different
