"""dmuon-titan under torchtitan's expert parallelism on 4 gloo ranks (``expert_parallel_degree``
2 of a ``dp_shard`` of 4, so ``efsdp`` 2; or HSDP, 2 replicas of ``dp_shard`` 2 = ``ep`` 2), with
qwen3's MoE debug model (4 small experts; DeepSeek-V3's too) and a DistMuon recipe: the model's
own ``parallelize`` splits each expert stack ``Shard(0)`` over ``ep``, dmuon owns each slice of
experts on a rank of its EP slot, and the run trains like the single-process reference written
from the recipe (the whole stacks, each expert its own matrix) and resumes from torchtitan's
checkpoint bit for bit."""

import pytest
import torch

from tests.titan.scenarios_titan import EXPERT_PROJECTIONS, LAYERS, train, train_reference
from tests.titan.test_titan_training import BF16_UPDATE_TOLERANCE, assert_like_reference

EXPERTS, EP = 4, 2
# torchtitan's sparse mesh is ([dp_replicate,] efsdp, ep) with ep varying fastest: rank r holds
# the experts of EP slot r % EP, EXPERTS // EP of them.
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
# The expert stacks of each model's MoE blocks (DeepSeek-V3's block 0 is dense).
MOE_LAYERS = {"qwen3_moe": range(LAYERS), "deepseek_v3": range(1, LAYERS)}


def expert_stacks(model: str) -> list[str]:
    return [
        f"layers.{layer}.moe.routed_experts.inner_experts.{projection}"
        for layer in MOE_LAYERS[model]
        for projection in EXPERT_PROJECTIONS
    ]


def assert_experts_owned_inside_their_ep_slot(run: dict, model: str) -> None:
    """Every expert of every stack has one owner, a rank of the EP slot that holds it."""
    per_slot = EXPERTS // EP
    owned: dict[tuple[str, int], int] = {}
    for rank, slices in enumerate(run["owned_experts"]):
        slot = range(rank % EP * per_slot, (rank % EP + 1) * per_slot)
        for stack, start, stop in slices:
            assert start in slot and stop - 1 in slot, (rank, stack, start, stop)
            for expert in range(start, stop):
                assert (stack, expert) not in owned, (rank, stack, expert)
                owned[(stack, expert)] = rank
    expected = [(stack, e) for stack in expert_stacks(model) for e in range(EXPERTS)]
    assert sorted(owned) == sorted(expected)


@pytest.mark.parametrize(
    ("options", "dedicated"),
    [
        ({}, 2 * 6),  # per block: wqkv, wo, router gate, three stacks
        ({"full_ac": True}, 2 * 6),
        # MLA (wq, wkv_a, wkv_b, wo); block 0 dense (three MLP matrices), block 1 MoE (router,
        # three shared-expert matrices, three stacks), as the 2-rank DeepSeek-V3 recipe test.
        ({"model": "deepseek_v3"}, (4 + 3) + (4 + 1 + 3 + 3)),
        # HSDP: 2 replicas of (dp_shard 2 = ep 2, efsdp 1); the same 4 rows a step.
        ({"dp_replicate": 2, "dp_shard": 2}, 2 * 6),
    ],
    ids=["selective_ac", "full_ac", "deepseek_v3", "hsdp"],
)
def test_expert_parallel_stacks_are_owned_in_their_ep_slot_and_train_like_the_reference(
    pool4, options, dedicated
):
    # The recipe tests' bounds (test_titan_training.py): the experts compute in bfloat16
    # (torchtitan's grouped matmul), so the dedicated matrices are compared by their updates.
    job = {**EP_JOB, **options}
    run = pool4.run(train, job_options=job)[0]
    assert len(run["dedicated"]) == dedicated
    assert_experts_owned_inside_their_ep_slot(run, job["model"])
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
