"""Backend status and environment: which kernel will run, why, and the rank-tagged logger.

Owns the ``DMUON_NS_KERNEL`` resolution order, ``get_ns_backend`` / ``get_backend_status``, and
``log_rank_tagged``. Rank and world size come from the RANK / WORLD_SIZE environment variables
(set by torchrun and the test harness): this package must not import torch.distributed.
"""

from __future__ import annotations

import logging
import os
import sys
from importlib import metadata
from typing import TYPE_CHECKING, Any

import torch

from dmuon_kernels._env import NS_CUDA_GRAPH_ENV, NS_KERNEL_ENV, SYRK_AUTOTUNE_LOG_ENV

# Names are imported from the module: the package attribute ``dmuon_kernels.syrk`` is the function.
from dmuon_kernels.syrk import (
    AUTO,
    CUBLAS,
    CUTE,
    KERNEL_DTYPES,
    QUACK,
    auto_candidate,
    backend_availability,
    backend_names,
    canonical_kernel_name,
    require_available,
    sm_version,
)
from dmuon_kernels.syrk.cache import CACHE_DIR_ENV

if TYPE_CHECKING:
    from dmuon_kernels.newton_schulz import NewtonSchulz

# Read by the modules that act on them; listed here so the status report shows them together.
ENV_VARS = (NS_KERNEL_ENV, NS_CUDA_GRAPH_ENV, SYRK_AUTOTUNE_LOG_ENV, CACHE_DIR_ENV)

# Where a NewtonSchulz kernel choice came from, in resolution order.
ORIGIN_ARGUMENT = "kernel argument"
ORIGIN_ENV = NS_KERNEL_ENV
ORIGIN_DETERMINISTIC = "deterministic=True"
ORIGIN_AUTO = "auto"

_KERNEL_DESCRIPTIONS = {
    CUBLAS: "universal fallback",
    QUACK: "Tri Dao quack",
    CUTE: "dmuon CuTe DSL SYRK",
}

# Optional libraries whose versions the status report shows, by distribution name.
_REPORTED_DISTRIBUTIONS = ("dmuon-kernels", "quack-kernels", "nvidia-cutlass-dsl", "triton")


# ---------------------------------------------------------------------------------------------
# Rank-tagged logging


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (it may be redirected after import)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


logger = logging.getLogger("dmuon_kernels")


def rank_tag() -> str:
    """``[DMuon][rank=R/W] `` from the RANK / WORLD_SIZE environment variables (default 0/1)."""
    rank = os.environ.get("RANK", "0")
    world_size = os.environ.get("WORLD_SIZE", "1")
    return f"[DMuon][rank={rank}/{world_size}] "


def _make_visible_by_default() -> None:
    # Progress lines must show up without any logging set-up, but an application that configured
    # logging (a handler on the root logger) gets them through its own handlers instead.
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        logger.addHandler(_CurrentStderrHandler())


def log_rank_tagged(message: str, *, level: int = logging.INFO) -> None:
    """Log ``message`` prefixed with ``[DMuon][rank=R/W] `` on the ``dmuon_kernels`` logger."""
    _make_visible_by_default()
    logger.log(level, "%s%s", rank_tag(), message)


# ---------------------------------------------------------------------------------------------
# Kernel resolution for Newton-Schulz


def env_ns_kernel() -> str | None:
    """The canonical kernel named by ``DMUON_NS_KERNEL``, or None when unset or empty."""
    value = os.environ.get(NS_KERNEL_ENV, "").strip()
    if not value:
        return None
    return canonical_kernel_name(value, source=f"environment variable {NS_KERNEL_ENV}")


def ns_kernel_request(requested: str, deterministic: bool) -> tuple[str, str]:
    """``(kernel passed to syrk, origin)``: a non-"auto" argument, then a non-"auto"
    DMUON_NS_KERNEL, then ``deterministic`` (-> "cublas"), then "auto" (the hardware ladder).

    A kernel named by the argument always wins, so ``deterministic=True`` with an explicit
    kernel="quack" runs quack.
    """
    if requested != AUTO:
        return requested, ORIGIN_ARGUMENT
    from_env = env_ns_kernel()
    if from_env not in (None, AUTO):  # DMUON_NS_KERNEL=auto decides nothing
        return from_env, ORIGIN_ENV
    if deterministic:
        return CUBLAS, ORIGIN_DETERMINISTIC
    return AUTO, ORIGIN_AUTO


def ns_syrk_kernel(requested: str, *, deterministic: bool) -> str:
    """The kernel name Newton-Schulz passes to ``syrk`` (see ``ns_kernel_request``)."""
    return ns_kernel_request(requested, deterministic)[0]


def require_ns_kernel(kernel: str, origin: str) -> None:
    """Fail fast when an explicitly chosen kernel cannot run here."""
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
    """``(kernel that really runs, where/why)`` for an iteration in ``dtype`` on ``device``."""
    sm = sm_version(device)
    where = f"SM{sm}" if sm is not None else device.type.upper()
    if sm is None:
        return CUBLAS, f"{where}, torch fallback"
    if dtype not in KERNEL_DTYPES:
        return CUBLAS, f"{where}, {_KERNEL_DESCRIPTIONS[CUBLAS]}"
    if syrk_kernel == AUTO:
        return auto_candidate(device)
    description = _KERNEL_DESCRIPTIONS.get(syrk_kernel, "registered backend")
    return syrk_kernel, f"{where}, {description}"


# ---------------------------------------------------------------------------------------------
# Reports


def get_ns_backend(ns: NewtonSchulz | None = None) -> str:
    """One line naming the Newton-Schulz form and the SYRK kernel that will really run.

    E.g. ``"Gram NS · kernel=cublas (SM80, universal fallback)"``. ``ns`` defaults to
    ``NewtonSchulz()`` (which honours ``DMUON_NS_KERNEL``). Under "auto" the per-shape autotuner
    may still send individual shapes to cuBLAS.
    """
    if ns is None:
        from dmuon_kernels.newton_schulz import NewtonSchulz

        ns = NewtonSchulz()
    form = "Gram" if ns.backend == "gram" else "Direct"
    details = ns.kernel_reason
    if ns.kernel_origin == ORIGIN_ENV:
        details += f"; set by {NS_KERNEL_ENV}"
    elif ns.kernel_origin == ORIGIN_DETERMINISTIC:
        details += f"; {ORIGIN_DETERMINISTIC}"
    if ns.dtype not in KERNEL_DTYPES:
        details += f"; {str(ns.dtype).removeprefix('torch.')} iteration"
    if ns.kernel_origin == ORIGIN_AUTO and ns.kernel != CUBLAS:
        details += _autotune_summary(ns.kernel)
    return f"{form} NS · kernel={ns.kernel} ({details})"


def _autotune_summary(kernel: str) -> str:
    """``"; autotune kept cuBLAS for 2 of 9 problems"`` (and ``"chose cute for 3"``) once "auto"
    sent problems to another backend than ``kernel``, the ladder's pick."""
    autotune = sys.modules.get("dmuon_kernels.syrk.autotune")  # loaded by the first auto call
    if autotune is None:
        return ""
    counts = autotune.chosen_backends()
    parts = [
        f"kept cuBLAS for {count}" if name == CUBLAS else f"chose {name} for {count}"
        for name, count in sorted(counts.items())
        if name != kernel
    ]
    return f"; autotune {', '.join(parts)} of {sum(counts.values())} problems" if parts else ""


def _distribution_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def get_backend_status() -> dict[str, Any]:
    """A JSON-friendly report: device and SM, the "auto" choice, every backend's availability
    and reason, the relevant environment variables, and library versions."""
    device = default_device()
    auto_choice, auto_reason = auto_candidate(device)
    backends = {}
    for name in backend_names():
        available, reason = backend_availability(name)
        backends[name] = {"available": available, "reason": reason}
    versions: dict[str, str | None] = {"torch": torch.__version__}
    versions.update({name: _distribution_version(name) for name in _REPORTED_DISTRIBUTIONS})
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "sm": sm_version(device),
        "cuda": torch.version.cuda,
        "auto_choice": auto_choice,
        "auto_reason": auto_reason,
        "backends": backends,
        "env": {name: os.environ.get(name) for name in ENV_VARS},
        "versions": versions,
    }
