"""dmuon on tensor-parallel models: matrices that ``parallelize_module`` made into DTensors.

The tiny decoder is parallelized with torch's plans on the "tp" dim of a named mesh and trained
4 steps on gloo (the first step, steady ones, and the momentum and HSDP publish carried between
steps); every weight (dedicated TP chunks gathered, FSDP2's parameters) must stay within
FP32_TOLERANCE of the single-process reference (fp32 Newton-Schulz), on every rank. See
[Note: tensor-parallel matrices] in ``dmuon.tp`` for what moves where. Checkpoints across TP and
1-D layouts: ``test_checkpoint.py``.
"""

from __future__ import annotations

import pytest

from tests.distributed.scenarios_tensor_parallel import (
    count_tensor_parallel_step,
    misplaced_tp_parameter_errors,
    nan_in_one_tp_chunk_is_skipped_everywhere,
    train_ddp_tensor_parallel,
    train_tensor_parallel,
    unnamed_tp_mesh_error,
)
from tests.distributed.test_protocol import FP32_TOLERANCE, assert_matches_reference, message_entry


def test_tp2_trains_like_the_single_process_reference(pool2):
    results = pool2.run(train_tensor_parallel, dp=1, tp=2)
    assert_matches_reference(results, FP32_TOLERANCE)
    for result in results:
        assert result["tp_ranks"] == [0, 1] and result["num_tp"] == 2
        # The unsharded parameters the model computes with are DTensors, as parallelize_module
        # made them.
        assert all(result["is_dtensor"].values())
    # Owners spread over the TP slots: both TP ranks run Newton-Schulz for some layer.
    assert {owner[2] for owner in results[0]["owners"].values()} == {0, 1}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["z3", "z2"])
def test_dp2_x_tp2_trains_like_the_single_process_reference(
    pool4, sequence_parallel, reshard_after_forward
):
    # tp-sp: SequenceParallel norms, a vocabulary-parallel embedding and head around the
    # dedicated projections.
    results = pool4.run(
        train_tensor_parallel,
        dp=2,
        tp=2,
        sequence_parallel=sequence_parallel,
        reshard_after_forward=reshard_after_forward,
    )
    assert_matches_reference(results, FP32_TOLERANCE)
    assert [result["tp_ranks"] for result in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert {tuple(owner) for owner in results[0]["owners"].values()} <= {
        (shard, 0, tp) for shard in range(2) for tp in range(2)
    }


def test_two_steps_without_a_forward_match_the_reference(pool4):
    results = pool4.run(train_tensor_parallel, dp=2, tp=2, two_steps_without_forward=True)
    assert_matches_reference(results, FP32_TOLERANCE)


def test_3d_replicate_shard_tp_mesh_trains_like_the_reference_and_sync_equals_async(pool8):
    asynchronous = pool8.run(train_tensor_parallel, dp=4, tp=2, replicas=2)
    synchronous = pool8.run(train_tensor_parallel, dp=4, tp=2, replicas=2, replicate_async=False)
    assert_matches_reference(asynchronous, FP32_TOLERANCE)
    assert [r["losses"] for r in asynchronous] == [r["losses"] for r in synchronous]


def test_ddp2_x_tp2_trains_like_the_single_process_reference(pool4):
    results = pool4.run(train_ddp_tensor_parallel, dp=2, tp=2)
    assert_matches_reference(results, FP32_TOLERANCE)


def test_a_tp_model_on_an_unnamed_mesh_raises_the_named_mesh_error_with_the_fix(pool2):
    for message in pool2.run(unnamed_tp_mesh_error):
        assert message.startswith("DMuon requires named DeviceMesh for TP detection")
        assert 'mesh_dim_names=("dp", "tp")' in message


def test_bytes_moved_per_step_equal_the_protocol_on_dp2_x_tp2(pool4):
    # Over dp, each TP rank runs the 1-D protocol on its chunks: under Z3 a rank receives the
    # chunks the other dp rank owns twice (forward, backward) and sends their gradients (+ one
    # flag each) once. Over tp, each
    # TP-sharded matrix's padded chunk goes from every TP rank of its owner to its runner (fp32
    # Muon input) and back (fp32 Newton-Schulz output here).
    results = pool4.run(count_tensor_parallel_step, dp=2, tp=2)
    for result in results:
        assert result["broadcast_received"] == 2 * 4 * sum(result["received_numels"])
        assert result["reduce_sent"] == 4 * sum(message_entry(n) for n in result["received_numels"])
        assert result["gather_sent"] == 4 * sum(result["exchanged_padded_numels"])
        assert result["scatter_received"] == 4 * sum(result["exchanged_padded_numels"])
        assert result["gathers"] == len(result["runners"])
    assert sum(bool(result["exchanged_padded_numels"]) for result in results) == 4


def test_tp_parameters_dmuon_cannot_take_raise_naming_the_parameter_and_the_fix(pool2):
    for messages in pool2.run(misplaced_tp_parameter_errors):
        over_dp, two_dims, partial = messages["over_dp"], messages["two_dims"], messages["partial"]
        assert "q_proj.weight is a DTensor over the data-parallel mesh dims ['dp']" in over_dp
        assert "parallelize_module(model, mesh['tp'], plan), then dedicate_params" in over_dp
        assert "on the 2-D mesh ('tp', 'cp'); dmuon supports one tensor-parallel dim" in two_dims
        assert "placed Partial(sum)" in partial
        assert "Shard(dim) (ColwiseParallel, RowwiseParallel) or Replicate()" in partial


def test_clip_grad_norm_counts_each_tp_chunk_once_and_clips_like_the_reference(pool4):
    # max_norm well below the gradient norm: every step is clipped, so a chunk counted on one TP
    # rank only (or a plain matrix counted twice) changes the parameters.
    results = pool4.run(train_tensor_parallel, dp=2, tp=2, clip_max_norm=0.05, steps=4)
    assert_matches_reference(results, FP32_TOLERANCE)


def test_clip_grad_norm_on_ddp_x_tp_counts_the_chunks_ddp_holds_as_plain_tensors(pool4):
    # The sequence-parallel plan shards the embedding and the head, which stay with DDP as
    # plain local chunks: each must count as its TP chunk, not as a replicated tensor.
    results = pool4.run(
        train_ddp_tensor_parallel, dp=2, tp=2, sequence_parallel=True, clip_max_norm=0.05, steps=3
    )
    assert_matches_reference(results, FP32_TOLERANCE)


def test_a_nan_in_one_tp_chunk_skips_the_step_on_every_rank(pool4):
    for result in pool4.run(nan_in_one_tp_chunk_is_skipped_everywhere):
        assert result == {"unchanged": True, "warned": True}
