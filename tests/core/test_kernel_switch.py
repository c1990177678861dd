"""What ``dmuon.Muon`` hands the background kernel compile (``dmuon.kernel_switch``): the
Newton-Schulz inputs its fused step really runs, batch sizes included (the CuTe kernel's tiling
depends on them); and on the CPU nothing starts and no step agrees on anything. The agreement
across ranks is in tests/distributed/test_kernel_switch.py, the compile itself in tests/gpu."""

from __future__ import annotations

import itertools

import torch
from torch import nn

import dmuon
from dmuon import muon_state
from dmuon.hooks import get_dedicated_state
from dmuon.kernel_switch import ns_inputs
from dmuon_kernels.background_compile import background_compile
from dmuon_kernels.newton_schulz import NewtonSchulz
from dmuon_kernels.syrk import readiness


class RecordingNewtonSchulz(NewtonSchulz):
    """A real NewtonSchulz that also records the shape of each batch the step iterates."""

    def __init__(self) -> None:
        super().__init__(dtype=torch.float32, kernel="cublas")
        self.shapes: list[tuple[int, ...]] = []

    def iterate_normalized(self, X, **kwargs):
        self.shapes.append(tuple(X.shape))
        return super().iterate_normalized(X, **kwargs)


def _model() -> nn.Module:
    # wide, tall, square and odd sides; layer 1 in its own param group (its own batches)
    sizes = (48, 96, 48, 48, 70, 40)
    return nn.ModuleDict(
        {
            "layers": nn.ModuleList(
                nn.Sequential(*[nn.Linear(a, b) for a, b in itertools.pairwise(sizes)])
                for _ in range(2)
            )
        }
    )


def _model_by_layer() -> nn.Module:
    """``_model()`` dedicated with each layer its own hook boundary and layer."""
    torch.manual_seed(0)
    model = _model()
    dmuon.dedicate_params(
        model,
        None,
        lambda name, p: p.ndim == 2,
        layer_id_fn=lambda name: ".".join(name.split(".")[:2]),
        hook_boundary_predicate=lambda module: isinstance(module, nn.Sequential),
    )
    return model


def test_the_compile_job_gets_the_newton_schulz_inputs_the_step_runs():
    model = _model_by_layer()
    ns = RecordingNewtonSchulz()
    optimizer = dmuon.Muon(
        model,
        ns_backend=ns,
        param_groups=[{"params": lambda name, p: name.startswith("layers.1.") and p.ndim == 2}],
    )
    x = torch.randn(4, 48)
    sum(layer(x).square().sum() for layer in model["layers"]).backward()
    optimizer.step()
    predicted = ns_inputs(get_dedicated_state(model), optimizer.param_groups)
    assert sorted(predicted) == sorted(ns.shapes)
    assert len(ns.shapes) == 8  # 4 (short, long) classes per group, two groups


def test_the_compile_job_gets_a_large_shapes_calls_split_as_the_step_splits_them(monkeypatch):
    # A large model's matrices of one shape go through Newton-Schulz in several calls of at
    # most NS_CALL_BYTES; the job must build (and allocate) those calls, not one of them all.
    # The bound is lowered here so that the small model's (48, 96) pairs take one call each.
    monkeypatch.setattr(muon_state, "NS_CALL_BYTES", 2 * 48 * 96)
    torch.manual_seed(0)
    model = _model()
    dmuon.dedicate_params(model, None, lambda name, p: p.ndim == 2)
    ns = RecordingNewtonSchulz()
    optimizer = dmuon.Muon(model, ns_backend=ns)
    x = torch.randn(4, 48)
    sum(layer(x).square().sum() for layer in model["layers"]).backward()
    optimizer.step()
    predicted = ns_inputs(get_dedicated_state(model), optimizer.param_groups)
    assert sorted(predicted) == sorted(ns.shapes)
    assert [s for s in ns.shapes if s[1:] == (48, 96)] == [(1, 48, 96)] * 4  # the step split


def test_with_overlap_step_the_compile_job_gets_each_units_inputs():
    """``overlap_step=True`` batches per chunk of the model (during backward, and in the step for
    what it recomputes): each layer here is its own chunk, so each batch holds one layer's
    matrices of a shape where the plain step's holds both layers'."""
    model = _model_by_layer()
    ns = RecordingNewtonSchulz()
    optimizer = dmuon.Muon(model, ns_backend=ns, overlap_step=True)
    x = torch.randn(4, 48)
    sum(layer(x).square().sum() for layer in model["layers"]).backward()
    optimizer.step()
    state = get_dedicated_state(model)
    predicted = ns_inputs(state, optimizer.param_groups, optimizer._overlap)
    assert sorted(predicted) == sorted(ns.shapes)
    assert len(ns.shapes) == 8  # 4 (short, long) classes per layer, each layer its own unit
    assert sorted(predicted) != sorted(ns_inputs(state, optimizer.param_groups))


def test_a_muon_on_the_cpu_starts_no_background_compile():
    model = _model()
    dmuon.dedicate_params(model, None, lambda name, p: p.ndim == 2)
    optimizer = dmuon.Muon(model)
    model["layers"][0](torch.randn(4, 48)).square().sum().backward()
    optimizer.step()
    assert not background_compile().active
    assert not readiness.tuning_deferred()
