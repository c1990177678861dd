"""The gloo worker pool: runs scenarios on every rank, reports failures, survives hangs and crashes."""

import sys
import time

import pytest
import torch

from tests.distributed import scenarios_pool
from tests.distributed.pool import (
    SCENARIOS_PER_WORKER_LIFE,
    ScenarioError,
    ScenarioTimeout,
    WorkerCrash,
    WorkerPool,
    scenario_address,
)


def test_every_rank_runs_the_scenario_in_a_one_thread_gloo_group(pool2):
    setups = pool2.run(scenarios_pool.report_setup)
    assert [setup["rank"] for setup in setups] == [0, 1]
    for setup in setups:
        assert setup["world_size"] == 2
        assert setup["backend"] == "gloo"
        assert setup["num_threads"] == 1
        assert setup["pg_timeout_s"] == pool2.pg_timeout_s
        assert setup["master_addr"] == "127.0.0.1"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_fork_server_runs_one_thread_after_its_preload(pool2):
    # A thread alive in the server at a fork (one that holds a lock, say) would be missing from
    # every worker with its lock still held: see [Note: forked workers] in pool.py.
    threads = pool2.run(scenarios_pool.fork_server_threads)[0]
    assert len(threads) == 1, f"the fork server runs threads {threads}"


def test_results_come_back_in_rank_order_and_collectives_work(pool4):
    assert pool4.run(scenarios_pool.sum_of_ranks) == [6.0] * 4


def test_a_scenario_can_be_named_by_module_and_function(pool2):
    assert pool2.run("tests.distributed.scenarios_pool:sum_of_ranks") == [1.0, 1.0]


def test_every_scenario_starts_from_the_seed_it_is_given(pool2):
    first, again, other_seed = (pool2.run(scenarios_pool.random_draw, seed=s) for s in (0, 0, 1))
    torch.manual_seed(0)
    expected = torch.rand(3)
    for rank in range(2):
        assert torch.equal(first[rank], expected)
        assert torch.equal(again[rank], expected)
        assert not torch.equal(other_seed[rank], expected)


def test_an_exception_reports_every_failing_rank_with_its_traceback_and_output(pool4):
    with pytest.raises(ScenarioError) as failure:
        pool4.run(scenarios_pool.raise_on_ranks, ranks=[1, 3], message="bad input")
    message = str(failure.value)
    assert "raised on ranks [1, 3]" in message
    for rank in (1, 3):
        assert f"--- rank {rank} ---" in message
        assert f"ValueError: bad input (rank {rank})" in message
        assert f"rank {rank} is about to check its input" in message
    assert "ValueError: bad input (rank 0)" not in message
    assert sorted(failure.value.rank_reports) == [1, 3]
    assert "Traceback" in failure.value.rank_reports[1]
    # The pool is usable again right away.
    assert pool4.run(scenarios_pool.sum_of_ranks) == [6.0] * 4


def test_worker_output_of_a_passing_scenario_goes_to_the_test_stdout(pool2, capsys):
    pool2.run(scenarios_pool.print_line, text="hello")
    captured = capsys.readouterr().out
    assert "hello from rank 0" in captured
    assert "hello from rank 1" in captured


def test_a_collective_issued_by_one_rank_fails_at_the_deadline_and_the_pool_recovers():
    with WorkerPool(2) as pool:  # its own, so that only the failure can replace its workers
        pool.run(scenarios_pool.sum_of_ranks)
        with pytest.raises(
            ScenarioTimeout, match="still running at the deadline on ranks"
        ) as failure:
            pool.run(scenarios_pool.only_rank_zero_all_reduces, deadline_s=3)
        assert 0 in failure.value.rank_reports
        assert pool.run(scenarios_pool.sum_of_ranks) == [1.0, 1.0]
        assert pool.generation == 2


def test_a_collective_issued_by_one_rank_raises_once_the_group_timeout_passes(pool2):
    with pytest.raises(ScenarioError, match=r"raised on ranks \[0\]") as failure:
        pool2.run(scenarios_pool.only_rank_zero_all_reduces_on_short_timeout_group, timeout_s=1)
    assert not isinstance(failure.value, ScenarioTimeout)
    assert (
        "Timed out" in failure.value.rank_reports[0]
        or "timeout" in failure.value.rank_reports[0].lower()
    )
    assert pool2.run(scenarios_pool.sum_of_ranks) == [1.0, 1.0]


def test_a_rank_blocked_outside_collectives_is_killed_at_the_deadline(pool2):
    with pytest.raises(ScenarioTimeout):
        pool2.run(scenarios_pool.block_forever_on_rank, rank=1, deadline_s=2)
    assert pool2.run(scenarios_pool.sum_of_ranks) == [1.0, 1.0]


def test_a_dying_worker_is_reported_with_its_exit_code_and_replaced(pool2):
    with pytest.raises(WorkerCrash, match=r"processes died: rank -> exit code \{1: 7\}"):
        pool2.run(scenarios_pool.exit_on_rank, rank=1, exit_code=7)
    assert pool2.run(scenarios_pool.sum_of_ranks) == [1.0, 1.0]


def test_a_segfaulting_worker_is_reported_with_the_signal_and_its_python_stack(pool2):
    with pytest.raises(WorkerCrash) as failure:
        pool2.run(scenarios_pool.segfault_on_rank, rank=1)
    message = str(failure.value)
    assert "processes died: rank -> exit code {1: -11 (SIGSEGV)}" in message
    # faulthandler's report, written by the dying worker into its log, names the scenario's line.
    assert "Fatal Python error: Segmentation fault" in message
    assert "in segfault_on_rank" in message
    assert pool2.run(scenarios_pool.sum_of_ranks) == [1.0, 1.0]


def test_a_2x2_device_mesh_broadcasts_within_each_subgroup(pool4):
    received = pool4.run(scenarios_pool.broadcast_along_each_mesh_dim)
    # Mesh [[0, 1], [2, 3]]: "shard" groups are rows {0,1} {2,3}, "replicate" columns {0,2} {1,3}.
    assert [r["shard"] for r in received] == [0.0, 0.0, 2.0, 2.0]
    assert [r["replicate"] for r in received] == [0.0, 1.0, 0.0, 1.0]


def test_workers_are_replaced_before_their_process_groups_pile_up():
    with WorkerPool(2) as pool:
        counts = [
            pool.run(scenarios_pool.new_groups_then_count, count=1)[0]
            for _ in range(SCENARIOS_PER_WORKER_LIFE + 1)
        ]
        assert pool.generation == 2
    # The default group and one more a scenario, until the next life starts with the default.
    assert counts == [*range(2, SCENARIOS_PER_WORKER_LIFE + 2), 2]


def test_an_idle_pool_stops_its_workers_and_starts_new_ones_for_the_next_scenario():
    with WorkerPool(2, stop_when_idle_s=0.5) as pool:
        assert pool.run(scenarios_pool.sum_of_ranks) == [1.0, 1.0]
        give_up = time.monotonic() + 30
        while "running" in repr(pool) and time.monotonic() < give_up:
            time.sleep(0.1)
        assert "stopped" in repr(pool)
        assert pool.run(scenarios_pool.sum_of_ranks) == [1.0, 1.0]
        assert pool.generation == 2


def test_scenarios_that_workers_cannot_import_are_refused_with_the_fix():
    def nested():
        return None

    with pytest.raises(ValueError, match="define it at the top level of a module under tests/"):
        scenario_address(nested)
    with pytest.raises(ValueError, match="is not of the form 'module:function'"):
        scenario_address("tests.distributed.scenarios_pool")


def test_arguments_that_cannot_be_pickled_are_refused_before_anything_runs():
    pool = WorkerPool(2)
    with pytest.raises(TypeError, match="cannot be pickled for the workers"):
        pool.run(scenarios_pool.print_line, text=lambda: None)
    assert pool.generation == 0  # nothing was spawned
