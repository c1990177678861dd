"""The quack backend: alpha·A·Aᵀ + beta·C through quack-kernels' symmetric GEMM (SM90+).

Owns the adapter over ``quack.gemm_interface.gemm_symmetric`` (quack-kernels 0.5.0 with
nvidia-cutlass-dsl 4.5.2, and newer releases whose signature still fits) for ``syrk`` and
``symmetric_product``, and over its plain ``gemm``/``gemm_add`` (one untuned configuration) for
``matmul``: probing that the library and the GPU can run it, and bringing operands to the layout
quack requires, for all three operations in one place (``_run``). It is the only module that
imports quack, and only on first use, so importing dmuon_kernels never fails because quack is
missing. It must not choose between backends (the dispatcher and the autotuner do that) and must
not fall back silently to another library: when quack cannot run, it says why.

What quack requires, and what the adapter does about it:

- fp16 or bf16 operands on a CUDA device with compute capability 9.0 or newer;
- every stride but the unit one, and the data pointer, 16-byte aligned: operands that are not
  are copied contiguous, and sizes that are not multiples of 8 elements are zero-padded (zero
  rows and columns add nothing to any of the products), the result sliced back;
- quack computes the upper triangle and mirrors it, so C must be symmetric (as it always is in
  Newton-Schulz); a non-symmetric C gives the symmetrised upper triangle of the true result;
- a batch (L, M, K) runs natively in one launch; deeper batches are flattened to one.

[Note: host cost of a quack call]

quack 0.5's ``gemm_symmetric`` reaches its launcher through a torch custom op
(``quack::gemm_symmetric_out``), whose dispatch (autograd, in-place-or-view and backend layers,
all in Python) cost about half of a warmed call's 106-201 µs of host time on the H200
(``benchmarks/results/dispatch-h200-2026-12-01-48aeddf.log``). The custom op exists for
``torch.compile``; these calls run eagerly (or inside a CUDA-graph capture, which records the
same kernel), so the adapter calls the function the op wraps (kept by torch as the op's
``_init_fn``) with the arguments ``gemm_symmetric`` passes it, when the probe finds it taking
them; otherwise it calls ``gemm_symmetric``. Both launch the same compiled kernel on the same
stream (tests/gpu/test_dispatch_cache_gpu.py checks the two give the same bits). The rest of a
call is quack's own Python (operand views, its compile-cache lookup, launch arguments).

The first call of each kernel variant in a process (quack compiles per dtype, layout, with or
without C and whether alpha and beta are 1) compiles it, or loads it from quack's disk cache: that
call is timed as a ``compile`` phase and announced with its seconds (``DMUON_SYRK_AUTOTUNE_LOG=0``
silences the line), like the library import.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dmuon_kernels._env import progress_lines_enabled, quietly
from dmuon_kernels._log import COMPILE, IMPORT, log_rank_tagged, timed_phase
from dmuon_kernels.syrk._operands import effective_c, one_batch
from dmuon_kernels.syrk._requirements import (
    check_gpu_operands,
    distribution_version,
    gpu_problem,
)
from dmuon_kernels.syrk.kernel_cache import share_compile_caches
from dmuon_kernels.syrk.registry import MATMUL, SYMMETRIC_PRODUCT, SYRK, extra_install_command

QUACK_MIN_COMPUTE_CAPABILITY = (9, 0)
QUACK_INSTALL_HINT = extra_install_command("quack")

# quack's TMA loads need 16-byte aligned rows: 8 elements of fp16/bf16.
_ALIGNMENT_BYTES = 16
# quack accepts A with either K or M contiguous (A = Xᵀ of a contiguous X is M-contiguous), which
# saves a transposing copy; see test_quack_accepts_transposed_views in tests/gpu.
_ACCEPTS_M_MAJOR = True


@dataclass(frozen=True, slots=True)
class _QuackApi:
    """What the probe found: the entry point, how to call it, and the versions for cache keys."""

    gemm_symmetric: Callable[..., Tensor]
    accepts_out: bool
    quack_version: str
    cutlass_version: str
    # Plain GEMMs (alpha·A·B, alpha·A·B + beta·C) for ``matmul``; None when this release lacks
    # them with an untuned mode (then ``matmul`` raises and autotune keeps cuBLAS).
    gemm: Callable[..., Tensor] | None = None
    gemm_add: Callable[..., Tensor] | None = None
    # The launcher ``gemm_symmetric`` reaches through torch's custom-op dispatch, called
    # directly as (A, B, out, C, alpha=..., beta=...); None where this release has none that
    # takes those (see [Note: host cost of a quack call]).
    symmetric_launcher: Callable[..., None] | None = None


_probe_result: _QuackApi | str | None = None  # the probe runs once per process


def _probe_quack() -> _QuackApi | str:
    """Import quack and check its symmetric GEMM; a string is the reason it cannot be used."""
    if importlib.util.find_spec("quack") is None:
        return "quack-kernels is not installed"
    # Before the first ``import quack``: quack reads QUACK_CACHE_DIR once, when it is imported.
    share_compile_caches()
    try:
        with timed_phase(IMPORT, "quack-kernels") as phase:
            import quack
            from quack import gemm_interface
    except Exception as exc:  # a broken cutlass-dsl raises anything from ImportError to OSError
        return (
            f"quack-kernels is installed but failed to import ({type(exc).__name__}: {exc}); "
            "it needs a matching nvidia-cutlass-dsl (quack-kernels 0.5.0 pairs with "
            f"nvidia-cutlass-dsl 4.5.2): reinstall with {QUACK_INSTALL_HINT}"
        )
    quack_version = str(getattr(quack, "__version__", distribution_version("quack-kernels")))
    if quietly(progress_lines_enabled):
        log_rank_tagged(
            f"imported quack-kernels {quack_version} (with nvidia-cutlass-dsl) in "
            f"{phase.seconds:.1f} s, once per process"
        )
    entry = getattr(gemm_interface, "gemm_symmetric", None)
    if not callable(entry):
        return (
            f"quack-kernels {quack_version} has no quack.gemm_interface.gemm_symmetric; "
            "dmuon-kernels knows the API of quack-kernels 0.5.0. Install that release "
            "(pip install 'quack-kernels==0.5.0' 'nvidia-cutlass-dsl==4.5.2') or use "
            'kernel="auto"'
        )
    try:
        signature = inspect.signature(entry)
    except (TypeError, ValueError):
        return (
            f"quack-kernels {quack_version}: the signature of gemm_symmetric cannot be read, so "
            "dmuon-kernels cannot check it takes (A, B, C=..., alpha=..., beta=...); install "
            'quack-kernels==0.5.0 with nvidia-cutlass-dsl==4.5.2 or use kernel="auto"'
        )
    parameters = signature.parameters
    positional = [
        p
        for p in parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("C", "out")
    ]
    missing = [name for name in ("C", "alpha", "beta") if name not in parameters]
    if len(positional) < 2 or missing:
        return (
            f"quack-kernels {quack_version}: gemm_symmetric{signature} does not "
            "take (A, B, C=..., alpha=..., beta=...) as in quack-kernels 0.5.0"
            + (f" (missing {', '.join(missing)})" if missing else "")
            + "; install quack-kernels==0.5.0 with nvidia-cutlass-dsl==4.5.2 or use "
            'kernel="auto"'
        )
    return _QuackApi(
        gemm_symmetric=entry,
        accepts_out="out" in parameters,
        quack_version=quack_version,
        cutlass_version=distribution_version("nvidia-cutlass-dsl"),
        gemm=_untuned_entry(gemm_interface, "gemm", ("A", "B", "alpha")),
        gemm_add=_untuned_entry(gemm_interface, "gemm_add", ("A", "B", "C", "alpha", "beta")),
        symmetric_launcher=_undispatched(gemm_interface, "gemm_symmetric_out"),
    )


def _untuned_entry(module: object, name: str, required: tuple[str, ...]) -> Callable | None:
    """``module.name`` when it takes ``required`` and ``tuned`` (we pass tuned=False: quack's own
    autotuner would compile dozens of configurations; ours compares one against cuBLAS)."""
    entry = getattr(module, name, None)
    try:
        parameters = inspect.signature(entry).parameters if callable(entry) else {}
    except (TypeError, ValueError):
        return None
    return entry if all(p in parameters for p in (*required, "tuned")) else None


# What the launcher behind quack's custom op must take for the adapter to call it directly.
_LAUNCHER_PARAMETERS = ("A", "B", "out", "C", "alpha", "beta")


def _undispatched(module: object, name: str) -> Callable[..., None] | None:
    """The function torch's custom op ``module.name`` wraps (``_init_fn`` of a
    ``torch.library.custom_op``), when it takes ``_LAUNCHER_PARAMETERS``; else None."""
    function = getattr(getattr(module, name, None), "_init_fn", None)
    try:
        parameters = inspect.signature(function).parameters if callable(function) else {}
    except (TypeError, ValueError):
        return None
    return function if all(p in parameters for p in _LAUNCHER_PARAMETERS) else None


def _quack_api() -> _QuackApi | str:
    global _probe_result
    if _probe_result is None:
        _probe_result = _probe_quack()
    return _probe_result


def _hardware_problem() -> str | None:
    return gpu_problem("quack's symmetric GEMM", QUACK_MIN_COMPUTE_CAPABILITY, "Hopper")


NAME = "quack"


def is_available() -> tuple[bool, str]:
    """``(usable here?, why)`` for the current CUDA device; never raises."""
    problem = _hardware_problem()
    if problem is not None:
        # Hardware first: it needs no import of quack (importing cutlass-dsl takes seconds).
        return False, problem
    api = _quack_api()
    if isinstance(api, str):
        return False, api
    return True, f"quack-kernels {api.quack_version}, nvidia-cutlass-dsl {api.cutlass_version}"


def versions() -> dict[str, str]:
    """Library versions that make a cached autotune verdict stale when they change."""
    api = _quack_api()
    if isinstance(api, str):
        return {}
    return {"quack-kernels": api.quack_version, "nvidia-cutlass-dsl": api.cutlass_version}


def syrk(
    A: Tensor,  # (..., M, K)
    C: Tensor | None = None,  # (..., M, M), symmetric
    alpha: float = 1.0,
    beta: float = 0.0,
) -> Tensor:  # (..., M, M), exactly symmetric
    """``alpha·A·Aᵀ + beta·C`` through quack; RuntimeError with the reason when it cannot run."""
    return _run(SYRK, A, None, C, alpha, beta)


def symmetric_product(
    A: Tensor,  # (..., M, M)
    B: Tensor,  # (..., M, M), with A·B symmetric
    C: Tensor | None = None,  # (..., M, M), symmetric
    alpha: float = 1.0,
    beta: float = 0.0,
) -> Tensor:  # (..., M, M), exactly symmetric
    """``alpha·A·B + beta·C`` where A·B is known to be symmetric (A, B commuting symmetric
    matrices, e.g. polynomials in one Gram matrix): quack computes the upper triangle of tiles
    and mirrors it, half the work of a full product."""
    if B.shape != A.shape or A.shape[-1] != A.shape[-2]:
        raise ValueError(
            f"symmetric_product takes square A and B of one shape, got A {tuple(A.shape)} and "
            f"B {tuple(B.shape)}"
        )
    return _run(SYMMETRIC_PRODUCT, A, B, C, alpha, beta)


def matmul(
    A: Tensor,  # (..., M, K)
    B: Tensor,  # (..., K, N)
    C: Tensor | None = None,  # (..., M, N)
    alpha: float = 1.0,
    beta: float = 0.0,
) -> Tensor:  # (..., M, N)
    """``alpha·A·B + beta·C`` through quack's plain GEMM (one default configuration)."""
    return _run(MATMUL, A, B, C, alpha, beta)


def _run(
    op: str, A: Tensor, B: Tensor | None, C: Tensor | None, alpha: float, beta: float
) -> Tensor:
    """The one operand front of the three operations: checks, the beta rule, one batch
    dimension, padding and alignment, then quack, then the result sliced back.

    ``op`` is SYRK (B None: A·Aᵀ), SYMMETRIC_PRODUCT (B square like A) or MATMUL (B (..., K, N)).
    """
    api = _quack_api()
    if isinstance(api, str):
        raise RuntimeError(f"SYRK kernel 'quack' cannot run: {api}")
    if op == MATMUL and (api.gemm is None or api.gemm_add is None):
        raise RuntimeError(
            f"quack-kernels {api.quack_version} has no gemm/gemm_add taking tuned=...; "
            "matmul runs on cuBLAS"
        )
    _check_operand(A, None if op == MATMUL else C)
    alpha, beta = float(alpha), float(beta)
    C = effective_c(C, beta)
    N = A.shape[-2] if B is None or op == SYMMETRIC_PRODUCT else B.shape[-1]
    out_shape = (*A.shape[:-1], N)
    if C is not None:
        C = C.to(A.dtype).expand(out_shape)
    if B is not None:
        B = B.to(A.dtype)
    if A.numel() == 0 or (B is not None and B.numel() == 0):
        out = torch.zeros(out_shape, dtype=A.dtype, device=A.device)
        return out.add_(C, alpha=beta) if C is not None else out
    A, B, C = one_batch(A), one_batch(B), one_batch(C)
    M = A.shape[-2]
    step = _elements_per_16_bytes(A)
    A = _aligned(_padded(A, step))
    B = A.mT if B is None else _aligned(_padded(B, step))  # syrk: Aᵀ, padded with A
    if C is not None:
        C = _aligned(_padded(C, step))
    out = _launch(api, op, A, B, C, alpha, beta)
    if out.shape[-2:] != (M, N):
        out = out[..., :M, :N].contiguous()
    return out.reshape(out_shape)


def _launch(
    api: _QuackApi, op: str, A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float
) -> Tensor:
    """quack on prepared operands; the first call of each kernel variant is timed and announced
    (see [Note: host cost of a quack call])."""
    layouts = (A.stride(-1) == 1, B.stride(-1) == 1, C is None or C.stride(-1) == 1)
    variant = (op, A.dtype, A.device, C is None, alpha == 1.0, beta == 1.0, layouts)
    if variant in _ready_variants:
        return _call(api, op, A, B, C, alpha, beta)
    announce = progress_lines_enabled()  # an invalid switch raises before any work
    entry = "gemm_symmetric" if op != MATMUL else "gemm" if C is None else "gemm_add"
    description = f"quack {entry} kernel for {str(A.dtype).removeprefix('torch.')}"
    description += " with C" if C is not None else ""
    with timed_phase(COMPILE, description) as phase:
        out = _call(api, op, A, B, C, alpha, beta)
    _ready_variants.add(variant)
    if announce:
        log_rank_tagged(
            f"{description} ready in {phase.seconds:.1f} s (first use of this variant in the "
            "process: compiled, or loaded from quack's own cache)"
        )
    return out


# The kernel variants quack has compiled or loaded in this process (see ``_launch``).
_ready_variants: set[tuple] = set()


def _call(
    api: _QuackApi, op: str, A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float
) -> Tensor:
    """One quack launch on prepared operands: ``gemm_symmetric(A, B, C=..., alpha=...,
    beta=...)`` (B (L, K, M) for quack: Aᵀ for syrk), or the plain GEMM for MATMUL."""
    if op == MATMUL:
        if C is None:
            return api.gemm(A, B, alpha=alpha, tuned=False)  # type: ignore[misc]
        return api.gemm_add(A, B, C, alpha=alpha, beta=beta, tuned=False)  # type: ignore[misc]
    if C is None:
        beta = 1.0  # unused without C; 1.0 selects quack's plain epilogue (one compile fewer)
    out_shape = (*A.shape[:-1], A.shape[-2])
    if api.symmetric_launcher is not None:
        out = torch.empty(out_shape, dtype=A.dtype, device=A.device)
        api.symmetric_launcher(A, B, out, C, alpha=alpha, beta=beta)
        return out
    kwargs: dict[str, object] = {"C": C, "alpha": alpha, "beta": beta}
    if api.accepts_out:
        kwargs["out"] = torch.empty(out_shape, dtype=A.dtype, device=A.device)
    return api.gemm_symmetric(A, B, **kwargs)


def _padded(t: Tensor, step: int) -> Tensor:
    """``t`` with its last two sizes zero-padded to multiples of ``step`` (``t`` itself when they
    are)."""
    pad_rows, pad_cols = -t.shape[-2] % step, -t.shape[-1] % step
    if pad_rows or pad_cols:
        return torch.nn.functional.pad(t, (0, pad_cols, 0, pad_rows))
    return t


def _elements_per_16_bytes(t: Tensor) -> int:
    return _ALIGNMENT_BYTES // t.element_size()


def _aligned(t: Tensor) -> Tensor:
    """``t`` itself when quack can read it in place (either of its last two dims contiguous, the
    other strides and the base 16-byte aligned), else a contiguous copy."""
    step = _elements_per_16_bytes(t)
    if t.data_ptr() % _ALIGNMENT_BYTES == 0:
        strides = t.stride()
        if strides[-1] == 1 and all(s % step == 0 for s in strides[:-1]):
            return t
        if (
            _ACCEPTS_M_MAJOR
            and strides[-2] == 1
            and all(s % step == 0 for i, s in enumerate(strides) if i != t.ndim - 2)
        ):
            return t
    return t.contiguous()


def _check_operand(A: Tensor, C: Tensor | None) -> None:
    check_gpu_operands("quack", A, C)
