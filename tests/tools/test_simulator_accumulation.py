"""Gradient accumulation in ``dmuon-tools simulate``: a step of several micro-batches, each
reducing its gradients (the default) or only the last under ``no_sync``, against the figures
one micro-batch gives (compute and collectives counted by hand)."""

from __future__ import annotations

import dataclasses

import pytest

from dmuon_tools.machine import H200, with_training_tflops
from dmuon_tools.memory import GIB
from dmuon_tools.model_shapes import DecoderShape
from dmuon_tools.simulator import Layout, ModelSizes, Workload, accumulation_for, simulate

# 4 layers; the same decoder as test_simulator's.
SMALL = DecoderShape(
    name="small",
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=8000,
)
ONE = Workload(seq_len=1024, micro_batch=2)
NO_FLOORS = dataclasses.replace(H200, layer_host_ms={"fsdp2": 0.0, "dmuon": 0.0})
SYSTEMS = ("fsdp2-adamw", "dmuon-z3", "dmuon-z3-overlap", "naive-muon")


def predictions(layout: Layout, workload: Workload, machine=NO_FLOORS, systems=SYSTEMS):
    return simulate(SMALL, layout, workload, machine, systems).predictions


def count(prediction, kind: str) -> int:
    return prediction.bytes_per_kind.get(kind, {}).get("count", 0)


@pytest.mark.parametrize("no_sync", [False, True])
def test_on_one_gpu_a_step_of_three_micro_batches_is_three_forward_backwards_and_one_step(no_sync):
    plain = ("fsdp2-adamw", "dmuon-z3", "naive-muon")  # the overlapped step: its own test
    one = predictions(Layout(num_shards=1), ONE, systems=plain)
    three = predictions(
        Layout(num_shards=1),
        dataclasses.replace(ONE, accumulation=3, no_sync=no_sync),
        systems=plain,
    )
    for name, single in one.items():
        tripled = three[name]
        for phase in ("forward", "backward", "head"):
            assert tripled.compute_ms[phase] == pytest.approx(3 * single.compute_ms[phase]), name
        assert tripled.optimizer_ms == pytest.approx(single.optimizer_ms), name
        forward_backward = single.step_ms - single.optimizer_ms
        assert tripled.step_ms == pytest.approx(3 * forward_backward + single.optimizer_ms), name


def test_each_micro_batch_reduces_its_gradients_by_default_and_only_the_last_under_no_sync():
    layout = Layout(num_shards=8, num_replicas=2, gpus_per_node=16)
    one = predictions(layout, ONE)
    each = predictions(layout, dataclasses.replace(ONE, accumulation=3))
    last = predictions(layout, dataclasses.replace(ONE, accumulation=3, no_sync=True))
    # FSDP2 per micro-batch: the root and 4 layers gathered in forward, the 4 layers again in
    # backward (9 all-gathers); 4 layers and the root reduce-scattered, then all-reduced across
    # the 2 replicas (5 + 5).
    fsdp2 = one["fsdp2-adamw"]
    assert count(fsdp2, "all-gather") == 9
    assert count(fsdp2, "reduce-scatter") == count(fsdp2, "replicate all-reduce") == 5
    assert (
        count(each["fsdp2-adamw"], "all-gather") == count(last["fsdp2-adamw"], "all-gather") == 27
    )
    for kind in ("reduce-scatter", "replicate all-reduce"):
        assert count(each["fsdp2-adamw"], kind) == 15
        assert count(last["fsdp2-adamw"], kind) == 5
    for kind, scales_without_sync in (
        ("shard broadcast", True),
        ("shard reduce", False),
        ("replicate reduce", False),
    ):
        single = count(one["dmuon-z3"], kind)
        assert single > 0, kind
        assert count(each["dmuon-z3"], kind) == 3 * single, kind
        assert count(last["dmuon-z3"], kind) == (3 if scales_without_sync else 1) * single, kind
    # The optimizer step is the same whatever the micro-batches: one publish, one owner step.
    assert count(each["dmuon-z3"], "replicate publish") == count(
        one["dmuon-z3"], "replicate publish"
    )
    for name in SYSTEMS:
        assert last[name].step_ms <= each[name].step_ms + 1e-9, name


def test_no_sync_holds_every_gradient_unsharded_on_each_rank_until_the_last_reduce():
    layout = Layout(num_shards=8)
    model = ModelSizes.of(SMALL)
    each = predictions(layout, dataclasses.replace(ONE, accumulation=2))
    last = predictions(layout, dataclasses.replace(ONE, accumulation=2, no_sync=True))
    held = 4 * (model.dedicated_numel + model.other_numel) / GIB  # fp32, the reduce dtype
    for name in SYSTEMS:
        assert "accumulated unsharded grads (no_sync)" not in each[name].memory_gib, name
        memory = last[name].memory_gib
        assert memory["accumulated unsharded grads (no_sync)"] == pytest.approx(held), name
        for moment in ("end of forward", "end of backward"):
            assert memory[moment] == pytest.approx(each[name].memory_gib[moment] + held), name
        assert memory["optimizer step"] == pytest.approx(each[name].memory_gib["optimizer step"])


def test_the_overlapped_step_speculates_only_when_the_last_backward_alone_reduces():
    layout = Layout(num_shards=8)
    each = predictions(layout, dataclasses.replace(ONE, accumulation=2))
    last = predictions(layout, dataclasses.replace(ONE, accumulation=2, no_sync=True))
    # Without no_sync the second backward discards the first one's speculation and the later
    # ones do not speculate: the step computes everything, as the plain one does.
    assert each["dmuon-z3-overlap"].step_ms == pytest.approx(each["dmuon-z3"].step_ms)
    assert each["dmuon-z3-overlap"].optimizer_ms == pytest.approx(each["dmuon-z3"].optimizer_ms)
    speculation = [s for s in last["dmuon-z3-overlap"].spans if "(speculative)" in s["name"]]
    assert speculation
    assert not [s for s in each["dmuon-z3-overlap"].spans if "(speculative)" in s["name"]]


def test_tokens_per_step_give_whole_micro_batches_on_every_data_parallel_rank():
    workload = Workload(seq_len=8192, micro_batch=1)
    # 2**20 tokens over 8 ranks of 8192 tokens a micro-batch: 16 micro-batches each.
    assert accumulation_for(2**20, workload, 8) == 16
    assert accumulation_for(4 * 2**20, workload, 64) == 8
    assert accumulation_for(4 * 2**20, workload, 512) == 1
    assert dataclasses.replace(workload, accumulation=16).tokens_per_step(8) == 2**20
    with pytest.raises(ValueError, match=r"one micro-batch on each of the 512 data-parallel ranks "
                                         r"is 4,194,304 tokens"):  # fmt: skip
        accumulation_for(2**20, workload, 512)
    with pytest.raises(ValueError, match=r"use a multiple of it, e.g. 65,536 or 131,072"):
        accumulation_for(100_000, workload, 8)


def test_a_workload_refuses_a_non_positive_accumulation():
    with pytest.raises(
        ValueError, match="workload: accumulation must be a positive integer, got 0"
    ):
        Workload(accumulation=0)


def test_half_the_compute_rate_doubles_forward_and_backward_and_leaves_the_step_alone():
    layout = Layout(num_shards=1)
    full = predictions(layout, ONE)
    half = predictions(
        layout, ONE, machine=with_training_tflops(NO_FLOORS, NO_FLOORS.training_tflops / 2)
    )
    for name in SYSTEMS:
        for phase in ("forward", "backward", "head"):
            assert half[name].compute_ms[phase] == pytest.approx(2 * full[name].compute_ms[phase])
        assert half[name].optimizer_ms == pytest.approx(full[name].optimizer_ms)
    scaled = with_training_tflops(H200, 300.0)
    assert scaled.training_tflops == 300.0 and scaled.name == H200.name
    assert (
        "what-if: 300 TFLOP/s instead of the machine's 416.7" in scaled.sources["training_tflops"]
    )
