"""A rank that dies mid-step makes every other rank fail within the process group's timeout;
none hangs."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.distributed.pool import worker_context
from tests.reliability import rank_death

WORLD = 3
PG_TIMEOUT_S = 10.0
# Generous for a busy 2-core machine; far below what a hang would take.
FAIL_WITHIN_S = 150.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("where", ["forward", "after-backward"])
def test_a_rank_that_dies_makes_every_other_rank_fail_instead_of_hanging(tmp_path, where):
    port = free_port()
    outputs = [tmp_path / f"rank{rank}.json" for rank in range(WORLD)]
    logs = [tmp_path / f"rank{rank}.log" for rank in range(WORLD)]
    context = worker_context()
    processes = [
        context.Process(
            target=rank_death.main,
            args=(rank, WORLD, port, where, PG_TIMEOUT_S, str(outputs[rank]), str(logs[rank])),
            daemon=True,
        )
        for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    give_up_at = time.monotonic() + FAIL_WITHIN_S + 60
    for process in processes:
        process.join(max(0.0, give_up_at - time.monotonic()))
    if any(process.is_alive() for process in processes):
        for process in processes:
            process.kill()
        pytest.fail(f"a rank hung after its peer died ({where})")

    def log_of(rank: int) -> str:
        return logs[rank].read_text() if logs[rank].exists() else "(no output)"

    assert processes[-1].exitcode == 1, log_of(WORLD - 1)  # the rank that died
    for rank in range(WORLD - 1):
        assert outputs[rank].exists(), log_of(rank)
        report = json.loads(outputs[rank].read_text())
        assert report["error"] is not None, f"rank {rank} trained on without its peer"
        # The first collective to notice may be dmuon's (then named, see test_timeouts) or
        # FSDP2's own; either way it is an error, not a hang.
        assert "Error" in report["error"], report["error"]
        assert report["seconds"] < FAIL_WITHIN_S, report
