"""What the CUDA-graph and quack modules promise on a machine without a GPU.

Capture and quack themselves are tested in tests/gpu; here: the switches, the eager fall-through,
the errors a user without the hardware or the library gets, what the probe finds in a quack
release, and the quack adapter's operand front over a stand-in that computes in float64.
"""

from __future__ import annotations

import logging
import re
import sys
import textwrap

import pytest
import torch
from torch import Tensor

from dmuon_kernels import NewtonSchulz, _log
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
        y = graphed(x)
        assert torch.equal(y, x * 2)
        assert graphed.mode(x) == "eager"
    assert len(calls) == 3


def test_finish_runs_on_every_call_with_the_functions_outputs():
    graphed = GraphedFunction(lambda x: (x * 2, x + 1), finish=lambda a, b: a @ b.mT)
    x = torch.arange(6.0).reshape(2, 3)
    for _ in range(3):
        assert torch.equal(graphed(x), (x * 2) @ (x + 1).mT)


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


def test_the_probe_times_the_import_and_says_how_long_it_took(fake_quack, caplog, monkeypatch):
    monkeypatch.delenv("DMUON_SYRK_AUTOTUNE_LOG", raising=False)
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    fake_quack(KNOWN_GEMM_SYMMETRIC)
    _log.clear_recorded_phases()
    quack_backend._quack_api()
    (phase,) = _log.recorded_phases()
    assert (phase.kind, phase.what) == ("import", "quack-kernels")
    (line,) = [m for m in caplog.messages if "imported quack-kernels" in m]
    assert re.fullmatch(
        r"\[DMuon\]\[rank=\d+/\d+\] imported quack-kernels 9\.9\.0 \(with nvidia-cutlass-dsl\) "
        r"in \d+\.\d s, once per process",
        line,
    )


KNOWN_GEMM_SYMMETRIC = """
def gemm_symmetric(A, B, C=None, out=None, out_dtype=None, dynamic_scheduler=False,
                   alpha=1.0, beta=1.0):
    return A @ B
"""


def test_the_probe_finds_the_launcher_behind_torchs_custom_op(fake_quack):
    # A real torch custom op, as quack 0.5 wraps its launcher: the probe reads the function
    # torch keeps behind it.
    fake_quack(
        KNOWN_GEMM_SYMMETRIC
        + """
import torch

@torch.library.custom_op("dmuon_test_fake_quack::gemm_symmetric_out", mutates_args=("out",))
def gemm_symmetric_out(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor,
                       C: torch.Tensor | None = None, dynamic_scheduler: bool = False,
                       alpha: float = 1.0, beta: float = 1.0) -> None:
    out.copy_(alpha * (A @ B))

LAUNCHED_BY = gemm_symmetric_out._init_fn
"""
    )
    api = quack_backend._quack_api()
    assert not isinstance(api, str)
    assert api.symmetric_launcher is sys.modules["quack.gemm_interface"].LAUNCHED_BY


def test_a_release_whose_launcher_takes_other_arguments_keeps_the_public_entry(fake_quack):
    fake_quack(
        KNOWN_GEMM_SYMMETRIC
        + """
class _Op:
    @staticmethod
    def _init_fn(A, B, D, scale):
        raise AssertionError("never called")

gemm_symmetric_out = _Op()
"""
    )
    api = quack_backend._quack_api()
    assert not isinstance(api, str) and api.symmetric_launcher is None


class TorchQuack:
    """quack's entry points computed in float64 on the CPU, checking that every operand is laid
    out as quack requires (sizes and strides multiples of 8 elements, 16-byte aligned base), and
    recording what each call was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Tensor, Tensor, Tensor | None, float, float]] = []

    @staticmethod
    def check(t: Tensor) -> None:
        assert t.shape[-1] % 8 == 0 and t.shape[-2] % 8 == 0, t.shape
        assert t.data_ptr() % 16 == 0
        strides = t.stride()
        assert strides[-1] == 1 or strides[-2] == 1, f"no unit stride in the last two: {strides}"
        assert all(s % 8 == 0 for s in strides if s != 1), (
            f"a stride not a multiple of 8: {strides}"
        )

    def product(self, entry, A, B, C, alpha, beta) -> Tensor:
        for operand in (A, B) if C is None else (A, B, C):
            self.check(operand)
        self.calls.append((entry, A, B, C, alpha, beta))
        result = alpha * (A.double() @ B.double())
        return result if C is None else result + beta * C.double()

    def launcher(self, A, B, out, C=None, dynamic_scheduler=False, alpha=1.0, beta=1.0):
        out.copy_(self.product("launcher", A, B, C, alpha, beta))

    def gemm_symmetric(self, A, B, C=None, out=None, alpha=1.0, beta=1.0):
        return self.product("gemm_symmetric", A, B, C, alpha, beta).to(A.dtype)

    def gemm(self, A, B, alpha=1.0, tuned=True):
        assert tuned is False
        return self.product("gemm", A, B, None, alpha, 0.0).to(A.dtype)

    def gemm_add(self, A, B, C, alpha=1.0, beta=1.0, tuned=True):
        assert tuned is False
        return self.product("gemm_add", A, B, C, alpha, beta).to(A.dtype)


def _strided(storage: Tensor, offset: int, shape: tuple, stride: tuple) -> Tensor:
    return storage.as_strided(shape, stride, offset)


@pytest.mark.parametrize(
    "make",
    [
        lambda s: _strided(s, 0, (8, 12), (12, 1)),  # a size not a multiple of 8
        lambda s: _strided(s, 1, (8, 8), (8, 1)),  # a base 4 bytes past 16-byte alignment
        lambda s: _strided(s, 0, (8, 8), (12, 1)),  # a row stride not a multiple of 8
        lambda s: _strided(s, 0, (8, 8), (16, 2)),  # no unit stride among the last two
    ],
    ids=["size", "alignment", "row-stride", "no-unit-stride"],
)
def test_the_torch_quack_stand_in_rejects_each_layout_quack_cannot_take(make):
    storage = torch.zeros(512)
    TorchQuack.check(_strided(storage, 0, (8, 8), (8, 1)))
    TorchQuack.check(_strided(storage, 0, (8, 16), (1, 8)))  # column-major: unit stride first
    with pytest.raises(AssertionError):
        TorchQuack.check(make(storage))


@pytest.fixture
def torch_quack(monkeypatch):
    """The quack adapter over ``TorchQuack`` on the CPU (the GPU operand check switched off)."""
    fake = TorchQuack()

    def install(launcher: bool = True) -> TorchQuack:
        api = quack_backend._QuackApi(
            gemm_symmetric=fake.gemm_symmetric,
            accepts_out=True,
            quack_version="test",
            cutlass_version="test",
            gemm=fake.gemm,
            gemm_add=fake.gemm_add,
            symmetric_launcher=fake.launcher if launcher else None,
        )
        monkeypatch.setattr(quack_backend, "_probe_result", api)
        return fake

    monkeypatch.setattr(quack_backend, "_check_operand", lambda A, C: None)
    monkeypatch.setattr(quack_backend, "_ready_variants", set())
    return install


def half(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).mul_(0.3).half()


def symmetric(*shape: int, seed: int = 0) -> Tensor:
    S = half(*shape, seed=seed).float()
    return ((S + S.mT) / 2).half()


def assert_close(out: Tensor, expected: Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == torch.float16
    torch.testing.assert_close(out.double(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("launcher", [True, False], ids=["launcher", "public entry"])
@pytest.mark.parametrize("shape", [(13, 21), (16, 64), (3, 9, 30), (2, 3, 12, 20)], ids=str)
def test_quack_syrk_pads_aligns_and_slices_back_any_shape(torch_quack, shape, launcher):
    fake = torch_quack(launcher)
    A = half(*shape)
    C = symmetric(*shape[:-1], shape[-2], seed=1)
    expected = 0.5 * (A.double() @ A.double().mT) - 1.25 * C.double()
    assert_close(quack_backend.syrk(A, C, 0.5, -1.25), expected)
    (entry, _, B, _, _, _) = fake.calls[-1]
    assert entry == ("launcher" if launcher else "gemm_symmetric")
    assert B.stride(-2) == 1  # syrk hands quack Aᵀ, a view of the padded A


def test_quack_syrk_reads_a_transposed_view_in_place(torch_quack):
    fake = torch_quack()
    X = half(64, 32)
    quack_backend.syrk(X.mT)  # (32, 64), M-contiguous
    (_, A, _, _, _, _) = fake.calls[-1]
    assert A.data_ptr() == X.data_ptr()


def test_quack_with_beta_zero_never_reads_c(torch_quack):
    fake = torch_quack()
    A = half(16, 24)
    C = torch.full((16, 16), float("nan"), dtype=torch.float16)
    out = quack_backend.syrk(A, C, 1.0, 0.0)
    assert torch.isfinite(out).all()
    assert fake.calls[-1][3] is None


def test_quack_symmetric_product_and_matmul_share_the_front(torch_quack):
    fake = torch_quack()
    S, B, C = symmetric(3, 20, 20), symmetric(3, 20, 20, seed=2), symmetric(3, 20, 20, seed=3)
    expected = S.double() @ B.double() + 0.5 * C.double()
    assert_close(quack_backend.symmetric_product(S, B, C, 1.0, 0.5), expected)
    X, Y = half(2, 3, 12, 20), half(2, 3, 20, 28, seed=4)
    assert_close(quack_backend.matmul(X, Y, None, 2.0, 0.0), 2.0 * (X.double() @ Y.double()))
    Z = half(2, 3, 12, 28, seed=5)
    expected = X.double() @ Y.double() - Z.double()
    assert_close(quack_backend.matmul(X, Y, Z, 1.0, -1.0), expected)
    assert [call[0] for call in fake.calls] == ["launcher", "gemm", "gemm_add"]


def test_quack_on_empty_operands_gives_beta_c(torch_quack):
    torch_quack()
    A, C = half(8, 0), symmetric(8, 8)
    assert torch.equal(quack_backend.syrk(A, C, 1.0, 2.0), 2.0 * C)


def test_the_first_use_of_each_quack_variant_is_timed_and_announced_once(
    torch_quack, caplog, monkeypatch
):
    monkeypatch.delenv("DMUON_SYRK_AUTOTUNE_LOG", raising=False)
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    torch_quack()
    _log.clear_recorded_phases()
    A, C = half(16, 24), symmetric(16, 16)
    for _ in range(2):
        quack_backend.syrk(A)
        quack_backend.syrk(A, C, 0.5, 2.0)
    ready = [m for m in caplog.messages if "ready in" in m]
    assert len(ready) == 2
    assert "quack gemm_symmetric kernel for float16 ready in" in ready[0]
    assert "quack gemm_symmetric kernel for float16 with C ready in" in ready[1]
    phases = [(p.kind, p.what) for p in _log.recorded_phases()]
    assert phases == [
        ("compile", "quack gemm_symmetric kernel for float16"),
        ("compile", "quack gemm_symmetric kernel for float16 with C"),
    ]


def test_an_invalid_progress_switch_never_makes_quack_unavailable(fake_quack, monkeypatch):
    monkeypatch.setenv("DMUON_SYRK_AUTOTUNE_LOG", "sometimes")
    fake_quack(KNOWN_GEMM_SYMMETRIC)
    assert not isinstance(quack_backend._quack_api(), str)


def test_an_invalid_progress_switch_raises_naming_it_before_a_first_use(torch_quack, monkeypatch):
    fake = torch_quack()
    monkeypatch.setenv("DMUON_SYRK_AUTOTUNE_LOG", "sometimes")
    with pytest.raises(ValueError, match=r"DMUON_SYRK_AUTOTUNE_LOG='sometimes' is not an on/off"):
        quack_backend.syrk(half(16, 24))
    assert fake.calls == []
