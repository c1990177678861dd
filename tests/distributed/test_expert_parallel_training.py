"""Expert parallelism on gloo, trained with ``dmuon.Muon``: against the reference, and through
checkpoints that move between EP=2, EP=1 and one process.

The tiny MoE decoder with its experts split over ep (``models_moe``) trains with Muon against
the single-process reference on the full model: ep=2 x efsdp=2 on 4 ranks (DTensor stacks and
local stacks), ep=2 with HSDP replicas, and steps on which some experts get no token. Each
owner's experts of every stack go through Newton-Schulz as one batch. A sharded checkpoint of an
EP run resumes on EP=1 and in one process like the uninterrupted run, and one of an EP=1 run
resumes on EP=2, momentum included.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import scenarios_expert_parallel as scenarios
from tests.distributed import scenarios_moe
from tests.distributed.models_moe import DIM, HIDDEN, NUM_EXPERTS

FP32_TOLERANCE = 1e-5  # fp32 Newton-Schulz: only the order of float additions differs
STACKS = ("layers.0.w_in", "layers.0.w_out", "layers.1.w_in", "layers.1.w_out")
EXPERT_SHAPE = (min(DIM, HIDDEN), max(DIM, HIDDEN))


def assert_matches_reference(results):
    for rank, result in enumerate(results):
        worst = max(result["max_errors"])
        assert worst < FP32_TOLERANCE, f"rank {rank}: max relative error {worst:.3e}"


def experts_of(piece: str) -> tuple[int, int]:
    start, stop = piece.split("[")[1][:-1].split(":")
    return int(start), int(stop)


@pytest.mark.parametrize("as_dtensor", [True, False], ids=["dtensor-stacks", "local-stacks"])
def test_ep2_x_efsdp2_on_four_ranks_trains_like_the_single_process_reference(pool4, as_dtensor):
    assert_matches_reference(pool4.run(scenarios.train_against_reference, as_dtensor=as_dtensor))


@pytest.mark.parametrize(
    "options",
    [{"reshard_after_forward": False}, {"overlap_step": True}, {"clip_max_norm": 0.05}],
    ids=["z2", "overlap_step", "clip"],
)
def test_ep2_x_efsdp2_trains_like_the_reference_on_every_path(pool4, options):
    assert_matches_reference(pool4.run(scenarios.train_against_reference, **options))


def test_ep2_with_hsdp_replicas_trains_like_the_reference(pool4):
    assert_matches_reference(pool4.run(scenarios.train_against_reference, replicas=2))


def test_experts_without_tokens_on_some_steps_are_stepped_as_the_reference_steps_them(pool4):
    """Steps 1 and 2 route no token to experts 1, 2 and 5 anywhere: their zero gradient still
    moves them by momentum and weight decay, as in one process."""
    results = pool4.run(
        scenarios.train_against_reference, steps=4, blocked={1: (1, 2, 5), 2: (1, 2, 5)}
    )
    assert_matches_reference(results)


def test_each_owner_orthogonalises_its_experts_of_every_stack_in_one_batch(pool4):
    results = pool4.run(scenarios.train_against_reference, steps=1)
    total = 0
    for rank, result in enumerate(results):
        owned = sum(
            stop - start
            for start, stop in map(experts_of, filter(lambda p: "[" in p, result["owned"]))
        )
        batches = [call for call in result["newton_schulz_calls"] if EXPERT_SHAPE in call]
        assert len(batches) == 1, f"rank {rank}: {result['newton_schulz_calls']}"
        assert batches[0].count(EXPERT_SHAPE) == owned
        total += owned
    assert total == len(STACKS) * NUM_EXPERTS


# ---- checkpoints ----------------------------------------------------------------------------


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_owned_match_full(results, full: dict) -> None:
    """Every owned piece and matrix (and its momentum) of an EP run against a full state."""
    seen = set()
    for result in results:
        for part, expected in (("weights", full["model"]), ("momentum", None)):
            for name, value in result[part].items():
                stack = name.split("[")[0]
                if part == "weights":
                    reference = expected[stack]
                else:
                    reference = full["optim"][stack]["momentum_buffer"]
                if "[" in name:
                    reference = reference[slice(*experts_of(name))]
                assert relative(value, reference) < FP32_TOLERANCE, (part, name)
                seen.add(name)
    assert {name.split("[")[0] for name in seen} >= set(STACKS)


@pytest.fixture(scope="module")
def uninterrupted_ep1(gloo_pool, tmp_path_factory):
    """An EP=1 run on 4 ranks saved midway, and its final full state."""
    path = str(tmp_path_factory.mktemp("ep-checkpoints") / "ep1")
    return path, gloo_pool(4).run(scenarios_moe.save_midway_and_finish, path=path)[0]


@pytest.fixture(scope="module")
def saved_ep2(gloo_pool, tmp_path_factory):
    """An ep=2 x efsdp=2 run saved midway, and each rank's owned state at the end."""
    path = str(tmp_path_factory.mktemp("ep-checkpoints") / "ep2")
    return path, gloo_pool(4).run(scenarios.save_midway_and_finish, path=path)


def test_an_ep2_run_ends_where_the_ep1_run_ends(saved_ep2, uninterrupted_ep1):
    assert_owned_match_full(saved_ep2[1], uninterrupted_ep1[1])


def test_the_full_state_of_an_ep2_run_is_the_full_state_of_the_ep1_run(pool4, uninterrupted_ep1):
    """Weights and momentum gathered from every EP slot's owners into (E, m, n) entries."""
    full = pool4.run(scenarios.train_and_gather_full_state)[0]
    expected = uninterrupted_ep1[1]
    assert full["model"].keys() == expected["model"].keys()
    for key, value in expected["model"].items():
        assert relative(full["model"][key], value) < FP32_TOLERANCE, key
    for stack in STACKS:
        momentum = full["optim"][stack]["momentum_buffer"]
        assert momentum.shape == expected["optim"][stack]["momentum_buffer"].shape
        assert relative(momentum, expected["optim"][stack]["momentum_buffer"]) < FP32_TOLERANCE


def test_an_ep2_checkpoint_resumes_on_ep2_like_the_uninterrupted_run(pool4, saved_ep2):
    path, uninterrupted = saved_ep2
    resumed = pool4.run(scenarios.resume_and_finish, path=path)
    for before, after in zip(uninterrupted, resumed):
        for part in ("weights", "momentum"):
            assert after[part].keys() == before[part].keys()
            for name, value in before[part].items():
                assert torch.equal(after[part][name], value), (part, name)


@pytest.mark.parametrize("world", [4, 2])
def test_an_ep2_checkpoint_resumes_on_ep1_like_the_uninterrupted_run(
    gloo_pool, saved_ep2, uninterrupted_ep1, world
):
    resumed = gloo_pool(world).run(scenarios_moe.resume_and_finish, path=saved_ep2[0])[0]
    expected = uninterrupted_ep1[1]
    for key, value in expected["model"].items():
        assert relative(resumed["model"][key], value) < FP32_TOLERANCE, key
    for stack in STACKS:
        momentum = resumed["optim"][stack]["momentum_buffer"]
        assert relative(momentum, expected["optim"][stack]["momentum_buffer"]) < FP32_TOLERANCE


def test_an_ep2_checkpoint_resumes_in_one_process_like_the_uninterrupted_run(
    saved_ep2, uninterrupted_ep1
):
    resumed = scenarios_moe.resume_and_finish(path=saved_ep2[0], replicas=0)
    expected = uninterrupted_ep1[1]
    for key, value in expected["model"].items():
        assert relative(resumed["model"][key], value) < FP32_TOLERANCE, key
    for stack in STACKS:
        momentum = resumed["optim"][stack]["momentum_buffer"]
        assert relative(momentum, expected["optim"][stack]["momentum_buffer"]) < FP32_TOLERANCE


@pytest.mark.parametrize("replicas", [1, 2], ids=["ep2-x-efsdp2", "ep2-hsdp-2"])
def test_an_ep1_checkpoint_resumes_on_ep2_like_the_uninterrupted_run(
    pool4, uninterrupted_ep1, replicas
):
    path, expected = uninterrupted_ep1
    resumed = pool4.run(scenarios.resume_and_finish, path=path, replicas=replicas)
    assert_owned_match_full(resumed, expected)


def test_an_ep4_checkpoint_whose_ranks_own_their_slots_whole_resumes_on_ep1(
    gloo_pool, tmp_path, uninterrupted_ep1
):
    """ep=4 on 4 ranks: each rank owns all of its EP slot's experts; its sharded entries still
    hold them at their global offsets."""
    path = str(tmp_path / "ep4")
    gloo_pool(4).run(scenarios.save_midway_and_finish, path=path, ep=4)
    resumed = gloo_pool(4).run(scenarios_moe.resume_and_finish, path=path)[0]
    expected = uninterrupted_ep1[1]
    for key, value in expected["model"].items():
        assert relative(resumed["model"][key], value) < FP32_TOLERANCE, key
    for stack in STACKS:
        momentum = resumed["optim"][stack]["momentum_buffer"]
        assert relative(momentum, expected["optim"][stack]["momentum_buffer"]) < FP32_TOLERANCE
