"""The overlapped owner step in the simulator (``dmuon-z3-overlap``, ``dmuon-z2-overlap``): its
work runs only where the compute is idle during backward, in dmuon's chunks of layers once each
chunk's gradients have landed, and the rest after the backward; nothing of forward or backward
moves."""

from __future__ import annotations

import dataclasses
import math

import pytest

from dmuon.inspect import SPECULATION_CHUNKS, speculation_chunks
from dmuon_tools.machine import Link
from dmuon_tools.simulator import Layout, simulate
from dmuon_tools.timeline import After, Op, Timeline
from tests.tools.test_simulator import NO_FLOORS, SMALL, WORKLOAD

# Slow links: backward waits for its gathers and reduces, so the compute has idle time to fill.
SLOW = dataclasses.replace(NO_FLOORS, nvlink=Link(bandwidth_gbps=20.0, latency_us=10.0))


def predictions(layout, machine=SLOW, systems=("dmuon-z3", "dmuon-z3-overlap")):
    return simulate(SMALL, layout, WORKLOAD, machine, systems)


def compute_spans(prediction, kinds=("forward", "backward", "head")):
    return [
        (s["name"], s["start_ms"], s["end_ms"])
        for s in prediction.spans
        if s["resource"] == "compute" and s["kind"] in kinds
    ]


def speculative(prediction):
    return [s for s in prediction.spans if "(speculative)" in s["name"]]


def test_fill_idle_takes_only_the_idle_time_and_returns_the_rest():
    timeline = Timeline()
    first = timeline.add(Op(name="a", stream="c", resource="gpu", kind="x", duration_ms=2.0))
    timeline.add(Op(name="wait", stream="n", resource="net", kind="y", duration_ms=5.0))
    timeline.add(
        Op(name="b", stream="c", resource="gpu", kind="x", duration_ms=1.0, deps=(After(1),))
    )
    filler = Op(name="f", stream="s", resource="gpu", kind="z", duration_ms=4.0)
    pieces, left = timeline.fill_idle(filler, not_before=1.0)
    placed = [(timeline.ops[i].start_ms, timeline.ops[i].end_ms) for i in pieces]
    assert placed == [(2.0, 5.0)]  # between "a" (ends at 2) and "b" (starts at 5)
    assert left == pytest.approx(1.0)
    assert timeline.ops[first].end_ms == 2.0 and timeline.ops[2].start_ms == 5.0


@pytest.mark.parametrize("shards", [2, 4])
def test_forward_and_backward_do_not_move_and_the_step_is_not_longer(shards):
    result = predictions(Layout(num_shards=shards)).predictions
    plain, overlapped = result["dmuon-z3"], result["dmuon-z3-overlap"]
    before, after = compute_spans(plain), compute_spans(overlapped)
    assert [name for name, _, _ in before] == [name for name, _, _ in after]
    times = [t for _, *both in before for t in both]
    assert [t for _, *both in after for t in both] == pytest.approx(times, abs=1e-6)
    assert speculative(overlapped), "no owner work was placed during backward"
    assert any(
        s["end_ms"] <= max(e for _, _, e in compute_spans(plain)) for s in speculative(overlapped)
    )
    assert overlapped.step_ms <= plain.step_ms
    assert overlapped.exposed_comm_ms < plain.exposed_comm_ms


def test_the_owner_work_is_conserved_and_starts_after_every_layer_of_its_chunk_lands():
    simulation = predictions(Layout(num_shards=4))
    overlapped = simulation.predictions["dmuon-z3-overlap"]
    chunks = {chunk.layers[0]: chunk for chunk in simulation.owners.overlap_chunks}
    work = math.fsum(s["end_ms"] - s["start_ms"] for s in speculative(overlapped))
    assert work == pytest.approx(math.fsum(chunk.ms for chunk in chunks.values()))
    reduces = {}
    for s in overlapped.spans:
        if s["kind"] == "shard reduce" and s["layer"] is not None:
            reduces[s["layer"]] = min(reduces.get(s["layer"], math.inf), s["end_ms"])
    for s in speculative(overlapped):
        landed = max(reduces.get(layer, 0.0) for layer in chunks[s["layer"]].layers)
        assert s["start_ms"] >= landed - 1e-9, s


def test_the_chunks_are_dmuons_cut_of_the_heaviest_owners_layers():
    simulation = predictions(Layout(num_shards=1))  # one owner: every layer is its own
    chunks = simulation.owners.overlap_chunks
    layers = list(range(SMALL.num_hidden_layers))
    expected = speculation_chunks(layers, dict.fromkeys(layers, 1))  # equal layers
    assert [chunk.layers for chunk in chunks] == [
        tuple(layer for layer in layers if expected[layer] == index)
        for index in sorted(set(expected.values()))
    ]
    assert len(chunks) == min(SPECULATION_CHUNKS, SMALL.num_hidden_layers)


def test_under_tensor_parallelism_the_overlapped_step_is_the_plain_one():
    result = predictions(Layout(num_shards=2, tp=2)).predictions
    assert result["dmuon-z3-overlap"].step_ms == result["dmuon-z3"].step_ms
    assert not speculative(result["dmuon-z3-overlap"])


def test_the_overlapped_step_holds_six_bytes_per_owned_element_from_backward_to_the_step():
    simulation = predictions(Layout(num_shards=2))
    plain, overlapped = (
        simulation.predictions[system].memory_gib for system in ("dmuon-z3", "dmuon-z3-overlap")
    )
    held = 6 * simulation.owners.owned_numel_max / 2**30  # fp32 scratch momentum + fp16 output
    assert overlapped["dmuon speculation (backward to step)"] == pytest.approx(held)
    assert overlapped["end of backward"] == pytest.approx(plain["end of backward"] + held)
    assert "dmuon speculation (backward to step)" not in plain
    under_tp = predictions(Layout(num_shards=2, tp=2)).predictions["dmuon-z3-overlap"]
    assert "dmuon speculation (backward to step)" not in under_tp.memory_gib
