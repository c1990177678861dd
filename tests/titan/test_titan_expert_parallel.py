"""dmuon-titan under torchtitan's expert parallelism on 4 gloo ranks (``expert_parallel_degree``
2 of a ``dp_shard`` of 4, so ``efsdp`` 2; or HSDP, 2 replicas of ``dp_shard`` 2 = ``ep`` 2), with
qwen3's MoE debug model (4 small experts; DeepSeek-V3's too) and a DistMuon recipe: the model's
own ``parallelize`` splits each expert stack ``Shard(0)`` over ``ep``, dmuon owns each slice of
experts on a rank of its EP slot, and the run trains like the single-process reference written
from the recipe (the whole stacks, each expert its own matrix), resumes from torchtitan's
checkpoint bit for bit, and resumes at EP 1 like the EP 2 run."""

import pytest
import torch

from tests.titan.scenarios_titan import (
    EXPERT_PROJECTIONS,
    LAYERS,
    build_error,
    train,
    train_reference,
)
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
# The expert stacks of each model's MoE blocks (DeepSeek-V3's and the Kimi models' block 0 is
# dense).
MOE_LAYERS = {
    "qwen3_moe": range(LAYERS),
    "deepseek_v3": range(1, LAYERS),
    "kimi_k2_5": range(1, LAYERS),
    "moonlight": range(1, LAYERS),
}


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


# The uninterrupted EP 2 run both resume tests compare against, with a checkpoint at step 3.
SAVING = {**EP_JOB, "steps": 6, "checkpoint_folder": "ckpt", "checkpoint_interval": 3}


@pytest.fixture(scope="module")
def uninterrupted(pool4, tmp_path_factory) -> tuple[dict, str]:
    """One 6-step EP 2 run and its checkpoint root, shared by the resume tests."""
    root = str(tmp_path_factory.mktemp("uninterrupted_ep"))
    return pool4.run(train, job_options=SAVING, checkpoint_root=root)[0], root


def assert_resumed_repeats(resumed: dict, run: dict, load_step: int) -> None:
    """``resumed`` (from ``run``'s checkpoint at ``load_step``) repeated its later steps bit for
    bit: their losses and the final weights."""
    assert resumed["first_step"] == load_step + 1
    assert resumed["logged"] == run["logged"][load_step:]
    assert resumed["final"].keys() == run["final"].keys()
    different = [k for k, v in resumed["final"].items() if not torch.equal(v, run["final"][k])]
    assert not different, different


def test_an_expert_parallel_job_resumed_at_step_3_repeats_steps_4_to_6(pool4, uninterrupted):
    run, root = uninterrupted
    resumed = pool4.run(train, job_options={**SAVING, "load_step": 3}, checkpoint_root=root)[0]
    assert_resumed_repeats(resumed, run, load_step=3)


def test_an_expert_parallel_checkpoint_resumes_at_ep_1_like_the_ep_2_run(pool4, uninterrupted):
    # The step-3 checkpoint of EP 2 loads at EP 1 (each rank's stacks whole again, dmuon's
    # expert pieces re-cut over dp_shard 4); steps 4-6 then differ from EP 2's by the order of
    # the float sums only (token dispatch, gradient reductions), bounded as the reference tests
    # bound them. Measured: losses 1e-6, weights 8e-4, expert updates 0.4% relative.
    run, root = uninterrupted
    resumed = pool4.run(
        train, job_options={**SAVING, "ep": 1, "load_step": 3}, checkpoint_root=root
    )[0]
    assert resumed["first_step"] == 4
    steps_4_to_6 = {"logged": run["logged"][3:], "final": run["final"]}
    assert_like_reference(
        resumed, steps_4_to_6, weights=1e-2, losses=1e-3, matrix_updates=BF16_UPDATE_TOLERANCE
    )


def test_an_expert_parallel_checkpoint_resumes_on_two_ranks_like_the_four_rank_run(
    pool2, uninterrupted
):
    # Another world size: the step-3 checkpoint of EP 2 on 4 ranks loads on 2 ranks at EP 1
    # (dp_shard 2, the same global batch): steps 4-6 differ from the 4-rank run's by the order
    # of the float sums only, bounded as the EP 1 resume above.
    run, root = uninterrupted
    two_ranks = {"ep": 1, "dp_shard": 2, "local_batch": 2 * SAVING["local_batch"], "load_step": 3}
    resumed = pool2.run(train, job_options={**SAVING, **two_ranks}, checkpoint_root=root)[0]
    assert resumed["first_step"] == 4
    steps_4_to_6 = {"logged": run["logged"][3:], "final": run["final"]}
    assert_like_reference(
        resumed, steps_4_to_6, weights=1e-2, losses=1e-3, matrix_updates=BF16_UPDATE_TOLERANCE
    )


def test_a_moe_job_with_tensor_parallelism_at_ep_1_is_refused_naming_the_sharded_stack(pool4):
    # The other half of the EP-with-TP refusal's fix (check_supported, test_titan_switch.py):
    # at EP 1, torchtitan shards each expert stack over tp, which dmuon does not dedicate; the
    # build stops on every rank with the core's message, naming the stack and the way out.
    job = {**EP_JOB, "ep": 1, "tp": 2, "dp_shard": 2}
    for message in pool4.run(build_error, job_options=job):
        assert "layers.0.moe.routed_experts.inner_experts.w1_EFD" in message
        assert "placements (Shard(dim=1),)" in message
        assert "tensor-parallel expert stacks are not dedicated yet" in message
        assert "leave it out of the predicate" in message
