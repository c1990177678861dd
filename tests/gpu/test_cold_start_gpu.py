"""Cold start across processes on one GPU machine: what one process tuned and compiled, the next
loads from ``DMUON_CACHE_DIR`` instead of measuring and compiling again, with the same results;
the first-use work of each is timed, recorded and announced, so a first step can be accounted for.

Each test runs fresh Python processes (as a second training job on the machine would be) with a
private cache folder, and reads their rank-tagged lines and recorded phases to see what they
did."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dmuon_kernels import _log
from dmuon_kernels.graphs import GraphedFunction
from dmuon_kernels.syrk import backend_availability

REPO = Path(__file__).resolve().parents[2]

# Runs one product the way a user would, saves the result and prints what was chosen.
PROCESS_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from dmuon_kernels.syrk import resolve_kernel, syrk
    kernel, out_path = sys.argv[1], sys.argv[2]
    generator = torch.Generator(device="cuda").manual_seed(21)
    # 2·2048²·8192 FLOP = MIN_TUNED_FLOP: the smallest problem "auto" tunes.
    A = torch.randn(2048, 8192, device="cuda", generator=generator).mul_(8192**-0.25).half()
    out = syrk(A, kernel=kernel)
    torch.cuda.synchronize()
    torch.save(out.cpu(), out_path)
    from dmuon_kernels import _log
    print("phases", json.dumps([[p.kind, p.what, p.seconds] for p in _log.recorded_phases()]))
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


def phases_of(result: subprocess.CompletedProcess) -> list[tuple[str, str, float]]:
    (line,) = [s for s in result.stdout.splitlines() if s.startswith("phases ")]
    return [tuple(phase) for phase in json.loads(line.removeprefix("phases "))]


def test_a_cold_process_accounts_for_its_first_use_work_and_a_warm_one_only_loads(tmp_path):
    available, reason = backend_availability("cute")
    if not available:
        pytest.skip(f"cute unavailable: {reason}")
    first = run_process(tmp_path, "auto", "first")
    cold = phases_of(first)
    kinds = {kind for kind, _, _ in cold}
    assert "import" in kinds and "compile" in kinds, cold
    if "SYRK autotune candidate started" in first.stderr:  # a fast backend was tuned
        assert "autotune" in kinds, cold
        verdicts = [s for s in first.stderr.splitlines() if "SYRK autotune verdict" in s]
        assert verdicts and all(re.search(r"; took \d+\.\d s$", s) for s in verdicts)
    compiled = [s for s in first.stderr.splitlines() if "] compiled CuTe SYRK kernel" in s]
    assert all(re.search(r" in \d+\.\d s$", s) for s in compiled), compiled
    second = run_process(tmp_path, "auto", "second")
    warm = phases_of(second)
    assert not [p for p in warm if p[0] in ("autotune", "compile") and "CuTe" in p[1]], warm
    assert "autotune" not in {kind for kind, _, _ in warm}, warm


def test_a_capture_is_a_timed_phase_and_announced_with_its_seconds(caplog, monkeypatch):
    monkeypatch.delenv("DMUON_SYRK_AUTOTUNE_LOG", raising=False)
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    graphed = GraphedFunction(lambda x: x * 2, name="test function")
    x = torch.randn(64, 48, device="cuda")
    _log.clear_recorded_phases()
    for _ in range(3):  # eager, capture, replay
        assert torch.equal(graphed(x), x * 2)
    (phase,) = [p for p in _log.recorded_phases() if p.kind == "capture"]
    assert phase.what == "test function shape=(64, 48) dtype=float32"
    (line,) = [m for m in caplog.messages if "captured a CUDA graph" in m]
    assert re.search(
        r"captured a CUDA graph of test function shape=\(64, 48\) dtype=float32 in \d+\.\d\d s$",
        line,
    )


# A dmuon.Muon step on CUDA in a fresh process with an empty Triton cache: counts the fused step
# kernels' compiled specialisations (and launchers) once those compiled ahead are ready, then after
# two steps.
COMPILE_AHEAD_SCRIPT = textwrap.dedent(
    """
    import collections, itertools, json, os, pathlib, sys, torch
    from torch import nn
    import dmuon
    from dmuon_kernels import _fused_triton

    def compiled():
        folder = pathlib.Path(os.environ["TRITON_CACHE_DIR"])
        names = [p.stem for p in folder.glob("*/*.json") if p.stem.endswith("_kernel")]
        # Triton 3.6 builds a C launcher per kernel signature, kept beside the kernels.
        names += ["launcher"] * len(list(folder.glob("*/__triton_launcher*.so")))
        return dict(collections.Counter(names))

    torch.manual_seed(0)
    # wide, tall and square matrices, sides that are not multiples of 16 (512 -> 200 -> 520), and
    # a NorMuon group (layer 1)
    sizes = (512, 1024, 512, 512, 200, 520)
    model = nn.ModuleDict({"layers": nn.ModuleList(
        nn.Sequential(*[nn.Linear(a, b) for a, b in itertools.pairwise(sizes)]) for _ in range(2)
    )}).cuda()
    dmuon.dedicate_params(
        model, None, lambda name, p: p.ndim == 2,
        layer_id_fn=lambda name: ".".join(name.split(".")[:2]),
        hook_boundary_predicate=lambda module: isinstance(module, nn.Sequential),
    )
    optimizer = dmuon.Muon(
        model, param_groups=[{"params": lambda name, p: name.startswith("layers.1.")
                              and p.ndim == 2, "normuon": True}],
    )
    _fused_triton._await_compiles_ahead()
    ahead = compiled()
    for _ in range(2):
        x = torch.randn(8, 512, device="cuda")
        sum(layer(x).square().sum() for layer in model["layers"]).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    print("counts", json.dumps({"ahead": ahead, "after_steps": compiled()}))
    """
)


def test_the_first_step_compiles_no_fused_kernel_beyond_those_compiled_ahead(tmp_path):
    from dmuon_kernels.fused import triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
    script = tmp_path / "process.py"
    script.write_text(COMPILE_AHEAD_SCRIPT)
    source_paths = [
        str(REPO / "packages" / name / "src") for name in ("dmuon-kernels", "dmuon-core")
    ]
    env = {
        **os.environ,
        "DMUON_CACHE_DIR": str(tmp_path / "cache"),
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "PYTHONPATH": os.pathsep.join([*source_paths, os.environ.get("PYTHONPATH", "")]),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    env.pop("DMUON_FUSED_TRITON", None)
    env.pop("DMUON_SYRK_AUTOTUNE_LOG", None)  # the progress line checked below is on by default
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=540
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [s for s in result.stdout.splitlines() if s.startswith("counts ")]
    counts = json.loads(line.removeprefix("counts "))
    assert counts["ahead"], result.stderr[-2000:]  # something was compiled ahead
    assert counts["after_steps"] == counts["ahead"], (counts, result.stderr[-2000:])
    assert "Triton kernel specialisations of the fused step ready" in result.stderr
