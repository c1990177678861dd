"""Scenarios of the kernel switch agreement (``dmuon.kernel_switch``): ranks whose compile jobs
end at different steps, or fail, take the same decision on the same step.

Each rank trains a small FSDP2 model with ``dmuon.Muon`` (its step group spans the ranks) and
owns a ``BackgroundCompile`` whose job is a real child process: one that waits until its rank
writes a release file, or one that exits with a failure status. A CPU machine cannot build the
GPU kernels, so the job's work is not what is tested here (tests/gpu does that); its lifetime,
the states read from the real process, the all-reduce and the gate are.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import dmuon
from dmuon.kernel_switch import at_step_boundary
from dmuon.testing import dedicate_and_shard
from dmuon_kernels import background_compile as background_compile_module
from dmuon_kernels.background_compile import PENDING, BackgroundCompile, job_spec
from dmuon_kernels.newton_schulz import NewtonSchulz
from dmuon_kernels.syrk import readiness
from tests.distributed.models import TinyDecoder, batches, loss_fn, rank_rows

# A job that ends when the file named by its first argument exists (the spec path follows).
WAIT_FOR_RELEASE = (
    "import pathlib, sys, time\n"
    "while not pathlib.Path(sys.argv[1]).exists():\n"
    "    time.sleep(0.01)\n"
)
# A job that fails at once, as a crashed compile would.
FAIL = "import sys; print('compile job: simulated crash of the kernel library'); sys.exit(3)"
JOB_END_TIMEOUT_S = 60.0


def _model_and_optimizer():
    model = TinyDecoder()
    dedicate_and_shard(model, "cpu", 1, True)
    ns = NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas")
    return model, dmuon.Muon(model, ns_backend=ns)


def _wait_until_ended(compiles: BackgroundCompile) -> int:
    """The job's state once its process ended (polled as the boundaries do)."""
    deadline = time.monotonic() + JOB_END_TIMEOUT_S
    while (state := compiles.local_state()) == PENDING:
        if time.monotonic() > deadline:
            raise TimeoutError("the compile job did not end within a minute of its release")
        time.sleep(0.01)
    return state


def switch_steps(release_dir: str, steps: int, failing_rank: int | None = None) -> dict:
    """Train ``steps`` steps; rank r's job ends (is released, and has exited) just before the
    boundary of step r + 1, except ``failing_rank``'s, which fails at once. Returns, per step,
    whether the gate was still closed after its boundary, and the step of the switch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = _model_and_optimizer()
    release = Path(release_dir) / f"rank{rank}"
    script = FAIL if rank == failing_rank else WAIT_FOR_RELEASE
    compiles = BackgroundCompile(command=[sys.executable, "-c", script, str(release)])
    ns = optimizer.newton_schulz
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiles.submit(job_spec(ns, torch.device("cpu"), [(2, 16, 32)]))
            deferred = []
            for step, batch in enumerate(batches(steps, world), 1):
                if step == rank + 1 and rank != failing_rank:
                    release.touch()
                    _wait_until_ended(compiles)
                if rank == failing_rank and step == 1:
                    _wait_until_ended(compiles)
                at_step_boundary(optimizer.step_group, step, compiles)
                deferred.append(readiness.tuning_deferred())
                loss_fn(model, rank_rows(batch, rank, world)).backward()
                optimizer.step()
                optimizer.zero_grad()
        finally:
            compiles.stop()
            readiness.resume_tuning()  # the gate is process-wide: leave it open for what follows
    return {
        "deferred": deferred,
        "switch_step": compiles.switch_step,
        "active": compiles.active,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    }


def step_group_switch_steps(release_dir: str, steps: int, nan_step: int) -> dict:
    """Two models per rank trained in one ``dmuon.StepGroup`` (``nonfinite="skip"``), each
    ``Muon.step`` agreeing at its boundary through the process-wide compile job, as training
    does; rank r's job ends just before step r + 1, and rank 0 puts a NaN in a gradient at
    ``nan_step`` (every rank skips it). Returns the switch step and the skipped steps; a rank
    making one agreement more or less than another would hang here."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step_group = dmuon.StepGroup()
    models, optimizers = [], []
    for _ in range(2):
        model = TinyDecoder()
        dedicate_and_shard(model, "cpu", 1, True)
        ns = NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas")
        models.append(model)
        optimizers.append(dmuon.Muon(model, ns_backend=ns, step_group=step_group, nonfinite="skip"))
    release = Path(release_dir) / f"rank{rank}"
    compiles = background_compile_module.background_compile()
    assert not compiles.active and compiles.switch_step is None, "a job left by another test"
    compiles.command = [sys.executable, "-c", WAIT_FOR_RELEASE, str(release)]
    skipped = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiles.submit(job_spec(optimizers[0].newton_schulz, torch.device("cpu"), []))
            compiles.submit(
                job_spec(optimizers[1].newton_schulz, torch.device("cpu"), [(2, 16, 32)])
            )
            for step, batch in enumerate(batches(steps, world), 1):
                if step == rank + 1:
                    release.touch()
                    _wait_until_ended(compiles)
                for model in models:
                    loss_fn(model, rank_rows(batch, rank, world)).backward()
                if step == nan_step and rank == 0:
                    next(p for p in models[1].parameters() if p.grad is not None).grad.fill_(
                        float("nan")
                    )
                seen = len(caught)
                for optimizer in optimizers:
                    optimizer.step()
                if any("skipped on every rank" in str(w.message) for w in caught[seen:]):
                    skipped.append(step)
                for optimizer in optimizers:
                    optimizer.zero_grad()
            result = {
                "switch_step": compiles.switch_step,
                "active": compiles.active,
                "deferred": readiness.tuning_deferred(),
                "skipped": skipped,
            }
        finally:
            compiles.stop()
            readiness.resume_tuning()
            background_compile_module._process_wide = None  # the next test's process is fresh
    return result
