"""Reports: which Newton-Schulz kernel will really run and why, and what this machine offers.

Owns ``get_ns_backend`` (one line) and ``get_backend_status`` (a JSON-friendly dict). It only
reports: every choice it describes is made by ``syrk.dispatch`` (and per shape by the
autotuner), and it must not change any of them.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from dmuon_kernels._env import (
    KERNEL_CACHE_ENV,
    KERNEL_COMPILE_ENV,
    NS_CUDA_GRAPH_ENV,
    NS_KERNEL_ENV,
    SYRK_AUTOTUNE_LOG_ENV,
    kernel_compile_mode,
)
from dmuon_kernels.newton_schulz import NewtonSchulz
from dmuon_kernels.syrk import readiness
from dmuon_kernels.syrk._requirements import KERNEL_DTYPES, installed_version
from dmuon_kernels.syrk.cache import CACHE_DIR_ENV
from dmuon_kernels.syrk.dispatch import (
    AUTOTUNE_MODULE,
    ORIGIN_AUTO,
    ORIGIN_DETERMINISTIC,
    ORIGIN_ENV,
    auto_candidate,
    default_device,
    ns_kernel_request,
    sm_version,
)
from dmuon_kernels.syrk.kernel_cache import default_kernel_cache, trust_problem
from dmuon_kernels.syrk.registry import AUTO, CUBLAS, backend_availability, backend_names

# The variables that steer the kernels, shown by the status report.
ENV_VARS = (
    NS_KERNEL_ENV,
    NS_CUDA_GRAPH_ENV,
    SYRK_AUTOTUNE_LOG_ENV,
    CACHE_DIR_ENV,
    KERNEL_CACHE_ENV,
    KERNEL_COMPILE_ENV,
)

# Optional libraries whose versions the status report shows, by distribution name.
_REPORTED_DISTRIBUTIONS = ("dmuon-kernels", "quack-kernels", "nvidia-cutlass-dsl", "triton")


def get_ns_backend(ns: NewtonSchulz | None = None) -> str:
    """One line naming the Newton-Schulz form and the SYRK kernel that will really run.

    E.g. ``"Gram NS · kernel=cublas (SM80, universal fallback)"``. ``ns`` defaults to
    ``NewtonSchulz()`` (which honours ``DMUON_NS_KERNEL``). Under "auto" the per-shape autotuner
    may still send individual shapes to cuBLAS.

    Without ``ns`` it raises what ``NewtonSchulz()`` raises, because then no kernel would run:
    RuntimeError when ``DMUON_NS_KERNEL`` names a kernel that cannot run here, ValueError when it
    names no kernel; both messages name the variable and the fix. ``get_backend_status()``
    reports the same problem under ``"ns"`` without raising.
    """
    if ns is None:
        ns = NewtonSchulz()
    form = "Gram" if ns.backend == "gram" else "Direct"
    details = ns.kernel_reason
    if ns.kernel_origin == ORIGIN_ENV:
        details += f"; set by {NS_KERNEL_ENV}"
    elif ns.kernel_origin == ORIGIN_DETERMINISTIC:
        details += f"; {ORIGIN_DETERMINISTIC}"
    if ns.dtype is not None and ns.dtype not in KERNEL_DTYPES:  # asked for; None is no news
        details += f"; {str(ns.dtype).removeprefix('torch.')} iteration"
    if ns.kernel_origin == ORIGIN_AUTO and ns.kernel != CUBLAS:
        if readiness.tuning_deferred():  # why: a compile building, or one that failed
            details += f"; cuBLAS: {readiness.deferred_because()}"
        details += _autotune_summary(ns.kernel)
    return f"{form} NS · kernel={ns.kernel} ({details})"


def _autotune_summary(kernel: str) -> str:
    """``"; autotune kept cuBLAS for 2 of 9 problems"`` (and ``"chose cute for 3"``) once "auto"
    sent problems to another backend than ``kernel``, the ladder's pick."""
    autotune = sys.modules.get(AUTOTUNE_MODULE)  # loaded by the first auto call
    if autotune is None:
        return ""
    counts = autotune.chosen_backends()
    parts = [
        f"kept cuBLAS for {count}" if name == CUBLAS else f"chose {name} for {count}"
        for name, count in sorted(counts.items())
        if name != kernel
    ]
    return f"; autotune {', '.join(parts)} of {sum(counts.values())} problems" if parts else ""


def _default_ns_report() -> dict[str, str | None]:
    """``get_backend_status()["ns"]``: what ``NewtonSchulz()`` asks for and gets here, or why
    it cannot be built. Never raises for a misconfigured environment."""
    report: dict[str, str | None] = {
        "requested": None,
        "origin": ORIGIN_ENV,
        "backend": None,
        "error": None,
    }
    try:
        report["requested"], report["origin"] = ns_kernel_request(AUTO, deterministic=False)
        report["backend"] = get_ns_backend()
    except (RuntimeError, ValueError) as error:  # the messages name the variable and the fix
        report["error"] = str(error)
    return report


def _kernel_cache_report() -> dict[str, Any]:
    """``get_backend_status()["kernel_cache"]``: where compiled kernels are kept, whether that
    is on, and why the folder is not used (``syrk.kernel_cache.trust_problem``), or None."""
    cache = default_kernel_cache()
    folder = cache.folder
    try:
        enabled = cache.enabled
    except ValueError as error:  # DMUON_KERNEL_CACHE is not an on/off value
        return {"folder": str(folder), "enabled": None, "problem": str(error)}
    problem = trust_problem(folder) if enabled and folder.exists() else None
    return {"folder": str(folder), "enabled": enabled, "problem": problem}


def _kernel_compile_report() -> dict[str, str | None]:
    """``get_backend_status()["kernel_compile"]``: the mode ``NewtonSchulz()`` gets
    ("background" or "wait"; None with ``error`` when ``DMUON_KERNEL_COMPILE`` is not one), and
    why "auto" runs cuBLAS untuned now (a background compile pending), or None."""
    try:
        mode, error = kernel_compile_mode(), None
    except ValueError as exc:
        mode, error = None, str(exc)
    return {"mode": mode, "error": error, "deferred": readiness.deferred_because()}


def get_backend_status() -> dict[str, Any]:
    """A JSON-friendly report: device and SM, the "auto" choice, what ``NewtonSchulz()`` runs,
    every backend's availability and reason, where compiled kernels are kept, the relevant
    environment variables, and library versions.

    ``status["ns"]`` describes ``NewtonSchulz()``: ``requested`` ("auto", or the kernel
    ``DMUON_NS_KERNEL`` names; None when it names none), ``origin`` (what decided the request),
    ``backend`` (the ``get_ns_backend()`` line, or None) and ``error`` (the message
    ``NewtonSchulz()`` and ``get_ns_backend()`` raise, or None). A misconfigured environment,
    such as ``DMUON_NS_KERNEL=quack`` where quack cannot run, is reported there, never raised.
    ``status["kernel_cache"]`` gives the compiled-kernel folder, whether the cache is on, and
    ``problem``: why kernels are not loaded from that folder (another user's, or writable by
    others), or None. ``status["kernel_compile"]`` gives the compile mode (``mode``, or
    ``error``) and ``deferred``: why "auto" runs cuBLAS untuned until the background compile's
    switch, or None.
    """
    device = default_device()
    auto_choice, auto_reason = auto_candidate(device)
    backends = {}
    for name in backend_names():
        available, reason = backend_availability(name)
        backends[name] = {"available": available, "reason": reason}
    versions: dict[str, str | None] = {"torch": torch.__version__}
    versions.update({name: installed_version(name) for name in _REPORTED_DISTRIBUTIONS})
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "sm": sm_version(device),
        "cuda": torch.version.cuda,
        "auto_choice": auto_choice,
        "auto_reason": auto_reason,
        "ns": _default_ns_report(),
        "backends": backends,
        "kernel_cache": _kernel_cache_report(),
        "kernel_compile": _kernel_compile_report(),
        "env": {name: os.environ.get(name) for name in ENV_VARS},
        "versions": versions,
    }
