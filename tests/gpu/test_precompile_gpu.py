"""Compiling Newton-Schulz's quack kernels ahead (``dmuon_kernels.syrk.precompile``) on the GPU:
the background processes fill a fresh cache without holding GPU memory, a later job starts none,
and a Newton-Schulz run afterwards compiles nothing more, so the compiled kernels are exactly
the ones the iterations run.

Each step is a fresh Python process over one private cache folder, as jobs on a machine are."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

START = textwrap.dedent(
    """
    import torch
    from dmuon_kernels.syrk import precompile
    started = precompile.compile_ns_kernels_ahead("quack", torch.float16, torch.device("cuda", 0))
    print("started", len(started), "exit codes", [p.wait(timeout=400) for p in started])
    """
)

# Newton-Schulz under "auto" in both forms (gram: wide matrices; direct: square ones), on
# batches large enough that the autotuner times quack on every symmetric product.
USE = textwrap.dedent(
    """
    import torch
    from dmuon_kernels import newton_schulz
    for shape in ((8, 2048, 8192), (8, 2048, 2048)):
        newton_schulz(torch.randn(shape, device="cuda"))
    torch.cuda.synchronize()
    """
)

LIST = textwrap.dedent(
    """
    import os
    from pathlib import Path
    folder = Path(os.environ["DMUON_CACHE_DIR"]) / "quack"
    print("objects", sorted(str(p.relative_to(folder)) for p in folder.rglob("*.o")))
    """
)

# One variant compiled in this process, then whether the process holds a CUDA context (memory
# on the GPU) afterwards.
CONTEXT = textwrap.dedent(
    """
    import torch
    from dmuon_kernels.syrk import quack
    quack.compile_only("syrk", torch.float16, torch.device("cuda", 0), with_c=False, alpha=1, beta=1)
    from cuda.bindings import driver
    driver.cuInit(0)
    _, device = driver.cuDeviceGet(0)
    _, flags, active = driver.cuDevicePrimaryCtxGetState(device)
    print("context active", bool(active))
    """
)


def run(tmp_path: Path, script: str, **environment: str) -> str:
    env = {
        **os.environ,
        "DMUON_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "packages" / "dmuon-kernels" / "src"), os.environ.get("PYTHONPATH", "")]
        ),
        **environment,
    }
    for name in ("LOCAL_RANK", "DMUON_KERNEL_CACHE", "QUACK_CACHE_DIR", "CUTE_DSL_CACHE_DIR"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=500
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout + result.stderr


def objects(tmp_path: Path) -> str:
    (line,) = [line for line in run(tmp_path, LIST).splitlines() if line.startswith("objects")]
    return line


def test_kernels_compiled_ahead_are_the_ones_newton_schulz_runs(tmp_path, needs_quack):
    first = run(tmp_path, START)
    assert "started 3 exit codes [0, 0, 0]" in first, first[-3000:]
    assert first.count("compiled ahead in the background") == 3, first[-3000:]
    assert "started 0 exit codes []" in run(tmp_path, START)  # the markers: a later job starts none
    compiled_ahead = objects(tmp_path)
    assert compiled_ahead.count(".o") == 3, compiled_ahead
    used = run(tmp_path, USE, DMUON_PRECOMPILE="0")
    assert "quack gemm_symmetric kernel" in used, used[-3000:]  # quack did run
    assert objects(tmp_path) == compiled_ahead, used[-3000:]  # nothing new


def test_compiling_ahead_holds_no_cuda_context(tmp_path, needs_quack):
    pytest.importorskip("cuda.bindings")
    assert "context active False" in run(tmp_path, CONTEXT)
