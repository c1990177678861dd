"""GPU tests: skipped without CUDA; each session tunes into a private autotune cache folder.

Run on a CUDA machine with ``pytest tests/gpu``. The quack tests also need quack-kernels (and a
matching nvidia-cutlass-dsl) and an SM90+ GPU; they skip with the reason otherwise.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

GPU_DIR = Path(__file__).resolve().parent

# Before anything tunes: verdicts of this session go to a fresh folder, never ~/.cache/dmuon.
os.environ.setdefault("DMUON_CACHE_DIR", tempfile.mkdtemp(prefix="dmuon-gpu-tests-"))
# The tests of tuned kernels (quack, CuTe, graphs, the fused step) mean the kernels a tuned run
# steps with, so a Muon here compiles them first instead of stepping on cuBLAS until a
# background compile lands; test_background_compile_gpu.py sets the mode of each of its runs.
os.environ.setdefault("DMUON_KERNEL_COMPILE", "wait")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if GPU_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


def quack_problem() -> str | None:
    """Why quack cannot run here, or None."""
    from dmuon_kernels.syrk import backend_availability

    available, reason = backend_availability("quack")
    return None if available else reason


@pytest.fixture
def needs_quack():
    problem = quack_problem() if torch.cuda.is_available() else "no CUDA"
    if problem is not None:
        pytest.skip(f"quack unavailable: {problem}")


@pytest.fixture
def needs_triton():
    from dmuon_kernels.fused import triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
