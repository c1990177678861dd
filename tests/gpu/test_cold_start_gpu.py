"""Cold start across processes on one GPU machine: what one process tuned and compiled, the next
loads from ``DMUON_CACHE_DIR`` instead of measuring and compiling again, with the same results.

Each test runs fresh Python processes (as a second training job on the machine would be) with a
private cache folder, and reads their rank-tagged lines to see what they did."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dmuon_kernels.syrk import backend_availability

REPO = Path(__file__).resolve().parents[2]

# Runs one product the way a user would, saves the result and prints what was chosen.
PROCESS_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from dmuon_kernels.syrk import resolve_kernel, syrk
    kernel, out_path = sys.argv[1], sys.argv[2]
    generator = torch.Generator(device="cuda").manual_seed(21)
    # 2·2048²·8192 FLOP = MIN_TUNED_FLOP: the smallest problem "auto" tunes.
    A = torch.randn(2048, 8192, device="cuda", generator=generator).mul_(8192**-0.25).half()
    out = syrk(A, kernel=kernel)
    torch.cuda.synchronize()
    torch.save(out.cpu(), out_path)
    print("chosen", resolve_kernel(kernel, A))
    """
)


def run_process(tmp_path: Path, kernel: str, name: str) -> subprocess.CompletedProcess:
    script = tmp_path / "process.py"
    script.write_text(PROCESS_SCRIPT)
    source_paths = [str(REPO / "packages" / "dmuon-kernels" / "src"), str(REPO)]
    env = {
        **os.environ,
        "DMUON_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([*source_paths, os.environ.get("PYTHONPATH", "")]),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    env.pop("DMUON_SYRK_AUTOTUNE_LOG", None)
    env.pop("DMUON_KERNEL_CACHE", None)
    result = subprocess.run(
        [sys.executable, str(script), kernel, str(tmp_path / f"{name}.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def test_a_verdict_tuned_by_one_process_is_reused_by_the_next(tmp_path):
    first = run_process(tmp_path, "auto", "first")
    second = run_process(tmp_path, "auto", "second")
    if "SYRK autotune candidate started" not in first.stderr:
        pytest.skip("auto resolves to cuBLAS here without tuning (no fast backend)")
    assert "SYRK autotune candidate started" not in second.stderr, second.stderr[-2000:]
    assert first.stdout.split()[-1] == second.stdout.split()[-1]  # the same backend
    assert torch.equal(torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt"))


def test_a_cute_kernel_compiled_by_one_process_is_loaded_by_the_next(tmp_path):
    available, reason = backend_availability("cute")
    if not available:
        pytest.skip(f"cute unavailable: {reason}")
    first = run_process(tmp_path, "cute", "first")
    assert "] compiling CuTe SYRK kernel" in first.stderr, first.stderr[-2000:]
    assert list((tmp_path / "cache" / "kernels").glob("*.o")), "nothing was saved"
    second = run_process(tmp_path, "cute", "second")
    assert "compiling CuTe SYRK kernel" not in second.stderr, second.stderr[-2000:]
    assert torch.equal(torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt"))
