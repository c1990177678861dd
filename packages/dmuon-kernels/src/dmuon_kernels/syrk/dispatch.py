"""Which SYRK kernel runs: the whole choice order, from the kernel argument to the autotuner.

Owns every decision of the form "which backend computes this product". Newton-Schulz asks once
per instance (``ns_kernel_request``), and each product once per operand signature
(``resolve_kernel``; ``syrk._call_cache`` remembers the answer), in this order:

1. a kernel name is validated first: an unknown one raises ValueError naming the choices;
2. a kernel named by the caller (not "auto") always wins, so ``deterministic=True`` with
   ``kernel="quack"`` runs quack;
3. under "auto", a non-"auto" ``DMUON_NS_KERNEL`` decides (Newton-Schulz only);
4. then ``deterministic=True`` means "cublas" (Newton-Schulz only);
5. an explicit kernel that is registered but unavailable raises RuntimeError with its reason and
   install hint, on every device, so a misconfiguration shows up on a CPU smoke test too;
6. inputs that are not on CUDA or not float16/bfloat16 always run the torch path ("cublas"):
   the fast kernels exist only for those, and the torch path is exact enough for the rest;
7. "auto" follows the hardware ladder (``auto_candidate``): SM >= 90 with quack -> quack; the
   CuTe kernel available -> cute; else cublas;
8. a candidate other than cublas is confirmed per shape by the autotuner
   (``dmuon_kernels.syrk.autotune.choose_kernel``), which also tries the other available
   ``FAST_BACKENDS`` and keeps whichever beats cuBLAS most, else cuBLAS; except while a
   background compile is pending (``syrk.readiness``): then "auto" runs cuBLAS, untuned, until
   the switch.

The names, the backends and their availability come from ``syrk.registry``; the autotuner is
imported on first use (it depends on the registry, never on this module). Reports of the choice
live in ``dmuon_kernels.status``; the operations themselves in ``dmuon_kernels.syrk``. This
module must not import optional libraries, torch.distributed, or anything from dmuon.
"""

from __future__ import annotations

import importlib
import os

import torch
from torch import Tensor

from dmuon_kernels._env import NS_KERNEL_ENV
from dmuon_kernels.syrk._requirements import KERNEL_DTYPES
from dmuon_kernels.syrk.readiness import tuning_deferred
from dmuon_kernels.syrk.registry import (
    AUTO,
    CUBLAS,
    CUTE,
    QUACK,
    SYRK,
    backend_availability,
    canonical_kernel_name,
    registry_generation,
    require_available,
)

# The hardware ladder (rule 7): "auto" takes the first available of these, else cuBLAS.
AUTO_LADDER = (QUACK, CUTE)

# How reports describe each backend ("SM90, Tri Dao quack"), and the torch path off CUDA.
KERNEL_DESCRIPTIONS: dict[str, str] = {
    CUBLAS: "universal fallback",
    QUACK: "Tri Dao quack",
    CUTE: "dmuon CuTe DSL SYRK",
}
TORCH_FALLBACK = "torch fallback"

# The module that confirms an "auto" candidate per shape (rule 8), imported on first use.
AUTOTUNE_MODULE = "dmuon_kernels.syrk.autotune"

# Where a Newton-Schulz kernel choice came from (rules 2, 3, 4, or the ladder).
ORIGIN_ARGUMENT = "kernel argument"
ORIGIN_ENV = NS_KERNEL_ENV
ORIGIN_DETERMINISTIC = "deterministic=True"
ORIGIN_AUTO = "auto"

# device -> (registry generation, ladder choice): the ladder runs once per device until a
# backend is registered or unregistered.
_auto_candidates: dict[torch.device, tuple[int, tuple[str, str]]] = {}

# ---------------------------------------------------------------------------------------------
# The hardware ladder and the per-call choice


def sm_version(device: torch.device) -> int | None:
    """Compute capability as an int (e.g. 90 for SM 9.0), or None for non-CUDA devices."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def auto_candidate(device: torch.device) -> tuple[str, str]:
    """The hardware ladder for "auto" (rule 7): ``(backend name, why)`` for inputs on
    ``device``. quack's own availability check refuses GPUs older than SM90."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    generation = registry_generation()
    cached = _auto_candidates.get(device)
    if cached is not None and cached[0] == generation:
        return cached[1]
    sm = sm_version(device)
    if sm is None:
        choice = (CUBLAS, f"{device.type.upper()}, {TORCH_FALLBACK}")
    else:
        name = next((n for n in AUTO_LADDER if backend_availability(n)[0]), CUBLAS)
        choice = (name, f"SM{sm}, {KERNEL_DESCRIPTIONS[name]}")
    _auto_candidates[device] = (generation, choice)
    return choice


def _per_shape_verdict(
    candidate: str, A: Tensor, C: Tensor | None, op: str, B: Tensor | None
) -> str:
    """Rule 8: let the autotuner keep ``candidate``, pick another fast backend, or send this
    shape to cuBLAS."""
    autotune = importlib.import_module(AUTOTUNE_MODULE)
    return autotune.choose_kernel(candidate, A, C, op=op, B=B)


def resolve_kernel(
    kernel: str, A: Tensor, C: Tensor | None = None, *, op: str = SYRK, B: Tensor | None = None
) -> str:
    """The backend that runs ``syrk(A, C, kernel=kernel)`` (or ``op`` on A, B, C, e.g.
    SYMMETRIC_PRODUCT or MATMUL); rules 1, 5 to 8 of the module docstring."""
    name = canonical_kernel_name(kernel)
    if name not in (AUTO, CUBLAS):
        require_available(name)
    if not A.is_cuda or A.dtype not in KERNEL_DTYPES:
        return CUBLAS
    if name == AUTO:
        name = auto_candidate(A.device)[0]
        if name != CUBLAS:
            name = CUBLAS if tuning_deferred() else _per_shape_verdict(name, A, C, op, B)
    return name


# ---------------------------------------------------------------------------------------------
# Newton-Schulz: the request order (rules 2 to 4) and what it resolves to here


def env_ns_kernel() -> str | None:
    """The canonical kernel named by ``DMUON_NS_KERNEL``, or None when unset or empty."""
    value = os.environ.get(NS_KERNEL_ENV, "").strip()
    if not value:
        return None
    return canonical_kernel_name(value, source=f"environment variable {NS_KERNEL_ENV}")


def ns_kernel_request(requested: str, deterministic: bool) -> tuple[str, str]:
    """``(kernel passed to syrk, origin)``: a non-"auto" argument, then a non-"auto"
    DMUON_NS_KERNEL, then ``deterministic`` (-> "cublas"), then "auto" (the hardware ladder)."""
    if requested != AUTO:
        return requested, ORIGIN_ARGUMENT
    from_env = env_ns_kernel()
    if from_env not in (None, AUTO):  # DMUON_NS_KERNEL=auto decides nothing
        return from_env, ORIGIN_ENV
    if deterministic:
        return CUBLAS, ORIGIN_DETERMINISTIC
    return AUTO, ORIGIN_AUTO


def require_ns_kernel(kernel: str, origin: str) -> None:
    """Fail fast (rule 5, at construction) when an explicitly chosen kernel cannot run here."""
    if kernel == AUTO:
        return
    if origin == ORIGIN_ENV:
        require_available(
            kernel, source=NS_KERNEL_ENV, alternative=f"set {NS_KERNEL_ENV}=auto (or unset it)"
        )
    else:
        require_available(kernel)


def default_device() -> torch.device:
    """The device a NewtonSchulz reports for: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def effective_kernel(syrk_kernel: str, dtype: torch.dtype, device: torch.device) -> tuple[str, str]:
    """``(kernel that really runs, where/why)`` for an iteration in ``dtype`` on ``device``
    (rules 6 and 7; the per-shape autotune of rule 8 is reported by ``status``)."""
    sm = sm_version(device)
    if sm is None:
        return CUBLAS, f"{device.type.upper()}, {TORCH_FALLBACK}"
    if dtype not in KERNEL_DTYPES:
        return CUBLAS, f"SM{sm}, {KERNEL_DESCRIPTIONS[CUBLAS]}"
    if syrk_kernel == AUTO:
        return auto_candidate(device)
    return syrk_kernel, f"SM{sm}, {KERNEL_DESCRIPTIONS.get(syrk_kernel, 'registered backend')}"
