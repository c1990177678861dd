"""The background compile's setting and its jobs in the training process
(``dmuon_kernels.background_compile``; the agreement across ranks is in
tests/distributed/test_kernel_switch.py, the kernels a job builds in tests/gpu).

The setting reads like every other switch: the argument, else ``DMUON_KERNEL_COMPILE``, else
"background", and a wrong value names where it came from, what it was and the choices. A job
that fails for real (the real job module, on a machine without CUDA; a command that cannot
start) leaves cuBLAS in place with one warning that says why and what to do; nothing starts on
the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

from dmuon_kernels import compile_job
from dmuon_kernels._env import KERNEL_COMPILE_ENV, kernel_compile_mode
from dmuon_kernels.background_compile import (
    FAILED,
    PENDING,
    BackgroundCompile,
    job_spec,
    wants_background_compile,
)
from dmuon_kernels.newton_schulz import NewtonSchulz
from dmuon_kernels.status import get_backend_status
from dmuon_kernels.syrk import readiness
from dmuon_kernels.syrk.autotune import SyrkAutotuner, SyrkProblem
from dmuon_kernels.syrk.registry import registry_generation

JOB_END_TIMEOUT_S = 120.0


@pytest.fixture
def open_gate():
    """The gate is process-wide: every test leaves it open, as it found it."""
    assert not readiness.tuning_deferred()
    yield
    readiness.resume_tuning()


def test_the_kernel_compile_mode_is_background_unless_the_argument_or_the_variable_says_wait(
    monkeypatch,
):
    monkeypatch.delenv(KERNEL_COMPILE_ENV, raising=False)
    assert kernel_compile_mode() == "background"
    monkeypatch.setenv(KERNEL_COMPILE_ENV, " Wait ")
    assert kernel_compile_mode() == "wait"
    assert NewtonSchulz().kernel_compile == "wait"
    assert kernel_compile_mode("background") == "background"  # the argument wins
    assert NewtonSchulz(kernel_compile="background").kernel_compile == "background"
    monkeypatch.setenv(KERNEL_COMPILE_ENV, "")
    assert kernel_compile_mode() == "background"


def test_an_unknown_kernel_compile_mode_in_the_environment_names_the_variable_and_the_choices(
    monkeypatch,
):
    monkeypatch.setenv(KERNEL_COMPILE_ENV, "later")
    with pytest.raises(ValueError) as error:
        NewtonSchulz()
    message = str(error.value)
    assert message.startswith(
        "environment variable DMUON_KERNEL_COMPILE='later' is not a kernel compile mode: use "
        "'background' (the default"
    )
    assert "or 'wait' (compile and tune inside the first step" in message


def test_an_unknown_kernel_compile_argument_is_named_with_its_value(monkeypatch):
    monkeypatch.delenv(KERNEL_COMPILE_ENV, raising=False)
    with pytest.raises(ValueError, match=r"^kernel_compile='soon' is not a kernel compile mode"):
        NewtonSchulz(kernel_compile="soon")
    with pytest.raises(ValueError, match=r"or None to read DMUON_KERNEL_COMPILE$"):
        kernel_compile_mode(1)


def test_no_background_compile_is_wanted_on_the_cpu_nor_for_a_named_kernel(monkeypatch):
    monkeypatch.delenv(KERNEL_COMPILE_ENV, raising=False)
    cpu = torch.device("cpu")
    assert not wants_background_compile(NewtonSchulz(), cpu)
    assert not wants_background_compile(NewtonSchulz(kernel="cublas"), cpu)


def _state_once_ended(compiles: BackgroundCompile) -> int:
    deadline = time.monotonic() + JOB_END_TIMEOUT_S
    while (state := compiles.local_state()) == PENDING:
        assert time.monotonic() < deadline, "the compile job did not end within two minutes"
        time.sleep(0.05)
    return state


@pytest.mark.skipif(torch.cuda.is_available(), reason="fails for real only without CUDA")
def test_a_real_job_that_fails_keeps_cublas_and_warns_once_with_its_output(open_gate):
    compiles = BackgroundCompile()  # the real job module
    spec = job_spec(NewtonSchulz(dtype=torch.float16), torch.device("cuda", 0), [(4, 256, 1024)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiles.submit(spec)
        assert readiness.tuning_deferred()  # "auto" runs cuBLAS from now on
        assert _state_once_ended(compiles) == FAILED
        assert compiles.local_state() == FAILED  # asked again: no second warning
    (warning,) = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    message = str(warning.message)
    assert message.startswith("dmuon background kernel compile failed: it exited with status 1")
    assert "the compile job was given device 'cuda:0' but this process sees no CUDA device" in (
        message
    )
    assert "Newton-Schulz keeps running cuBLAS on every rank for the rest of this run" in message
    assert message.endswith(
        "Fix the cause above, or set DMUON_KERNEL_COMPILE=wait to compile inside the first "
        "step instead."
    )
    compiles.keep_cublas(step=1)
    assert not compiles.active
    assert readiness.tuning_deferred()  # cuBLAS stays


def submitted_and_not_started(compiles: BackgroundCompile) -> str:
    """Submit a job that cannot start: it warns once, saying so, and the rank is FAILED; returns
    the warning's text."""
    spec = job_spec(NewtonSchulz(), torch.device("cpu"), [(2, 16, 32)])
    with pytest.warns(RuntimeWarning) as caught:
        compiles.submit(spec)
    (warning,) = caught
    assert str(warning.message).startswith(
        "dmuon background kernel compile failed: it could not be started (FileNotFoundError"
    )
    assert compiles.local_state() == FAILED
    return str(warning.message)


def test_a_job_that_cannot_start_keeps_cublas_and_says_why(open_gate, tmp_path):
    compiles = BackgroundCompile(command=[str(tmp_path / "no-such-python")])
    submitted_and_not_started(compiles)
    assert compiles.active  # until the ranks agree (dmuon.kernel_switch)
    compiles.keep_cublas(step=1)
    assert not compiles.active and readiness.tuning_deferred()
    # Reports say why "auto" runs cuBLAS now: no compile is building anything anymore.
    assert readiness.deferred_because().startswith(
        "this rank's background kernel compile failed, so Newton-Schulz keeps running cuBLAS on "
        "every rank for the rest of the run"
    )


def test_a_job_without_a_temporary_folder_keeps_cublas_and_says_why_instead_of_raising(
    open_gate, tmp_path, monkeypatch
):
    # Raised on one rank (at Muon's construction, or a queued job's start at a step boundary),
    # the error would leave the other ranks waiting in the step's agreement.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-folder"))
    compiles = BackgroundCompile()
    assert "no-such-folder" in submitted_and_not_started(compiles)
    compiles.keep_cublas(step=1)
    assert not compiles.active and readiness.tuning_deferred()


def test_a_job_that_reports_no_shape_done_for_too_long_is_ended_and_keeps_cublas(open_gate):
    # Without the bound a hung job keeps "auto" on cuBLAS, and the ranks agreeing every step,
    # for the rest of the run.
    hung = [
        sys.executable,
        "-c",
        "import time; print('compile job: stuck', flush=True); time.sleep(120)",
    ]
    compiles = BackgroundCompile(command=hung, stall_seconds=0.5)
    compiles.submit(job_spec(NewtonSchulz(), torch.device("cpu"), [(2, 16, 32)]))
    process = compiles._job.process
    assert compiles.local_state() == PENDING
    time.sleep(1.0)
    with pytest.warns(RuntimeWarning) as caught:
        assert compiles.local_state() == FAILED
    (warning,) = caught
    assert str(warning.message).startswith(
        "dmuon background kernel compile failed: it reported no shape done for 0.5 s, so it was "
        "taken as hung and ended; the end of its output:\ncompile job: stuck"
    )
    assert process.returncode is not None  # ended and reaped, not left running
    compiles.keep_cublas(step=1)
    assert not compiles.active and readiness.tuning_deferred()


def test_the_switch_opens_the_gate_and_makes_every_cached_choice_stale(open_gate):
    compiles = BackgroundCompile()
    compiles.submit(job_spec(NewtonSchulz(), torch.device("cpu"), []))  # a rank owning nothing
    assert compiles.active and readiness.tuning_deferred()
    assert compiles.local_state() == 2  # READY: no job was needed
    generation = registry_generation()
    compiles.switch(step=3)
    assert not readiness.tuning_deferred()
    assert registry_generation() == generation + 1
    assert (compiles.switch_step, compiles.active) == (3, False)


def test_the_status_report_says_the_mode_and_why_auto_waits(open_gate, monkeypatch):
    monkeypatch.setenv(KERNEL_COMPILE_ENV, "wait")
    status = get_backend_status()
    assert status["kernel_compile"] == {"mode": "wait", "error": None, "deferred": None}
    assert status["env"][KERNEL_COMPILE_ENV] == "wait"
    BackgroundCompile().submit(job_spec(NewtonSchulz(), torch.device("cpu"), []))
    monkeypatch.setenv(KERNEL_COMPILE_ENV, "never")
    report = get_backend_status()["kernel_compile"]
    assert report["mode"] is None
    assert report["error"].startswith("environment variable DMUON_KERNEL_COMPILE='never'")
    assert report["deferred"].startswith("a background compile is building the Newton-Schulz")


def test_a_job_whose_parent_is_gone_exits_at_once_without_building_anything(tmp_path):
    spec = job_spec(NewtonSchulz(), torch.device("cpu"), [(2, 16, 32)])
    progress = tmp_path / "progress.jsonl"
    # pid 1 is never this test's process: the job's parent is not the trainer it names.
    spec.update(parent_pid=1 if os.getpid() != 1 else 2, progress=str(progress))
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    source = str(Path(compile_job.__file__).resolve().parents[1])
    result = subprocess.run(
        [sys.executable, "-m", "dmuon_kernels.compile_job", str(tmp_path / "spec.json")],
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == compile_job.ORPHANED_STATUS, result.stderr[-2000:]
    assert not progress.exists()


def test_a_job_builds_every_untuned_contender_the_expected_winner_first(tmp_path):
    cpu = torch.device("cpu")
    tuner = SyrkAutotuner(cache_dir=tmp_path, challengers=("cute",), prior=lambda p, d: "cute")
    problem = SyrkProblem(M=2048, K=4096, batch=2, dtype=torch.float16, has_c=False)
    # The prior expects cute, but only the timings say whether it loses: both are built.
    assert tuner.compile_plan("quack", problem, cpu) == ["cute", "quack"]
    # A verdict already known needs its winner's kernel alone.
    cache, key = tuner._key("quack", problem, cpu)
    won = problem.verdict("quack", "quack", "measured", candidate_ms=1.0, cublas_ms=2.0)
    cache.put(key, won, persist=False)
    assert tuner.compile_plan("quack", problem, cpu) == ["quack"]
