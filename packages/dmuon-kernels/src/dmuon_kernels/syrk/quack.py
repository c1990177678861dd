"""The quack backend: alpha·A·Aᵀ + beta·C through quack-kernels' symmetric GEMM (SM90+).

Owns the adapter over ``quack.gemm_interface.gemm_symmetric`` (quack-kernels 0.5.0 with
nvidia-cutlass-dsl 4.5.2, and newer releases whose signature still fits) for ``syrk`` and
``symmetric_product``, and over its plain ``gemm``/``gemm_add`` (one untuned configuration) for
``matmul``: probing that the
library and the GPU can run it, and bringing operands to the layout quack requires. It is the
only module that imports quack, and only on first use, so importing dmuon_kernels never fails
because quack is missing. It must not choose between backends (the dispatcher and the autotuner
do that) and must not fall back silently to another library: when quack cannot run, it says why.

What quack requires, and what the adapter does about it:

- fp16 or bf16 operands on a CUDA device with compute capability 9.0 or newer;
- every stride but the unit one, and the data pointer, 16-byte aligned: operands that are not
  are copied contiguous, and M or K that are not multiples of 8 elements are zero-padded (zero
  rows and columns add nothing to A·Aᵀ), the result sliced back;
- quack computes the upper triangle and mirrors it, so C must be symmetric (as it always is in
  Newton-Schulz); a non-symmetric C gives the symmetrised upper triangle of the true result;
- a batch (L, M, K) runs natively in one launch.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dmuon_kernels.syrk._requirements import (
    check_gpu_operands,
    distribution_version,
    gpu_problem,
)
from dmuon_kernels.syrk.kernel_cache import share_compile_caches

QUACK_MIN_COMPUTE_CAPABILITY = (9, 0)
QUACK_INSTALL_HINT = "pip install dmuon-kernels[quack]"

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


_probe_result: _QuackApi | str | None = None  # the probe runs once per process


def _probe_quack() -> _QuackApi | str:
    """Import quack and check its symmetric GEMM; a string is the reason it cannot be used."""
    if importlib.util.find_spec("quack") is None:
        return "quack-kernels is not installed"
    # Before the first ``import quack``: quack reads QUACK_CACHE_DIR once, when it is imported.
    share_compile_caches()
    try:
        import quack
        from quack import gemm_interface
    except Exception as exc:  # a broken cutlass-dsl raises anything from ImportError to OSError
        return (
            f"quack-kernels is installed but failed to import ({type(exc).__name__}: {exc}); "
            "it needs a matching nvidia-cutlass-dsl (quack-kernels 0.5.0 pairs with "
            f"nvidia-cutlass-dsl 4.5.2): reinstall with {QUACK_INSTALL_HINT}"
        )
    quack_version = str(getattr(quack, "__version__", distribution_version("quack-kernels")))
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
    api = _quack_api()
    if isinstance(api, str):
        raise RuntimeError(f"SYRK kernel 'quack' cannot run: {api}")
    _check_operand(A, C)
    alpha, beta = float(alpha), float(beta)
    if beta == 0.0:
        C = None  # beta·C with beta = 0 must not propagate NaN/inf from C, as in torch.addmm
    M, K = A.shape[-2], A.shape[-1]
    out_shape = (*A.shape[:-1], M)
    if C is not None:
        C = C.to(A.dtype).expand(out_shape)
    if M == 0 or K == 0 or A.numel() == 0:
        out = torch.zeros(out_shape, dtype=A.dtype, device=A.device)
        return out.add_(C, alpha=beta) if C is not None else out
    if A.dim() > 3:  # quack takes one batch dimension
        flat_C = None if C is None else C.reshape(-1, M, M)
        return syrk(A.reshape(-1, M, K), flat_C, alpha, beta).reshape(out_shape)

    pad_m, pad_k = -M % _elements_per_16_bytes(A), -K % _elements_per_16_bytes(A)
    if pad_m or pad_k:
        A = torch.nn.functional.pad(A, (0, pad_k, 0, pad_m))
        if C is not None:
            C = torch.nn.functional.pad(C, (0, pad_m, 0, pad_m))
    A = _aligned(A, allow_m_major=_ACCEPTS_M_MAJOR)
    if C is not None:
        C = _aligned(C, allow_m_major=True)  # symmetric: either major reads the same matrix

    out = _call(api, A, A.mT, C, alpha, beta)
    return out[..., :M, :M].contiguous() if pad_m else out


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
    api = _quack_api()
    if isinstance(api, str):
        raise RuntimeError(f"SYRK kernel 'quack' cannot run: {api}")
    _check_operand(A, C)
    if B.shape != A.shape or A.shape[-1] != A.shape[-2]:
        raise ValueError(
            f"symmetric_product takes square A and B of one shape, got A {tuple(A.shape)} and "
            f"B {tuple(B.shape)}"
        )
    alpha, beta = float(alpha), float(beta)
    if beta == 0.0:
        C = None
    M = A.shape[-1]
    if C is not None:
        C = C.to(A.dtype).expand(A.shape)
    if A.numel() == 0:
        out = torch.zeros(A.shape, dtype=A.dtype, device=A.device)
        return out.add_(C, alpha=beta) if C is not None else out
    if A.dim() > 3:
        flat_C = None if C is None else C.reshape(-1, M, M)
        flat = symmetric_product(
            A.reshape(-1, M, M), B.to(A.dtype).reshape(-1, M, M), flat_C, alpha, beta
        )
        return flat.reshape(A.shape)
    pad = -M % _elements_per_16_bytes(A)
    B = B.to(A.dtype)
    if pad:
        A, B = (torch.nn.functional.pad(t, (0, pad, 0, pad)) for t in (A, B))
        if C is not None:
            C = torch.nn.functional.pad(C, (0, pad, 0, pad))
    A = _aligned(A, allow_m_major=_ACCEPTS_M_MAJOR)
    B = _aligned(B, allow_m_major=True)
    if C is not None:
        C = _aligned(C, allow_m_major=True)
    out = _call(api, A, B, C, alpha, beta)
    return out[..., :M, :M].contiguous() if pad else out


def matmul(
    A: Tensor,  # (..., M, K)
    B: Tensor,  # (..., K, N)
    C: Tensor | None = None,  # (..., M, N)
    alpha: float = 1.0,
    beta: float = 0.0,
) -> Tensor:  # (..., M, N)
    """``alpha·A·B + beta·C`` through quack's plain GEMM (one default configuration)."""
    api = _quack_api()
    if isinstance(api, str):
        raise RuntimeError(f"SYRK kernel 'quack' cannot run: {api}")
    if api.gemm is None or api.gemm_add is None:
        raise RuntimeError(
            f"quack-kernels {api.quack_version} has no gemm/gemm_add taking tuned=...; "
            "matmul runs on cuBLAS"
        )
    _check_operand(A, None)
    alpha, beta = float(alpha), float(beta)
    if beta == 0.0:
        C = None
    M, K, N = A.shape[-2], A.shape[-1], B.shape[-1]
    out_shape = (*A.shape[:-1], N)
    if C is not None:
        C = C.to(A.dtype).expand(out_shape)
    B = B.to(A.dtype)
    if A.numel() == 0 or B.numel() == 0:
        out = torch.zeros(out_shape, dtype=A.dtype, device=A.device)
        return out.add_(C, alpha=beta) if C is not None else out
    if A.dim() > 3:
        flat_C = None if C is None else C.reshape(-1, M, N)
        flat = matmul(A.reshape(-1, M, K), B.reshape(-1, K, N), flat_C, alpha, beta)
        return flat.reshape(out_shape)
    step = _elements_per_16_bytes(A)
    pad_m, pad_k, pad_n = -M % step, -K % step, -N % step
    if pad_m or pad_k or pad_n:
        A = torch.nn.functional.pad(A, (0, pad_k, 0, pad_m))
        B = torch.nn.functional.pad(B, (0, pad_n, 0, pad_k))
        if C is not None:
            C = torch.nn.functional.pad(C, (0, pad_n, 0, pad_m))
    A, B = _aligned(A, allow_m_major=True), _aligned(B, allow_m_major=True)
    if C is None:
        out = api.gemm(A, B, alpha=alpha, tuned=False)
    else:
        out = api.gemm_add(
            A, B, _aligned(C, allow_m_major=True), alpha=alpha, beta=beta, tuned=False
        )
    return out[..., :M, :N].contiguous() if pad_m or pad_n else out


def _call(
    api: _QuackApi, A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float
) -> Tensor:
    """quack's ``gemm_symmetric(A, B, C=..., alpha=..., beta=...)`` on prepared operands."""
    if C is None:
        beta = 1.0  # unused without C; 1.0 selects quack's plain epilogue (one compile fewer)
    kwargs: dict[str, object] = {"C": C, "alpha": alpha, "beta": beta}
    if api.accepts_out:
        out_shape = (*A.shape[:-1], A.shape[-2])
        kwargs["out"] = torch.empty(out_shape, dtype=A.dtype, device=A.device)
    return api.gemm_symmetric(A, B, **kwargs)


def _elements_per_16_bytes(t: Tensor) -> int:
    return _ALIGNMENT_BYTES // t.element_size()


def _aligned(t: Tensor, *, allow_m_major: bool) -> Tensor:
    """``t`` itself when quack can read it in place, else a contiguous copy."""
    step = _elements_per_16_bytes(t)
    if t.data_ptr() % _ALIGNMENT_BYTES == 0:
        strides = t.stride()
        if strides[-1] == 1 and all(s % step == 0 for s in strides[:-1]):
            return t
        if (
            allow_m_major
            and strides[-2] == 1
            and all(s % step == 0 for i, s in enumerate(strides) if i != t.ndim - 2)
        ):
            return t
    return t.contiguous()


def _check_operand(A: Tensor, C: Tensor | None) -> None:
    check_gpu_operands("quack", A, C)
