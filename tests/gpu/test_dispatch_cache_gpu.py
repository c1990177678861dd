"""The remembered dispatch on the GPU: a warmed call runs the backend the full resolution picks
and gives its result bit for bit; nothing provisional is remembered during a CUDA-graph capture;
``newton_schulz()`` equals a reused instance; ``dtype=None`` is the fp16 iteration on CUDA; the
CuTe backend works a launch plan out once per signature; quack's launcher called without torch's
custom-op dispatch gives the bits of its public entry; "auto" never tunes plain products."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from dmuon_kernels import NewtonSchulz, newton_schulz
from dmuon_kernels.syrk import (
    _call_cache,
    auto_candidate,
    autotune,
    backend_availability,
    get_backend,
    matmul,
    resolve_kernel,
    symmetric_product,
    syrk,
)
from dmuon_kernels.syrk import cute as cute_backend
from dmuon_kernels.syrk import quack as quack_backend
from tests.numerics import syrk_operands as operands

DTYPES = (torch.float16, torch.bfloat16)
# (batch, M, K): one shape per shape class the backends treat differently
SHAPES = ((None, 256, 1024), (None, 1024, 4096), (None, 200, 777), (3, 128, 512))


@pytest.fixture(autouse=True)
def _fresh_memo():
    _call_cache.clear()
    yield
    _call_cache.clear()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_c", [False, True], ids=["plain", "with_c"])
def test_a_remembered_syrk_runs_the_resolved_backend_bit_for_bit(shape, dtype, with_c):
    A, C = operands(*shape, dtype, seed=11)
    kwargs = {"C": C, "alpha": 0.5, "beta": -1.0} if with_c else {}
    first = syrk(A, **kwargs)  # resolves (tuning on first sight) and remembers
    key = _call_cache.signature("syrk", "auto", A, None, kwargs.get("C"))
    remembered = _call_cache.lookup(key)
    assert remembered is not None
    chosen = resolve_kernel("auto", A, kwargs.get("C"))
    assert remembered == get_backend(chosen).syrk  # the same backend function
    expected = get_backend(chosen).syrk(
        A, kwargs.get("C"), kwargs.get("alpha", 1.0), kwargs.get("beta", 0.0)
    )
    for out in (first, syrk(A, **kwargs)):
        assert torch.equal(out, expected), chosen


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_remembered_symmetric_and_plain_products_match_the_full_resolution(dtype):
    S, C = operands(None, 512, 512, dtype, seed=12)
    S = ((S.float() + S.float().mT) / 2).to(dtype)
    B = (0.5 * S.float() + 0.1 * (S.float() @ S.float())).to(dtype)
    for _ in range(2):
        out = symmetric_product(S, B, C=C, beta=0.5)
        chosen = resolve_kernel("auto", S, C, op="symmetric_product", B=B)
        backend = get_backend(chosen)
        product = getattr(backend, "symmetric_product", get_backend("cublas").symmetric_product)
        assert torch.equal(out, product(S, B, C, 1.0, 0.5)), chosen
    X, _ = operands(None, 512, 2048, dtype, seed=13)
    for _ in range(2):
        out = matmul(S, X)
        chosen = resolve_kernel("auto", S, op="matmul", B=X)
        backend = get_backend(chosen)
        product = getattr(backend, "matmul", get_backend("cublas").matmul)
        assert torch.equal(out, product(S, X, None, 1.0, 0.0)), chosen


def test_a_call_made_during_a_capture_is_not_remembered():
    A, _ = operands(None, 320, 960, torch.float16, seed=14)  # a shape no other test tunes
    auto_candidate(A.device)  # the backends' availability probes (imports) run before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        A @ A.mT  # cuBLAS's per-stream workspace is made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        syrk(A)  # auto under capture: a provisional cuBLAS answer, never tuned
    torch.cuda.current_stream().wait_stream(stream)
    assert _call_cache.lookup(_call_cache.signature("syrk", "auto", A)) is None
    syrk(A)  # outside the capture: resolved for good and remembered
    assert _call_cache.lookup(_call_cache.signature("syrk", "auto", A)) is not None


@pytest.mark.parametrize("shape", [(256, 1024), (512, 512), (1024, 256), (2, 128, 512)], ids=str)
def test_the_function_equals_a_reused_instance_bit_for_bit(shape):
    generator = torch.Generator(device="cuda").manual_seed(15)
    inputs = [torch.randn(shape, device="cuda", generator=generator) for _ in range(4)]
    instance = NewtonSchulz()
    for G in inputs:  # eager, capture, replay, replay: both sides go through the same stages
        assert torch.equal(newton_schulz(G), instance(G))


def test_the_default_dtype_is_the_fp16_iteration_on_cuda():
    G = torch.randn(256, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(16))
    default, fp16 = NewtonSchulz(), NewtonSchulz(dtype=torch.float16)
    assert default.iteration_dtype(G.device) == torch.float16
    for _ in range(3):
        assert torch.equal(default(G), fp16(G))
    buffer = default.normalized_buffer((2, 64, 256), G.device)
    assert buffer.dtype == torch.float16


@pytest.fixture
def needs_cute():
    available, reason = backend_availability("cute")
    if not available:
        pytest.skip(f"cute unavailable: {reason}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cute_works_out_a_launch_plan_once_per_signature(needs_cute, dtype):
    A, C = operands(None, 384, 1000, dtype, seed=17)
    first = cute_backend.syrk(A, C, 0.5, -1.0)
    plans = dict(cute_backend._plans)
    for _ in range(2):
        assert torch.equal(cute_backend.syrk(A, C, 0.5, -1.0), first)
    assert cute_backend._plans == plans
    other, _ = operands(None, 384, 1000, dtype, seed=18)
    cute_backend.syrk(other, C, 0.5, -1.0)  # same signature, other values: same plan
    assert cute_backend._plans == plans


# (batch, M, K) with and without C: unpadded, padded (M and K not multiples of 8), batched.
QUACK_SHAPES = ((None, 512, 1024), (None, 200, 777), (3, 128, 512))


@pytest.mark.parametrize("shape", QUACK_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quack_without_the_custom_op_dispatch_gives_the_bits_of_its_public_entry(
    needs_quack, monkeypatch, shape, dtype
):
    api = quack_backend._quack_api()
    if api.symmetric_launcher is None:
        pytest.skip("this quack release has no launcher the adapter calls directly")
    A, C = operands(*shape, dtype, seed=19)
    S = ((C.float() + C.float().mT) / 2).to(dtype)
    B = (0.5 * S.float() + 0.1 * (S.float() @ S.float())).to(dtype)  # commutes with S
    calls = (
        lambda: quack_backend.syrk(A),
        lambda: quack_backend.syrk(A, C, 0.5, -1.0),
        lambda: quack_backend.symmetric_product(S, B, C, 1.0, 0.75),
    )
    direct = [call() for call in calls]
    monkeypatch.setattr(
        quack_backend, "_probe_result", dataclasses.replace(api, symmetric_launcher=None)
    )
    for call, expected in zip(calls, direct, strict=True):
        assert torch.equal(call(), expected)


def test_auto_never_tunes_a_plain_product(caplog):
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    S, _ = operands(None, 4096, 4096, torch.float16, seed=20)
    X, _ = operands(None, 4096, 8192, torch.float16, seed=21)
    problem = autotune.SyrkProblem.of(S, None, "matmul", X)
    assert problem.flop >= autotune.MIN_TUNED_FLOP  # large enough to be tuned, were it tuned
    out = matmul(S, X)
    assert resolve_kernel("auto", S, op="matmul", B=X) == "cublas"
    assert torch.equal(out, get_backend("cublas").matmul(S, X, None, 1.0, 0.0))
    assert not [m for m in caplog.messages if "op=matmul" in m]
