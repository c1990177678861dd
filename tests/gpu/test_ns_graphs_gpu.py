"""Newton-Schulz on the GPU: every kernel against float64 oracles, CUDA-graph replay bit-identical
to eager, failed captures left eager, and batched NS equal to one call per matrix."""

from __future__ import annotations

import gc
import itertools
import sys
import warnings

import pytest
import torch

from dmuon_kernels import NewtonSchulz, newton_schulz, reference
from dmuon_kernels.coefficients import POLAR_EXPRESS_COEFFICIENTS
from dmuon_kernels.graphs import GraphedFunction
from tests.kernels.ns_matrices import (
    LOW_PRECISION_RATIO,
    log_spectrum,
    matrix_with_spectrum,
    plain_loop_error,
)
from tests.numerics import relative_error

# wide (gram form), square (direct form), tall (transposed gram)
CASES = {"wide": (256, 1024), "square": (384, 384), "tall": (1024, 256)}


def spectrum_matrix(rows, cols, seed=0):
    return matrix_with_spectrum(rows, cols, log_spectrum(min(rows, cols), 1e-3), seed=seed)


@pytest.mark.parametrize("kernel", ["cublas", "quack", "auto"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_newton_schulz_is_within_twice_the_plain_loop_error(kernel, case, request):
    if kernel == "quack":
        request.getfixturevalue("needs_quack")
    rows, cols = CASES[case]
    G = spectrum_matrix(rows, cols)
    exact = reference.newton_schulz_by_svd(G, POLAR_EXPRESS_COEFFICIENTS)
    yardstick = plain_loop_error(G, POLAR_EXPRESS_COEFFICIENTS, torch.float16)
    ns = NewtonSchulz(kernel=kernel)
    out = ns(G.cuda())
    assert out.dtype == torch.float32 and out.shape == G.shape
    assert relative_error(out.cpu(), exact) <= LOW_PRECISION_RATIO * yardstick


@pytest.mark.parametrize("backend", ["gram", "direct"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_graph_replay_is_bit_identical_to_eager(backend, case, monkeypatch):
    rows, cols = CASES[case]
    inputs = [spectrum_matrix(rows, cols, seed=s).cuda() for s in range(4)]
    monkeypatch.setenv("DMUON_NS_CUDA_GRAPH", "0")
    eager = NewtonSchulz(backend)
    monkeypatch.setenv("DMUON_NS_CUDA_GRAPH", "1")
    graphed = NewtonSchulz(backend)
    counts = []
    for G in inputs:  # call 1 eager (autotune), call 2 captures, calls 3-4 replay
        assert torch.equal(graphed(G), eager(G))
        counts.append(graphed.graphs.graph_count)
    assert counts == [0, 1, 1, 1]
    assert graphed.graphs.eager_reasons() == {}
    assert eager.graphs.graph_count == 0


def test_replayed_outputs_are_fresh_tensors():
    ns = NewtonSchulz()
    G1, G2 = (spectrum_matrix(128, 512, seed=s).cuda() for s in (5, 6))
    ns(G1)
    first = ns(G1)  # captured
    kept = first.clone()
    ns(G2)  # replays into the graph's static output
    assert torch.equal(first, kept)


def normalized(G):
    """What ``iterate_normalized`` takes: each matrix over its Frobenius norm, fp16 on CUDA."""
    return (G / G.norm(dim=(-2, -1), keepdim=True)).to("cuda", torch.float16)


def test_held_results_outlive_replays_of_every_graph_sharing_the_pool():
    """An overlapped step holds each call's result until commit while other signatures'
    graphs, captured before and after, replay in one memory pool."""
    ns, eager = NewtonSchulz(), NewtonSchulz()
    eager.iteration_graphs.enabled = False
    shapes = [(4, 128, 512), (2, 256, 256), (3, 64, 1024)]  # gram, direct, gram
    inputs = {shape: [normalized(torch.randn(shape)) for _ in range(2)] for shape in shapes}
    for _ in range(2):  # eager warm-up, then capture
        for shape in shapes:
            ns.iterate_normalized(inputs[shape][0])
    assert ns.iteration_graphs.graph_count == len(shapes)
    held = [(ns.iterate_normalized(X), X) for shape in shapes for X in inputs[shape]]
    for shape in reversed(shapes):  # replay every graph again, newest first
        ns.iterate_normalized(torch.zeros(shape, device="cuda", dtype=torch.float16))
    for result, X in held:
        assert torch.equal(result, eager.iterate_normalized(X))


def test_replays_from_two_streams_take_turns_in_the_pool():
    """A replay queued on a side stream behind a long kernel (an overlapped step's speculation)
    while the compute stream writes the same graph's input buffer, replays it and replays
    another graph of the pool: each call still gets its own input's result."""
    ns, eager = NewtonSchulz(), NewtonSchulz()
    eager.iteration_graphs.enabled = False
    shapes = [(4, 128, 512), (2, 256, 256)]
    for _ in range(2):  # eager warm-up, then capture
        for shape in shapes:
            ns.iterate_normalized(normalized(torch.randn(shape)))
    X1, X2 = (normalized(torch.randn(shapes[0])) for _ in range(2))
    Y = normalized(torch.randn(shapes[1]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s: the side stream's replay runs last
        on_side = ns.iterate_normalized(X1)
    buffer = ns.normalized_buffer(shapes[0], torch.device("cuda"))
    buffer.copy_(X2)
    on_compute = ns.iterate_normalized(buffer)
    other = ns.iterate_normalized(Y)
    torch.cuda.synchronize()
    assert torch.equal(on_side, eager.iterate_normalized(X1))
    assert torch.equal(on_compute, eager.iterate_normalized(X2))
    assert torch.equal(other, eager.iterate_normalized(Y))


def test_a_finish_that_returns_a_graph_output_is_refused():
    graphed = GraphedFunction(lambda x: (x * 2, x + 1), finish=lambda doubled, _: doubled[1:])
    x = torch.randn(16, 16, device="cuda")
    assert torch.equal(graphed(x), (x * 2)[1:])  # eager results are the caller's own
    with pytest.raises(RuntimeError, match="finish returned \\(a view of\\) a graph's output"):
        graphed(x)


def test_failed_capture_does_not_leave_a_replayable_graph():
    def syncs_with_the_host(x):
        scale = float(x.abs().max())  # a host sync: not capturable
        return x / scale

    graphed = GraphedFunction(syncs_with_the_host, name="test function")
    x = torch.randn(64, 64, device="cuda")
    expected = syncs_with_the_host(x)
    assert torch.equal(graphed(x), expected)  # eager warm-up
    with pytest.warns(RuntimeWarning, match="CUDA-graph replay is off for shape=\\(64, 64\\)"):
        assert torch.equal(graphed(x), expected)  # capture fails -> eager result
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: later calls are quiet
        y = torch.randn(64, 64, device="cuda")  # random ops work again after the failed capture
        assert torch.equal(graphed(y), syncs_with_the_host(y))
    assert graphed.mode(x) == "eager" and graphed.graph_count == 0
    (reason,) = graphed.eager_reasons().values()
    assert "capture failed" in reason and "resetting the CUDA generator" not in reason
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


def test_a_function_that_refuses_capture_stays_eager_and_correct():
    def refuses_capture(x):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("this library cannot be captured")
        return x * 3

    graphed = GraphedFunction(refuses_capture)
    x = torch.randn(32, 16, device="cuda")
    graphed(x)
    with pytest.warns(RuntimeWarning, match="cannot be captured"):
        assert torch.equal(graphed(x), x * 3)
    assert graphed.mode(x) == "eager"


def a_captured_graph_holder():
    """An object that holds a captured CUDA graph, as a NewtonSchulz holds its caches."""
    holder = GraphedFunction(lambda x: x + 1, name="holder")
    x = torch.randn(8, 8, device="cuda")
    for _ in range(3):
        holder(x)
    assert holder.mode(x) == "graph"
    return holder


def test_cyclic_garbage_holding_a_graph_is_not_collected_while_another_graph_is_captured():
    doomed = [a_captured_graph_holder()]

    def drops_the_holder_into_a_cycle(x):
        if torch.cuda.is_current_stream_capturing() and doomed:
            cycle = {"holder": doomed.pop()}
            cycle["self"] = cycle  # only the cyclic collector can free the holder now
            del cycle
            young = [[] for _ in range(10 * gc.get_threshold()[0])]  # would trigger collections
            del young
        return x * 2

    graphed = GraphedFunction(drops_the_holder_into_a_cycle)
    x = torch.randn(64, 64, device="cuda")
    graphed(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(graphed(x), x * 2)
    assert graphed.mode(x) == "graph" and graphed.eager_reasons() == {}
    assert gc.isenabled()


def test_a_capture_invalidated_on_the_cuda_side_leaves_later_signatures_capturable():
    doomed = [a_captured_graph_holder()]

    def destroys_a_graph_while_capturing(x):
        if torch.cuda.is_current_stream_capturing() and doomed:
            doomed.clear()  # the last reference: a CUDA graph destroyed mid-capture
        return x * 2

    graphed = GraphedFunction(destroys_a_graph_while_capturing)
    x = torch.randn(64, 64, device="cuda")
    graphed(x)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        assert torch.equal(graphed(x), x * 2)
    y = torch.randn(32, 32, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            assert torch.equal(graphed(y), y * 2)
    assert graphed.mode(x) == "eager" and graphed.mode(y) == "graph"
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


@pytest.mark.parametrize("backend", ["gram", "direct"])
def test_batched_newton_schulz_equals_one_call_per_matrix(backend):
    stack = torch.stack([spectrum_matrix(256, 1024, seed=s) for s in range(4)]).cuda()
    ns = NewtonSchulz(backend)
    batched = ns(stack)
    for i in range(stack.shape[0]):
        single = ns(stack[i])
        exact = reference.newton_schulz_by_svd(stack[i].cpu(), POLAR_EXPRESS_COEFFICIENTS)
        yardstick = plain_loop_error(stack[i].cpu(), POLAR_EXPRESS_COEFFICIENTS, torch.float16)
        # same polynomial; batched kernels may round differently, never worse than the rule
        assert relative_error(batched[i].cpu(), exact) <= LOW_PRECISION_RATIO * yardstick
        assert relative_error(batched[i].cpu(), single.cpu()) <= LOW_PRECISION_RATIO * yardstick


def test_batched_newton_schulz_replays_as_one_graph():
    ns = NewtonSchulz()
    stack = torch.stack([spectrum_matrix(128, 512, seed=s) for s in range(8)]).cuda()
    eager = NewtonSchulz()
    eager.graphs.enabled = False
    for _ in range(3):
        assert torch.equal(ns(stack), eager(stack))
    assert ns.graphs.graph_count == 1


def test_an_input_over_the_graph_size_limit_stays_eager_and_keeps_no_memory():
    from dmuon_kernels.graphs import GRAPH_MAX_NUMEL

    graphed = GraphedFunction(lambda x: x * 2)
    x = torch.ones(GRAPH_MAX_NUMEL + 1, device="cuda", dtype=torch.float16)
    for _ in range(3):  # warm-up, then what would be capture and replay
        assert torch.equal(graphed(x), x * 2)
    assert graphed.mode(x) == "eager" and graphed.graph_count == 0
    small = torch.ones(64, 64, device="cuda")
    for _ in range(3):
        graphed(small)
    assert graphed.mode(small) == "graph"


def test_a_call_may_raise_the_graph_size_limit_for_its_own_inputs():
    """``max_numel`` (the overlapped step's Newton-Schulz calls) captures inputs over the default
    limit; without it the same signature stays eager."""
    graphed = GraphedFunction(lambda x: x * 2)
    x = torch.ones(64, 64, device="cuda")
    for _ in range(3):
        assert torch.equal(graphed(x, max_numel=64 * 64 - 1), x * 2)
    assert graphed.mode(x) == "eager"
    for _ in range(3):
        assert torch.equal(graphed(x, max_numel=64 * 64), x * 2)
    assert graphed.mode(x) == "graph"
    ns, eager = NewtonSchulz(), eager_newton_schulz()
    X = torch.stack([spectrum_matrix(128, 512, seed=s) for s in range(4)]).cuda().half()
    X = X / torch.linalg.matrix_norm(X.float(), keepdim=True).half()
    for _ in range(3):
        assert torch.equal(ns.iterate_normalized(X, graph_max_numel=1), eager.iterate_normalized(X))
    assert ns.iteration_graphs.graph_count == 0
    for _ in range(3):
        assert torch.equal(
            ns.iterate_normalized(X, graph_max_numel=X.numel()), eager.iterate_normalized(X)
        )
    assert ns.iteration_graphs.mode(X) == "graph"


# --- the whole-call graph behind ns(G) ----------------------------------------------------------

WHOLE_CALL_CASES = {**CASES, "batched": (4, 128, 512), "batched_tall": (4, 512, 128)}


def eager_newton_schulz() -> NewtonSchulz:
    """A NewtonSchulz with both of its CUDA-graph caches off: the eager reference."""
    ns = NewtonSchulz()
    ns.graphs.enabled = ns.iteration_graphs.enabled = False
    return ns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", WHOLE_CALL_CASES, ids=str)
def test_a_warmed_call_replays_the_whole_call_graph_bit_identical_to_eager(case, dtype):
    *batch, rows, cols = WHOLE_CALL_CASES[case]
    G = torch.stack([spectrum_matrix(rows, cols, seed=s) for s in range(batch[0] if batch else 1)])
    G = (G if batch else G[0]).to(device="cuda", dtype=dtype)
    eager = eager_newton_schulz()
    ns = NewtonSchulz()
    expected = eager(G)
    assert ns.graphs.mode(G) == "eager"
    for _ in range(3):  # call 1 eager (autotune), call 2 captures, call 3 replays
        out = ns(G)
        assert torch.equal(out, expected)
        assert out.dtype == dtype and out.shape == G.shape
    assert ns.graphs.mode(G) == "graph" and ns.graphs.graph_count == 1
    assert ns.graphs.eager_reasons() == {}
    assert ns.iteration_graphs.graph_count == 0  # ns(G) never touches the iteration's cache
    assert eager.graphs.graph_count == 0 and eager.iteration_graphs.graph_count == 0


@pytest.mark.parametrize("case", ["wide", "tall", "batched"], ids=str)
def test_replays_with_new_values_give_new_correct_outputs_that_later_replays_leave_alone(case):
    *batch, rows, cols = WHOLE_CALL_CASES[case]
    inputs = [
        torch.stack([spectrum_matrix(rows, cols, seed=10 * s + b) for b in range(batch[0])])
        if batch
        else spectrum_matrix(rows, cols, seed=10 * s)
        for s in range(5)
    ]
    inputs = [G.cuda() for G in inputs]
    kept_inputs = [G.clone() for G in inputs]
    eager = eager_newton_schulz()
    ns = NewtonSchulz()
    ns(inputs[0])
    ns(inputs[0])  # captured
    assert ns.graphs.mode(inputs[0]) == "graph"
    outputs = [ns(G) for G in inputs]  # every one a replay into the same static buffers
    for G, kept, out in zip(inputs, kept_inputs, outputs, strict=True):
        assert torch.equal(G, kept)  # the input is copied in, never written
        assert torch.equal(out, eager(G))  # still right after the later replays
    for first, second in itertools.pairwise(outputs):
        assert not torch.equal(first, second)
        assert first.data_ptr() != second.data_ptr()


@pytest.mark.parametrize("shape", [(256, 1024), (1024, 256), (4, 128, 512)], ids=str)
def test_the_function_returns_what_a_reused_instance_returns_through_the_whole_call_graph(shape):
    ns_module = sys.modules["dmuon_kernels.newton_schulz"]
    generator = torch.Generator(device="cuda").manual_seed(21)
    inputs = [torch.randn(shape, device="cuda", generator=generator) for _ in range(4)]
    ns_module._instances.clear()
    instance = NewtonSchulz()
    for G in inputs:  # eager, capture, replay, replay
        assert torch.equal(newton_schulz(G), instance(G))
    (cached,) = ns_module._instances.values()
    assert cached.graphs.mode(inputs[0]) == "graph" and cached.graphs.graph_count == 1


def test_inputs_that_are_not_one_dense_block_replay_the_iteration_graph_alone():
    wide = spectrum_matrix(256, 2048).cuda()
    gapped = wide[:, ::2]  # (256, 1024) with gaps: a static copy would span all of `wide`
    expanded = spectrum_matrix(1, 1024).cuda().expand(256, 1024)  # stride 0: no static copy
    eager = eager_newton_schulz()
    ns = NewtonSchulz()
    for G in (gapped, expanded):
        for _ in range(3):
            assert torch.equal(ns(G), eager(G))
    assert ns.graphs.graph_count == 0
    assert ns.iteration_graphs.graph_count == 1  # both normalise to (256, 1024) fp16
