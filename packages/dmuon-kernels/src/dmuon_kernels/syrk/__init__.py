"""SYRK dispatch: ``syrk(A, C=None, alpha, beta, kernel)`` returns ``alpha·A·Aᵀ + beta·C``.

Owns the kernel names, the backend registry and ``resolve_kernel``, the one function that turns a
requested kernel into the backend that runs for a given input. Backends live one per module
(``cublas``, ``quack``, ``cute``) and are imported lazily, so a backend whose module or optional
library is missing only reports itself unavailable; importing ``dmuon_kernels`` never fails.

A backend is any object (usually a module) with::

    is_available() -> tuple[bool, str]      # (usable here?, human-readable reason)
    syrk(A, C, alpha, beta) -> Tensor       # A (..., M, K), C (..., M, M) or None; symmetric out

and optionally ``symmetric_product(A, B, C, alpha, beta)`` for ``alpha·A·B + beta·C`` when A·B is
known to be symmetric (commuting symmetric A and B, as in Newton-Schulz's Gram iteration) and
``matmul(A, B, C, alpha, beta)`` for a plain ``alpha·A·B + beta·C`` (Newton-Schulz's other
products); a backend without one runs that operation on the torch path. Each operation is
resolved (and autotuned under "auto") on its own.

Fallback rules, in order:
1. an unknown kernel name raises ValueError naming the valid choices;
2. an explicit kernel that is registered but unavailable raises RuntimeError with its reason and
   install hint (on every device, so a misconfiguration shows up on a CPU smoke test too);
3. inputs that are not on CUDA or not float16/bfloat16 always run the torch path ("cublas"):
   the fast kernels exist only for those, and the torch path is exact enough for everything else;
4. "auto" follows the hardware ladder (``auto_candidate``): SM >= 90 with quack -> quack; the
   CuTe kernel available -> cute; else cublas. A candidate other than cublas is then confirmed per
   shape by the autotuner when ``dmuon_kernels.syrk.autotune`` provides ``choose_kernel``, which
   also tries the other available ``FAST_BACKENDS`` and keeps whichever beats cuBLAS most.

This module must not import optional libraries, torch.distributed, or anything from dmuon.
"""

from __future__ import annotations

import importlib
import numbers
from typing import Protocol

import torch
from torch import Tensor

AUTO = "auto"
CUBLAS = "cublas"
QUACK = "quack"
CUTE = "cute"

# The backends that exist to beat cuBLAS: "auto" tunes every available one per shape.
FAST_BACKENDS = (QUACK, CUTE)

# Alternative spellings accepted wherever a kernel name is: the reference system calls its CuTe
# kernel "cute_sm80".
KERNEL_ALIASES: dict[str, str] = {"cute_sm80": CUTE}

# Backend name -> module that implements it, imported on first use.
BACKEND_MODULES: dict[str, str] = {
    CUBLAS: "dmuon_kernels.syrk.cublas",
    QUACK: "dmuon_kernels.syrk.quack",
    CUTE: "dmuon_kernels.syrk.cute",
}

INSTALL_HINTS: dict[str, str] = {
    QUACK: "pip install dmuon-kernels[quack] (needs an SM90+ GPU)",
    CUTE: "pip install dmuon-kernels[cute] (nvidia-cutlass-dsl; [syrk] is an alias)",
}

# The dtypes the fast kernels implement; everything else runs the torch path.
KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)

# The module that may confirm an "auto" candidate per shape (see ``resolve_kernel``).
AUTOTUNE_MODULE = "dmuon_kernels.syrk.autotune"

QUACK_MIN_SM = 90

# The operations a backend may implement (autotune verdicts are per operation).
SYRK = "syrk"
SYMMETRIC_PRODUCT = "symmetric_product"
MATMUL = "matmul"


class SyrkBackend(Protocol):
    def is_available(self) -> tuple[bool, str]: ...

    def syrk(self, A: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor: ...


class _MissingBackend:
    """Stands in for a backend whose module could not be imported."""

    def __init__(self, reason: str) -> None:
        self._reason = reason

    def is_available(self) -> tuple[bool, str]:
        return False, self._reason

    def syrk(self, A: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
        raise RuntimeError(self._reason)


_backends: dict[str, SyrkBackend] = {}
_availability: dict[str, tuple[bool, str]] = {}
_auto_candidates: dict[torch.device, tuple[str, str]] = {}


def register_backend(name: str, backend: SyrkBackend) -> None:
    """Register (or replace) the backend called ``name``; it becomes a valid kernel name."""
    if not name or name == AUTO or name in KERNEL_ALIASES:
        raise ValueError(f"cannot register a SYRK backend under the reserved name {name!r}")
    _backends[name] = backend
    _availability.pop(name, None)
    _auto_candidates.clear()


def unregister_backend(name: str) -> None:
    """Forget a backend added with ``register_backend`` (a built-in name reverts to its module)."""
    _backends.pop(name, None)
    _availability.pop(name, None)
    _auto_candidates.clear()


def backend_names() -> tuple[str, ...]:
    """The concrete backends (no "auto", no aliases), registered or known by module."""
    return tuple(dict.fromkeys([*BACKEND_MODULES, *_backends]))


def kernel_choices() -> tuple[str, ...]:
    """Every name accepted as ``kernel=``: "auto", the backends, and their aliases."""
    return (AUTO, *backend_names(), *KERNEL_ALIASES)


def canonical_kernel_name(kernel: object, *, source: str = "kernel") -> str:
    """Validate a kernel name and resolve aliases; ``source`` names where the value came from."""
    if isinstance(kernel, str):
        name = KERNEL_ALIASES.get(kernel, kernel)
        if name == AUTO or name in backend_names():
            return name
    choices = ", ".join(repr(choice) for choice in kernel_choices())
    raise ValueError(f"{source} must be one of {choices}; got {kernel!r}")


def get_backend(name: str) -> SyrkBackend:
    """The backend object for a canonical backend name, imported on first use."""
    backend = _backends.get(name)
    if backend is not None:
        return backend
    module_name = BACKEND_MODULES[name]
    try:
        backend = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            backend = _MissingBackend(f"importing {module_name} failed: {error}")
        else:
            backend = _MissingBackend(f"the {name!r} backend is not part of this installation")
    except ImportError as error:
        backend = _MissingBackend(f"importing {module_name} failed: {error}")
    _backends[name] = backend
    return backend


def backend_availability(name: str) -> tuple[bool, str]:
    """``(available, reason)`` for a canonical backend name, asked once per process."""
    if name not in _availability:
        try:
            available, reason = get_backend(name).is_available()
        except Exception as error:  # an availability probe must never break the caller
            available, reason = False, f"availability check raised {type(error).__name__}: {error}"
        _availability[name] = (bool(available), str(reason))
    return _availability[name]


def require_available(
    name: str, *, source: str = "kernel", alternative: str = 'use kernel="auto"'
) -> None:
    """Raise RuntimeError with the reason and the fix when backend ``name`` cannot run here."""
    available, reason = backend_availability(name)
    if available:
        return
    hint = INSTALL_HINTS.get(name)
    install = f"install it with `{hint}`, or " if hint else ""
    raise RuntimeError(
        f"{source}={name!r} cannot run here: {reason}. Fix: {install}{alternative}, "
        "which falls back to cuBLAS when no faster SYRK kernel is available."
    )


def sm_version(device: torch.device) -> int | None:
    """Compute capability as an int (e.g. 90 for SM 9.0), or None for non-CUDA devices."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def auto_candidate(device: torch.device) -> tuple[str, str]:
    """The hardware ladder for "auto": ``(backend name, why)`` for inputs on ``device``."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    cached = _auto_candidates.get(device)
    if cached is not None:
        return cached
    sm = sm_version(device)
    if sm is None:
        choice = (CUBLAS, f"{device.type.upper()}, torch fallback")
    elif sm >= QUACK_MIN_SM and backend_availability(QUACK)[0]:
        choice = (QUACK, f"SM{sm}, Tri Dao quack")
    elif backend_availability(CUTE)[0]:
        choice = (CUTE, f"SM{sm}, dmuon CuTe DSL SYRK")
    else:
        choice = (CUBLAS, f"SM{sm}, universal fallback")
    _auto_candidates[device] = choice
    return choice


def _per_shape_verdict(
    candidate: str, A: Tensor, C: Tensor | None, op: str, B: Tensor | None
) -> str:
    """Let the autotuner keep ``candidate`` or send this shape to cuBLAS."""
    try:
        autotune = importlib.import_module(AUTOTUNE_MODULE)
    except ModuleNotFoundError as error:
        if error.name != AUTOTUNE_MODULE:
            raise
        return candidate
    choose_kernel = getattr(autotune, "choose_kernel", None)
    if choose_kernel is None:
        return candidate
    return choose_kernel(candidate, A, C, op=op, B=B)


def resolve_kernel(
    kernel: str, A: Tensor, C: Tensor | None = None, *, op: str = SYRK, B: Tensor | None = None
) -> str:
    """The backend that runs ``syrk(A, C, kernel=kernel)`` (or ``op`` on A, B, C, e.g.
    SYMMETRIC_PRODUCT or MATMUL); see the module docstring's rules."""
    name = canonical_kernel_name(kernel)
    if name not in (AUTO, CUBLAS):
        require_available(name)
    if not A.is_cuda or A.dtype not in KERNEL_DTYPES:
        return CUBLAS
    if name == AUTO:
        name = auto_candidate(A.device)[0]
        if name != CUBLAS:
            name = _per_shape_verdict(name, A, C, op, B)
    return name


def _validate_operands(A: Tensor, C: Tensor | None, alpha: object, beta: object) -> None:
    if not isinstance(A, Tensor) or A.dim() < 2 or not A.is_floating_point():
        described = f"a {A.dim()}-D {A.dtype} tensor" if isinstance(A, Tensor) else type(A).__name__
        raise ValueError(
            f"syrk expects a floating-point tensor A of shape (..., M, K); got {described}"
        )
    for label, value in (("alpha", alpha), ("beta", beta)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"syrk {label} must be a real number; got {value!r}")
    if C is None:
        if beta != 0:
            raise ValueError(
                f"syrk got beta={beta!r} but no C: pass C=<(..., M, M) tensor> or leave beta=0"
            )
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
    ``kernel_choices()``; see the module docstring for how it is resolved and when it falls
    back to the torch path.
    """
    _validate_operands(A, C, alpha, beta)
    backend = get_backend(resolve_kernel(kernel, A, C))
    return backend.syrk(A, C, float(alpha), float(beta))


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
    product would come back symmetrised. Kernel resolution is ``syrk``'s; a backend without
    ``symmetric_product`` runs the torch path.
    """
    _validate_operands(A, C, alpha, beta)
    if not isinstance(B, Tensor) or B.shape != A.shape or A.shape[-1] != A.shape[-2]:
        shape = tuple(B.shape) if isinstance(B, Tensor) else type(B).__name__
        raise ValueError(
            f"symmetric_product takes square A and B of the same shape; got A "
            f"{tuple(A.shape)} and B {shape}"
        )
    backend = get_backend(resolve_kernel(kernel, A, C, op=SYMMETRIC_PRODUCT))
    product = getattr(backend, SYMMETRIC_PRODUCT, None)
    if product is None:
        product = getattr(get_backend(CUBLAS), SYMMETRIC_PRODUCT)
    return product(A, B, C, float(alpha), float(beta))


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
    backend = get_backend(resolve_kernel(kernel, A, C, op=MATMUL, B=B))
    product = getattr(backend, MATMUL, None)
    if product is None:
        product = getattr(get_backend(CUBLAS), MATMUL)
    return product(A, B, C, float(alpha), float(beta))


__all__ = [
    "FAST_BACKENDS",
    "KERNEL_ALIASES",
    "KERNEL_DTYPES",
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
