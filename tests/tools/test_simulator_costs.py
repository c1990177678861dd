"""``dmuon_tools.costs`` and ``dmuon_tools.timeline``: each formula against a value computed by
hand, and the list scheduler's placing and blame on small timelines."""

from __future__ import annotations

import math

import pytest

from dmuon_tools.costs import (
    ADAMW_BYTES_PER_ELEMENT,
    collective_ms,
    elementwise_ms,
    layer_backward_flops_per_token,
    layer_forward_flops_per_token,
    ns_batch_ms,
    ns_calls,
    ns_time_of_flops,
    owner_ns_ms,
    wire_bytes,
)
from dmuon_tools.machine import Link
from dmuon_tools.timeline import After, Op, Timeline

# 100 GB/s and 10 us a step: 1 GB takes 10 ms.
LINK = Link(bandwidth_gbps=100.0, latency_us=10.0)
GB = 1e9


@pytest.mark.parametrize(
    ("kind", "expected_ms"),
    [
        # (n - 1) alpha + (n - 1)/n B / bw, n = 4: 3 x 0.01 + 0.75 x 10
        ("all_gather", 0.03 + 7.5),
        ("reduce_scatter", 0.03 + 7.5),
        # twice the steps and twice the bytes
        ("all_reduce", 0.06 + 15.0),
        # pipelined along the ring: (n - 1) alpha + B / bw
        ("broadcast", 0.03 + 10.0),
        ("reduce", 0.03 + 10.0),
    ],
)
def test_ring_collectives_cost_what_the_alpha_beta_formula_gives_by_hand(kind, expected_ms):
    assert collective_ms(kind, 1 * GB, 4, LINK) == pytest.approx(expected_ms)


@pytest.mark.parametrize(
    "kind", ["all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce"]
)
def test_a_group_of_one_rank_costs_and_sends_nothing(kind):
    assert collective_ms(kind, 1 * GB, 1, LINK) == 0.0
    assert wire_bytes(kind, 1 * GB, 1) == 0.0


def test_an_owner_broadcast_sends_on_average_what_an_all_gather_of_the_same_tensor_sends():
    # The SPEC's "same bytes as FSDP2": (n - 1)/n B per rank for both.
    for ranks in (2, 8, 64):
        assert wire_bytes("broadcast", GB, ranks) == wire_bytes("all_gather", GB, ranks)
        assert wire_bytes("all_reduce", GB, ranks) == 2 * wire_bytes("reduce_scatter", GB, ranks)


def test_an_unknown_collective_or_group_size_is_refused():
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        collective_ms("gather", GB, 4, LINK)
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        collective_ms("broadcast", GB, 0, LINK)


# Two table points: (1024, 4096) at 0.26 ms and (4096, 4096) at 2.73 ms.
TABLE = {(1024, 4096): 0.26, (4096, 4096): 2.73}
SMALL_FLOPS = 6 * 1024**2 * 4096 + 14 * 1024**3  # ns_cost: 6 n^2 m + 14 n^3
SQUARE_FLOPS = 20 * 4096**3


def test_newton_schulz_time_is_the_table_value_at_a_table_shape():
    assert ns_batch_ms(TABLE, (1024, 4096), 1) == pytest.approx(0.26)
    assert ns_batch_ms(TABLE, (4096, 4096), 1) == pytest.approx(2.73)


def test_newton_schulz_between_table_points_is_log_log_interpolated_in_flops():
    flops = math.sqrt(SMALL_FLOPS * SQUARE_FLOPS)  # the geometric middle
    assert ns_time_of_flops(TABLE, flops) == pytest.approx(math.sqrt(0.26 * 2.73))


def test_newton_schulz_above_the_table_scales_with_flops_at_the_largest_points_rate():
    assert ns_time_of_flops(TABLE, 3 * SQUARE_FLOPS) == pytest.approx(3 * 2.73)


def test_newton_schulz_below_the_table_follows_the_first_segment():
    slope = math.log(2.73 / 0.26) / math.log(SQUARE_FLOPS / SMALL_FLOPS)
    expected = 0.26 * 0.5**slope
    assert ns_time_of_flops(TABLE, SMALL_FLOPS / 2) == pytest.approx(expected)


def test_a_batch_costs_one_call_of_its_total_flops():
    # 8 x (1024, 4096) in one call: the committed H200 measurement was 1.036 ms against 0.2833 ms
    # for one matrix; the model gives about 1.04 ms from single-matrix points alone.
    h200 = {(1024, 4096): 0.2833, (4096, 4096): 2.6795}
    assert ns_batch_ms(h200, (1024, 4096), 8) == pytest.approx(1.036, rel=0.05)
    assert ns_batch_ms(TABLE, (1024, 4096), 8) == ns_time_of_flops(TABLE, 8 * SMALL_FLOPS)
    assert ns_batch_ms(TABLE, (1024, 4096), 0) == 0.0


def test_batched_calls_follow_dmuons_256_mib_rule():
    # (4096, 14336) in fp16 is 112 MiB: two a call. 12 matrices -> six calls of two.
    assert list(ns_calls(12, 4096 * 14336)) == [2] * 6
    # 48 of 11.5 M elements (22 MiB): at most 11 a call -> 5 calls of equal runs 10,10,10,10,8.
    assert list(ns_calls(48, 2048 * 5632)) == [10, 10, 10, 10, 8]
    # A matrix larger than a call is a call alone.
    assert list(ns_calls(3, 16384 * 53248)) == [1, 1, 1]
    assert list(ns_calls(0, 4096)) == []


def test_an_owners_newton_schulz_is_the_sum_of_its_batched_calls():
    counts = {(1024, 4096): 3, (4096, 4096): 2}
    expected = ns_batch_ms(TABLE, (1024, 4096), 3) + ns_batch_ms(TABLE, (4096, 4096), 2)
    assert owner_ns_ms(TABLE, counts) == pytest.approx(expected)


def test_elementwise_passes_are_bytes_over_bandwidth():
    # 1e9 elements x 28 bytes at 3,500 GB/s = 8 ms.
    assert elementwise_ms(1e9, ADAMW_BYTES_PER_ELEMENT, 3500.0) == pytest.approx(8.0)


def test_a_layers_flops_per_token_are_two_per_weight_and_causal_attention():
    # 1,000 weights, attention width 64, sequence 128: forward 2,000 + 2 x 128 x 64.
    assert layer_forward_flops_per_token(1000, 64, 128) == 2000 + 2 * 128 * 64
    # backward: two products per forward product, attention 2.5 times its forward
    assert layer_backward_flops_per_token(1000, 64, 128) == 4000 + 2.5 * 2 * 128 * 64


# ---- the list scheduler -------------------------------------------------------------------------


def op(name, resource, ms, deps=(), kind="compute"):
    return Op(name=name, stream=resource, resource=resource, kind=kind, duration_ms=ms, deps=deps)


def test_operations_on_one_resource_run_in_issue_order_and_others_overlap():
    timeline = Timeline()
    first = timeline.add(op("a", "compute", 5.0))
    second = timeline.add(op("b", "compute", 3.0))
    comm = timeline.add(op("c", "nvlink", 4.0, kind="all-gather"))
    assert (timeline.ops[first].start_ms, timeline.ops[second].start_ms) == (0.0, 5.0)
    assert timeline.ops[comm].start_ms == 0.0  # another resource: overlaps


def test_an_operation_waits_for_the_end_or_the_start_of_what_it_depends_on():
    timeline = Timeline()
    compute = timeline.add(op("layer 0", "compute", 10.0))
    prefetch = timeline.add(op("gather 1", "nvlink", 4.0, (After(compute, at_start=True),)))
    reduce = timeline.add(op("reduce 0", "nvlink", 2.0, (After(compute),)))
    assert timeline.ops[prefetch].start_ms == 0.0
    assert timeline.ops[reduce].start_ms == 10.0


def test_a_wait_is_blamed_along_the_chain_that_held_it_back():
    # compute 0 [0, 2); publish [0, 6) on the network; broadcast [6, 9) waits for the publish;
    # compute 1 waits for the broadcast: its 7 ms wait (2 -> 9) is 4 ms of publish, 3 of broadcast.
    timeline = Timeline()
    timeline.add(op("compute 0", "compute", 2.0, kind="forward"))
    publish = timeline.add(op("publish", "network", 6.0, kind="replicate publish"))
    broadcast = timeline.add(
        op("broadcast", "nvlink", 3.0, (After(publish),), kind="shard broadcast")
    )
    timeline.add(op("compute 1", "compute", 1.0, (After(broadcast),), kind="forward"))
    exposed = timeline.exposed_by_kind(0.0, 10.0)
    assert exposed == pytest.approx({"replicate publish": 4.0, "shard broadcast": 3.0})


def test_the_tail_of_a_window_is_blamed_on_what_ends_it():
    timeline = Timeline()
    step = timeline.add(op("step", "compute", 2.0, kind="optimizer"))
    timeline.add(op("publish", "network", 5.0, (After(step),), kind="replicate publish"))
    assert timeline.exposed_by_kind(0.0, 7.0) == pytest.approx({"replicate publish": 5.0})
