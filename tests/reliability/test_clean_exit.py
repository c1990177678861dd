"""A training script that drops its dedicated model and leaves Python the usual way exits with 0.

Once the program drops it, a dedicated model is cyclic garbage (its state and its hooks reference
each other). Freed during the interpreter's teardown, its process groups aborted the process
("terminate called without an active exception", SIGABRT) in about half of the 4-rank runs on
gloo; dmuon collects it at exit instead (see [Note: groups end before the interpreter does] in
``dmuon.mesh``). One real torchrun job: every rank must exit with 0, print no abort, and report
the dropped model freed by dmuon's exit hooks, which is what makes the clean exit certain rather
than lucky (``train_then_exit.py`` says how it checks).
"""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("train_then_exit.py")
RANKS = 4
FREED = "dropped dedicated models alive after dmuon's exit hooks: 0"


def test_a_job_that_drops_its_model_and_exits_the_usual_way_exits_cleanly():
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={RANKS}", str(SCRIPT)]
    job = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    output = job.stdout + job.stderr
    assert job.returncode == 0 and "terminate called" not in output, output[-3000:]
    assert output.count(FREED) == RANKS, (
        f"every rank should report its dropped model freed before the interpreter's teardown "
        f"({FREED!r}):\n{output[-3000:]}"
    )
