"""What the CUDA-graph and quack modules promise on a machine without a GPU.

Capture and quack themselves are tested in tests/gpu; here: the switches, the eager fall-through,
and the errors a user without the hardware or the library gets.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from dmuon_kernels import NewtonSchulz
from dmuon_kernels.graphs import GraphedFunction, cuda_graphs_enabled
from dmuon_kernels.syrk import quack as quack_backend

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")


def test_cuda_graphs_are_on_by_default_and_dmuon_ns_cuda_graph_0_turns_them_off(monkeypatch):
    monkeypatch.delenv("DMUON_NS_CUDA_GRAPH", raising=False)
    assert cuda_graphs_enabled()
    assert GraphedFunction(torch.neg).enabled
    for off in ("0", "false", "off", "No"):
        monkeypatch.setenv("DMUON_NS_CUDA_GRAPH", off)
        assert not cuda_graphs_enabled()
        assert not GraphedFunction(torch.neg).enabled
    monkeypatch.setenv("DMUON_NS_CUDA_GRAPH", "1")
    assert cuda_graphs_enabled()


def test_cpu_inputs_run_eagerly_and_return_fresh_tensors():
    calls = []

    def double(x):
        calls.append(1)
        return x * 2

    graphed = GraphedFunction(double)
    x = torch.arange(6.0).reshape(2, 3)
    for _ in range(3):
        y = graphed(x, out_dtype=torch.float64)
        assert y.dtype == torch.float64 and torch.equal(y, (x * 2).double())
        assert graphed.mode(x) == "eager"
    assert len(calls) == 3


def test_newton_schulz_through_its_graph_wrapper_matches_the_plain_function():
    from dmuon_kernels import newton_schulz

    G = torch.randn(24, 56, generator=torch.Generator().manual_seed(0))
    ns = NewtonSchulz(dtype=torch.float32)
    for _ in range(3):  # eager warm-up, then the calls that would capture/replay on CUDA
        assert torch.equal(ns(G), newton_schulz(G, dtype=torch.float32))
    assert ns(G.double()).dtype == torch.float64


@needs_no_cuda
def test_kernel_quack_without_a_gpu_fails_at_construction_with_the_install_hint():
    with pytest.raises(RuntimeError) as raised:
        NewtonSchulz(kernel="quack")
    message = str(raised.value)
    assert "kernel='quack' cannot run here" in message
    assert "SM90" in message
    assert "pip install dmuon-kernels[quack]" in message
    assert 'kernel="auto"' in message


@needs_no_cuda
def test_quack_reports_itself_unavailable_without_a_gpu():
    available, reason = quack_backend.is_available()
    assert not available
    assert "needs a CUDA GPU with SM90 or newer" in reason


@pytest.fixture
def fake_quack(tmp_path, monkeypatch):
    """Install a stand-in ``quack`` package (another release's layout) for the probe to find."""

    def install(gemm_interface_source: str, version: str = "9.9.0") -> None:
        package = tmp_path / "quack"
        package.mkdir()
        (package / "__init__.py").write_text(
            f"__version__ = {version!r}\n"
            # as quack 0.5's quack.cache, which ``import quack`` imports, reads its folder
            "import os\nCACHE_DIR = os.getenv('QUACK_CACHE_DIR')\n"
        )
        (package / "gemm_interface.py").write_text(textwrap.dedent(gemm_interface_source))
        monkeypatch.syspath_prepend(str(tmp_path))

    # The probe points the libraries' caches at DMUON_CACHE_DIR: keep that inside the test.
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path / "dmuon-cache"))
    for variable in ("CUTE_DSL_CACHE_DIR", "QUACK_CACHE_DIR"):
        monkeypatch.setenv(variable, "")  # so that undoing the test unsets what the probe set
        monkeypatch.delenv(variable)
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "quack"}
    for name in saved:
        del sys.modules[name]
    monkeypatch.setattr(quack_backend, "_probe_result", None)
    yield install
    for name in [name for name in sys.modules if name.split(".")[0] == "quack"]:
        del sys.modules[name]
    sys.modules.update(saved)


def test_a_quack_release_without_gemm_symmetric_is_refused_with_the_supported_pins(fake_quack):
    fake_quack("def gemm(A, B):\n    return A @ B\n")
    reason = quack_backend._quack_api()
    assert isinstance(reason, str)
    assert "quack-kernels 9.9.0 has no quack.gemm_interface.gemm_symmetric" in reason
    assert "quack-kernels==0.5.0" in reason and "nvidia-cutlass-dsl==4.5.2" in reason


def test_a_quack_release_with_another_signature_is_refused_naming_what_is_missing(fake_quack):
    fake_quack("def gemm_symmetric(A, B, out=None, scale=1.0):\n    return A @ B\n")
    reason = quack_backend._quack_api()
    assert isinstance(reason, str)
    assert "gemm_symmetric(A, B, out=None, scale=1.0) does not take" in reason
    assert "missing C, alpha, beta" in reason


def test_a_quack_release_with_the_known_signature_is_accepted(fake_quack):
    fake_quack(
        """
        def gemm_symmetric(A, B, C=None, out=None, out_dtype=None, dynamic_scheduler=False,
                           alpha=1.0, beta=1.0):
            return A @ B
        """,
        version="0.6.1",
    )
    api = quack_backend._quack_api()
    assert not isinstance(api, str)
    assert api.quack_version == "0.6.1" and api.accepts_out


def test_a_quack_that_fails_to_import_is_reported_with_the_cutlass_pairing(fake_quack):
    fake_quack("raise ImportError('libcute_dsl.so: cannot open shared object file')\n")
    reason = quack_backend._quack_api()
    assert isinstance(reason, str)
    assert "failed to import (ImportError: libcute_dsl.so" in reason
    assert "nvidia-cutlass-dsl 4.5.2" in reason


def test_the_probe_points_quack_at_dmuons_cache_before_importing_it(fake_quack, tmp_path):
    fake_quack("def gemm(A, B):\n    return A @ B\n")
    quack_backend._quack_api()
    folder_quack_read_at_import = sys.modules["quack"].CACHE_DIR
    assert folder_quack_read_at_import == str(tmp_path / "dmuon-cache" / "quack")
