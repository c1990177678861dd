"""SYRK and its sibling products: ``syrk(A, C=None, alpha, beta, kernel)`` returns
``alpha·A·Aᵀ + beta·C``; ``symmetric_product`` and ``matmul`` serve Newton-Schulz's other
products.

Owns the three operations and the validation of their operands. Which backend computes each
call is ``syrk.dispatch``'s decision (its docstring lists the order), taken on the first call of
each operand signature and remembered by ``syrk._call_cache`` (a warmed call checks only alpha
and beta, then runs the remembered backend function); the kernel names and the backend registry
live in ``syrk.registry``; both are re-exported here. Backends live one per
module (``cublas``, ``quack``, ``cute``). A backend is any object (usually a module) with::

    is_available() -> tuple[bool, str]      # (usable here?, human-readable reason)
    syrk(A, C, alpha, beta) -> Tensor       # A (..., M, K), C (..., M, M) or None; symmetric out

and optionally ``symmetric_product(A, B, C, alpha, beta)`` for ``alpha·A·B + beta·C`` when A·B is
known to be symmetric (commuting symmetric A and B, as in Newton-Schulz's Gram iteration) and
``matmul(A, B, C, alpha, beta)`` for a plain ``alpha·A·B + beta·C`` (Newton-Schulz's other
products); a backend without one runs that operation on the torch path. Each operation is
resolved (and autotuned under "auto") on its own.

This module must not import optional libraries, torch.distributed, or anything from dmuon.
"""

from __future__ import annotations

import numbers

from torch import Tensor

from dmuon_kernels.syrk import _call_cache
from dmuon_kernels.syrk._requirements import KERNEL_DTYPES
from dmuon_kernels.syrk.dispatch import auto_candidate, resolve_kernel, sm_version
from dmuon_kernels.syrk.registry import (
    AUTO,
    BACKEND_MODULES,
    CUBLAS,
    CUTE,
    FAST_BACKENDS,
    INSTALL_HINTS,
    KERNEL_ALIASES,
    MATMUL,
    QUACK,
    SYMMETRIC_PRODUCT,
    SYRK,
    SyrkBackend,
    backend_availability,
    backend_names,
    canonical_kernel_name,
    get_backend,
    kernel_choices,
    register_backend,
    require_available,
    unregister_backend,
)


def _validate_scalars(C: Tensor | None, alpha: object, beta: object) -> None:
    """The checks a remembered signature still needs on every call: alpha and beta."""
    for label, value in (("alpha", alpha), ("beta", beta)):
        if type(value) is not float and (
            isinstance(value, bool) or not isinstance(value, numbers.Real)
        ):
            raise ValueError(f"syrk {label} must be a real number; got {value!r}")
    if C is None and beta != 0:
        raise ValueError(
            f"syrk got beta={beta!r} but no C: pass C=<(..., M, M) tensor> or leave beta=0"
        )


def _validate_operands(A: Tensor, C: Tensor | None, alpha: object, beta: object) -> None:
    if not isinstance(A, Tensor) or A.dim() < 2 or not A.is_floating_point():
        described = f"a {A.dim()}-D {A.dtype} tensor" if isinstance(A, Tensor) else type(A).__name__
        raise ValueError(
            f"syrk expects a floating-point tensor A of shape (..., M, K); got {described}"
        )
    _validate_scalars(C, alpha, beta)
    if C is None:
        return
    expected = (*A.shape[:-1], A.shape[-2])
    if not isinstance(C, Tensor) or tuple(C.shape) != expected:
        shape = tuple(C.shape) if isinstance(C, Tensor) else type(C).__name__
        raise ValueError(
            f"syrk C must have shape {expected} for A of shape {tuple(A.shape)}; got {shape}"
        )
    if C.dtype != A.dtype or C.device != A.device:
        raise ValueError(
            f"syrk C must match A's dtype and device ({A.dtype} on {A.device}); "
            f"got {C.dtype} on {C.device}"
        )


def syrk(
    A: Tensor,
    *,
    C: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    kernel: str = AUTO,
) -> Tensor:
    """Return ``alpha·A·Aᵀ + beta·C`` (symmetric) for A (..., M, K) and C (..., M, M).

    ``C`` must be symmetric (kernels may read only one triangle). ``kernel`` is one of
    ``kernel_choices()``; ``syrk.dispatch`` says how it is resolved and when it falls back to
    the torch path.
    """
    key = _call_cache.signature(SYRK, kernel, A, None, C)
    run = _call_cache.lookup(key)
    if run is None:  # a new signature: validate everything and resolve (maybe autotune)
        _validate_operands(A, C, alpha, beta)
        run = get_backend(resolve_kernel(kernel, A, C)).syrk
        _call_cache.remember(key, run, A)
    else:
        _validate_scalars(C, alpha, beta)
    return run(A, C, float(alpha), float(beta))


def symmetric_product(
    A: Tensor,
    B: Tensor,
    *,
    C: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    kernel: str = AUTO,
) -> Tensor:
    """Return ``alpha·A·B + beta·C`` for square A, B, C (..., M, M) when A·B is symmetric.

    The caller guarantees the symmetry (A and B symmetric and commuting, e.g. polynomials in the
    same Gram matrix): symmetric kernels compute one triangle and mirror it, so a non-symmetric
    product would come back symmetrised, and the CuTe kernel reads B's rows as its columns. Kernel resolution is ``syrk``'s; a backend without
    ``symmetric_product`` runs the torch path.
    """
    run = _call_cache.lookup(key := _call_cache.signature(SYMMETRIC_PRODUCT, kernel, A, B, C))
    if run is not None:
        _validate_scalars(C, alpha, beta)
        return run(A, B, C, float(alpha), float(beta))
    _validate_operands(A, C, alpha, beta)
    if not isinstance(B, Tensor) or B.shape != A.shape or A.shape[-1] != A.shape[-2]:
        shape = tuple(B.shape) if isinstance(B, Tensor) else type(B).__name__
        raise ValueError(
            f"symmetric_product takes square A and B of the same shape; got A "
            f"{tuple(A.shape)} and B {shape}"
        )
    return _product(SYMMETRIC_PRODUCT, kernel, A, B, C, alpha, beta, key)


def matmul(
    A: Tensor,
    B: Tensor,
    *,
    C: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    kernel: str = AUTO,
) -> Tensor:
    """Return ``alpha·A·B + beta·C`` for A (..., M, K), B (..., K, N), C (..., M, N).

    Newton-Schulz's non-symmetric products go through here so "auto" can pick, per shape, a
    faster GEMM than cuBLAS where one exists. Kernel resolution is ``syrk``'s; a backend without
    ``matmul`` runs the torch path.
    """
    run = _call_cache.lookup(key := _call_cache.signature(MATMUL, kernel, A, B, C))
    if run is not None:
        return run(A, B, C, float(alpha), float(beta))
    if (
        not isinstance(A, Tensor)
        or not isinstance(B, Tensor)
        or A.dim() < 2
        or A.shape[:-2] != B.shape[:-2]
        or A.shape[-1] != B.shape[-2]
    ):
        shapes = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in (A, B)]
        raise ValueError(
            f"matmul takes A (..., M, K) and B (..., K, N) with the same batch; got A "
            f"{shapes[0]} and B {shapes[1]}"
        )
    expected = (*A.shape[:-1], B.shape[-1])
    if C is not None and (not isinstance(C, Tensor) or tuple(C.shape) != expected):
        shape = tuple(C.shape) if isinstance(C, Tensor) else type(C).__name__
        raise ValueError(f"matmul C must have shape {expected}; got {shape}")
    return _product(MATMUL, kernel, A, B, C, alpha, beta, key)


def _product(
    op: str,
    kernel: str,
    A: Tensor,
    B: Tensor,
    C: Tensor | None,
    alpha: float,
    beta: float,
    key: _call_cache.Signature | None,
) -> Tensor:
    """``op`` (SYMMETRIC_PRODUCT or MATMUL) through the backend ``kernel`` resolves to, or the
    torch path when that backend does not implement it; remembered under ``key``."""
    backend = get_backend(resolve_kernel(kernel, A, C, op=op, B=B))
    product = getattr(backend, op, None)
    if product is None:
        product = getattr(get_backend(CUBLAS), op)
    _call_cache.remember(key, product, A)
    return product(A, B, C, float(alpha), float(beta))


__all__ = [
    "AUTO",
    "BACKEND_MODULES",
    "CUBLAS",
    "CUTE",
    "FAST_BACKENDS",
    "INSTALL_HINTS",
    "KERNEL_ALIASES",
    "KERNEL_DTYPES",
    "MATMUL",
    "QUACK",
    "SYMMETRIC_PRODUCT",
    "SYRK",
    "SyrkBackend",
    "auto_candidate",
    "backend_availability",
    "backend_names",
    "canonical_kernel_name",
    "get_backend",
    "kernel_choices",
    "matmul",
    "register_backend",
    "require_available",
    "resolve_kernel",
    "sm_version",
    "symmetric_product",
    "syrk",
    "unregister_backend",
]
