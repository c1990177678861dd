"""The cute backend: alpha·A·Aᵀ + beta·C (``syrk``) and alpha·A·B + beta·C for a symmetric
product (``symmetric_product``) through this project's own CuTe DSL SYRK kernels.

Owns the adapter over the device code of two paths: ``syrk._cute_sm90_kernel`` (Hopper: wgmma,
TMA, persistent and warp-specialised; 128x128 ping-pong tiles, or cooperative 256x128 tiles
where those fill the SMs in as few rounds, see ``choose_config``), run on compute capability 9.x,
and ``syrk._cute_kernel`` (SM80 warp-level MMA), run on 8.x and 10.x+ (wgmma exists only on 9.x)
and selectable on Hopper through ``path``/``config`` (so it stays tested there). The adapter
probes that nvidia-cutlass-dsl and the GPU can run them, chooses a path and a tile configuration
(one of ``syrk._cute_tiles.TILE_CONFIGS``) per shape class, brings operands to the layout the
kernel requires, and caches compiled kernels per (tile configuration, dtype, with or without C,
compute capability) so a warm process never recompiles, and a launch plan (configuration,
padding, grid, batch chunks) per call signature so a warmed call queries nothing. It is the
only module that imports the kernel modules (and through them cutlass), and only on
first use, so importing dmuon_kernels never fails because cutlass is missing. It must not choose
between backends (the dispatcher and the autotuner do) and must not fall back silently to
another library.

What the kernels require, and what the adapter does about it:

- fp16 or bf16 on a CUDA device with compute capability 8.0 or newer;
- SM90 path: A (batch, M, K_pad) contiguous with K_pad a multiple of 8 (TMA strides are
  multiples of 16 bytes) and a 16-byte aligned base; A is copied to a zero-padded buffer only
  when it is not already so (a transposed view, A = Xᵀ, is therefore copied once); TMA
  zero-fills the edge tiles, so M and K need no padding to the tile;
- SM80 path: A K-contiguous with rows padded to the tile and K padded to the k-tile: A is copied
  to a zero-padded contiguous buffer when its shape or layout differs (zero rows and columns add
  nothing to A·Aᵀ);
- SM90 "<name>_smem" and "<name>_smem_flat" configurations stage the epilogue in shared memory
  (swizzled or plain buffer) and store D with TMA; TMA needs D's rows 16 bytes apart, so for M
  not a multiple of 8 they run their direct twin ``<name>`` (``runnable_config``);
- C (..., M, M) contiguous; only its lower triangle is read, so C must be symmetric (as it
  always is in Newton-Schulz); the result is exactly symmetric (each element computed once);
- ``symmetric_product``: the kernels compute A·Bᵀ with B laid out like A, which is A·B because B
  is symmetric (the operation's contract: A and B symmetric and commuting);
- a batch (..., M, K) runs in one launch per chunk of at most 2³¹ elements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dmuon_kernels._env import progress_lines_enabled, quietly
from dmuon_kernels._log import IMPORT, log_rank_tagged, timed_phase
from dmuon_kernels.syrk._cute_tiles import (
    DIRECT,
    EPILOGUES,
    SM80,
    SM90,
    STAGED,
    STAGED_EPILOGUES,
    STAGED_FLAT,
    TILE_CONFIGS,
    TMA_ALIGNMENT_ELEMENTS,
    Sm80TileConfig,
    Sm90TileConfig,
    TileConfig,
)
from dmuon_kernels.syrk._operands import effective_c
from dmuon_kernels.syrk._requirements import (
    check_gpu_operands,
    distribution_version,
    gpu_problem,
)
from dmuon_kernels.syrk.kernel_cache import default_kernel_cache, share_compile_caches
from dmuon_kernels.syrk.registry import extra_install_command

NAME = "cute"
CUTE_MIN_COMPUTE_CAPABILITY = (8, 0)
CUTE_INSTALL_HINT = extra_install_command("cute")
# Bumped whenever the device code changes, so cached autotune verdicts are re-measured.
KERNEL_REVISION = "4"

# The modules whose source is the kernels' device and launch code (see _kernel_sources_digest).
_KERNEL_SOURCE_MODULES = ("_cute_kernel", "_cute_sm90_kernel", "_cute_runtime", "_cute_tiles")

_INT32_LIMIT = 2**31 - 1
_ALIGNMENT_BYTES = 16
_MAX_GRID_Z = 65535  # the batch is the grid's z dimension

# Path -> shape class -> tile configuration: "small" problems (fewer 128-wide output tiles than
# SMs) get small tiles so every SM has work. Large SM90 problems stage the epilogue through a
# plain shared-memory buffer: on the H200 that beat direct stores at every measured shape
# (4096² 1.56x vs 1.42x over cuBLAS, 8192² cooperative 1.77x vs 1.66x; benchmarks/results/
# syrk-h200-2026-11-29-cute-sm90-epilogues.json). The swizzled buffer ("smem") stays selectable:
# it avoids the plain one's bank conflicts but spills registers, and ran slower.
SHAPE_CLASS_CONFIGS: dict[str, dict[str, str]] = {
    SM80: {"large": "128x128_4warps", "small": "64x64_4warps"},
    SM90: {"large": "sm90_128x128_smem_flat", "small": "sm90_64x64"},
}
# Large SM90 problems whose triangle splits into equal rounds of 256x128 tiles use this one.
SM90_COOPERATIVE_CONFIG = "sm90_256x128_smem_flat"
PATH_DESCRIPTIONS: dict[str, str] = {
    SM80: "SM80 warp MMA",
    SM90: "SM90 wgmma + TMA, persistent warp-specialised",
}


@dataclasses.dataclass(frozen=True, slots=True)
class _CuteApi:
    """What the probe found: the kernel modules per path and the library version."""

    kernel_modules: dict[str, Any]
    cutlass_version: str
    runtime: Any = None  # syrk._cute_runtime: exports and loads compiled kernels


@dataclasses.dataclass(frozen=True, slots=True)
class _LaunchPlan:
    """Everything ``syrk`` derives from a call's signature (A's shape, strides, dtype and device,
    with or without C, the config and path asked for): worked out once, so a warmed call makes
    no device-capability query and chooses no configuration again."""

    kernel: Callable[..., Any]
    path: str
    batch: int
    M: int
    K: int
    padded_shape: tuple[int, int]  # (rows, cols) of each matrix of the buffer the kernel reads
    grid: tuple[int, int]  # SM90: (k_pad, tiles per matrix); SM80: (m_tiles, k_tiles)
    chunks: tuple[tuple[int, int], ...]
    sm_count: int
    device_index: int

    @property
    def padded_numel(self) -> int:
        return self.padded_shape[0] * self.padded_shape[1]

    @property
    def unpadded(self) -> bool:
        return self.padded_shape == (self.M, self.K)


# The current stream's raw handle without building a torch.cuda.Stream (several µs a call);
# torch's private accessor (Triton launches with it too), the public route where it is missing.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream
)
# The current device's index, as cheaply (torch.cuda.current_device's own call).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


_probe_result: _CuteApi | str | None = None  # the probe runs once per process
# (tile configuration, dtype name, with C, (major, minor)) -> compiled kernel
_compiled: dict[tuple[str, str, bool, tuple[int, int]], Callable[..., Any]] = {}
_sm_counts: dict[torch.device, int] = {}
# (A shape, A strides, dtype, device, with C, config, path) -> launch plan
_plans: dict[tuple, _LaunchPlan] = {}
MAX_LAUNCH_PLANS = 4096


def _probe_cutlass() -> _CuteApi | str:
    """Import the kernel module (and cutlass); a string is the reason it cannot be used."""
    if importlib.util.find_spec("cutlass") is None:
        return f"nvidia-cutlass-dsl is not installed ({CUTE_INSTALL_HINT})"
    share_compile_caches()
    try:
        with timed_phase(IMPORT, "nvidia-cutlass-dsl (CuTe SYRK kernels)") as phase:
            import cutlass  # noqa: F401  (first, so a broken cutlass is what the reason names)

            from dmuon_kernels.syrk import _cute_kernel, _cute_runtime, _cute_sm90_kernel
    except Exception as exc:  # a broken cutlass-dsl raises anything from ImportError to OSError
        return (
            f"nvidia-cutlass-dsl is installed but failed to import ({type(exc).__name__}: "
            f"{exc}); reinstall it with {CUTE_INSTALL_HINT} (tested with nvidia-cutlass-dsl "
            "4.5.2)"
        )
    version = distribution_version("nvidia-cutlass-dsl")
    if quietly(progress_lines_enabled):
        log_rank_tagged(
            f"imported nvidia-cutlass-dsl {version} for the CuTe SYRK kernels in "
            f"{phase.seconds:.1f} s, once per process"
        )
    return _CuteApi({SM80: _cute_kernel, SM90: _cute_sm90_kernel}, version, _cute_runtime)


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
    path = kernel_path(torch.device("cuda", torch.cuda.current_device()))
    return (
        True,
        f"dmuon CuTe DSL SYRK ({PATH_DESCRIPTIONS[path]}), nvidia-cutlass-dsl "
        f"{api.cutlass_version}",
    )


def kernel_path(device: torch.device) -> str:
    """SM90 (wgmma, TMA) on compute capability 9.x, where wgmma exists; SM80 elsewhere."""
    return SM90 if torch.cuda.get_device_capability(device)[0] == 9 else SM80


def versions() -> dict[str, str]:
    """Versions that make a cached autotune verdict stale when they change."""
    api = _cute_api()
    if isinstance(api, str):
        return {}
    return {
        "nvidia-cutlass-dsl": api.cutlass_version,
        "dmuon-cute-kernel": KERNEL_REVISION,
        # any edit of the kernel code re-measures, even when nobody bumped KERNEL_REVISION
        "dmuon-cute-sources": _kernel_sources_digest()[:16],
    }


def shape_class(M: int, batch: int, device: torch.device) -> str:
    """ "large" when 128-wide tiles already give every SM an output tile, else "small"."""
    tiles = math.ceil(M / TILE_CONFIGS[SHAPE_CLASS_CONFIGS[SM80]["large"]].tile)
    sm_count = _sm_count(device)
    return "large" if tiles * (tiles + 1) // 2 * batch >= sm_count else "small"


def _sm_count(device: torch.device) -> int:
    sm_count = _sm_counts.get(device)
    if sm_count is None:
        sm_count = _sm_counts[device] = torch.cuda.get_device_properties(
            device
        ).multi_processor_count
    return sm_count


def syrk(
    A: Tensor,  # (..., M, K)
    C: Tensor | None = None,  # (..., M, M), symmetric
    alpha: float = 1.0,
    beta: float = 0.0,
    *,
    config: str | None = None,  # a TILE_CONFIGS key; None: the path's shape-class choice
    path: str | None = None,  # "sm80" or "sm90"; None: kernel_path(A.device)
) -> Tensor:  # (..., M, M), exactly symmetric
    """``alpha·A·Aᵀ + beta·C`` through the CuTe DSL kernel; RuntimeError when it cannot run.

    ``path`` or ``config`` (which implies its path) forces a kernel: "sm90" needs compute
    capability 9.x; "sm80" runs on any supported GPU (on Hopper too, which keeps it tested).
    """
    return _lower_triangle_product(A, None, C, alpha, beta, config, path)


def symmetric_product(
    A: Tensor,  # (..., M, M)
    B: Tensor,  # (..., M, M), symmetric, commuting with A
    C: Tensor | None = None,  # (..., M, M), symmetric
    alpha: float = 1.0,
    beta: float = 0.0,
    *,
    config: str | None = None,
    path: str | None = None,
) -> Tensor:  # (..., M, M), exactly symmetric
    """``alpha·A·B + beta·C`` where A·B is known to be symmetric (A, B commuting symmetric
    matrices, e.g. polynomials in one Gram matrix): the kernel computes the lower triangle of
    tiles of A·Bᵀ (= A·B, B being symmetric) and mirrors it, half the work of a full product.
    ``config`` and ``path`` as for ``syrk``."""
    if B.shape != A.shape or A.shape[-1] != A.shape[-2]:
        raise ValueError(
            f"symmetric_product takes square A and B of one shape, got A {tuple(A.shape)} and "
            f"B {tuple(B.shape)}"
        )
    if B.device != A.device:
        raise ValueError(
            f"symmetric_product takes A and B on one device, got {A.device} and {B.device}"
        )
    return _lower_triangle_product(A, B.to(A.dtype), C, alpha, beta, config, path)


def _lower_triangle_product(
    A: Tensor,
    B: Tensor | None,  # None: A itself (syrk)
    C: Tensor | None,
    alpha: float,
    beta: float,
    config: str | None,
    path: str | None,
) -> Tensor:
    """``alpha·A·Bᵀ + beta·C``, one triangle of tiles computed and mirrored."""
    if config is not None or path is not None:
        _check_choice(config, path)
    _check_operand(A, C)
    alpha, beta = float(alpha), float(beta)
    C = effective_c(C, beta)
    M = A.shape[-2]
    out_shape = (*A.shape[:-1], M)
    if C is not None and (C.dtype != A.dtype or C.shape != out_shape):
        C = C.to(A.dtype).expand(out_shape)
    if A.numel() == 0:
        _api_and_path(A, config, path)  # nothing to compute, but the kernel must be runnable
        out = torch.zeros(out_shape, dtype=A.dtype, device=A.device)
        return out.add_(C, alpha=beta) if C is not None else out

    plan = _launch_plan(A, C is not None, config, path)
    # The kernels take raw addresses and the raw stream (TVM-FFI calls, see _cute_runtime).
    # Copies made here (padding, alignment) may be freed once the launches are enqueued: the
    # caching allocator hands their memory only to later work on the same stream.
    A_read = _kernel_operand(A, plan)
    B_read = A_read if B is None else _kernel_operand(B, plan)
    C_read = None if C is None else _contiguous_aligned(C)
    out = torch.empty(out_shape, dtype=A.dtype, device=A.device)
    size = A.element_size()
    a_base, b_base, a_step = A_read.data_ptr(), B_read.data_ptr(), plan.padded_numel * size
    d_base, d_step = out.data_ptr(), M * M * size
    c_base = d_base if C_read is None else C_read.data_ptr()  # C_read has out's layout
    stream = _raw_stream(plan.device_index)
    # The launch needs A's device current; entering torch.cuda.device costs microseconds, so only
    # when it is not.
    with (
        contextlib.nullcontext()
        if _current_device() == plan.device_index
        else torch.cuda.device(plan.device_index)
    ):
        for start, stop in plan.chunks:
            a_ptr, d_ptr = a_base + start * a_step, d_base + start * d_step
            b_ptr, c_ptr = b_base + start * a_step, c_base + start * d_step
            if plan.path == SM90:
                # persistent: at most one CTA per SM, each walking its share of the triangle
                k_pad, tiles_per_matrix = plan.grid
                ctas = min(plan.sm_count, tiles_per_matrix * (stop - start))
                plan.kernel(
                    a_ptr, b_ptr, d_ptr, c_ptr, M, k_pad, stop - start, ctas, alpha, beta, stream
                )
            else:
                m_tiles, k_tiles = plan.grid
                plan.kernel(
                    a_ptr, b_ptr, d_ptr, c_ptr, M, m_tiles, k_tiles, stop - start, alpha, beta,
                    stream,
                )  # fmt: skip
    return out


def _kernel_operand(X: Tensor, plan: _LaunchPlan) -> Tensor:
    """X (A, or B of A's shape) as the kernel reads it: X itself when it is contiguous, needs
    no padding and its base is 16-byte aligned, else a padded contiguous copy."""
    if plan.unpadded and X.is_contiguous() and X.data_ptr() % _ALIGNMENT_BYTES == 0:
        return X
    return _padded(X.reshape(plan.batch, plan.M, plan.K), *plan.padded_shape)


def _launch_plan(A: Tensor, has_c: bool, config: str | None, path: str | None) -> _LaunchPlan:
    """The plan for this signature, worked out (and the kernel compiled) on first use."""
    key = (A.shape, A.stride(), A.dtype, A.device, has_c, config, path)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= MAX_LAUNCH_PLANS:  # shapes that never repeat: start over
            _plans.clear()
        plan = _plans[key] = _new_launch_plan(A, has_c, config, path)
    return plan


def _check_choice(config: str | None, path: str | None) -> None:
    """ValueError unless ``config`` and ``path`` name a configuration and a path that agree."""
    if config is not None and config not in TILE_CONFIGS:
        raise ValueError(
            f"config must be one of {', '.join(map(repr, TILE_CONFIGS))} or None; got {config!r}"
        )
    if path is not None and path not in SHAPE_CLASS_CONFIGS:
        raise ValueError(
            f"path must be one of {', '.join(map(repr, SHAPE_CLASS_CONFIGS))} or None; got {path!r}"
        )
    if config is not None and path is not None and TILE_CONFIGS[config].path != path:
        raise ValueError(
            f"config {config!r} belongs to path {TILE_CONFIGS[config].path!r}, not {path!r}; "
            "pass one of them"
        )


def _api_and_path(A: Tensor, config: str | None, path: str | None) -> tuple[_CuteApi, str]:
    """The library and the path that run A; RuntimeError or ValueError when they cannot."""
    api = _cute_api()
    if isinstance(api, str):
        raise RuntimeError(f"SYRK kernel 'cute' cannot run: {api}")
    device_path = kernel_path(A.device)
    if config is not None:
        path = TILE_CONFIGS[config].path
    path = path or device_path
    if path == SM90 and device_path != SM90:
        major, minor = torch.cuda.get_device_capability(A.device)
        raise ValueError(
            f"the SM90 (wgmma) kernel needs compute capability 9.x, but {A.device} is "
            f"SM{major}{minor}; use path='sm80' or leave path and config as None"
        )
    return api, path


def _new_launch_plan(A: Tensor, has_c: bool, config: str | None, path: str | None) -> _LaunchPlan:
    api, path = _api_and_path(A, config, path)
    M, K = A.shape[-2], A.shape[-1]
    batch = math.prod(A.shape[:-2])
    name = runnable_config(config or choose_config(M, batch, A.device, path), M)
    tiles = TILE_CONFIGS[name]
    if tiles.path == SM90:
        k_pad = math.ceil(K / TMA_ALIGNMENT_ELEMENTS) * TMA_ALIGNMENT_ELEMENTS
        padded_shape = (M, k_pad)  # TMA zero-fills the rest of the edge tiles
        grid = (k_pad, tiles.triangle_tiles(M))
    else:
        m_tiles, k_tiles = math.ceil(M / tiles.tile), math.ceil(K / tiles.tile_k)
        padded_shape = (m_tiles * tiles.tile, k_tiles * tiles.tile_k)
        grid = (m_tiles, k_tiles)
    return _LaunchPlan(
        kernel=_kernel(api, name, A.dtype, has_c, A.device),
        path=tiles.path,
        batch=batch,
        M=M,
        K=K,
        padded_shape=padded_shape,
        grid=grid,
        chunks=tuple(_batch_chunks(batch, padded_shape[0] * padded_shape[1], M * M)),
        sm_count=_sm_count(A.device),
        device_index=A.device.index,
    )


def choose_config(M: int, batch: int, device: torch.device, path: str | None = None) -> str:
    """The tile configuration ``syrk`` runs for ``batch`` M x M outputs on ``device`` (and
    ``path``, by default ``kernel_path(device)``)."""
    path = path or kernel_path(device)
    name = SHAPE_CLASS_CONFIGS[path][shape_class(M, batch, device)]
    if path == SM90 and name == SHAPE_CLASS_CONFIGS[SM90]["large"]:
        name = _sm90_large_tiling(M, batch, _sm_count(device))
    return name


def runnable_config(name: str, M: int) -> str:
    """``name``, or its direct-epilogue twin when it stages the epilogue and M is not a
    multiple of 8 (TMA cannot describe D's rows then)."""
    tiles = TILE_CONFIGS[name]
    if (
        isinstance(tiles, Sm90TileConfig)
        and tiles.epilogue in STAGED_EPILOGUES
        and M % TMA_ALIGNMENT_ELEMENTS
    ):
        return with_epilogue(name, DIRECT)
    return name


def with_epilogue(name: str, epilogue: str) -> str:
    """The SM90 configuration of ``name``'s tiling with ``epilogue``: "<tiling>" for "direct",
    "<tiling>_<epilogue>" for a staged one (e.g. "sm90_256x128_smem_flat", "smem" ->
    "sm90_256x128_smem"). ValueError when ``name`` is not an SM90 configuration or its tiling
    has no such twin."""
    tiles = TILE_CONFIGS[name]
    if not isinstance(tiles, Sm90TileConfig):
        raise ValueError(f"config {name!r} is an SM80 tiling: only SM90 ones choose an epilogue")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}; got {epilogue!r}")
    tiling = name.removesuffix("_" + tiles.epilogue)
    twin = tiling if epilogue == DIRECT else f"{tiling}_{epilogue}"
    if twin not in TILE_CONFIGS:
        raise ValueError(f"the SM90 tiling {tiling!r} has no {epilogue!r} configuration")
    return twin


def _sm90_large_tiling(M: int, batch: int, sm_count: int) -> str:
    """The cooperative 256x128 tiling where it fills the SMs as evenly as 128x128 ping-pong
    (its tiles are twice the work, so twice as few rounds of them), else ping-pong."""
    pingpong = TILE_CONFIGS[SHAPE_CLASS_CONFIGS[SM90]["large"]]
    cooperative = TILE_CONFIGS[SM90_COOPERATIVE_CONFIG]
    assert isinstance(pingpong, Sm90TileConfig) and isinstance(cooperative, Sm90TileConfig)
    pingpong_rounds = math.ceil(pingpong.triangle_tiles(M) * batch / sm_count)
    cooperative_rounds = math.ceil(cooperative.triangle_tiles(M) * batch / sm_count)
    if 2 * cooperative_rounds <= pingpong_rounds:
        return SM90_COOPERATIVE_CONFIG
    return SHAPE_CLASS_CONFIGS[SM90]["large"]


def _kernel(
    api: _CuteApi, name: str, dtype: torch.dtype, has_c: bool, device: torch.device
) -> Callable[..., Any]:
    """The compiled kernel for this configuration: from memory, else from the on-disk cache
    (``syrk.kernel_cache``), else compiled on first use (and saved for later processes)."""
    capability = torch.cuda.get_device_capability(device)
    dtype_name = str(dtype).removeprefix("torch.")
    key = (name, dtype_name, has_c, capability)
    kernel = _compiled.get(key)
    if kernel is None:
        tiles = TILE_CONFIGS[name]
        module = api.kernel_modules[tiles.path]

        def compile_kernel() -> Callable[..., Any]:
            return module.compile_syrk(dtype_name, has_c, tiles)

        if api.runtime is None:  # no way to export: compile in every process
            kernel = compile_kernel()
        else:
            kernel = default_kernel_cache().get_or_compile(
                f"CuTe SYRK kernel {name} dtype={dtype_name} with_c={has_c}",
                _kernel_identity(api, tiles, dtype_name, has_c, capability),
                compile_kernel,
                api.runtime.load_compiled,
                api.runtime.dump_compiled,
            )
            kernel = api.runtime.direct_call(kernel)
        _compiled[key] = kernel
    return kernel


def _kernel_identity(
    api: _CuteApi, tiles: TileConfig, dtype_name: str, has_c: bool, capability: tuple[int, int]
) -> dict[str, str]:
    """Everything a compiled kernel's object code depends on: its name in the disk cache."""
    return {
        "tiles": repr(tiles),
        "dtype": dtype_name,
        "with_c": str(has_c),
        "arch": f"sm{capability[0]}{capability[1]}",
        "nvidia-cutlass-dsl": api.cutlass_version,
        "kernel_revision": KERNEL_REVISION,
        "kernel_sources": _kernel_sources_digest(),
    }


_sources_digest: str | None = None


def _kernel_sources_digest() -> str:
    """SHA-256 of the device-code modules, so any edit to a kernel invalidates saved objects
    (KERNEL_REVISION only when someone remembers to bump it)."""
    global _sources_digest
    if _sources_digest is None:
        digest = hashlib.sha256()
        folder = Path(__file__).resolve().parent
        for module in _KERNEL_SOURCE_MODULES:
            digest.update((folder / f"{module}.py").read_bytes())
        _sources_digest = digest.hexdigest()
    return _sources_digest


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
    if (rows, cols) == (M, K):
        if A3.is_contiguous() and A3.data_ptr() % _ALIGNMENT_BYTES == 0:
            return A3
        return A3.clone(memory_format=torch.contiguous_format)  # one copy, no zero fill
    padded = A3.new_zeros((batch, rows, cols))
    padded[:, :M, :K] = A3
    return padded


def _contiguous_aligned(t: Tensor) -> Tensor:
    if t.is_contiguous() and t.data_ptr() % _ALIGNMENT_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _check_operand(A: Tensor, C: Tensor | None) -> None:
    check_gpu_operands("cute", A, C)


__all__ = [
    "DIRECT",
    "EPILOGUES",
    "NAME",
    "SHAPE_CLASS_CONFIGS",
    "SM80",
    "SM90",
    "SM90_COOPERATIVE_CONFIG",
    "STAGED",
    "STAGED_EPILOGUES",
    "STAGED_FLAT",
    "TILE_CONFIGS",
    "Sm80TileConfig",
    "Sm90TileConfig",
    "TileConfig",
    "choose_config",
    "is_available",
    "kernel_path",
    "runnable_config",
    "shape_class",
    "symmetric_product",
    "syrk",
    "versions",
    "with_epilogue",
]
