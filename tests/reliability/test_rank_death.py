"""A rank that dies mid-step makes every other rank fail within the process group's timeout;
none hangs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("rank_death.py")
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
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                *map(str, (SCRIPT, rank, WORLD, port, where, PG_TIMEOUT_S, outputs[rank])),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    logs = []
    for process in processes:
        try:
            logs.append(process.communicate(timeout=FAIL_WITHIN_S + 60)[0])
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            pytest.fail(f"a rank hung after its peer died ({where})")
    assert processes[-1].returncode == 1  # the rank that died
    for rank in range(WORLD - 1):
        assert outputs[rank].exists(), logs[rank]
        report = json.loads(outputs[rank].read_text())
        assert report["error"] is not None, f"rank {rank} trained on without its peer"
        # The first collective to notice may be dmuon's (then named, see test_timeouts) or
        # FSDP2's own; either way it is an error, not a hang.
        assert "Error" in report["error"], report["error"]
        assert report["seconds"] < FAIL_WITHIN_S, report
