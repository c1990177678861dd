"""A persistent pool of gloo worker processes that runs test scenarios on every rank.

Owns: spawning ``world_size`` CPU processes joined in one gloo process group, running a scenario
function on all of them, collecting per-rank return values, and turning a failure on any rank
(an exception, a hang, a crash) into one exception in pytest with every failing rank's report.
It must not know anything about dmuon: scenarios are plain functions in importable modules.

Starting a gloo group costs seconds (each process needs torch), so one pool serves many
scenarios, and workers are forked from one server process that imported torch once (see
``[Note: forked workers]``). The cost of that reuse is shared state, handled like this:

- Every scenario starts with ``torch.manual_seed(seed)`` / ``random.seed(seed)`` on every rank,
  fp32 as the default dtype and grad mode on, and ends with a garbage collection (the groups its
  dropped models hold are freed there, not at a random point of a later scenario).
- Scenarios create their own subgroups (``dist.new_group``, ``init_device_mesh``); they stay
  until the workers are replaced, every ``SCENARIOS_PER_WORKER_LIFE`` scenarios (see
  ``[Note: groups end with their workers]``). Never reusing one keeps scenarios apart.
- After any failure (a rank raised, the deadline passed, a process died) the workers are killed
  and the next scenario gets fresh ones: a failed scenario can leave collectives half-issued,
  and a gloo group out of step would corrupt whatever runs next. A scenario that *expects* an
  error should catch it itself and return the message; an escaping exception costs a respawn.

Workers that wait burn CPU (their groups' threads), so a pool may stop them after some idle
seconds (``stop_when_idle_s``, see ``[Note: idle pools stop]``); the next scenario starts new ones.

Hangs never block CI: each process group has a short timeout (``DMUON_TEST_PG_TIMEOUT`` seconds,
default 60) so a collective that only some ranks issue raises on its own, and the pool also
waits with an overall deadline per scenario (``DMUON_TEST_SCENARIO_DEADLINE``, default 180 s).

Workers write their stdout/stderr (file descriptors 1 and 2, so C++ output included) to one log
file per rank; a worker killed by a signal leaves its Python stacks there (``faulthandler``).
After a successful scenario the new output is echoed to this process's stdout, which pytest
shows only for a failing test; after a failure it is part of the exception message.

Scenario functions must be importable by module name in a fresh process: define them at top
level of a module under ``tests/`` (e.g. ``tests/distributed/scenarios_*.py``) and pass the
function itself or ``"tests.distributed.scenarios_x:function_name"``. Arguments and return values
travel by plain pickle (tensors are copied, never shared).
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PG_TIMEOUT_ENV = "DMUON_TEST_PG_TIMEOUT"
SCENARIO_DEADLINE_ENV = "DMUON_TEST_SCENARIO_DEADLINE"
DEFAULT_PG_TIMEOUT_S = 60.0
DEFAULT_SCENARIO_DEADLINE_S = 180.0
# Starting 8 processes on 2 busy cores can take a while. Also how long the workers wait for each
# other at start-up: the process group's timeout may be much shorter (a test of timeouts).
STARTUP_DEADLINE_S = 120.0
# [Note: forked workers]
# Workers come from a "forkserver": one clean process, started on the first pool's start, that
# imports these modules once and forks every worker of every pool (respawns included). A fork
# costs milliseconds where a "spawn" re-imports torch (about 1 s of CPU a process, 2 cores
# shared by 8). It is safe: the server only imports, it never computes, so it holds no thread
# pool or lock a fork could copy in a bad state. A worker inherits the server's environment and
# sys.path (the parent's when the server started), then sets its own thread count and rendezvous
# variables; a scenario that needs an environment variable sets it itself. Scenario modules are
# imported in each worker. Preloaded are the libraries that take seconds to import, and what the
# suite adds (``preload_in_workers``): each would be paid again by every generation of workers
# (see [Note: groups end with their workers]); none may start a thread on import (see
# ARROW_ALLOCATOR_ENV) or read an environment variable a scenario sets.
WORKER_PRELOAD = (
    "torch",
    "torch._dynamo",  # FSDP2 imports it on a worker's first fully_shard: about 3 s of CPU
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    # The HF and torchtitan scenarios' stacks: about 6 s of CPU a process. torchtitan itself is
    # not preloaded: tests/titan/titan_on_cpu.py must be imported before it.
    "torch._inductor.compile_fx",
    "datasets",
    "transformers.trainer",
    __name__,  # this module: what each worker runs
)
# Added by the suite: see ``preload_in_workers``.
_suite_preload: list[str] = []
# pyarrow (under datasets) starts jemalloc's background thread when it loads, unless told not to.
ARROW_ALLOCATOR_ENV = ("JE_ARROW_MALLOC_CONF", "background_thread:false")
# [Note: frozen heap]
# torch, dynamo and the rest of the preload are about 300,000 objects the cyclic collector would
# walk in every full collection: 0.2 s of CPU a rank, after every scenario and whenever the
# collector runs inside one. A worker freezes them (``gc.freeze``) as it starts, and freezes what
# survives each scenario's collection, so each collection walks only the objects created since
# the last one. Frozen objects are never collected: anything the scenario still held at its end
# and drops later stays until its worker is replaced (see [Note: groups end with their workers]).
# [Note: groups end with their workers]
# Each gloo group keeps threads (a TCP loop and its work threads) that wake up every few
# milliseconds even when idle: 80 idle groups cost a worker 6% of a core. Left alive, the groups
# that scenarios create add up over a session until idle workers take most of a 2-core machine.
# Destroying a scenario's groups afterwards is not enough: DTensor's caches keep meshes (and
# their group names) of earlier scenarios that compare equal to a new one's. So the workers are
# replaced (a fork each, see [Note: forked workers]) before a scenario that would exceed this.
SCENARIOS_PER_WORKER_LIFE = 12
# [Note: idle pools stop]
# A pool whose workers hold a few scenarios' groups burns CPU while it waits (4 workers after 11
# scenarios: 0.2 of a core), and a session keeps a pool per world size: the idle ones slowed the
# busy one and every subprocess test on a 2-core machine. A pool made with ``stop_when_idle_s``
# stops its workers once that long has passed since its last scenario; the next scenario starts
# new ones (0.2 s for 2 ranks, 0.5 s for 4, 0.6 s for 8 here: what an idle pool burns in 2-3 s).

# Once one rank has failed, how long the others get to report before they are killed: long enough
# for ranks failing the same check to say so, short enough not to wait for a PG timeout.
STRAGGLER_GRACE_S = 2.0
# How much of each rank's output (characters, the tail) goes into a failure message.
LOG_TAIL_CHARS = 4000
# A worker whose pipe closed is dying; how long to wait for its exit code.
EXIT_CODE_WAIT_S = 5.0

Scenario = Callable[..., Any] | str


class ScenarioError(Exception):
    """A scenario failed on at least one rank; the message holds every failing rank's report."""

    def __init__(self, message: str, rank_reports: dict[int, str]) -> None:
        super().__init__(message)
        self.rank_reports = rank_reports


class ScenarioTimeout(ScenarioError):
    """Some ranks did not finish the scenario before the pool's deadline."""


class WorkerCrash(ScenarioError):
    """A worker process died (or never started) instead of reporting a result."""


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds; set e.g. {name}=60") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds; set e.g. {name}=60")
    return value


def scenario_address(scenario: Scenario) -> tuple[str, str]:
    """Return ``(module, qualified name)`` under which workers import ``scenario``."""
    if isinstance(scenario, str):
        module, _, qualname = scenario.partition(":")
        if not module or not qualname:
            raise ValueError(
                f"scenario {scenario!r} is not of the form 'module:function'; pass e.g. "
                "'tests.distributed.scenarios_pool:report_rank' or the function itself"
            )
        return module, qualname
    module = getattr(scenario, "__module__", None)
    qualname = getattr(scenario, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        raise ValueError(
            f"scenario {scenario!r} (module {module!r}, name {qualname!r}) cannot be imported by "
            "a worker process; define it at the top level of a module under tests/, e.g. "
            "tests/distributed/scenarios_<area>.py"
        )
    return module, qualname


def preload_in_workers(*modules: str) -> None:
    """Have the fork server import ``modules`` too, when it starts (see [Note: forked workers]):
    the suite's own imports that every worker would repeat, such as the package under test."""
    _suite_preload.extend(m for m in modules if m not in _suite_preload)


def worker_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context of the workers: the fork server of ``[Note: forked workers]``.
    Also for tests that need processes of their own with torch already imported."""
    context = multiprocessing.get_context("forkserver")
    os.environ.setdefault(*ARROW_ALLOCATOR_ENV)  # read by the server when it starts
    # No effect once the server runs.
    context.set_forkserver_preload([*WORKER_PRELOAD, *_suite_preload])
    return context


def _resolve_scenario(module_name: str, qualname: str) -> Callable[..., Any]:
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(
            f"worker could not import scenario module {module_name!r}: {error}. Scenario modules "
            f"must be importable from the repository root (sys.path starts with {sys.path[:3]})"
        ) from error
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


# ----------------------------------------------------------------------------------------------
# Worker side: everything below up to WorkerPool runs in the worker processes.


def _redirect_output(log_path: str) -> None:
    # dup2 onto fds 1 and 2 so output written by C++ (gloo warnings) lands in the log as well.
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def _reset_global_state(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def _worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    pg_timeout_s: float,
    connection: multiprocessing.connection.Connection,
    log_path: str,
) -> None:
    _redirect_output(log_path)
    # A crash in C++ (a segfault in gloo or a kernel) otherwise leaves nothing in the log.
    faulthandler.enable(all_threads=True)
    # See [Note: frozen heap]: what the fork server imported is never garbage.
    gc.freeze()
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(store_port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    if sys.platform == "linux":
        # Gloo otherwise picks the interface the host name resolves to, which some containers
        # and CI machines cannot route to themselves; all ranks live on this host.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Wait for every worker under the start-up deadline, then join the group under its own
    # (possibly short) timeout: a slow start must not look like a collective timing out.
    store = dist.TCPStore(
        "127.0.0.1",
        store_port,
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=STARTUP_DEADLINE_S),
    )
    store.set(f"started/{rank}", "1")
    store.wait([f"started/{other}" for other in range(world_size)])
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    store.set_timeout(timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    connection.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            request = connection.recv_bytes()
        except EOFError:
            # The pool went away. Skip the interpreter's slow teardown of torch: nothing to save.
            os._exit(0)
        module_name, qualname, kwargs, seed = pickle.loads(request)
        try:
            _reset_global_state(seed)
            result = _resolve_scenario(module_name, qualname)(**kwargs)
            reply = pickle.dumps(("ok", result))
        except BaseException:
            reply = pickle.dumps(("error", traceback.format_exc()))
        # The scenario's dropped models are cyclic garbage holding process groups (dmuon's):
        # free them now, between scenarios, not whenever a collection runs inside the next one.
        # What survives is frozen with the rest (see [Note: frozen heap]).
        gc.collect()
        gc.freeze()
        sys.stdout.flush()
        sys.stderr.flush()
        connection.send_bytes(reply)


# ----------------------------------------------------------------------------------------------
# Parent side.


def _exit_code_text(code: int | None) -> str:
    """``-11 (SIGSEGV)`` for a process killed by a signal, the plain code otherwise."""
    if code is not None and code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


@dataclass(slots=True)
class _Worker:
    rank: int
    process: multiprocessing.process.BaseProcess
    connection: multiprocessing.connection.Connection
    log_path: Path
    log_offset: int = 0

    def read_new_output(self) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(self.log_offset)
                data = log.read()
        except FileNotFoundError:
            return ""
        self.log_offset += len(data)
        return data.decode(errors="replace")


class WorkerPool:
    """``world_size`` gloo processes kept alive across scenarios; see the module docstring.

    ``run(scenario, **kwargs)`` calls ``scenario(**kwargs)`` on every rank and returns the list of
    per-rank results (index = global rank). Workers start on the first ``run`` and again after any
    failure. ``close()`` stops them.
    """

    def __init__(
        self,
        world_size: int,
        *,
        pg_timeout_s: float | None = None,
        deadline_s: float | None = None,
        stop_when_idle_s: float | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s or _env_seconds(PG_TIMEOUT_ENV, DEFAULT_PG_TIMEOUT_S)
        self.deadline_s = deadline_s or _env_seconds(
            SCENARIO_DEADLINE_ENV, DEFAULT_SCENARIO_DEADLINE_S
        )
        # How many times workers were (re)started; lets tests see a respawn happen.
        self.generation = 0
        self._scenarios_on_these_workers = 0
        self._workers: list[_Worker] = []
        self._store: dist.TCPStore | None = None
        self._log_dir: str | None = None
        # See [Note: idle pools stop]: the lock keeps the stopping thread out of a running scenario.
        self._stop_when_idle_s = stop_when_idle_s
        self._lock = threading.Lock()
        self._last_scenario_end = time.monotonic()
        self._idle_watch: threading.Thread | None = None

    def __repr__(self) -> str:
        state = "running" if self._workers else "stopped"
        return f"WorkerPool(world_size={self.world_size}, {state}, generation={self.generation})"

    # -- lifecycle ------------------------------------------------------------------------------

    def _start(self) -> None:
        # The rendezvous store lives here, bound to a port the OS picked, so concurrent test runs
        # on one machine never race for a "free" port.
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            self.world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=STARTUP_DEADLINE_S),
        )
        self._log_dir = tempfile.mkdtemp(prefix=f"gloo-pool-{self.world_size}-")
        self.generation += 1
        context = worker_context()
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe(duplex=True)
            log_path = Path(self._log_dir) / f"rank{rank}.log"
            process = context.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.world_size,
                    self._store.port,
                    self.pg_timeout_s,
                    child_end,
                    str(log_path),
                ),
                name=f"gloo-worker-{rank}-of-{self.world_size}",
                daemon=True,
            )
            process.start()
            child_end.close()
            self._workers.append(_Worker(rank, process, parent_end, log_path))
        try:
            replies = self._collect(STARTUP_DEADLINE_S)
        except BaseException:
            self._stop()  # half-started workers must not be taken for a ready pool
            raise
        if replies.failed:
            report = self._failure_report(replies, "starting the gloo workers")
            self._stop()
            raise replies.exception_type(report, replies.reports)

    def _stop(self) -> None:
        # Killing is safe: workers hold nothing worth saving, and it is fast even on a busy machine.
        for worker in self._workers:
            worker.connection.close()
            worker.process.kill()
        for worker in self._workers:
            worker.process.join()
            worker.process.close()
        self._workers = []
        self._scenarios_on_these_workers = 0
        self._store = None
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None

    def close(self) -> None:
        """Stop the workers (they are started again by the next ``run``)."""
        with self._lock:
            self._stop()

    def _stop_while_idle(self) -> None:
        """The idle watch of [Note: idle pools stop]: runs in a daemon thread of this process."""
        assert self._stop_when_idle_s is not None
        while True:
            time.sleep(self._stop_when_idle_s / 2)
            if not self._workers or not self._lock.acquire(blocking=False):
                continue
            try:
                idle = time.monotonic() - self._last_scenario_end
                if self._workers and idle >= self._stop_when_idle_s:
                    self._stop()
            finally:
                self._lock.release()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- running scenarios ----------------------------------------------------------------------

    def run(
        self,
        scenario: Scenario,
        /,
        *,
        seed: int = 0,
        deadline_s: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``scenario(**kwargs)`` on every rank; return the per-rank results in rank order.

        ``seed`` and ``deadline_s`` are options of the pool, never passed to the scenario.
        Raises ``ScenarioError`` if any rank raised, ``ScenarioTimeout`` if ranks were still busy
        after ``deadline_s`` (default: the pool's), ``WorkerCrash`` if a process died.
        """
        module_name, qualname = scenario_address(scenario)
        try:
            request = pickle.dumps((module_name, qualname, kwargs, seed))
        except Exception as error:
            raise TypeError(
                f"arguments of scenario {module_name}:{qualname} cannot be pickled for the "
                f"workers ({error}); pass plain values and tensors"
            ) from error
        with self._lock:
            try:
                return self._run(request, module_name, qualname, deadline_s or self.deadline_s)
            finally:
                self._last_scenario_end = time.monotonic()
                if self._stop_when_idle_s is not None and self._idle_watch is None:
                    self._idle_watch = threading.Thread(
                        target=self._stop_while_idle, name="gloo-pool-idle-watch", daemon=True
                    )
                    self._idle_watch.start()

    def _run(self, request: bytes, module_name: str, qualname: str, deadline_s: float) -> list:
        if self._scenarios_on_these_workers >= SCENARIOS_PER_WORKER_LIFE:
            self._stop()  # see [Note: groups end with their workers]
        if not self._workers:
            self._start()
        try:
            for worker in self._workers:
                worker.connection.send_bytes(request)
            replies = self._collect(deadline_s)
        except BaseException:
            # Interrupted (pytest-timeout, Ctrl-C) with the scenario still running: its late
            # replies would be taken for the next scenario's, so these workers cannot be reused.
            self._stop()
            raise
        if replies.failed:
            report = self._failure_report(replies, f"scenario {module_name}:{qualname}")
            self._stop()
            raise replies.exception_type(report, replies.reports)
        self._scenarios_on_these_workers += 1
        self._echo_output()
        return [replies.results[rank] for rank in range(self.world_size)]

    def _collect(self, deadline_s: float) -> _Replies:
        replies = _Replies()
        pending = {worker.rank: worker for worker in self._workers}
        give_up_at = time.monotonic() + deadline_s
        while pending:
            remaining = give_up_at - time.monotonic()
            if remaining <= 0:
                replies.timed_out = sorted(pending)
                break
            waitables: list[Any] = []
            for worker in pending.values():
                waitables += [worker.connection, worker.process.sentinel]
            ready = multiprocessing.connection.wait(waitables, timeout=remaining)
            for worker in list(pending.values()):
                if worker.connection in ready or worker.connection.poll():
                    try:
                        status, payload = pickle.loads(worker.connection.recv_bytes())
                    except EOFError:
                        status, payload = "crashed", None
                elif worker.process.sentinel in ready:
                    status, payload = "crashed", None
                else:
                    continue
                del pending[worker.rank]
                if status == "ok" or status == "ready":
                    replies.results[worker.rank] = payload
                elif status == "error":
                    replies.errors[worker.rank] = payload
                else:
                    worker.process.join(EXIT_CODE_WAIT_S)
                    replies.crashed[worker.rank] = worker.process.exitcode
            if replies.failed and pending:
                give_up_at = min(give_up_at, time.monotonic() + STRAGGLER_GRACE_S)
        return replies

    def _failure_report(self, replies: _Replies, what: str) -> str:
        lines = [f"{what} failed on a pool of {self.world_size} gloo processes:"]
        if replies.errors:
            lines.append(f"  raised on ranks {sorted(replies.errors)}")
        if replies.crashed:
            codes = ", ".join(
                f"{rank}: {_exit_code_text(code)}" for rank, code in replies.crashed.items()
            )
            lines.append(f"  processes died: rank -> exit code {{{codes}}}")
        if replies.timed_out:
            lines.append(
                f"  still running at the deadline on ranks {replies.timed_out} (a collective "
                "issued by only some ranks, or a rank stuck after another failed); workers "
                "were killed and will be respawned for the next scenario"
            )
        for worker in self._workers:
            rank = worker.rank
            output = worker.read_new_output()[-LOG_TAIL_CHARS:]
            if rank not in replies.errors and not output:
                continue
            lines.append(f"--- rank {rank} ---")
            if rank in replies.errors:
                lines.append(replies.errors[rank].rstrip())
            if output:
                lines.append(f"[rank {rank} output, last {LOG_TAIL_CHARS} characters]")
                lines.append(output.rstrip())
        return "\n".join(lines)

    def _echo_output(self) -> None:
        for worker in self._workers:
            output = worker.read_new_output()
            if output:
                sys.stdout.write(f"--- rank {worker.rank} output ---\n{output}")


@dataclass(slots=True)
class _Replies:
    """What the workers answered to one request (a scenario, or the start-up handshake)."""

    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # rank -> formatted traceback
    crashed: dict[int, int | None] = field(default_factory=dict)  # rank -> exit code
    timed_out: list[int] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.errors or self.crashed or self.timed_out)

    @property
    def reports(self) -> dict[int, str]:
        reports = dict(self.errors)
        reports.update(
            {
                rank: f"process died with exit code {_exit_code_text(code)}"
                for rank, code in self.crashed.items()
            }
        )
        reports.update({rank: "still running at the deadline" for rank in self.timed_out})
        return reports

    @property
    def exception_type(self) -> type[ScenarioError]:
        if self.crashed:
            return WorkerCrash
        if self.timed_out and not self.errors:
            return ScenarioTimeout
        return ScenarioError
