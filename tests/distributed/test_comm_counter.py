"""count_collectives() records exactly the c10d ops issued: kind, bytes, root, group, async flag."""

import dataclasses

import pytest

from tests.distributed import scenarios_comm_counter as scenarios
from tests.distributed.comm_counter import (
    Collective,
    broadcast_bytes_received_per_rank,
    count_collectives,
    reduce_bytes_sent_per_rank,
)

FP32, FP64, FP16, BF16, INT64 = 4, 8, 2, 2, 8  # bytes per element


def test_broadcast_and_reduce_on_the_world_are_counted_with_roots_bytes_and_async_flag(pool2):
    logs = pool2.run(scenarios.rooted_collectives_on_the_world)
    for rank, log in enumerate(logs):
        assert log.rank == rank
        assert log.calls == [
            Collective("c10d.broadcast_", "broadcast", 10 * FP32, 1, (0, 1), False, rank),
            Collective("c10d.reduce_", "reduce", 6 * FP64, 0, (0, 1), True, rank),
        ]
    assert broadcast_bytes_received_per_rank(logs) == [10 * FP32, 0]
    assert reduce_bytes_sent_per_rank(logs) == [0, 6 * FP64]
    assert logs[1].broadcast_bytes_sent_as_root() == 10 * FP32
    assert logs[0].reduce_bytes_received_as_root() == 6 * FP64
    assert [log.count() for log in logs] == [2, 2]
    assert [log.total_bytes() for log in logs] == [10 * FP32 + 6 * FP64] * 2


def test_subgroup_collectives_record_global_roots_and_only_on_members(pool4):
    results = pool4.run(scenarios.rooted_collectives_on_a_subgroup)
    logs = [log for log, _ in results]
    assert [value for _, value in results] == [0.0, 3.0, 2.0, 3.0]
    assert logs[0].calls == [] and logs[2].calls == []
    for rank in (1, 3):
        assert logs[rank].calls == [
            Collective("c10d.broadcast_", "broadcast", 5 * FP32, 3, (1, 3), True, rank),
            Collective("c10d.reduce_", "reduce", 4 * BF16, 1, (1, 3), False, rank),
        ]
    assert broadcast_bytes_received_per_rank(logs) == [0, 5 * FP32, 0, 0]
    assert reduce_bytes_sent_per_rank(logs) == [0, 0, 0, 4 * BF16]


def test_device_mesh_subgroups_are_recorded_with_their_global_ranks(pool4):
    logs = pool4.run(scenarios.broadcasts_along_a_device_mesh)
    shard_groups = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    replicate_groups = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    for rank, log in enumerate(logs):
        shard, replicate = log.of_kind("broadcast")
        assert (shard.group_ranks, shard.root, shard.nbytes) == (
            shard_groups[rank],
            shard_groups[rank][0],
            3 * FP32,
        )
        assert (replicate.group_ranks, replicate.root, replicate.nbytes) == (
            replicate_groups[rank],
            replicate_groups[rank][0],
            7 * FP16,
        )
    # Rank 0 roots both; rank 1 roots its column, rank 2 its row; rank 3 roots neither.
    assert broadcast_bytes_received_per_rank(logs) == [0, 3 * FP32, 7 * FP16, 3 * FP32 + 7 * FP16]


def test_all_reduce_all_gather_and_reduce_scatter_count_each_ranks_share(pool4):
    logs = pool4.run(scenarios.gathers_and_scatters)
    for rank, log in enumerate(logs):
        assert [(call.op, call.kind, call.nbytes, call.root) for call in log.calls] == [
            ("c10d.allreduce_", "all_reduce", 8 * FP32, None),
            ("c10d._allgather_base_", "all_gather", 3 * FP32, None),
            ("c10d._reduce_scatter_base_", "reduce_scatter", 2 * FP32, None),
            ("c10d.allgather_", "all_gather", 4 * INT64, None),
        ]
        assert all(call.group_ranks == (0, 1, 2, 3) and call.rank == rank for call in log.calls)
        assert log.total_bytes("all_gather") == 3 * FP32 + 4 * INT64


def test_point_to_point_records_the_peer_as_root(pool4):
    logs = pool4.run(scenarios.point_to_point_ring)
    for rank, log in enumerate(logs):
        send, recv = log.calls
        assert (send.kind, send.nbytes, send.root) == ("send", 12 * FP32, (rank + 1) % 4)
        assert (recv.kind, recv.nbytes, recv.root) == ("recv", 12 * FP32, (rank - 1) % 4)


def test_functional_broadcast_is_counted_once_with_its_global_root(pool4):
    results = pool4.run(scenarios.functional_broadcast_on_a_subgroup)
    logs = [log for log, _ in results]
    assert [received for _, received in results][2:] == [3.0, 3.0]
    assert logs[0].calls == [] and logs[1].calls == []
    for rank in (2, 3):
        assert logs[rank].calls == [
            Collective("_c10d_functional.broadcast", "broadcast", 6 * FP32, 3, (2, 3), True, rank)
        ]
    assert broadcast_bytes_received_per_rank(logs) == [0, 0, 6 * FP32, 0]


def test_collectives_dtensor_issues_inside_an_op_are_counted_too(pool2):
    results = pool2.run(scenarios.dtensor_collectives)
    gather = Collective(
        "_c10d_functional.all_gather_into_tensor", "all_gather", 8 * FP32, None, (0, 1), True, 0
    )
    for rank, (gather_log, add_log, total) in enumerate(results):
        assert total == 32.0
        rank_gather = dataclasses.replace(gather, rank=rank)
        assert gather_log.calls == [rank_gather]
        # gloo has no all_to_all, so DTensor turns Shard(1) into Shard(0) with an all_gather
        # while dispatching the add; then full_tensor() gathers the sum.
        assert add_log.calls == [rank_gather, rank_gather]


def test_counting_outside_a_process_group_is_refused_with_the_fix():
    with (
        pytest.raises(RuntimeError, match="needs an initialised default process group"),
        count_collectives(),
    ):
        pass
