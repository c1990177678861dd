"""The whole-call graph cache behind ``ns(G)`` (normalisation and the iteration in one graphable
function) against the staged pipeline it replaced, and which graph cache each entry point uses.

Capture and replay themselves are tested in tests/gpu/test_ns_graphs_gpu.py; on the CPU both
caches run eagerly, so what is checked here is the function the whole-call graph captures.
"""

from __future__ import annotations

import pytest
import torch

from dmuon_kernels import NewtonSchulz, newton_schulz
from dmuon_kernels.fused import DEFAULT_NS_EPS
from dmuon_kernels.newton_schulz import normalized_input, restored_output

SHAPES = {
    "wide": (24, 56),  # gram form
    "tall": (56, 24),  # transposed gram form
    "square": (32, 32),  # direct form
    "batched": (3, 24, 56),
    "batched_tall_4d": (2, 3, 56, 24),
}
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def staged_pipeline(ns: NewtonSchulz, G: torch.Tensor) -> torch.Tensor:
    """The call path before the whole-call graph: normalise eagerly, run the iteration through
    its own graph cache, restore eagerly."""
    X = normalized_input(G, eps=DEFAULT_NS_EPS, dtype=ns.iteration_dtype(G.device))
    return restored_output(ns.iteration_graphs(X), G)


def an_input(shape, dtype, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def layouts(shape, dtype):
    """G of ``shape`` in every layout a caller may pass: contiguous, last two dims transposed
    (dense), a slice with gaps, and an expanded view (stride 0)."""
    base = an_input(shape, dtype)
    wide_base = an_input((*shape[:-1], 2 * shape[-1]), dtype, seed=1)
    return {
        "contiguous": base,
        "transposed": an_input((*shape[:-2], shape[-1], shape[-2]), dtype, seed=2).mT,
        "gapped": wide_base[..., ::2],
        "expanded": an_input((*shape[:-2], 1, shape[-1]), dtype, seed=3).expand(shape),
    }


@pytest.mark.parametrize("backend", ["gram", "direct"])
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("case", SHAPES, ids=str)
def test_the_whole_call_function_equals_the_staged_pipeline_bit_for_bit(backend, dtype, case):
    ns = NewtonSchulz(backend)
    G = an_input(SHAPES[case], dtype)
    expected = staged_pipeline(ns, G)
    whole_call = restored_output(ns.graphs(G), G)
    assert torch.equal(whole_call, expected)
    assert whole_call.dtype == dtype and whole_call.shape == G.shape
    assert whole_call.stride() == expected.stride()
    assert torch.equal(ns(G), expected)


@pytest.mark.parametrize("iteration_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_whole_call_function_equals_the_staged_pipeline_for_low_precision_iterations(
    iteration_dtype,
):
    ns = NewtonSchulz(dtype=iteration_dtype)
    for shape in ((8, 20), (20, 8), (2, 8, 20)):
        G = an_input(shape, torch.float32)
        assert torch.equal(ns(G), staged_pipeline(ns, G))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "gapped", "expanded"])
@pytest.mark.parametrize("case", ["wide", "tall", "batched_tall_4d"], ids=str)
def test_every_input_layout_gives_the_staged_pipelines_result(layout, case):
    ns = NewtonSchulz()
    G = layouts(SHAPES[case], torch.float32)[layout]
    out = ns(G)
    assert torch.equal(out, staged_pipeline(ns, G))
    assert out.shape == G.shape and out.dtype == G.dtype


def test_ns_calls_on_dense_inputs_never_go_through_the_iteration_cache():
    ns = NewtonSchulz()
    assert ns.graphs is not ns.iteration_graphs
    calls = {"whole call": 0, "iteration": 0}

    def counting(cache, name):
        fn = cache.fn

        def counted(x):
            calls[name] += 1
            return fn(x)

        cache.fn = counted

    counting(ns.graphs, "whole call")
    counting(ns.iteration_graphs, "iteration")
    dense = layouts((24, 56), torch.float32)
    for layout in ("contiguous", "transposed"):
        ns(dense[layout])
    assert calls == {"whole call": 2, "iteration": 0}
    ns(dense["gapped"])  # not dense: the staged path, through the iteration cache
    assert calls == {"whole call": 2, "iteration": 1}
    ns.iterate_normalized(torch.zeros(1, 24, 56))  # the fused optimizer step's entry
    assert calls == {"whole call": 2, "iteration": 2}
    assert ns.graphs.mode(dense["contiguous"]) == "eager"  # no graphs on the CPU


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (3, 0, 4), (0, 4, 6)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_element_inputs_give_zeros_of_their_shape_and_dtype(shape, dtype):
    G = torch.empty(shape, dtype=dtype)
    for out in (NewtonSchulz()(G), newton_schulz(G)):
        assert out.shape == G.shape and out.dtype == dtype and out.numel() == 0


def test_the_function_runs_through_its_cached_instances_whole_call_path():
    G = an_input((24, 56), torch.bfloat16)
    ns = NewtonSchulz()
    assert torch.equal(newton_schulz(G), ns(G))
    assert torch.equal(newton_schulz(G), staged_pipeline(ns, G))
