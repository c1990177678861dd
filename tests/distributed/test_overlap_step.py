"""``dmuon.Muon(..., overlap_step=True)`` against the plain step, bit for bit, on gloo.

The overlapped step computes each chunk of boundaries' owner step during backward and commits it in
``step()`` only where its inputs are the plain step's; everything else is recomputed. Weights
(owned masters and FSDP2's parameters), momentum buffers and losses must be bit-identical to the
plain step's after several steps, and the counters must show the speculation was used (or, where
it must not be, that it was discarded).
"""

import math

import pytest
import torch

from tests.distributed.scenarios_overlap import plain_and_overlapped, speculation_after_one_backward

STEPS = 4


def assert_bit_identical(results):
    for rank, result in enumerate(results):
        plain, overlapped = result["plain"], result["overlapped"]
        assert plain["losses"] == overlapped["losses"] or all(
            a == b or (math.isnan(a) and math.isnan(b))
            for a, b in zip(plain["losses"], overlapped["losses"])
        ), f"rank {rank}: losses differ"
        for kind in ("owned", "momenta", "others"):
            assert plain[kind].keys() == overlapped[kind].keys(), f"rank {rank}: {kind} keys"
            for name in plain[kind]:
                assert same_bits(plain[kind][name], overlapped[kind][name]), (
                    f"rank {rank}: {kind} {name} differs"
                )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaNs included, which ``torch.equal`` calls different)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def stats(results):
    return [result["overlapped"]["stats"] for result in results]


def owns_muon_matrices(result) -> bool:
    return bool(result["overlapped"]["momenta"])


@pytest.mark.parametrize(
    ("world_size", "replicas", "reshard_after_forward"),
    [(2, 1, True), (2, 1, False), (4, 1, True), (4, 2, True), (4, 2, False)],
    ids=["z3-2", "z2-2", "z3-4", "hsdp-2x2-z3", "hsdp-2x2-z2"],
)
def test_the_overlapped_step_is_the_plain_step_bit_for_bit(
    gloo_pool, world_size, replicas, reshard_after_forward
):
    results = gloo_pool(world_size).run(
        plain_and_overlapped,
        replicas=replicas,
        reshard_after_forward=reshard_after_forward,
        steps=STEPS,
    )
    assert_bit_identical(results)
    for rank, (result, s) in enumerate(zip(results, stats(results))):
        if owns_muon_matrices(result):  # every matrix committed from backward, none redone
            assert s.committed > 0 and s.committed == s.speculated, f"rank {rank}: {s}"
            assert s.recomputed == 0 and s.discarded == 0, f"rank {rank}: {s}"


@pytest.mark.parametrize(("world_size", "replicas"), [(2, 1), (4, 2)], ids=["z3-2", "hsdp-2x2-z3"])
def test_chunks_of_several_layers_are_the_plain_step_bit_for_bit(gloo_pool, world_size, replicas):
    results = gloo_pool(world_size).run(plain_and_overlapped, replicas=replicas, layers=9, steps=3)
    assert_bit_identical(results)
    for rank, (result, s) in enumerate(zip(results, stats(results))):
        if owns_muon_matrices(result):
            assert s.committed > 0 and s.committed == s.speculated, f"rank {rank}: {s}"
            assert s.recomputed == 0 and s.discarded == 0, f"rank {rank}: {s}"


def test_with_direct_newton_schulz_in_fp16(pool2):
    results = pool2.run(plain_and_overlapped, ns_backend="direct", ns_dtype="float16", steps=3)
    assert_bit_identical(results)


def test_the_owner_step_runs_during_backward(pool2):
    results = pool2.run(speculation_after_one_backward)
    for rank, result in enumerate(results):
        assert result["before_step"].speculated == result["owned"] > 0, f"rank {rank}: {result}"
        assert result["before_step"].committed == 0
        assert result["after_step"].committed == result["owned"], f"rank {rank}: {result}"


def test_accumulation_under_no_sync_commits_the_last_backward(pool2):
    results = pool2.run(plain_and_overlapped, micro_batches=3, no_sync=True, steps=STEPS)
    assert_bit_identical(results)
    for s in stats(results):
        assert s.committed == s.speculated > 0 and s.recomputed == 0


def test_accumulation_without_no_sync_recomputes(pool2):
    """Every backward reduces; the first one's speculation is invalidated by the second's sum
    into the masters' gradients, and the later ones do not speculate at all."""
    results = pool2.run(plain_and_overlapped, micro_batches=2, no_sync=False, steps=3)
    assert_bit_identical(results)
    for s in stats(results):
        assert s.committed == 0 and s.discarded == s.speculated > 0 and s.recomputed > 0


def test_a_clip_that_does_not_scale_keeps_the_speculation(pool2):
    results = pool2.run(plain_and_overlapped, clip_max_norm=1e6, steps=STEPS)
    assert_bit_identical(results)
    for s in stats(results):
        assert s.committed == s.speculated > 0 and s.recomputed == 0


def test_a_clip_that_scales_recomputes(pool2):
    results = pool2.run(plain_and_overlapped, clip_max_norm=1e-3, steps=STEPS)
    assert_bit_identical(results)
    for s in stats(results):
        assert s.committed == 0 and s.discarded == s.speculated > 0 and s.recomputed > 0


def test_a_nan_gradient_skips_the_step_and_discards_the_speculation(pool2):
    results = pool2.run(plain_and_overlapped, nan_at_step=1, steps=STEPS)
    assert_bit_identical(results)
    for s in stats(results):
        assert s.discarded > 0 and s.committed > 0
        assert s.committed + s.discarded == s.speculated and s.recomputed == 0


def test_a_nan_gradient_under_nonfinite_ignore_commits_what_the_plain_step_computes(pool2):
    results = pool2.run(plain_and_overlapped, nan_at_step=1, nonfinite="ignore", steps=2)
    assert_bit_identical(results)


def test_an_lr_scheduler_applies_at_commit(pool2):
    results = pool2.run(plain_and_overlapped, lr_schedule=True, steps=STEPS)
    assert_bit_identical(results)
    for s in stats(results):
        assert s.committed == s.speculated > 0


def test_a_momentum_changed_after_backward_recomputes(pool2):
    results = pool2.run(plain_and_overlapped, momentum_change_at_step=1, steps=3)
    assert_bit_identical(results)
    for s in stats(results):
        assert s.discarded > 0 and s.recomputed == s.discarded
