"""Compiling a training run's Newton-Schulz kernels in the background, so the first step never
waits for a kernel compile.

Owns the training process's side of the compile job (``dmuon_kernels.compile_job``): whether one
is wanted (``wants_background_compile``), starting it, following its progress, its failure, and
the switch. It only says what this process is ready for; the step every rank switches on is
agreed by dmuon-core (``dmuon.kernel_switch``), which calls ``switch`` or ``keep_cublas`` on
every rank at the same step. It must not import torch.distributed or anything from dmuon.

[Note: the switch]

On a fresh machine the tuned SYRK kernels (quack, the CuTe kernels) compile for 3-6 s a variant,
inside the step and holding the GIL: a first step 6 to 17 s over Trainer + AdamW. So, by default
(``DMUON_KERNEL_COMPILE=background``; ``NewtonSchulz(kernel_compile=...)``):

1. at ``dmuon.Muon`` construction, each rank starts one job: a separate Python process (GIL
   free) that builds the kernels of the Newton-Schulz shapes this rank owns into the on-disk
   caches, then exits. The process-wide gate (``syrk.readiness``) closes: "auto" runs cuBLAS,
   untuned, so steps compile and tune nothing. One line per rank names the shapes running on
   cuBLAS meanwhile; one per shape when its kernels are built;
2. at each step boundary while a job is pending, the ranks agree on their states (one small
   all-reduce of the minimum of FAILED < PENDING < READY): when every rank is READY, every rank
   calls ``switch`` on that same step. The gate opens and every cached choice and CUDA graph
   becomes stale (the registry generation moves), so each shape's next call tunes as usual,
   loading the kernels from disk instead of compiling them, and is captured again. From there
   the steps are exactly those of a run that compiled first;
3. a job that fails (a crash, no GPU libraries, out of memory; or hung: no shape done for
   ``STALL_SECONDS``, then it is ended) warns once on its rank, and every
   rank keeps cuBLAS for the rest of the run (``keep_cublas``): correct, without the speed-up.

Numerics change at the switch by a kernel's rounding. ``DMUON_KERNEL_COMPILE=wait`` starts no
job: the first step compiles and tunes in the process (slower, bit-reproducible from step 1).
Nothing starts on the CPU, for a kernel named explicitly (not "auto"), for an iteration dtype
the fast kernels lack, where "auto" resolves to cuBLAS anyway, or where the compiled-kernel
cache is off or untrusted (the first step compiles then, as in "wait").

A job never outlives its trainer: it exits when its parent is gone (``compile_job``), and this
process kills it at exit. At most one job runs per process; shapes submitted while one runs
wait for it and go in the next.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO

import torch

from dmuon_kernels._env import (
    COMPILE_IN_BACKGROUND,
    KERNEL_CACHE_ENV,
    KERNEL_COMPILE_ENV,
    env_flag,
)
from dmuon_kernels._log import log_rank_tagged
from dmuon_kernels.newton_schulz import NewtonSchulz, dtype_name
from dmuon_kernels.syrk import readiness
from dmuon_kernels.syrk._requirements import KERNEL_DTYPES
from dmuon_kernels.syrk.dispatch import ORIGIN_AUTO, auto_candidate
from dmuon_kernels.syrk.kernel_cache import default_kernel_cache, trust_problem
from dmuon_kernels.syrk.registry import CUBLAS

# A process's local state, ordered so that the minimum over the ranks is the agreed one.
FAILED, PENDING, READY = 0, 1, 2
STATE_NAMES = {FAILED: "failed", PENDING: "pending", READY: "ready"}
# The lines of a failed job's log quoted in its warning.
LOG_TAIL_LINES = 12
# How long a job gets to end after SIGTERM at exit, before SIGKILL.
TERMINATE_GRACE_SECONDS = 2.0
# A job that reports no shape done for this long is taken as hung: ended, and failed (cuBLAS
# kept). One shape builds a few kernel variants of 3-6 s each; without a bound, a hung job would
# keep "auto" on cuBLAS, and the ranks agreeing every step, for the rest of the run.
STALL_SECONDS = 900.0

Shape = tuple[int, int, int]


def wants_background_compile(newton_schulz: NewtonSchulz, device: torch.device) -> bool:
    """Whether a ``dmuon.Muon`` with ``newton_schulz`` on ``device`` compiles its kernels in the
    background: its ``kernel_compile`` is "background", the device is CUDA, the kernel is "auto"
    (no argument, ``DMUON_NS_KERNEL`` or ``deterministic=True`` named one), the iteration dtype
    has fast kernels, "auto" picks a fast backend here, and the compiled-kernel cache is on and
    trusted (otherwise the job's kernels could not reach this process, which would compile them
    again at the switch, in the middle of the run: better in the first step). Facts every rank
    of a homogeneous job shares, so all ranks agree without a collective."""
    return (
        newton_schulz.kernel_compile == COMPILE_IN_BACKGROUND
        and device.type == "cuda"
        and newton_schulz.kernel_origin == ORIGIN_AUTO
        and newton_schulz.iteration_dtype(device) in KERNEL_DTYPES
        and auto_candidate(device)[0] != CUBLAS
        and _kernel_cache_usable()
    )


def _kernel_cache_usable() -> bool:
    """The compiled-kernel cache is on and its folder (when it exists yet) is one objects are
    loaded from ([Note: whose objects are loaded] in ``syrk.kernel_cache``)."""
    if not env_flag(KERNEL_CACHE_ENV, default=True):
        return False
    folder = default_kernel_cache().folder
    return not folder.exists() or trust_problem(folder) is None


def job_spec(newton_schulz: NewtonSchulz, device: torch.device, shapes: Iterable[Shape]) -> dict:
    """What ``compile_job`` needs (without the parent and progress file): the device, the
    Newton-Schulz settings and the shapes (B, n, m), n <= m, sorted."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return {
        "device": str(device),
        "newton_schulz": {
            "backend": newton_schulz.backend,
            "coefficients": [list(row) for row in newton_schulz.coefficients],
            "restart_iterations": list(newton_schulz.restart_iterations),
            "dtype": dtype_name(newton_schulz.iteration_dtype(device)),
            "eps": newton_schulz._request.eps,
        },
        "shapes": sorted({tuple(int(size) for size in shape) for shape in shapes}),
    }


@dataclasses.dataclass(slots=True)
class _Job:
    """One running compile job: its process, files, and what was read of its progress."""

    process: subprocess.Popen
    shapes: list[Shape]
    folder: Path
    log: IO[bytes]
    started: float
    progressed: float  # time.monotonic() of its start or of its last shape done
    progress_read: int = 0  # bytes of the progress file already read
    done: int = 0  # shapes reported done

    @property
    def progress_path(self) -> Path:
        return self.folder / "progress.jsonl"

    @property
    def log_path(self) -> Path:
        return self.folder / "job.log"


class BackgroundCompile:
    """This process's compile jobs (``background_compile()`` is the process-wide one).

    ``command``: the job's command line before the spec file's path (default: this Python
    running ``dmuon_kernels.compile_job``). ``stall_seconds``: how long a job may go without
    reporting a shape done before it is ended as hung (``STALL_SECONDS``).
    """

    def __init__(
        self, command: Sequence[str] | None = None, stall_seconds: float = STALL_SECONDS
    ) -> None:
        self.command = list(command) if command is not None else None
        self.stall_seconds = stall_seconds
        self._queue: list[dict] = []
        self._job: _Job | None = None
        self._failure: str | None = None
        self._started: float | None = None
        self._shapes: list[Shape] = []
        self._settled = False
        self._owner_pid = os.getpid()  # a forked child never ends its parent's job
        # Set at the switch: the step (as counted by the caller) and seconds since the start.
        self.switch_step: int | None = None
        self.seconds_to_switch: float | None = None
        atexit.register(self.stop)

    @property
    def active(self) -> bool:
        """True from the first ``submit`` until ``switch`` or ``keep_cublas``: the step
        boundaries must agree on the ranks' states."""
        return self._started is not None and not self._settled

    @property
    def shapes(self) -> list[Shape]:
        """Every shape submitted, in order."""
        return list(self._shapes)

    def submit(self, spec: dict) -> None:
        """Compile ``spec``'s shapes (``job_spec``) in a job: now, or after the running one.
        Closes the "auto" gate until the switch, and makes this process ``active`` even when
        the spec holds no shape (a rank that owns no matrix still agrees at each boundary)."""
        if self._settled:
            return  # switched already: "auto" tunes in the process from now on
        if self._started is None:
            self._started = time.perf_counter()
        self._shapes.extend(tuple(shape) for shape in spec["shapes"])
        readiness.defer_tuning(
            f"a background compile is building the Newton-Schulz kernels ({KERNEL_COMPILE_ENV}"
            f"={COMPILE_IN_BACKGROUND})"
        )
        if not spec["shapes"]:
            return  # nothing to build here; this rank still agrees at each step boundary
        log_rank_tagged(
            f"Newton-Schulz shapes {_shape_list(spec['shapes'])} run on cuBLAS while their "
            "kernels compile in a background process; they switch to the tuned kernels at a "
            f"step every rank agrees on ({KERNEL_COMPILE_ENV}=wait compiles inside the first "
            "step instead)"
        )
        self._queue.append(spec)
        self._start_next()

    def local_state(self) -> int:
        """FAILED, PENDING or READY for this process, after reading the job's progress (one line
        per shape done) and starting the next queued job. Never waits."""
        if self._failure is not None:
            return FAILED
        job = self._job
        if job is not None:
            self._read_progress(job)
            status = job.process.poll()
            if status is None:
                if time.monotonic() - job.progressed <= self.stall_seconds:
                    return PENDING
                self._job = None
                _end(job.process)
                job.log.close()
                self._fail(
                    f"it reported no shape done for {self.stall_seconds:g} s, so it was taken as "
                    "hung and ended",
                    job,
                )
                return FAILED
            self._read_progress(job)  # the lines written since the read above
            self._job = None
            job.log.close()
            if status != 0:
                self._fail(f"it exited with status {status}", job)
                return FAILED
            shutil.rmtree(job.folder, ignore_errors=True)
            self._start_next()
        if self._failure is not None:
            return FAILED
        return PENDING if self._job is not None else READY

    def switch(self, step: int) -> None:
        """Every rank is READY at ``step``: "auto" tunes and runs the compiled kernels from now
        on (``readiness.resume_tuning``)."""
        self._settled = True
        self.switch_step = step
        self.seconds_to_switch = time.perf_counter() - (self._started or time.perf_counter())
        readiness.resume_tuning()
        log_rank_tagged(
            f"step {step}: every rank's Newton-Schulz kernels are compiled "
            f"({self.seconds_to_switch:.1f} s after the background compile started); shapes "
            f"{_shape_list(self._shapes)} switch from cuBLAS to their tuned kernels now (each "
            "one's first call tunes, loading the kernels from disk, and captures its CUDA graph "
            "again)"
        )

    def keep_cublas(self, step: int) -> None:
        """Some rank's job failed: every rank keeps cuBLAS for "auto" for the rest of the run
        (the gate stays closed)."""
        self._settled = True
        self.stop()
        where = "this rank's" if self._failure is not None else "another rank's"
        why = (
            f"{where} background kernel compile failed, so Newton-Schulz keeps running cuBLAS on "
            f"every rank for the rest of the run ({KERNEL_COMPILE_ENV}=wait compiles inside the "
            "first step instead)"
        )
        readiness.defer_tuning(why)  # the reason reports give: no compile is building anymore
        log_rank_tagged(f"step {step}: {why}")

    def stop(self) -> None:
        """End the running job, if any (at exit, or when the run keeps cuBLAS)."""
        if os.getpid() != self._owner_pid:
            return
        job, self._job = self._job, None
        self._queue.clear()
        if job is None:
            return
        _end(job.process)
        job.log.close()
        shutil.rmtree(job.folder, ignore_errors=True)

    # ---- internals --------------------------------------------------------------------------

    def _start_next(self) -> None:
        if self._job is not None or not self._queue or self._failure is not None:
            return
        spec = self._queue.pop(0)
        command = self.command or [sys.executable, "-m", "dmuon_kernels.compile_job"]
        folder: Path | None = None
        log: IO[bytes] | None = None
        # Any OSError here (no temporary folder, a full disk, no executable) is the job's
        # failure, never the caller's exception: raised on one rank, inside a step boundary or
        # Muon's construction, it would leave the other ranks waiting in the agreement.
        try:
            folder = Path(tempfile.mkdtemp(prefix="dmuon-compile-job-"))  # mode 0700
            spec = {**spec, "parent_pid": os.getpid(), "progress": str(folder / "progress.jsonl")}
            (folder / "spec.json").write_text(json.dumps(spec))
            log = (folder / "job.log").open("wb")
            process = subprocess.Popen(
                [*command, str(folder / "spec.json")],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_job_environment(),
            )
        except OSError as exc:
            if log is not None:
                log.close()
            self._fail(f"it could not be started ({type(exc).__name__}: {exc})", None)
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            return
        self._job = _Job(
            process, [tuple(s) for s in spec["shapes"]], folder, log, time.time(), time.monotonic()
        )

    def _read_progress(self, job: _Job) -> None:
        try:
            with job.progress_path.open("rb") as file:
                file.seek(job.progress_read)
                text = file.read()
        except FileNotFoundError:
            return
        complete = text[: text.rfind(b"\n") + 1]  # a line still being written waits
        job.progress_read += len(complete)
        if complete:
            job.progressed = time.monotonic()
        for line in complete.decode().splitlines():
            entry = json.loads(line)
            job.done += 1
            log_rank_tagged(
                f"Newton-Schulz shape {tuple(entry['shape'])}: kernels compiled in the "
                f"background in {entry['seconds']:.1f} s ({job.done}/{len(job.shapes)} of this "
                "job); it runs cuBLAS until every rank's kernels are ready"
            )

    def _fail(self, why: str, job: _Job | None) -> None:
        tail = ""
        if job is not None:
            lines = job.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            tail = "; the end of its output:\n" + "\n".join(lines) if lines else ""
            shutil.rmtree(job.folder, ignore_errors=True)
        self._failure = why
        self._queue.clear()
        message = (
            f"dmuon background kernel compile failed: {why}{tail}\nNewton-Schulz keeps running "
            "cuBLAS on every rank for the rest of this run (correct results, without the tuned "
            f"kernels' speed-up). Fix the cause above, or set {KERNEL_COMPILE_ENV}=wait to "
            "compile inside the first step instead."
        )
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _end(process: subprocess.Popen) -> None:
    """End ``process`` if it still runs (SIGTERM, then SIGKILL after a grace) and reap it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(TERMINATE_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _job_environment() -> dict[str, str]:
    """This process's environment, with the folder this package was imported from first on
    PYTHONPATH, so the job imports the same dmuon_kernels."""
    source = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (source, path) if p)}


def _shape_list(shapes: Iterable[Sequence[int]]) -> str:
    return ", ".join(f"{tuple(shape)}" for shape in shapes) or "(none)"


_process_wide: BackgroundCompile | None = None


def background_compile() -> BackgroundCompile:
    """The process-wide compile jobs (``dmuon.Muon`` submits to it)."""
    global _process_wide
    if _process_wide is None:
        _process_wide = BackgroundCompile()
    return _process_wide
