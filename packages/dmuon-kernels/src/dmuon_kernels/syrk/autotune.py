"""Per-shape autotune for ``kernel="auto"``: keep the faster SYRK kernel only where it is right.

Owns the verdict for each problem (M, K, batch, dtype, with or without C) on each GPU model:
the first time a problem is seen, the hardware ladder's candidate (quack or cute), and each other
available fast backend that implements the operation (the challengers: on an H200 with both
installed, quack and cute both compete), is

1. cross-checked against cuBLAS: on the same random inputs, the candidate's relative error
   against an fp32 product must be within ``ERROR_RATIO_LIMIT`` times cuBLAS's own error against
   that product, plus a small floor (``ERROR_FLOOR_ULPS`` units of the dtype's rounding);
2. timed against cuBLAS on the GPU alone (``timing.median_ms``), interleaved, after warm-up;

and wins its verdict only when it passes the check and is at least ``WIN_MARGIN`` faster. Of
the winners the one with the largest speed-up over cuBLAS runs the problem; with none, cuBLAS
does, so "auto" is never slower than cuBLAS by more than timing noise. One verdict per
(problem, backend) keeps each comparison against cuBLAS measured in the same interleaved run.

Tuning a contender on a machine's first run compiles its kernel variant (3-5 s each), so where
the winner is known from measurements on the GPU model (``measured_prior``; see [Note: the SM90
prior]) the process-wide tuner tunes the expected winner first and the other contenders only if
it loses to cuBLAS. ``DMUON_SYRK_AUTOTUNE_PRIOR=0`` tunes every contender.

Some problems are never tuned and run cuBLAS, because what tuning them would cost a machine's
first run (compiling the contenders: seconds each) is known to buy nothing:

- a problem under ``MIN_TUNED_FLOP`` (counted as cuBLAS computes it): it takes microseconds, so a
  faster kernel would save microseconds per call (a small model's first step spent 37 s tuning
  such problems);
- an operation outside ``TUNED_OPS``: plain products (``matmul``), which no fast backend has
  beaten cuBLAS on (see the constant).
Verdicts live in memory and in ``syrk.cache``'s JSON file; the key holds the library versions,
so an upgrade re-tunes. Progress lines go through the rank-tagged logger, each verdict with the
seconds its candidate took (compile included), and each candidate is recorded as an
``autotune`` phase (``dmuon_kernels._log``); ``DMUON_SYRK_AUTOTUNE_LOG=0`` silences the lines.

Tuning runs on private random inputs drawn from a private generator: it never reads or writes
the caller's tensors and never advances the global RNG, so it changes no result beyond which
kernel's rounding the caller gets. It runs inside a training step, beside everything the step
holds, so its memory is kept to the inputs in the problem's dtype, one output at a time and an
fp32 reference of the first and last matrices of a batch only (the cross-check's sample). It
must not run while a CUDA graph is being captured (Newton-Schulz runs each shape eagerly before
capturing it); if asked to, it answers cuBLAS for that call and records nothing.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dmuon_kernels._env import SYRK_AUTOTUNE_LOG_ENV as AUTOTUNE_LOG_ENV
from dmuon_kernels._env import SYRK_AUTOTUNE_PRIOR_ENV, env_flag, progress_lines_enabled
from dmuon_kernels._log import AUTOTUNE, log_rank_tagged, timed_phase
from dmuon_kernels.syrk._requirements import distribution_version
from dmuon_kernels.syrk.cache import Verdict, VerdictCache
from dmuon_kernels.syrk.registry import (
    CUBLAS,
    CUTE,
    FAST_BACKENDS,
    MATMUL,
    QUACK,
    SYMMETRIC_PRODUCT,
    SYRK,
    backend_availability,
    get_backend,
)
from dmuon_kernels.syrk.timing import median_ms

BASELINE = CUBLAS

# The candidate's error may be this many times cuBLAS's (both against the same fp32 product).
ERROR_RATIO_LIMIT = 2.0
# ...plus this many units of the dtype's rounding (2^-11 for fp16, 2^-8 for bf16), so two kernels
# that both round correctly never fail on a lucky cuBLAS draw.
ERROR_FLOOR_ULPS = 0.25
# The candidate must beat cuBLAS by this fraction; inside timing noise cuBLAS is kept.
WIN_MARGIN = 0.01
# alpha/beta used when tuning a problem with C, as Newton-Schulz calls it: quack compiles one
# kernel variant per (alpha == 1, beta == 1), so a tuning call of another variant than the
# iteration's compiles a kernel the iteration never runs, and the iteration then compiles its own
# (one more 3-4 s compile on a first step). A SYRK with C is b·R + c·R² (neither is 1); a
# symmetric product or a product is a·Q + Z·Q (alpha 1).
TUNING_ALPHA_WITH_C = {SYRK: 0.75, SYMMETRIC_PRODUCT: 1.0, MATMUL: 1.0}
TUNING_BETA_WITH_C = -1.25
TUNING_SEED = 0x5EED
# Problems below this many FLOPs (2·M·N·K·batch, as cuBLAS computes it; about 0.1 ms on an H200)
# run cuBLAS untuned under "auto".
MIN_TUNED_FLOP = 2**36
# The operations the process-wide tuner tunes; the others run cuBLAS untuned under "auto". quack's
# plain GEMM (``matmul``: one untuned configuration) never beat cuBLAS by WIN_MARGIN in any
# measured problem: 11 verdicts on the H200, 256³ to 4096³, 512x512x1408 in a batch of 18, with
# and without C (benchmarks/results/dispatch-h200-*.log, cold-start-h200-*-before-threshold.json;
# at best a tie, 0.2034 ms against 0.2024 at 4096³), and tuning it compiled two more quack kernels
# (gemm, gemm_add) on a machine's first step. The CuTe kernels have no matmul.
TUNED_OPS = (SYRK, SYMMETRIC_PRODUCT)

# [Note: the SM90 prior]
# With quack and the CuTe kernel both installed on an SM90 GPU, each problem's first tuning
# compiled both contenders' kernel variants (3-5 s each, serially): a 0.89 B Llama's first step
# compiled 4 quack and 2 CuTe variants (21 s) to keep quack on every problem. Measured on the
# H200, with and without C and for symmetric products alike, quack wins except on one matrix
# (no batch) whose Gram edge M (the short edge of the orthogonalised matrix) is 4096 to 8191:
# - batched, edges 704-2048: quack 5-16% ahead of CuTe (cold-start-h200-2026-12-02 results of
#   Qwen2, Qwen3-MoE and the 0.89 B Llama; e.g. 2048² x 32: 0.445 ms vs 0.479); 4096² x 8: 0.82
#   ms vs 0.96 (syrk-cute-h200-2026-12-01-48aeddf);
# - one 4096²: CuTe 0.116 ms vs quack 0.143 (dispatch-h200-2026-12-01-48aeddf); one 4096x14336:
#   1.72x cuBLAS vs 1.20x;
# - one 8192²: quack 1.98x cuBLAS vs CuTe's 1.75x.
# The expected winner is tuned first (still cross-checked and timed against cuBLAS); the others
# only when it loses, so the rule can cost speed but never correctness, and a verdict already in
# the cache is always used.
SM90_CUTE_EDGES = range(4096, 8192)


def measured_prior(problem: SyrkProblem, device: torch.device) -> str | None:
    """The fast backend expected to win ``problem`` on ``device``'s GPU model, or None where
    nothing was measured (every contender is tuned): [Note: the SM90 prior]."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return None
    single = problem.batch <= 1
    return CUTE if single and problem.M in SM90_CUTE_EDGES else QUACK


def autotune_log_enabled() -> bool:
    """False when ``DMUON_SYRK_AUTOTUNE_LOG`` is 0/false/no/off; on by default; read at every
    line (``env_flag``: any other value raises ValueError)."""
    return progress_lines_enabled()


def _log(message: str) -> None:
    if autotune_log_enabled():
        log_rank_tagged(f"SYRK autotune {message}")


@dataclass(frozen=True, slots=True)
class SyrkProblem:
    """What one verdict is about: ``op`` on ``A`` (batch, M, K) (batch 0 = unbatched), with or
    without C. ``op`` is "syrk" (A·Aᵀ), "symmetric_product" (A·B, square, M = K) or "matmul"
    (A·B with B (K, N); N is 0 for the other two)."""

    M: int
    K: int
    batch: int
    dtype: torch.dtype
    has_c: bool
    op: str = SYRK
    N: int = 0

    @classmethod
    def of(
        cls, A: Tensor, C: Tensor | None, op: str = SYRK, B: Tensor | None = None
    ) -> SyrkProblem:
        batch = 0 if A.dim() == 2 else math.prod(A.shape[:-2])
        N = int(B.shape[-1]) if op == MATMUL and B is not None else 0
        return cls(int(A.shape[-2]), int(A.shape[-1]), batch, A.dtype, C is not None, op, N)

    @property
    def flop(self) -> int:
        """Multiply-adds x 2 of the whole product as cuBLAS computes it (both triangles)."""
        N = {SYRK: self.M, SYMMETRIC_PRODUCT: self.M}.get(self.op, self.N)
        return 2 * self.M * N * self.K * max(self.batch, 1)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def shape(self) -> tuple[int, ...]:
        """(M, K), or (M, K, N) for matmul."""
        return (self.M, self.K, self.N) if self.op == MATMUL else (self.M, self.K)

    def verdict(self, candidate: str, backend: str, reason: str, **measured: float) -> Verdict:
        """A verdict about this problem, recorded now; ``measured`` holds the errors and
        timings that were taken (``Verdict``'s field names)."""
        return Verdict(
            backend=backend,
            candidate=candidate,
            reason=reason,
            op=self.op,
            shape=self.shape,
            batch=self.batch,
            dtype=self.dtype_name,
            with_c=self.has_c,
            recorded=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **measured,
        )

    def describe(self) -> str:
        """``shape=(4096,14336) dtype=float16`` plus batch and C when present, for log lines."""
        shape = ",".join(map(str, self.shape))
        text = f"shape=({shape}) dtype={self.dtype_name}"
        if self.op != SYRK:
            text += f" op={self.op}"
        if self.batch:
            text += f" batch={self.batch}"
        if self.has_c:
            text += " with_c=True"
        return text


def library_versions(*backend_modules: object) -> dict[str, str]:
    """The versions a verdict depends on: ours, torch, CUDA, and those the compared backends
    (candidate and baseline) report through their optional ``versions()``."""
    versions = {
        "dmuon-kernels": _own_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
    }
    for module in backend_modules:
        versions_fn = getattr(module, "versions", None)
        if callable(versions_fn):
            versions.update({str(k): str(v) for k, v in versions_fn().items()})
    return versions


def _own_version() -> str:
    """dmuon-kernels' version: from the installed metadata, else (a source tree on PYTHONPATH,
    as on the GPU machine) from the package already imported; never importing it from here,
    which would be a cycle."""
    version = distribution_version("dmuon-kernels")
    if version == "unknown":
        package = sys.modules.get("dmuon_kernels")
        version = str(getattr(package, "__version__", version))
    return version


def verdict_key(problem: SyrkProblem, candidate: str, versions: dict[str, str]) -> str:
    """The cache key: the problem, the candidate and every version (sorted), as one string."""
    version_text = ",".join(f"{name}={value}" for name, value in sorted(versions.items()))
    return (
        f"op={problem.op};M={problem.M};K={problem.K};"
        + (f"N={problem.N};" if problem.op == MATMUL else "")
        + f"batch={problem.batch};"
        f"dtype={problem.dtype_name};"
        f"with_c={int(problem.has_c)};candidate={candidate};versions={version_text}"
    )


def gpu_model(device: torch.device) -> str:
    """``"NVIDIA H200 (SM90)"``: the name and compute capability, which file the verdict goes in."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (SM{major}{minor})"


def _unit_roundoff(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2


class SyrkAutotuner:
    """Verdicts per GPU model, in memory and in the JSON cache under ``cache_dir``.

    ``cache_dir=None`` reads ``DMUON_CACHE_DIR`` (default ``~/.cache/dmuon``) when a file is
    first needed. Problems under ``min_flop`` FLOPs, and operations outside ``tuned_ops`` (None:
    every operation), run cuBLAS untuned; with a ``prior``, the contender it names is tuned
    first and the others only if it loses (the process-wide tuner uses ``MIN_TUNED_FLOP``,
    ``TUNED_OPS`` and ``measured_prior``). Each instance keeps its own memory, so tests use fresh
    ones.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        get_backend: Callable[[str], object] | None = None,
        challengers: Sequence[str] | None = None,
        min_flop: int = 0,
        tuned_ops: Sequence[str] | None = None,
        prior: Callable[[SyrkProblem, torch.device], str | None] | None = None,
    ) -> None:
        self.cache_dir = cache_dir
        # The backend expected to win a problem (tuned first, the others only if it loses);
        # None, or a None answer: every contender is tuned.
        self.prior = prior
        self.min_flop = min_flop
        self.tuned_ops = None if tuned_ops is None else tuple(tuned_ops)
        # Name -> backend module; defaults to the dispatcher's registry.
        self._get_backend = get_backend
        # Backends tuned besides the ladder's candidate; None: every available fast backend.
        self.challengers = None if challengers is None else tuple(challengers)
        self._caches: dict[str, VerdictCache] = {}
        self._versions: dict[str, dict[str, str]] = {}
        # (candidate, device, problem) -> backend: the per-call fast path, no string keys.
        self._chosen: dict[tuple[str, torch.device, SyrkProblem], str] = {}

    def backend(self, name: str) -> object:
        if self._get_backend is not None:
            return self._get_backend(name)
        return get_backend(name)

    def cache_for(self, model: str) -> VerdictCache:
        cache = self._caches.get(model)
        if cache is None:
            cache = self._caches[model] = VerdictCache(model, self.cache_dir)
        return cache

    def choose(
        self,
        candidate: str,
        A: Tensor,
        C: Tensor | None = None,
        *,
        op: str = SYRK,
        B: Tensor | None = None,
    ) -> str:
        """The backend to run ``op`` on A (B, C): of ``candidate`` and the challengers that
        implement ``op``, the one with the largest speed-up over cuBLAS among those that won
        their own verdict; cuBLAS when none did. Under a prior, a contender not tuned yet is
        tuned only if it is the expected winner or no contender has won so far."""
        if candidate == BASELINE:
            return BASELINE
        problem = SyrkProblem.of(A, C, op, B)
        chosen_key = (candidate, A.device, problem)
        chosen = self._chosen.get(chosen_key)
        if chosen is not None:
            return chosen
        if problem.flop < self.min_flop or (
            self.tuned_ops is not None and problem.op not in self.tuned_ops
        ):
            self._chosen[chosen_key] = BASELINE
            return BASELINE
        capturing = A.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        contenders = self.contenders(candidate, op)
        known = {name: self._verdict_if_known(name, problem, A.device) for name in contenders}
        verdicts = [verdict for verdict in known.values() if verdict is not None]
        expected = self._expected_winner(problem, A.device, contenders)
        untuned = [name for name in contenders if known[name] is None]
        untuned.sort(key=lambda name: name != expected)  # the expected winner first
        for contender in untuned:
            if expected not in (None, contender) and any(verdict.won for verdict in verdicts):
                _log(
                    f"skipped {problem.describe()} backend={contender}: "
                    f"{fastest_winner(verdicts)} won it and no other is expected to win here "
                    f"({SYRK_AUTOTUNE_PRIOR_ENV}=0 tunes every contender)"
                )
                continue
            if capturing:
                return BASELINE  # never tune inside a capture, and remember nothing
            verdicts.append(self.tune(contender, problem, A.device))
        chosen = fastest_winner(verdicts)
        self._chosen[chosen_key] = chosen
        return chosen

    def compile_for(
        self,
        candidate: str,
        A: Tensor,
        C: Tensor | None = None,
        *,
        op: str = SYRK,
        B: Tensor | None = None,
    ) -> str:
        """What a background compile job (``dmuon_kernels.compile_job``) runs instead of
        ``choose``: the kernels ``choose`` would compile for this problem (``compile_plan``) are
        built, each by one call on the tuning inputs (so they land in the on-disk caches), and
        nothing is timed or recorded. Returns the first that ran, for the caller's own call to
        go through it too (the iteration's alpha and beta), else cuBLAS."""
        if candidate == BASELINE:
            return BASELINE
        problem = SyrkProblem.of(A, C, op, B)
        if problem.flop < self.min_flop or (
            self.tuned_ops is not None and problem.op not in self.tuned_ops
        ):
            return BASELINE
        built = [
            name
            for name in self.compile_plan(candidate, problem, A.device)
            if self._build(name, problem, A.device)
        ]
        return built[0] if built else BASELINE

    def compile_plan(self, candidate: str, problem: SyrkProblem, device: torch.device) -> list[str]:
        """The contenders whose kernels ``choose`` may need for ``problem``: the winner of the
        verdicts already known; else every contender not tuned yet, the prior's expected winner
        first. ``choose`` tunes the others only when the expected one loses ([Note: the SM90
        prior]), but which one loses is known only from timings, and a job builds what tuning
        may load so that the training process never compiles: a kernel built in vain costs the
        job's time, not a step's (an H100 run lost quack's verdict at (2048, 4096) and then
        compiled the CuTe kernel in the step)."""
        contenders = self.contenders(candidate, problem.op)
        known = {name: self._verdict_if_known(name, problem, device) for name in contenders}
        verdicts = [verdict for verdict in known.values() if verdict is not None]
        if any(verdict.won for verdict in verdicts):
            return [fastest_winner(verdicts)]
        untuned = [name for name in contenders if known[name] is None]
        expected = self._expected_winner(problem, device, contenders)
        if expected in untuned:
            untuned.remove(expected)
            untuned.insert(0, expected)
        return untuned

    def _build(self, name: str, problem: SyrkProblem, device: torch.device) -> bool:
        """One call of ``name`` on ``problem``'s tuning inputs (compiling its kernel, or loading
        it); False, with a line, when it raises."""
        try:
            _tuning_inputs(problem, device).run(self.backend(name), problem.op)
            torch.cuda.synchronize(device)
        except Exception as exc:  # that contender is not compiled; choose() will say why
            _log(
                f"compile of {problem.describe()} backend={name} failed "
                f"({type(exc).__name__}: {exc})"
            )
            return False
        return True

    def contenders(self, candidate: str, op: str) -> list[str]:
        """``candidate`` (the hardware ladder's pick) first, then the challengers that
        implement ``op``."""
        names = [candidate]
        for name in self._challengers():
            if name not in names and (op == SYRK or hasattr(self.backend(name), op)):
                names.append(name)
        return names

    def _expected_winner(
        self, problem: SyrkProblem, device: torch.device, contenders: list[str]
    ) -> str | None:
        """The prior's pick when it is one of several contenders and the prior is switched on
        (``DMUON_SYRK_AUTOTUNE_PRIOR``), else None."""
        if self.prior is None or len(contenders) < 2:
            return None
        if not env_flag(SYRK_AUTOTUNE_PRIOR_ENV, default=True):
            return None
        expected = self.prior(problem, device)
        return expected if expected in contenders else None

    def _challengers(self) -> tuple[str, ...]:
        if self.challengers is not None:
            return self.challengers
        return tuple(name for name in FAST_BACKENDS if backend_availability(name)[0])

    def _key(
        self, candidate: str, problem: SyrkProblem, device: torch.device
    ) -> tuple[VerdictCache, str]:
        model = gpu_model(device) if device.type == "cuda" else "cpu"
        if candidate not in self._versions:
            self._versions[candidate] = library_versions(
                self.backend(candidate), self.backend(BASELINE)
            )
        key = verdict_key(problem, candidate, self._versions[candidate])
        return self.cache_for(model), key

    def _verdict_if_known(
        self, candidate: str, problem: SyrkProblem, device: torch.device
    ) -> Verdict | None:
        cache, key = self._key(candidate, problem, device)
        verdict = cache.get(key)
        if verdict is None or verdict.backend not in (candidate, BASELINE):
            return None
        return verdict

    def tune(self, candidate: str, problem: SyrkProblem, device: torch.device) -> Verdict:
        """Cross-check and time ``candidate`` against cuBLAS on ``problem``; record and return
        the verdict."""
        cache, key = self._key(candidate, problem, device)
        _log(f"candidate started {problem.describe()} backend={candidate}")
        with timed_phase(AUTOTUNE, f"{problem.describe()} backend={candidate}") as phase:
            try:
                verdict = _measure(
                    problem, device, candidate, self.backend(candidate), self.backend(BASELINE)
                )
                persist = True
            except torch.cuda.OutOfMemoryError as exc:
                reason = f"out of memory while tuning ({exc})"
                verdict = problem.verdict(candidate, BASELINE, reason)
                persist = False  # another process (or a later run) may have the memory
            except Exception as exc:  # a candidate that raises loses; the reason is logged
                reason = f"{candidate} raised {type(exc).__name__}: {exc}"
                verdict = problem.verdict(candidate, BASELINE, reason)
                persist = False
            cache.put(key, verdict, persist=persist)
        _log(
            f"verdict {problem.describe()} backend={verdict.backend} ({verdict.reason}); "
            f"took {phase.seconds:.1f} s"
        )
        return verdict


def fastest_winner(verdicts: Sequence[Verdict]) -> str:
    """The backend of the verdict with the largest speed-up over cuBLAS among those the
    candidate won; each speed-up is against cuBLAS timed in the same interleaved run, so
    verdicts measured at different times compare fairly."""
    best, best_speedup = BASELINE, 1.0
    for verdict in verdicts:
        if verdict.won and verdict.speedup > best_speedup:
            best, best_speedup = verdict.backend, verdict.speedup
    return best


@dataclass(slots=True)
class _TuningInputs:
    A: Tensor  # (batch?, M, K)
    B: Tensor | None  # symmetric_product: (batch?, M, M), A + I so A·B = A² + A exactly;
    #                   matmul: (batch?, K, N)
    C: Tensor | None  # (batch?, M, M) symmetric; (batch?, M, N) for matmul
    alpha: float
    beta: float

    def run(self, backend: Any, op: str) -> Tensor:
        """``op`` through ``backend`` (a module of the registry, or a test's stand-in)."""
        if op == SYRK:
            return backend.syrk(self.A, self.C, self.alpha, self.beta)
        return getattr(backend, op)(self.A, self.B, self.C, self.alpha, self.beta)

    def fp32_reference(self) -> Tensor:
        """alpha·A·B + beta·C (B = Aᵀ for syrk) in true fp32, TF32 off for this product only,
        for the first and last matrices of a batch (``_sample``)."""
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            A32 = _sample(self.A).float()
            B32 = A32.mT if self.B is None else _sample(self.B).float()
            product = torch.matmul(A32, B32).mul_(self.alpha)
            if self.C is None:
                return product
            return product.add_(_sample(self.C).float(), alpha=self.beta)
        finally:
            torch.set_float32_matmul_precision(previous)

    def error_of(self, backend: Any, op: str, reference: Tensor) -> float:
        """The relative error of ``backend``'s result against ``reference``, the output freed
        before returning."""
        return _relative_error(_sample(self.run(backend, op)), reference)


def _sample(t: Tensor) -> Tensor:
    """What is cross-checked: the first and last matrices of a batch (a kernel that mis-steps
    through the batch gets the last one wrong), the matrix itself when unbatched."""
    return t[[0, -1]] if t.dim() == 3 else t


def _random(
    shape: tuple[int, ...], generator: torch.Generator, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """Standard normal entries drawn straight in ``dtype`` (no fp32 copy of a large input)."""
    return torch.randn(shape, generator=generator, device=device, dtype=dtype)


def _symmetric(
    shape: tuple[int, ...], generator: torch.Generator, device: torch.device, dtype: torch.dtype
) -> Tensor:
    S = _random(shape, generator, device, dtype)
    return S.add_(S.mT.clone()).mul_(0.5)


def _tuning_inputs(problem: SyrkProblem, device: torch.device) -> _TuningInputs:
    generator = torch.Generator(device=device)
    generator.manual_seed(TUNING_SEED)
    lead = (problem.batch,) if problem.batch else ()
    square = (*lead, problem.M, problem.M)
    alpha, beta = (1.0, 0.0)
    if problem.has_c:
        alpha, beta = TUNING_ALPHA_WITH_C[problem.op], TUNING_BETA_WITH_C
    dtype = problem.dtype
    if problem.op == MATMUL:
        shapes = ((problem.M, problem.K), (problem.K, problem.N), (problem.M, problem.N))
        A, B, C = (
            _random((*lead, *shape), generator, device, dtype).mul_(problem.K**-0.25)
            for shape in shapes
        )
        return _TuningInputs(A, B, C if problem.has_c else None, alpha, beta)
    C = _symmetric(square, generator, device, dtype) if problem.has_c else None
    if problem.op == SYMMETRIC_PRODUCT:
        # Symmetric with a zero diagonal, so B = A + I is exact in any dtype and commutes with A.
        A = _symmetric(square, generator, device, dtype).mul_(problem.M**-0.25)
        A.diagonal(dim1=-2, dim2=-1).zero_()
        B = A.clone()
        B.diagonal(dim1=-2, dim2=-1).fill_(1.0)
        return _TuningInputs(A, B, C, alpha, beta)
    # Scale so A·Aᵀ has entries of order 1 off the diagonal and sqrt(K) on it: well inside fp16.
    A = _random((*lead, problem.M, problem.K), generator, device, dtype).mul_(problem.K**-0.25)
    return _TuningInputs(A, None, C, alpha, beta)


def _relative_error(out: Tensor, reference: Tensor) -> float:
    difference = torch.linalg.vector_norm((out.float() - reference).flatten())
    return float(difference / torch.linalg.vector_norm(reference.flatten()).clamp_min(1e-30))


def _measure(
    problem: SyrkProblem,
    device: torch.device,
    candidate: str,
    candidate_module: object,
    baseline_module: object,
) -> Verdict:
    if problem.op != SYRK and not hasattr(candidate_module, problem.op):
        return problem.verdict(candidate, BASELINE, f"{candidate} has no {problem.op}")
    inputs = _tuning_inputs(problem, device)
    reference = inputs.fp32_reference()
    candidate_error = inputs.error_of(candidate_module, problem.op, reference)
    baseline_error = inputs.error_of(baseline_module, problem.op, reference)
    del reference
    bound = ERROR_RATIO_LIMIT * baseline_error + ERROR_FLOOR_ULPS * _unit_roundoff(problem.dtype)
    errors = {"candidate_error": candidate_error, "cublas_error": baseline_error}
    if not candidate_error <= bound:  # also catches NaN
        reason = (
            f"{candidate} failed the cross-check: relative error {candidate_error:.3g} > "
            f"{bound:.3g} ({ERROR_RATIO_LIMIT:g}x cuBLAS's {baseline_error:.3g} + floor)"
        )
        return problem.verdict(candidate, BASELINE, reason, **errors)

    timings = median_ms(
        {
            candidate: lambda: inputs.run(candidate_module, problem.op),
            BASELINE: lambda: inputs.run(baseline_module, problem.op),
        },
        device,
    )
    candidate_ms, baseline_ms = timings[candidate], timings[BASELINE]
    wins = candidate_ms < (1.0 - WIN_MARGIN) * baseline_ms
    reason = (
        f"{candidate} {candidate_ms:.4f} ms vs cublas {baseline_ms:.4f} ms, "
        f"error {candidate_error:.3g} vs {baseline_error:.3g}"
    )
    return problem.verdict(
        candidate,
        candidate if wins else BASELINE,
        reason,
        candidate_ms=candidate_ms,
        cublas_ms=baseline_ms,
        **errors,
    )


_default_tuner: SyrkAutotuner | None = None


def default_autotuner() -> SyrkAutotuner:
    """The process-wide tuner the dispatcher uses (cache folder from ``DMUON_CACHE_DIR``)."""
    global _default_tuner
    if _default_tuner is None:
        _default_tuner = SyrkAutotuner(
            min_flop=MIN_TUNED_FLOP, tuned_ops=TUNED_OPS, prior=measured_prior
        )
    return _default_tuner


# True in a background compile job's process (``compile_only_in_this_process``).
_compile_only = False


def compile_only_in_this_process() -> None:
    """From now on "auto" compiles what it would tune and times nothing
    (``SyrkAutotuner.compile_for``): for ``dmuon_kernels.compile_job``'s process only, whose
    timings would compete with the training process for the GPU."""
    global _compile_only
    _compile_only = True


def choose_kernel(
    candidate: str, A: Tensor, C: Tensor | None, *, op: str = SYRK, B: Tensor | None = None
) -> str:
    """Dispatcher hook: the backend that runs this call under ``kernel="auto"``."""
    if _compile_only:
        return default_autotuner().compile_for(candidate, A, C, op=op, B=B)
    return default_autotuner().choose(candidate, A, C, op=op, B=B)


def chosen_backends() -> dict[str, int]:
    """How many problems this process has run under "auto", per backend (for status reports)."""
    counts: dict[str, int] = {}
    for backend in default_autotuner()._chosen.values():
        counts[backend] = counts.get(backend, 0) + 1
    return counts


__all__ = [
    "AUTOTUNE_LOG_ENV",
    "ERROR_RATIO_LIMIT",
    "MIN_TUNED_FLOP",
    "TUNED_OPS",
    "SyrkAutotuner",
    "SyrkProblem",
    "Verdict",
    "autotune_log_enabled",
    "choose_kernel",
    "chosen_backends",
    "default_autotuner",
    "fastest_winner",
    "gpu_model",
    "measured_prior",
    "verdict_key",
]
