"""The fused step's kernels compiled ahead: what ``dmuon.Muon`` asks to compile is what its step
launches ([Note: compiles ahead] in ``dmuon_kernels._fused_triton``).

On the CPU no kernel compiles, so the launches are recorded instead: the step's road
(``muon_update.orthogonalized_matrices`` then ``apply_matrices_``) runs with the Triton kernels
swapped for recorders, and every launch's specialisation must be one derived ahead for its
shape, and every one derived ahead must be launched (none compiled in vain). tests/gpu checks the
same on a real step through Triton's own cache.
"""

from __future__ import annotations

import importlib.util

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


def as_specialised(args: tuple) -> tuple:
    """Tensors as their dtypes (each must be 16-byte aligned, as the derivation assumes)."""
    converted = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            assert arg.data_ptr() % 16 == 0, "the test's tensors are all aligned"
            arg = arg.dtype
        converted.append(arg)
    return tuple(converted)


@pytest.fixture
def recorders(monkeypatch):
    from dmuon_kernels import _fused_triton, fused

    monkeypatch.setattr(fused, "_kernels", lambda *tensors: _fused_triton)
    found = {}
    for name in ("_momentum_kernel", "_normalize_kernel", "_apply_update_kernel"):
        found[name] = Recorder(getattr(_fused_triton, name))
        monkeypatch.setattr(_fused_triton, name, found[name])
    return found


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize(
    "momentum_dtype", [torch.float32, torch.bfloat16], ids=["fp32-momentum", "bf16-momentum"]
)
@pytest.mark.parametrize("normuon", [False, True], ids=["muon", "normuon"])
def test_the_step_launches_exactly_the_specialisations_derived_ahead(
    recorders, nesterov, momentum_dtype, normuon
):
    from dmuon_kernels import _fused_triton

    newton_schulz = NewtonSchulz(dtype=torch.float16)
    launched, derived = set(), set()
    for rows, cols in SHAPES:
        grads = [torch.randn(rows, cols) for _ in range(3)]
        momenta = [torch.zeros(rows, cols, dtype=momentum_dtype) for _ in range(3)]
        masters = [torch.zeros(rows, cols) for _ in range(3)]
        for recorder in recorders.values():
            recorder.launches.clear()
        orthogonal = muon_update.orthogonalized_matrices(
            newton_schulz, grads, momenta, [True, False, False], momentum=0.9, nesterov=nesterov
        )
        normuon_state = ([torch.zeros(rows) for _ in range(3)], 0.95, 1e-8) if normuon else None
        muon_update.apply_matrices_(
            masters, orthogonal, lr=0.02, weight_decay=0.1, adjust_lr=None, normuon=normuon_state
        )
        for recorder in recorders.values():
            assert recorder.launches, f"{recorder.fn.__name__} was not launched for {rows}x{cols}"
            for args, options in recorder.launches:
                launched.add(
                    _fused_triton.specialisation_key(recorder.kernel, as_specialised(args), options)
                )
        for kernel, args, options in _fused_triton.step_launches(
            rows, cols, grad_dtype=torch.float32, momentum_dtype=momentum_dtype,
            nesterov=nesterov, ns_dtype=torch.float16, master_dtype=torch.float32,
            update_dtype=torch.float32 if normuon else torch.float16,
        ):  # fmt: skip
            derived.add(_fused_triton.specialisation_key(kernel, args, options))
    assert launched == derived
    # wide and tall differ in layout, multiples of 16 from other sides: neither collapses
    assert len(derived) > 3


def test_a_bf16_step_on_cuda_would_compile_nothing_on_the_cpu():
    from dmuon_kernels.fused import compile_step_kernels_ahead

    started = compile_step_kernels_ahead(
        torch.device("cpu"), [(64, 128)], momentum_dtype=torch.float32, nesterov=True,
        ns_dtype=torch.float16,
    )  # fmt: skip
    assert started == 0


def test_the_optimizer_asks_for_every_muon_matrix_shape_of_each_group(monkeypatch):
    asked = []

    def record(newton_schulz, device, shapes, **options):
        asked.append((device, sorted(shapes), options))
        return 0

    monkeypatch.setattr(muon_update, "compile_kernels_ahead", record)
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
            dict(nesterov=False, momentum_dtype=torch.bfloat16, normuon=False),
        )
    ]
