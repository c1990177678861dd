"""The per-signature memo of the SYRK dispatcher and the per-configuration NewtonSchulz behind
``newton_schulz()``: what they key on, what invalidates them, and that they never change a
result or swallow an error."""

from __future__ import annotations

import sys

import pytest
import torch

from dmuon_kernels import NewtonSchulz, newton_schulz
from dmuon_kernels.syrk import (
    _call_cache,
    matmul,
    register_backend,
    symmetric_product,
    syrk,
    unregister_backend,
)

ns_module = sys.modules["dmuon_kernels.newton_schulz"]


@pytest.fixture(autouse=True)
def _fresh_memo(monkeypatch):
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    _call_cache.clear()
    yield
    _call_cache.clear()


def a_matrix(rows=6, cols=10, seed=0, dtype=torch.float32):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


def a_symmetric(size=6, seed=1):
    S = a_matrix(size, size, seed)
    return S + S.mT


class _Recording:
    """A backend that counts calls and returns a recognisable -1 matrix."""

    def __init__(self):
        self.calls = 0

    def is_available(self):
        return True, "test backend"

    def syrk(self, A, C, alpha, beta):
        self.calls += 1
        return -torch.ones(*A.shape[:-1], A.shape[-2], dtype=A.dtype)


def test_a_repeated_signature_is_resolved_once_and_gives_the_same_result():
    A = a_matrix()
    first = syrk(A)
    assert _call_cache.size() == 1
    assert torch.equal(syrk(a_matrix()), first)
    assert _call_cache.size() == 1
    C = a_symmetric()
    symmetric_product(C, C, C=C, beta=0.5)
    matmul(C, A)
    assert _call_cache.size() == 3


def test_the_signature_holds_shape_strides_dtype_kernel_and_c():
    A = a_matrix()
    syrk(A)
    syrk(A.mT.contiguous().mT)  # same shape, other strides
    syrk(A.double())
    syrk(A, kernel="cublas")
    syrk(A, C=a_symmetric(), beta=1.0)
    syrk(a_matrix(4, 10))
    assert _call_cache.size() == 6


def test_a_remembered_signature_still_checks_alpha_and_beta():
    A = a_matrix()
    syrk(A)
    with pytest.raises(ValueError, match=r"syrk got beta=1.0 but no C"):
        syrk(A, beta=1.0)
    with pytest.raises(ValueError, match=r"syrk alpha must be a real number; got 'x'"):
        syrk(A, alpha="x")
    with pytest.raises(ValueError, match=r"syrk beta must be a real number; got True"):
        syrk(A, C=a_symmetric(), beta=True)


def test_errors_are_never_remembered():
    with pytest.raises(ValueError, match=r"syrk C must have shape \(6, 6\)"):
        syrk(a_matrix(), C=torch.ones(5, 5), beta=1.0)
    with pytest.raises(ValueError, match=r"syrk expects a floating-point tensor A"):
        syrk([[1.0]])
    with pytest.raises(ValueError, match=r"symmetric_product takes square A and B"):
        symmetric_product(a_symmetric(), a_matrix())
    with pytest.raises(ValueError, match=r"kernel must be one of"):
        syrk(a_matrix(), kernel="fastest")
    assert _call_cache.size() == 0


def test_registering_a_backend_forgets_every_remembered_choice():
    A = a_matrix()
    syrk(A)
    assert _call_cache.size() == 1
    register_backend("recording", _Recording())
    try:
        syrk(A)  # the registry changed: resolved again
        assert _call_cache.size() == 1
    finally:
        unregister_backend("recording")
    assert _call_cache.lookup(_call_cache.signature("syrk", "auto", A)) is None


def test_an_unavailable_backend_keeps_raising_on_every_call():
    register_backend(
        "offline", type("Offline", (_Recording,), {"is_available": lambda s: (False, "off")})()
    )
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"kernel='offline' cannot run here: off"):
                syrk(torch.ones(2, 2), kernel="offline")
    finally:
        unregister_backend("offline")


def test_the_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(_call_cache, "MAX_ENTRIES", 3)
    for rows in range(1, 6):
        syrk(a_matrix(rows, 4))
    assert _call_cache.size() <= 3


# --- newton_schulz(): one NewtonSchulz per configuration ------------------------------------


def test_the_function_reuses_one_instance_per_configuration_and_matches_it():
    ns_module._instances.clear()
    G = a_matrix(8, 24)
    first = newton_schulz(G)
    second = newton_schulz(G, backend="gram")  # spelled differently: its own entry, same result
    assert torch.equal(first, second)
    assert torch.equal(first, NewtonSchulz()(G))
    count = len(ns_module._instances)
    newton_schulz(a_matrix(8, 24, seed=3))
    assert len(ns_module._instances) == count


def test_the_function_accepts_lists_and_keys_them_by_value():
    ns_module._instances.clear()
    rows = [[3.4445, -4.7750, 2.0315]] * 5
    G = a_matrix(8, 24)
    first = newton_schulz(G, coefficients=rows, restart_iterations=[2])
    again = newton_schulz(G, coefficients=[list(r) for r in rows], restart_iterations=[2])
    assert torch.equal(first, again)
    assert len(ns_module._instances) == 1


def test_the_function_passes_eps_to_its_instance():
    G = a_matrix(8, 24)
    assert not torch.equal(newton_schulz(G, eps=1e-7), newton_schulz(G, eps=10.0))
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0; got -1"):
        newton_schulz(G, eps=-1)


def test_the_function_follows_dmuon_ns_kernel_between_calls(monkeypatch):
    ns_module._instances.clear()
    newton_schulz(a_matrix())
    monkeypatch.setenv("DMUON_NS_KERNEL", "cublas")
    newton_schulz(a_matrix())
    origins = sorted(ns.kernel_origin for ns in ns_module._instances.values())
    assert origins == ["DMUON_NS_KERNEL", "auto"]


def test_the_function_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(ns_module, "MAX_CACHED_INSTANCES", 2)
    ns_module._instances.clear()
    for eps in (1e-7, 1e-6, 1e-5, 1e-4):
        newton_schulz(a_matrix(), eps=eps)
    assert len(ns_module._instances) <= 2


def test_the_function_follows_dmuon_ns_cuda_graph_between_calls(monkeypatch):
    ns_module._instances.clear()
    monkeypatch.setenv("DMUON_NS_CUDA_GRAPH", "0")
    newton_schulz(a_matrix())
    monkeypatch.setenv("DMUON_NS_CUDA_GRAPH", "1")
    newton_schulz(a_matrix())
    enabled = sorted(ns.graphs.enabled for ns in ns_module._instances.values())
    assert enabled == [False, True]
