"""Newton-Schulz's quack kernels compiled ahead, in background processes, while a first
training step's forward and backward run.

Owns which quack kernel variants Newton-Schulz runs (``NS_VARIANTS``), the decision to compile
them ahead (``compile_ns_kernels_ahead``), the background processes, and their entry point
(``syrk._precompile_worker``). How one variant compiles without launching is
``syrk.quack.compile_only``'s business.

[Note: compiling ahead]
On a machine's first run, each quack kernel variant Newton-Schulz runs is compiled at its first
use inside the first step, one after the other: 3-4 s each on the H200, and the Gram iteration
runs three (X·Xᵀ; b·R + c·R²; a·Q + Z·Q). So a ``NewtonSchulz`` whose kernel is quack starts, when
it is built (the optimizer's construction), one background process per variant, which compiles
that variant into quack's disk cache in quack's compile-only mode (fake tensors: no GPU memory,
nothing launched). The processes run beside the training process's imports, data loading and
first forward and backward. When the step reaches a variant, quack's per-kernel file lock makes
it wait for the process compiling it, then load the object (milliseconds). Correctness never
depends on it: a variant no process compiled (one failed, or is not needed) is compiled in the
step as before, and every result still comes from the same kernel.

- Once per machine and job: only the process with ``LOCAL_RANK`` 0 (or none) starts them, once
  per (device, dtype); the other ranks' first uses wait on the same locks.
- Once per cache: a process that compiled its variant leaves a marker in quack's cache folder
  (``dmuon-ahead-<key>``, the key holding the library versions, the GPU architecture, the dtype
  and the variant), and a later run finding it starts nothing.
- Only into dmuon's cache folders (``kernel_cache.share_compile_caches``: quack's folder under
  ``DMUON_CACHE_DIR``, or ``QUACK_CACHE_DIR`` when the user set it); never with
  ``DMUON_KERNEL_CACHE=0``. ``DMUON_PRECOMPILE=0`` turns it off.
- The processes print their own rank-tagged line (compiled in how long, or why not) and exit;
  they outlive a training process that ends first, so a compile is never cut half-written.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dmuon_kernels._env import KERNEL_CACHE_ENV, PRECOMPILE_ENV, env_flag
from dmuon_kernels._log import log_rank_tagged
from dmuon_kernels.syrk.autotune import TUNING_ALPHA_WITH_C, TUNING_BETA_WITH_C
from dmuon_kernels.syrk.kernel_cache import QUACK_CACHE_ENV, share_compile_caches
from dmuon_kernels.syrk.registry import QUACK, SYMMETRIC_PRODUCT, SYRK

MARKER_PREFIX = "dmuon-ahead-"
# The background processes' entry point (a module nothing imports, so ``-m`` runs it once).
WORKER_MODULE = "dmuon_kernels.syrk._precompile_worker"


@dataclass(frozen=True, slots=True)
class Variant:
    """One quack kernel variant: the operation, whether it adds C, and alpha and beta (quack
    compiles one variant per (alpha == 1, beta == 1)), as Newton-Schulz and the autotuner call
    it."""

    op: str
    with_c: bool
    alpha: float = 1.0
    beta: float = 1.0

    def describe(self, dtype: torch.dtype) -> str:
        """As ``syrk.quack`` announces the variant's first use, with the operation."""
        with_c = " with C" if self.with_c else ""
        return f"quack gemm_symmetric kernel for {str(dtype).removeprefix('torch.')}{with_c} ({self.op})"


# What the Gram and direct iterations run on quack (their plain products run cuBLAS): X·Xᵀ;
# b·R + c·R² (neither coefficient 1); a·Q + Z·Q and its kin (alpha 1). The autotuner tunes with
# the same alpha and beta classes (``TUNING_ALPHA_WITH_C``), so it needs no other variant.
NS_VARIANTS = (
    Variant(SYRK, with_c=False),
    Variant(SYRK, with_c=True, alpha=TUNING_ALPHA_WITH_C[SYRK], beta=TUNING_BETA_WITH_C),
    Variant(
        SYMMETRIC_PRODUCT,
        with_c=True,
        alpha=TUNING_ALPHA_WITH_C[SYMMETRIC_PRODUCT],
        beta=TUNING_BETA_WITH_C,
    ),
)

# (device index, dtype) pairs this process has started compiles for.
_started: set[tuple[int, torch.dtype]] = set()
# The processes started, kept so that they are not reaped as garbage while they run.
_processes: list[subprocess.Popen] = []


def quack_cache_folder() -> Path | None:
    """The folder quack caches its objects in when dmuon shares it (see
    ``share_compile_caches``); None when dmuon's kernel cache is off or quack keeps its own
    default."""
    if not env_flag(KERNEL_CACHE_ENV, default=True):
        return None
    share_compile_caches()
    folder = os.environ.get(QUACK_CACHE_ENV)
    return Path(folder) if folder else None


def marker_name(variant: Variant, dtype: torch.dtype, capability: tuple[int, int]) -> str:
    """The marker file of ``variant`` compiled for ``dtype`` on an SM``capability`` GPU with
    this machine's quack, nvidia-cutlass-dsl and torch."""
    from dmuon_kernels.syrk import quack

    identity = {
        **quack.versions(),
        "torch": torch.__version__,
        "capability": list(capability),
        "dtype": str(dtype),
        **asdict(variant),
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return MARKER_PREFIX + digest[:24]


def is_first_local_rank() -> bool:
    """Whether this process is the first of its machine (``LOCAL_RANK`` unset counts as 0)."""
    return os.environ.get("LOCAL_RANK", "0").strip() in ("", "0")


def compile_ns_kernels_ahead(
    kernel: str, dtype: torch.dtype, device: torch.device
) -> list[subprocess.Popen]:
    """Start compiling, in the background, the quack variants of ``NS_VARIANTS`` that a
    Newton-Schulz running ``kernel`` in ``dtype`` on ``device`` will use and that no earlier run
    compiled; returns the processes started. See [Note: compiling ahead] for when none are."""
    if not env_flag(PRECOMPILE_ENV, default=True):
        return []
    if kernel != QUACK or device.type != "cuda" or not is_first_local_rank():
        return []
    index = torch.cuda.current_device() if device.index is None else device.index
    if (index, dtype) in _started:
        return []
    _started.add((index, dtype))
    folder = quack_cache_folder()
    if folder is None:
        return []
    capability = torch.cuda.get_device_capability(index)
    pending = [
        (variant, folder / marker_name(variant, dtype, capability))
        for variant in NS_VARIANTS
        if not (folder / marker_name(variant, dtype, capability)).exists()
    ]
    started = [_start(variant, dtype, index, marker) for variant, marker in pending]
    _processes.extend(started)
    if started:
        log_rank_tagged(
            f"compiling {len(started)} quack kernel variants for "
            f"{str(dtype).removeprefix('torch.')} in background processes (pids "
            f"{', '.join(str(p.pid) for p in started)}), ahead of the first step's Newton-Schulz; "
            f"once per cache folder ({PRECOMPILE_ENV}=0 turns this off)"
        )
    return started


def _start(variant: Variant, dtype: torch.dtype, index: int, marker: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        WORKER_MODULE,
        "--device",
        str(index),
        "--dtype",
        str(dtype).removeprefix("torch."),
        "--variant",
        json.dumps(asdict(variant)),
        "--marker",
        str(marker),
        "--started-at",
        repr(time.time()),
    ]
    env = dict(os.environ)
    # The worker imports this package from where this process did, whatever its sys.path.
    package_root = str(Path(__file__).resolve().parents[2])  # .../src of dmuon_kernels/syrk/
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    # Its own session: a Ctrl-C meant for training does not cut a compile half-written.
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
