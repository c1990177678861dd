"""The Newton-Schulz counter on gloo: after k optimizer steps every Muon matrix (each expert of
a stack, each row block) shows exactly k on the rank that owns it and 0 on every other, under
gradient accumulation with and without ``no_sync``, the overlapped step, pipeline stages and
expert stacks, also under expert parallelism (issue 42, item 4; [Note: one Newton-Schulz per matrix per step] in
``dmuon.ns_counts``)."""

from __future__ import annotations

import pytest

import dmuon.inspect
from tests.distributed import scenarios_checkpoint
from tests.distributed import scenarios_ns_counter as scenarios

STEPS = 3


def as_tuple(count) -> tuple[int, ...]:
    return count if isinstance(count, tuple) else (count,)


def assert_each_matrix_counted_k_times_by_its_owner_alone(results, steps: int = STEPS) -> None:
    """Per rank: k where the routing table names this rank the owner (of the matrix, or of the
    expert), 0 elsewhere; over the ranks: every matrix k times in all."""
    totals: dict[str, list[int]] = {}
    for result in results:
        rank = result["rank"]
        assert result["counts"].keys() == result["owners"].keys()
        for fqn, count in result["counts"].items():
            owner = result["owners"][fqn]
            if isinstance(owner, tuple):  # an expert stack: one count per expert
                expected = tuple(
                    steps if piece.rank == rank else 0
                    for piece in owner
                    for _ in range(piece.start, piece.stop)
                )
            else:
                expected = (steps if owner == rank else 0,) * len(as_tuple(count))
            assert as_tuple(count) == expected, (rank, fqn, count, owner)
            total = totals.setdefault(fqn, [0] * len(expected))
            totals[fqn] = [a + b for a, b in zip(total, as_tuple(count))]
    assert all(set(total) == {steps} for total in totals.values()), totals


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "reducing-every-micro-batch"])
@pytest.mark.parametrize(("world_size", "replicas"), [(2, 1), (4, 2)], ids=["1d-2", "hsdp-2x2"])
def test_accumulating_four_micro_batches_gives_each_matrix_one_newton_schulz_a_step(
    gloo_pool, world_size, replicas, no_sync
):
    results = gloo_pool(world_size).run(
        scenarios.accumulated, steps=STEPS, replicas=replicas, no_sync=no_sync
    )
    assert_each_matrix_counted_k_times_by_its_owner_alone(results)


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "reducing-every-micro-batch"])
def test_the_overlapped_step_counts_one_newton_schulz_a_step_whether_committed_or_recomputed(
    pool2, no_sync
):
    results = pool2.run(scenarios.accumulated, steps=STEPS, no_sync=no_sync, overlap_step=True)
    assert_each_matrix_counted_k_times_by_its_owner_alone(results)
    stats = [result["stats"] for result in results]
    if no_sync:  # one landing a step: everything speculated is committed
        assert all(s.committed > 0 and s.recomputed == 0 for s in stats), stats
    else:  # each micro-batch lands: the earlier speculations are discarded, never counted
        assert all(s.discarded > 0 for s in stats), stats


def test_row_blocks_count_one_newton_schulz_per_block_a_step(pool2):
    results = pool2.run(scenarios.accumulated, steps=STEPS, row_blocks=True)
    assert_each_matrix_counted_k_times_by_its_owner_alone(results)
    counts = {
        fqn: c for result in results for fqn, c in result["counts"].items() if any(as_tuple(c))
    }
    assert counts["layers.0.q_proj.weight"] == (STEPS,) * 5  # 5 heads of 6 rows
    assert counts["layers.1.up_proj.weight"] == (STEPS, STEPS)


def test_a_step_skipped_for_a_nan_gradient_counts_nothing(pool2):
    results = pool2.run(scenarios.accumulated, steps=STEPS, nan_at_step=1)
    assert_each_matrix_counted_k_times_by_its_owner_alone(results, steps=STEPS - 1)


@pytest.mark.parametrize(("schedule", "dp"), [("1f1b", 2), ("gpipe", 1), ("interleaved_1f1b", 2)])
def test_pipeline_stages_count_one_newton_schulz_a_step_on_each_stage(pool4, schedule, dp):
    per_rank = pool4.run(scenarios.pipelined, steps=STEPS, schedule=schedule, dp=dp)
    # One optimizer per stage: the counts of each stage over the ranks that hold it.
    by_stage: dict[tuple, list[dict]] = {}
    for stages in per_rank:
        for result in stages:
            by_stage.setdefault(tuple(sorted(result["owners"])), []).append(result)
    assert len(by_stage) == 4 // dp * (2 if schedule == "interleaved_1f1b" else 1)
    for results in by_stage.values():
        assert_each_matrix_counted_k_times_by_its_owner_alone(results)


@pytest.mark.parametrize("replicas", [1, 2], ids=["1d-4", "hsdp-2x2"])
def test_each_expert_of_a_stack_counts_one_newton_schulz_a_step_on_its_owner(pool4, replicas):
    results = pool4.run(scenarios.expert_stacks, steps=STEPS, replicas=replicas)
    assert_each_matrix_counted_k_times_by_its_owner_alone(results)
    assert any(isinstance(owner, tuple) for owner in results[0]["owners"].values())


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "reducing-every-micro-batch"])
def test_under_expert_parallelism_each_expert_counts_one_newton_schulz_a_step_on_its_owner_alone(
    pool4, no_sync
):
    """ep=2 x efsdp=2: a rank holds only its EP slot's experts, yet every count and the routing
    table's owners cover all 8 experts of each stack, and each expert is counted on its owner
    (a rank of its EP slot) alone."""
    results = pool4.run(scenarios.expert_parallel, steps=STEPS, no_sync=no_sync)
    assert_each_matrix_counted_k_times_by_its_owner_alone(results)
    for result in results:
        stacks = {fqn: c for fqn, c in result["counts"].items() if len(as_tuple(c)) > 1}
        assert len(stacks) == 4 and all(len(c) == 8 for c in stacks.values()), stacks
        for fqn in stacks:  # EP slot e is ranks e and e + 2 and holds experts [4e, 4e + 4)
            for piece in result["owners"][fqn]:
                assert piece.rank % 2 == piece.start // 4, (fqn, result["owners"][fqn])


def test_a_tensor_parallel_matrix_counts_one_newton_schulz_a_step_on_each_tp_rank_of_its_owner(
    pool4,
):
    # dp 2 x tp 2: the owner's TP ranks each hold a chunk of the master and apply their chunk of
    # the one Newton-Schulz output, so each counts k; the other dp rank's pair counts 0.
    results = pool4.run(scenarios.tensor_parallel, steps=STEPS)
    for fqn, owner in results[0]["owners"].items():
        counted = {r["rank"]: r["counts"][fqn] for r in results if r["counts"][fqn]}
        assert set(counted.values()) == {STEPS}, (fqn, counted)
        assert len(counted) == 2 and owner in counted, (fqn, owner, counted)


def test_in_one_process_every_matrix_counts_every_step_and_a_fresh_optimizer_none():
    model, optimizer = scenarios_checkpoint.build(replicas=0)
    assert set(dmuon.inspect.newton_schulz_counts(optimizer).values()) == {0}
    scenarios_checkpoint.train(model, optimizer, range(STEPS))
    counts = dmuon.inspect.newton_schulz_counts(optimizer)
    assert counts.keys() == {row.fqn for row in optimizer.routing() if row.route == "muon"}
    assert set(counts.values()) == {STEPS}
