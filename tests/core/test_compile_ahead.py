"""The fused step's kernels compiled ahead: what ``dmuon.Muon`` asks to compile is what its step
launches ([Note: compiles ahead] in ``dmuon_kernels._fused_triton``).

On the CPU no kernel compiles, so the launches are recorded instead: a real dmuon step runs with
the Triton kernels swapped for recorders, and every launch's specialisation must be one derived
ahead from what the optimizer asked for. tests/gpu checks the same on a CUDA step through
Triton's own cache.
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
from torch import nn

import dmuon
from dmuon import muon_update
from dmuon_kernels.newton_schulz import NewtonSchulz

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)

# Wide, tall, square, and sides that are not multiples of 16 (another integer specialisation).
SHAPES = [(48, 160), (160, 48), (64, 64), (70, 130), (130, 70)]


class Recorder:
    """Stands in for a Triton kernel: records each launch's arguments, runs nothing."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.arg_names = kernel.arg_names
        self.fn = kernel.fn
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **options: self.launches.append((args, options))


@pytest.fixture
def recorders(monkeypatch):
    from dmuon_kernels import _fused_triton, fused

    monkeypatch.setattr(fused, "_kernels", lambda *tensors: _fused_triton)
    found = {}
    for name in ("_momentum_kernel", "_normalize_kernel", "_apply_update_kernel"):
        found[name] = Recorder(getattr(_fused_triton, name))
        monkeypatch.setattr(_fused_triton, name, found[name])
    return found


def launch_keys(recorders) -> set[tuple]:
    from dmuon_kernels import _fused_triton

    keys = set()
    for recorder in recorders.values():
        assert recorder.launches, f"{recorder.fn.__name__} was never launched"
        for args, options in recorder.launches:
            args = tuple(
                _fused_triton.pointer_of(arg) if isinstance(arg, torch.Tensor) else arg
                for arg in args
            )
            keys.add(_fused_triton.specialisation_key(recorder.kernel, args, options))
    return keys


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("momentum_dtype", ["float32", "bfloat16"])
def test_a_real_step_launches_only_specialisations_derived_ahead(
    recorders, monkeypatch, nesterov, momentum_dtype
):
    """dmuon's own step (its averaged gradients are views of the received messages, after
    gradients of sizes that are not multiples of 4), with the second layer in a NorMuon group."""
    from dmuon_kernels import _fused_triton

    requests = []

    def record(device, shapes, more_launches, **dtypes):
        requests.append((list(shapes), dtypes))
        return 0

    monkeypatch.setattr(muon_update, "compile_step_kernels_ahead", record)
    torch.manual_seed(0)
    sizes = (48, 160, 48, 48, 70, 130)  # wide, tall, square, sides not multiples of 16
    model = nn.ModuleDict({"layers": nn.ModuleList(
        nn.Sequential(*[nn.Linear(a, b) for a, b in itertools.pairwise(sizes)]) for _ in range(2)
    )})  # fmt: skip
    dmuon.dedicate_params(
        model, None, lambda name, p: p.ndim == 2,
        layer_id_fn=lambda name: ".".join(name.split(".")[:2]),
        hook_boundary_predicate=lambda module: isinstance(module, nn.Sequential),
    )  # fmt: skip
    second = {"params": lambda name, p: name.startswith("layers.1.") and p.ndim == 2}
    optimizer = dmuon.Muon(
        model,
        nesterov=nesterov,
        momentum_dtype=momentum_dtype,
        ns_backend=NewtonSchulz(dtype=torch.float16),  # as on CUDA
        param_groups=[{**second, "normuon": True}],
    )
    for _ in range(2):
        x = torch.randn(4, 48)
        sum(layer(x).square().sum() for layer in model["layers"]).backward()
        optimizer.step()
        optimizer.zero_grad()
    derived = {
        _fused_triton.specialisation_key(*launch)
        for shapes, dtypes in requests
        for rows, cols in shapes
        for launch in _fused_triton.step_launches(
            rows, cols, grad_dtype=torch.float32, master_dtype=torch.float32, **dtypes
        )
    }
    launched = launch_keys(recorders)
    assert launched <= derived, sorted(map(str, launched - derived))
    assert {dtypes["normuon"] for _, dtypes in requests} == {False, True}


def test_nothing_compiles_ahead_for_cpu_tensors():
    from dmuon_kernels.fused import compile_step_kernels_ahead

    started = compile_step_kernels_ahead(
        torch.device("cpu"), [(64, 128)], momentum_dtype=torch.float32, nesterov=True,
        ns_dtype=torch.float16,
    )  # fmt: skip
    assert started == 0


def test_the_optimizer_asks_for_every_muon_matrix_shape_of_each_group(monkeypatch):
    asked = []

    def record(device, shapes, **options):
        asked.append((device, list(shapes), options))
        return 0

    monkeypatch.setattr(muon_update, "compile_step_kernels_ahead", record)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 96), nn.Linear(96, 32), nn.Linear(32, 32))
    dmuon.dedicate_params(
        model, None, lambda name, p: p.ndim == 2,
        layer_id_fn=lambda name: name.split(".")[0],
        hook_boundary_predicate=lambda module: isinstance(module, nn.Linear),
    )  # fmt: skip
    dmuon.Muon(model, nesterov=False, momentum_dtype="bfloat16")
    assert asked == [
        (
            torch.device("cpu"),
            [(32, 32), (32, 96), (96, 32)],
            dict(
                nesterov=False,
                momentum_dtype=torch.bfloat16,
                ns_dtype=torch.float32,
                normuon=False,
                aligned_gradients=True,
                more_launches=[],
            ),
        )
    ]


@pytest.mark.parametrize("gemm", ["cublas", "triton"])
def test_the_update_gemm_that_writes_the_segments_compiles_ahead_when_chosen(monkeypatch, gemm):
    """bf16 weights: the plain step's update also writes each owner segment ([Note: the step
    writes the segments]); with ``DMUON_UPDATE_GEMM=triton`` the GEMM doing it is asked for each
    Muon shape (its launch on a CUDA step: tests/gpu/test_update_gemm_gpu.py), with cuBLAS none."""
    from dmuon_kernels import _fused_triton
    from dmuon_kernels._update_gemm_triton import update_gemm_launches

    monkeypatch.setenv("DMUON_UPDATE_GEMM", gemm)
    asked = []
    monkeypatch.setattr(
        muon_update, "compile_step_kernels_ahead",
        lambda device, shapes, **options: asked.append(options["more_launches"]) or 0,
    )  # fmt: skip
    model = nn.Sequential(nn.Linear(32, 96), nn.Linear(96, 32)).to(torch.bfloat16)
    dmuon.dedicate_params(
        model, None, lambda name, p: p.ndim == 2,
        layer_id_fn=lambda name: name.split(".")[0],
        hook_boundary_predicate=lambda module: isinstance(module, nn.Linear),
    )  # fmt: skip
    dmuon.Muon(model, ns_backend=NewtonSchulz(dtype=torch.float16))
    expected = []
    if gemm == "triton":
        for rows, cols in [(32, 96), (96, 32)]:
            expected += update_gemm_launches(
                rows, cols, ns_dtype=torch.float16, copy_dtype=torch.bfloat16
            )
    key = _fused_triton.specialisation_key
    assert [[key(*launch) for launch in launches] for launches in asked] == [
        [key(*launch) for launch in expected]
    ]


def test_each_specialisation_starts_once_and_a_kernels_first_compile_precedes_its_others(
    monkeypatch, caplog
):
    """compile_step_ahead's bookkeeping, with the compile itself recorded instead: later calls
    (another param group) start only what is new, and wait for the kernel's first compile."""
    from dmuon_kernels import _fused_triton

    started = []

    def record(device, kernel, args, options, after):
        if after is not None:
            after.exception()  # as the real one waits
        started.append((kernel.fn.__name__, after))
        if options.get("OUT_MODE") == 2 and options.get("GRAD_VEC") == 1:
            raise RuntimeError("no ptxas here")

    monkeypatch.setattr(_fused_triton, "_warm_up", record)
    monkeypatch.setattr(_fused_triton, "_started", set())
    monkeypatch.setattr(_fused_triton, "_first_compiles", {})
    monkeypatch.setattr(_fused_triton, "_pending_compiles", [])
    dtypes = dict(
        grad_dtype=torch.float32, momentum_dtype=torch.float32, nesterov=True,
        ns_dtype=torch.float16, master_dtype=torch.float32, normuon=False,
    )  # fmt: skip
    device = torch.device("cpu")
    wide = _fused_triton.step_launches(64, 128, **dtypes)
    tall = _fused_triton.step_launches(128, 64, **dtypes)
    assert _fused_triton.compile_step_ahead(device, wide) == len(wide)
    assert _fused_triton.compile_step_ahead(device, wide + tall) == len(tall)
    assert _fused_triton.compile_step_ahead(device, tall) == 0
    firsts = {}
    for name, after in started:
        if after is None:
            assert name not in firsts, f"{name} has two first compiles"
            firsts[name] = True
        else:
            assert name in firsts
    with caplog.at_level("INFO", logger="dmuon_kernels"):
        _fused_triton._await_compiles_ahead()
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1 and "4 of 10" in failed[0] and "no ptxas here" in failed[0], failed
    _fused_triton._await_compiles_ahead()  # nothing pending: returns at once
