"""The SYRK backends that exist: kernel names, the registry, and whether each can run here.

Owns the names accepted as ``kernel=`` (and their aliases), the backend protocol, the map from a
name to the module that implements it, the registry of backends added at run time, and the
availability of each (asked once per process). Backends live one per module (``cublas``,
``quack``, ``cute``) and are imported on first use, so a backend whose module or optional library
is missing only reports itself unavailable; importing dmuon_kernels never fails. Which backend
runs a call is ``syrk.dispatch``'s decision, not this module's. It must not import optional
libraries, torch.distributed, or anything from dmuon.
"""

from __future__ import annotations

import importlib
from typing import Protocol

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


def extra_install_command(extra: str, note: str = "") -> str:
    """How to install dmuon-kernels with ``extra``: the published form, and today's (dmuon is
    not on PyPI yet, so ``pip install dmuon-kernels[...]`` fails until it is)."""
    note = f"{note}; " if note else ""
    return (
        f"pip install dmuon-kernels[{extra}] ({note}not on PyPI yet: from a checkout of the "
        f'repository, pip install "./packages/dmuon-kernels[{extra}]")'
    )


INSTALL_HINTS: dict[str, str] = {
    QUACK: extra_install_command("quack", "needs an SM90+ GPU"),
    CUTE: extra_install_command("cute", "nvidia-cutlass-dsl; [syrk] is an alias"),
}

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
# Bumped by every change to the registry, so choices cached elsewhere (the "auto" ladder) can
# tell that they are stale.
_generation = 0


def register_backend(name: str, backend: SyrkBackend) -> None:
    """Register (or replace) the backend called ``name``; it becomes a valid kernel name."""
    if not name or name == AUTO or name in KERNEL_ALIASES:
        raise ValueError(f"cannot register a SYRK backend under the reserved name {name!r}")
    global _generation
    _backends[name] = backend
    _availability.pop(name, None)
    _generation += 1


def unregister_backend(name: str) -> None:
    """Forget a backend added with ``register_backend`` (a built-in name reverts to its module)."""
    global _generation
    _backends.pop(name, None)
    _availability.pop(name, None)
    _generation += 1


def registry_generation() -> int:
    """A number that changes whenever a backend is registered or unregistered, or the backends
    "auto" may pick change (``advance_registry_generation``)."""
    return _generation


def advance_registry_generation() -> None:
    """Make every choice cached against the registry stale (the per-call memo, the "auto"
    ladder, Newton-Schulz's CUDA graphs): the background compile's switch does this when "auto"
    may pick the fast backends again."""
    global _generation
    _generation += 1


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
