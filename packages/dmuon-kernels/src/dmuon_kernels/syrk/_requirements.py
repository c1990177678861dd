"""What an optional GPU backend needs: a recent enough GPU, the installed version of its
library, and operands it can take. Shared by the quack and CuTe adapters (it imports neither),
the dispatcher (the kernel dtypes) and the version reports.
"""

from __future__ import annotations

import importlib.metadata

import torch
from torch import Tensor

# The dtypes the fast kernels implement; everything else runs the torch path.
KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


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


def installed_version(name: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed (or this
    package runs from a source tree without metadata)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def distribution_version(name: str) -> str:
    """``installed_version``, or "unknown"."""
    return installed_version(name) or "unknown"


def check_gpu_operands(kernel: str, A: Tensor, C: Tensor | None) -> None:
    """Raise ValueError, with the fix, unless A (..., M, K) and C (..., M, M) suit a GPU kernel."""
    if A.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"SYRK kernel {kernel!r} takes float16 or bfloat16, got A.dtype={A.dtype}; cast A "
            "(Newton-Schulz iterates in float16 by default) or use kernel='cublas'"
        )
    if A.device.type != "cuda":
        raise ValueError(
            f"SYRK kernel {kernel!r} runs on CUDA tensors, got A on {A.device}; move A to the GPU "
            "or use kernel='cublas' (its torch fallback runs anywhere)"
        )
    if A.ndim < 2:
        raise ValueError(
            f"SYRK kernel {kernel!r} takes A of shape (..., M, K), got {tuple(A.shape)}"
        )
    if C is not None and C.shape[-2:] != (A.shape[-2], A.shape[-2]):
        raise ValueError(
            f"C must be (M, M) = ({A.shape[-2]}, {A.shape[-2]}) for A of shape "
            f"{tuple(A.shape)}, got C of shape {tuple(C.shape)}"
        )
