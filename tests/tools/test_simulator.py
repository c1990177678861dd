"""``dmuon_tools.simulator``: the step each system is predicted to take obeys the limits and
orderings the protocol implies (no communication on one rank, Z3 moves 1.5x Z2's bytes, dmuon
moves FSDP2's bytes, the owner step shrinks with owners, HSDP publish hidden or exposed)."""

from __future__ import annotations

import dataclasses

import pytest

from dmuon_tools.costs import ns_batch_ms
from dmuon_tools.machine import H200, Link
from dmuon_tools.model_shapes import PRESETS, DecoderShape
from dmuon_tools.ns_table import shape_key
from dmuon_tools.simulator import (
    SYSTEMS,
    Layout,
    ModelSizes,
    Workload,
    choose_layout,
    simulate,
)

# Per layer: gate, up and down (16.8 M elements) are units alone; q, k, v, o (under dmuon's 5 M
# elements) are packed into one unit: 16 units of 4 layers.
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
WORKLOAD = Workload(seq_len=1024, micro_batch=2)
# Without the host floors, compute is FLOPs at the measured rate only.
NO_FLOORS = dataclasses.replace(H200, layer_host_ms={"fsdp2": 0.0, "dmuon": 0.0})
DMUON_KINDS = ("shard broadcast", "shard reduce")


def run(layout: Layout, *, machine=NO_FLOORS, workload=WORKLOAD, systems=tuple(SYSTEMS)):
    return simulate(SMALL, layout, workload, machine, systems).predictions


def wire(prediction, kinds=None) -> float:
    return sum(
        entry["wire"]
        for kind, entry in prediction.bytes_per_kind.items()
        if kinds is None or kind in kinds
    )


def test_world_size_one_has_no_communication():
    for name, prediction in run(Layout(num_shards=1)).items():
        assert prediction.bytes_per_kind == {}, name
        assert prediction.exposed_comm_ms == 0.0, name
        assert all(span["resource"] == "compute" for span in prediction.spans), name


def test_z3_moves_one_and_a_half_times_z2s_bytes_when_weights_and_gradients_share_a_dtype():
    layout = Layout(num_shards=4)
    same_dtype = Workload(seq_len=1024, micro_batch=2, param_bytes=4, reduce_bytes=4)
    predictions = run(layout, workload=same_dtype, systems=("dmuon-z3", "dmuon-z2"))
    z3, z2 = predictions["dmuon-z3"], predictions["dmuon-z2"]
    # 3(N-1)/N P against 2(N-1)/N P: the weights go out twice, the gradients come back once.
    assert wire(z3, DMUON_KINDS) == pytest.approx(1.5 * wire(z2, DMUON_KINDS))
    broadcast = "shard broadcast"
    assert z3.bytes_per_kind[broadcast]["payload"] == 2 * z2.bytes_per_kind[broadcast]["payload"]
    assert z3.bytes_per_kind["shard reduce"] == z2.bytes_per_kind["shard reduce"]


def test_dmuon_sends_what_fsdp2_sends_for_the_same_model():
    predictions = run(Layout(num_shards=8), systems=("fsdp2-adamw", "dmuon-z3"))
    assert wire(predictions["dmuon-z3"]) == pytest.approx(wire(predictions["fsdp2-adamw"]))


def test_without_replicas_the_synchronous_and_asynchronous_publish_give_the_same_step():
    predictions = run(Layout(num_shards=8), systems=("dmuon-z3", "dmuon-z3-sync"))
    assert predictions["dmuon-z3"].step_ms == predictions["dmuon-z3-sync"].step_ms
    assert "replicate publish" not in predictions["dmuon-z3"].bytes_per_kind


def test_an_asynchronous_publish_is_hidden_behind_the_next_forward_and_a_synchronous_one_is_not():
    layout = Layout(num_shards=2, num_replicas=4, gpus_per_node=2)  # replicas across nodes
    # A layer's forward (about 3 ms) outlasts a layer's publish (about 0.4 ms).
    busy = Workload(seq_len=4096, micro_batch=8)
    predictions = run(layout, workload=busy, systems=("dmuon-z3", "dmuon-z3-sync"))
    asynchronous, synchronous = predictions["dmuon-z3"], predictions["dmuon-z3-sync"]
    publish_ms = sum(
        span["end_ms"] - span["start_ms"]
        for span in synchronous.spans
        if span["kind"] == "replicate publish"
    )
    assert synchronous.exposed_ms["replicate publish"] == pytest.approx(publish_ms)
    # Only the first layer's publish has nothing to hide behind (its forward needs it first).
    first_layer_ms = sum(
        span["end_ms"] - span["start_ms"]
        for span in synchronous.spans
        if span["kind"] == "replicate publish" and span["layer"] == 0
    )
    assert asynchronous.exposed_ms.get("replicate publish", 0.0) <= first_layer_ms + 1e-9
    assert asynchronous.step_ms < synchronous.step_ms


def test_the_timeline_shows_the_previous_steps_publish_running_into_the_step():
    layout = Layout(num_shards=2, num_replicas=4, gpus_per_node=2)
    prediction = run(layout, systems=("dmuon-z3",))["dmuon-z3"]
    carried = [span for span in prediction.spans if span["step"] == -1]
    assert carried and {span["kind"] for span in carried} == {"replicate publish"}
    assert all(span["end_ms"] > 0 for span in carried)
    assert all(span["start_ms"] < prediction.step_ms for span in prediction.spans)


def test_a_publish_longer_than_the_next_forward_delays_it():
    slow_network = dataclasses.replace(
        NO_FLOORS, network=Link(bandwidth_gbps=0.05, latency_us=10.0)
    )
    layout = Layout(num_shards=2, num_replicas=4, gpus_per_node=2)
    prediction = run(layout, machine=slow_network, systems=("dmuon-z3",))["dmuon-z3"]
    assert prediction.exposed_ms["replicate publish"] > 0


def test_the_owner_step_shrinks_as_owners_are_added():
    steps = [
        run(Layout(num_shards=shards), systems=("dmuon-z3",))["dmuon-z3"].optimizer_ms
        for shards in (1, 2, 4, 8)
    ]
    assert steps == sorted(steps, reverse=True)
    # Less than 8x faster: one owner batches all 28 matrices, which fills the GPU better.
    assert steps[-1] < steps[0] / 2


def test_naive_muon_runs_every_matrix_s_newton_schulz_on_every_rank():
    model = ModelSizes.of(SMALL)
    every_matrix = sum(
        ns_batch_ms(NO_FLOORS.reference_ns_ms, shape_key(dims), 1) for layer in model.layers
        for _, dims in layer
    )  # fmt: skip
    for shards in (1, 8):
        naive = run(Layout(num_shards=shards), systems=("naive-muon",))["naive-muon"]
        assert naive.compute_ms["optimizer"] >= every_matrix
    one, eight = (
        run(Layout(num_shards=shards), systems=("naive-muon",))["naive-muon"] for shards in (1, 8)
    )
    # more ranks add the all-gathers and take nothing off the redundant Newton-Schulz
    assert eight.optimizer_ms > one.optimizer_ms
    assert eight.bytes_per_kind["naive all-gather"]["count"] == model.num_matrices


def test_forward_and_backward_compute_does_not_depend_on_the_number_of_ranks():
    compute = {
        shards: run(Layout(num_shards=shards), systems=("fsdp2-adamw",))["fsdp2-adamw"].compute_ms
        for shards in (1, 8)
    }
    for phase in ("forward", "backward", "head"):
        assert compute[1][phase] == pytest.approx(compute[8][phase])


def test_tensor_parallelism_divides_compute_by_the_tp_size():
    plain = run(Layout(num_shards=4), systems=("fsdp2-adamw",))["fsdp2-adamw"]
    tp = run(Layout(num_shards=4, tp=2), systems=("fsdp2-adamw",))["fsdp2-adamw"]
    assert tp.compute_ms["forward"] == pytest.approx(plain.compute_ms["forward"] / 2)
    assert tp.bytes_per_kind["tp all-reduce"]["count"] > 0


def test_under_tp_the_heaviest_owner_s_matrices_meet_on_their_runner_and_go_back():
    simulation = simulate(SMALL, Layout(num_shards=2, tp=2), WORKLOAD, NO_FLOORS, ["dmuon-z3"])
    exchange = simulation.predictions["dmuon-z3"].bytes_per_kind["tp exchange"]
    # a gather and a scatter of its whole matrices, in the 2-byte NS dtype
    assert exchange["count"] == 2
    assert exchange["payload"] == 2 * 2 * simulation.owners.heaviest_numel


def test_the_step_is_never_shorter_than_the_rank_s_own_work():
    for prediction in run(Layout(num_shards=8, num_replicas=2)).values():
        assert prediction.step_ms >= sum(prediction.compute_ms.values()) - 1e-6
        exposed = sum(prediction.exposed_ms.values())
        assert prediction.step_ms == pytest.approx(sum(prediction.compute_ms.values()) + exposed)


def test_memory_per_gpu_splits_fsdp2_state_over_shards_and_dmuon_state_over_every_owner():
    model = ModelSizes.of(SMALL)
    gib = 2**30
    for replicas in (1, 4):
        predictions = run(Layout(num_shards=4, num_replicas=replicas, gpus_per_node=16))
        fsdp2 = predictions["fsdp2-adamw"].memory_gib
        total = model.dedicated_numel + model.other_numel
        assert fsdp2["AdamW state"] == pytest.approx(8 * total / 4 / gib)
        assert fsdp2["FSDP2 sharded params"] == pytest.approx(4 * total / 4 / gib)
    one = run(Layout(num_shards=4), systems=("dmuon-z3",))["dmuon-z3"].memory_gib
    four = run(Layout(num_shards=4, num_replicas=4), systems=("dmuon-z3",))["dmuon-z3"]
    # 4 x more owner slots: each holds about a quarter of the masters
    assert four.memory_gib["dmuon fp32 masters"] < one["dmuon fp32 masters"] / 2
    z2 = run(Layout(num_shards=4), systems=("dmuon-z2",))["dmuon-z2"].memory_gib
    assert z2["gathered weights (peak)"] > one["gathered weights (peak)"]


def test_a_layout_is_told_which_link_each_group_uses():
    in_node = Layout(num_shards=8, num_replicas=4, gpus_per_node=8)
    assert (in_node.link_class("shard"), in_node.link_class("replicate")) == ("nvlink", "network")
    across = Layout(num_shards=16, gpus_per_node=8)
    assert across.link_class("shard") == "network"
    assert Layout(num_shards=2, num_replicas=2, gpus_per_node=8).link_class("replicate") == "nvlink"
    assert Layout(num_shards=2, tp=4, gpus_per_node=8).link_class("shard") == "nvlink"


def test_choose_layout_shards_over_the_smallest_group_where_fsdp2_fits():
    workload = Workload()
    eight_b = choose_layout(PRESETS["llama3-8b"], 64, H200, workload)
    assert (eight_b.num_shards, eight_b.num_replicas) == (8, 8)
    # 70B with AdamW needs more than a node's 8 x 139 GiB of state: two nodes
    seventy_b = choose_layout(PRESETS["llama3-70b"], 64, H200, workload)
    assert (seventy_b.num_shards, seventy_b.num_replicas) == (16, 4)
    assert choose_layout(PRESETS["llama3-8b"], 4, H200, workload).num_shards == 4
    # Nothing smaller fits: every GPU shards.
    assert choose_layout(PRESETS["llama3-70b"], 8, H200, workload).num_shards == 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_shards": 0}, "num_shards must be a positive integer, got 0"),
        ({"num_shards": 2, "tp": 16}, "TP 16 spans more than one node of 8 GPUs"),
        ({"num_shards": 2_000_000}, "2,000,000 ranks, more than the 1,000,000"),
    ],
)
def test_a_bad_layout_is_refused_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


def test_a_mixture_of_experts_model_and_a_config_without_vocabulary_are_refused():
    with pytest.raises(ValueError, match="mixture-of-experts decoder; simulate models dense"):
        ModelSizes.of(PRESETS["mixtral-8x7b"])
    with pytest.raises(ValueError, match='add "vocab_size" to the config'):
        ModelSizes.of(dataclasses.replace(SMALL, vocab_size=None))


def test_an_unknown_system_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown systems \['dmuon-z4'\]; choose from"):
        simulate(SMALL, Layout(num_shards=2), WORKLOAD, H200, ["dmuon-z4"])
