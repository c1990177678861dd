"""Compiling Newton-Schulz's quack kernels ahead (``dmuon_kernels.syrk.precompile``), on the CPU:
when nothing is started, that the variants are exactly those the iterations run, and a
background process's failure path. tests/gpu/test_precompile_gpu.py compiles for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from dmuon_kernels.syrk import precompile
from dmuon_kernels.syrk.precompile import NS_VARIANTS, Variant, compile_ns_kernels_ahead

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("kernel", "device", "environment"),
    [
        ("cublas", CUDA, {}),
        ("cute", CUDA, {}),
        ("quack", torch.device("cpu"), {}),
        ("quack", CUDA, {"LOCAL_RANK": "1"}),
        ("quack", CUDA, {"DMUON_PRECOMPILE": "0"}),
    ],
    ids=["cublas", "cute", "cpu", "second-local-rank", "switched-off"],
)
def test_nothing_starts_off_quack_off_the_first_local_rank_or_when_switched_off(
    monkeypatch, kernel, device, environment
):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    # Each case returns before any CUDA call (there is no GPU here): none may spawn anything.
    assert compile_ns_kernels_ahead(kernel, torch.float16, device) == []
    assert precompile._processes == []


def test_a_misspelt_switch_raises_naming_it(monkeypatch):
    monkeypatch.setenv("DMUON_PRECOMPILE", "disabled")
    with pytest.raises(ValueError, match="DMUON_PRECOMPILE='disabled' is not an on/off value"):
        compile_ns_kernels_ahead("quack", torch.float16, CUDA)


def test_the_variants_are_those_the_gram_and_direct_iterations_run(monkeypatch):
    """quack compiles one kernel per (C or not, alpha == 1, beta == 1): a missing variant is
    compiled in the first step after all, a needless one costs a background process."""
    ns_module = sys.modules["dmuon_kernels.newton_schulz"]  # the package exports the function
    called: set[tuple[str, bool, bool, bool]] = set()

    def recording(op: str, product):
        def call(*args, C=None, alpha=1.0, beta=0.0, **kwargs):
            with_c = C is not None and beta != 0.0
            called.add((op, with_c, alpha == 1.0, not with_c or beta == 1.0))
            return product(*args, C=C, alpha=alpha, beta=beta, **kwargs)

        return call

    for op in ("syrk", "symmetric_product"):
        monkeypatch.setattr(ns_module, op, recording(op, getattr(ns_module, op)))
    for backend in ("gram", "direct"):
        ns_module.newton_schulz(torch.randn(16, 40), backend=backend)
    compiled = {(v.op, v.with_c, v.alpha == 1.0, v.beta == 1.0) for v in NS_VARIANTS}
    assert called == compiled, (called, compiled)


def test_markers_differ_per_variant_dtype_and_architecture_and_are_stable():
    names = {
        precompile.marker_name(variant, dtype, capability)
        for variant in NS_VARIANTS
        for dtype in (torch.float16, torch.bfloat16)
        for capability in ((9, 0), (10, 0))
    }
    assert len(names) == len(NS_VARIANTS) * 2 * 2
    variant = NS_VARIANTS[1]
    assert precompile.marker_name(variant, torch.float16, (9, 0)) in names
    assert all(name.startswith(precompile.MARKER_PREFIX) for name in names)


def test_a_background_process_that_cannot_compile_says_why_and_leaves_no_marker(tmp_path):
    """The real entry point, where quack cannot run (no quack, no GPU): it exits 1 with a
    rank-tagged line naming the variant and the reason, and no marker, so a later run tries
    again."""
    marker = tmp_path / "marker"
    variant = Variant("syrk", with_c=True, alpha=0.75, beta=-1.25)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dmuon_kernels.syrk._precompile_worker",
            "--device",
            "0",
            "--dtype",
            "float16",
            "--variant",
            json.dumps(asdict(variant)),
            "--marker",
            str(marker),
            "--started-at",
            "0",
        ],
        env={**os.environ, "RANK": "3", "WORLD_SIZE": "8"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert (
        "[DMuon][rank=3/8] background compile of the quack gemm_symmetric kernel for float16 "
        "with C (syrk) failed (RuntimeError: SYRK kernel 'quack' cannot run:"
    ) in result.stderr
    assert result.stderr.rstrip().endswith("the first step compiles it instead")
    assert not marker.exists()
