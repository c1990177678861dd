"""What an optional GPU backend needs before it is imported: a recent enough GPU, and the
installed version of its library. Shared by the quack and CuTe adapters; imports neither.
"""

from __future__ import annotations

import importlib.metadata

import torch


def gpu_problem(kernel: str, min_capability: tuple[int, int], family: str) -> str | None:
    """Why the current CUDA device cannot run ``kernel``, or None when it can.

    ``family`` names the oldest architecture that can, e.g. "Hopper" for (9, 0).
    """
    need = f"SM{min_capability[0]}{min_capability[1]}"
    if not torch.cuda.is_available():
        return (
            f"{kernel} needs a CUDA GPU with {need} or newer ({family} or newer), and torch "
            "sees no CUDA device"
        )
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < min_capability:
        return (
            f"{kernel} needs an {need}+ GPU ({family} or newer), but "
            f"{torch.cuda.get_device_name()} is SM{major}{minor}"
        )
    return None


def distribution_version(name: str) -> str:
    """The installed version of a distribution, or "unknown"."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
