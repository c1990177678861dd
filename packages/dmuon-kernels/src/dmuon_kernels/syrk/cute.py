"""The cute backend: alpha·A·Aᵀ + beta·C through this project's own CuTe DSL SYRK kernel.

Owns the adapter over ``syrk._cute_kernel`` (the device code): probing that nvidia-cutlass-dsl
and the GPU can run it, choosing a tile configuration per shape class, bringing operands to the
layout the kernel requires, and caching compiled kernels per (tile configuration, dtype, with or
without C, compute capability) so a warm process never recompiles. It is the only module that
imports ``_cute_kernel`` (and through it cutlass), and only on first use, so importing
dmuon_kernels never fails because cutlass is missing. It must not choose between backends (the
dispatcher and the autotuner do) and must not fall back silently to another library.

What the kernel requires, and what the adapter does about it:

- fp16 or bf16 on a CUDA device with compute capability 8.0 or newer (the kernel uses SM80
  warp-level MMA, which SM90 runs too);
- A K-contiguous with rows padded to the tile and K padded to the k-tile: A is copied to a
  zero-padded contiguous buffer when its shape or layout differs (zero rows and columns add
  nothing to A·Aᵀ); a transposed view (A = Xᵀ) is therefore copied once;
- C (..., M, M) contiguous; only its lower triangle is read, so C must be symmetric (as it
  always is in Newton-Schulz); the result is exactly symmetric (each element computed once);
- a batch (..., M, K) runs in one launch per chunk of at most 2³¹ elements.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dmuon_kernels.syrk._requirements import (
    check_gpu_operands,
    distribution_version,
    gpu_problem,
)

NAME = "cute"
CUTE_MIN_COMPUTE_CAPABILITY = (8, 0)
CUTE_INSTALL_HINT = "pip install dmuon-kernels[cute]"
# Bumped whenever the device code changes, so cached autotune verdicts are re-measured.
KERNEL_REVISION = "1"

_INT32_LIMIT = 2**31 - 1
_ALIGNMENT_BYTES = 16
_MAX_GRID_Z = 65535  # the batch is the grid's z dimension


@dataclass(frozen=True, slots=True)
class TileConfig:
    """A tiling of the kernel (mirrors ``_cute_kernel.TileConfig``, which needs cutlass)."""

    tile: int
    tile_k: int
    stages: int
    warps_m: int
    warps_n: int


TILE_CONFIGS: dict[str, TileConfig] = {
    "128x128_4warps": TileConfig(tile=128, tile_k=64, stages=3, warps_m=2, warps_n=2),
    "128x128_8warps": TileConfig(tile=128, tile_k=64, stages=3, warps_m=2, warps_n=4),
    "64x64_4warps": TileConfig(tile=64, tile_k=64, stages=4, warps_m=2, warps_n=2),
}
# Shape class -> tile configuration: "small" problems (fewer 128-wide output tiles than SMs) get
# small tiles so every SM has work.
SHAPE_CLASS_CONFIGS: dict[str, str] = {"large": "128x128_4warps", "small": "64x64_4warps"}


@dataclass(frozen=True, slots=True)
class _CuteApi:
    """What the probe found: the kernel module and the library version for cache keys."""

    kernel_module: Any
    cutlass_version: str


_probe_result: _CuteApi | str | None = None  # the probe runs once per process
# (tile configuration, dtype name, with C, (major, minor)) -> compiled kernel
_compiled: dict[tuple[str, str, bool, tuple[int, int]], Callable[..., Any]] = {}
_sm_counts: dict[torch.device, int] = {}


def _probe_cutlass() -> _CuteApi | str:
    """Import the kernel module (and cutlass); a string is the reason it cannot be used."""
    if importlib.util.find_spec("cutlass") is None:
        return f"nvidia-cutlass-dsl is not installed ({CUTE_INSTALL_HINT})"
    try:
        import cutlass  # noqa: F401  (first, so a broken cutlass is what the reason names)

        from dmuon_kernels.syrk import _cute_kernel
    except Exception as exc:  # a broken cutlass-dsl raises anything from ImportError to OSError
        return (
            f"nvidia-cutlass-dsl is installed but failed to import ({type(exc).__name__}: "
            f"{exc}); reinstall it with {CUTE_INSTALL_HINT} (tested with nvidia-cutlass-dsl "
            "4.5.2)"
        )
    return _CuteApi(_cute_kernel, distribution_version("nvidia-cutlass-dsl"))


def _cute_api() -> _CuteApi | str:
    global _probe_result
    if _probe_result is None:
        _probe_result = _probe_cutlass()
    return _probe_result


def _hardware_problem() -> str | None:
    return gpu_problem("the CuTe DSL SYRK kernel", CUTE_MIN_COMPUTE_CAPABILITY, "Ampere")


def is_available() -> tuple[bool, str]:
    """``(usable here?, why)`` for the current CUDA device; never raises."""
    problem = _hardware_problem()
    if problem is not None:
        return False, problem  # hardware first: it needs no import of cutlass (seconds)
    api = _cute_api()
    if isinstance(api, str):
        return False, api
    return True, f"dmuon CuTe DSL SYRK (SM80 warp MMA), nvidia-cutlass-dsl {api.cutlass_version}"


def versions() -> dict[str, str]:
    """Versions that make a cached autotune verdict stale when they change."""
    api = _cute_api()
    if isinstance(api, str):
        return {}
    return {"nvidia-cutlass-dsl": api.cutlass_version, "dmuon-cute-kernel": KERNEL_REVISION}


def shape_class(M: int, batch: int, device: torch.device) -> str:
    """ "large" when 128-wide tiles already give every SM an output tile, else "small"."""
    tiles = math.ceil(M / TILE_CONFIGS[SHAPE_CLASS_CONFIGS["large"]].tile)
    sm_count = _sm_counts.get(device)
    if sm_count is None:
        sm_count = _sm_counts[device] = torch.cuda.get_device_properties(
            device
        ).multi_processor_count
    return "large" if tiles * (tiles + 1) // 2 * batch >= sm_count else "small"


def syrk(
    A: Tensor,  # (..., M, K)
    C: Tensor | None = None,  # (..., M, M), symmetric
    alpha: float = 1.0,
    beta: float = 0.0,
    *,
    config: str | None = None,  # a TILE_CONFIGS key; None picks by shape_class
) -> Tensor:  # (..., M, M), exactly symmetric
    """``alpha·A·Aᵀ + beta·C`` through the CuTe DSL kernel; RuntimeError when it cannot run."""
    if config is not None and config not in TILE_CONFIGS:
        raise ValueError(
            f"config must be one of {', '.join(map(repr, TILE_CONFIGS))} or None; got {config!r}"
        )
    _check_operand(A, C)
    api = _cute_api()
    if isinstance(api, str):
        raise RuntimeError(f"SYRK kernel 'cute' cannot run: {api}")
    alpha, beta = float(alpha), float(beta)
    if beta == 0.0:
        C = None  # beta·C with beta = 0 must not propagate NaN/inf from C, as in torch.addmm
    M, K = A.shape[-2], A.shape[-1]
    out_shape = (*A.shape[:-1], M)
    if C is not None:
        C = C.to(A.dtype).expand(out_shape)
    if A.numel() == 0:
        out = torch.zeros(out_shape, dtype=A.dtype, device=A.device)
        return out.add_(C, alpha=beta) if C is not None else out

    batch = math.prod(A.shape[:-2])
    A3 = A.reshape(batch, M, K)
    C3 = None if C is None else _contiguous_aligned(C.reshape(batch, M, M))
    name = config or SHAPE_CLASS_CONFIGS[shape_class(M, batch, A.device)]
    tiles = TILE_CONFIGS[name]
    m_tiles, k_tiles = math.ceil(M / tiles.tile), math.ceil(K / tiles.tile_k)
    out = torch.empty((batch, M, M), dtype=A.dtype, device=A.device)
    A_padded = _padded(A3, m_tiles * tiles.tile, k_tiles * tiles.tile_k)

    kernel = _kernel(api, name, A.dtype, C3 is not None, A.device)
    module = api.kernel_module
    dtype_name = str(A.dtype).removeprefix("torch.")
    stream = module.stream_handle(torch.cuda.current_stream(A.device).cuda_stream)
    with torch.cuda.device(A.device):
        for start, stop in _batch_chunks(batch, A_padded[0].numel(), M * M):
            d_ptr = module.pointer(dtype_name, out[start].data_ptr())
            c_ptr = d_ptr if C3 is None else module.pointer(dtype_name, C3[start].data_ptr())
            kernel(
                module.pointer(dtype_name, A_padded[start].data_ptr()),
                d_ptr,
                c_ptr,
                M,
                m_tiles,
                k_tiles,
                stop - start,
                alpha,
                beta,
                stream,
            )
    return out.reshape(out_shape)


def _kernel(
    api: _CuteApi, name: str, dtype: torch.dtype, has_c: bool, device: torch.device
) -> Callable[..., Any]:
    """The compiled kernel for this configuration, compiled on first use."""
    capability = torch.cuda.get_device_capability(device)
    dtype_name = str(dtype).removeprefix("torch.")
    key = (name, dtype_name, has_c, capability)
    kernel = _compiled.get(key)
    if kernel is None:
        module = api.kernel_module
        tiles = TILE_CONFIGS[name]
        config = module.TileConfig(
            tile=tiles.tile,
            tile_k=tiles.tile_k,
            stages=tiles.stages,
            warps_m=tiles.warps_m,
            warps_n=tiles.warps_n,
        )
        kernel = _compiled[key] = module.compile_syrk(dtype_name, has_c, config)
    return kernel


def _batch_chunks(batch: int, a_elements: int, d_elements: int) -> list[tuple[int, int]]:
    """Split the batch so each launch indexes fewer than 2³¹ elements of A and of D and fits the
    grid's z dimension, in chunks whose D offset stays 16-byte aligned."""
    per_matrix = max(a_elements, d_elements)
    if per_matrix > _INT32_LIMIT:
        raise ValueError(
            f"SYRK kernel 'cute' indexes with int32 and one matrix here has {per_matrix} "
            f"elements (padded A or the M x M output), more than 2^31 - 1; use kernel='cublas' "
            "for this shape"
        )
    chunk = max(1, min(_INT32_LIMIT // per_matrix, _MAX_GRID_Z))
    if chunk < batch:
        chunk = max(8, chunk - chunk % 8) if chunk >= 8 else 1
        if chunk == 1 and (d_elements * 2) % _ALIGNMENT_BYTES:
            raise ValueError(
                f"SYRK kernel 'cute': a batch of {batch} matrices of {d_elements} output "
                "elements must be split one by one and the outputs would be misaligned; use "
                "kernel='cublas' for this shape"
            )
    return [(start, min(start + chunk, batch)) for start in range(0, batch, chunk)]


def _padded(A3: Tensor, rows: int, cols: int) -> Tensor:
    """A3 (batch, M, K) as a contiguous (batch, rows, cols) buffer, zero beyond (M, K)."""
    batch, M, K = A3.shape
    if (rows, cols) == (M, K) and A3.is_contiguous() and A3.data_ptr() % _ALIGNMENT_BYTES == 0:
        return A3
    padded = A3.new_zeros((batch, rows, cols))
    padded[:, :M, :K] = A3
    return padded


def _contiguous_aligned(t: Tensor) -> Tensor:
    if t.is_contiguous() and t.data_ptr() % _ALIGNMENT_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _check_operand(A: Tensor, C: Tensor | None) -> None:
    check_gpu_operands("cute", A, C)
