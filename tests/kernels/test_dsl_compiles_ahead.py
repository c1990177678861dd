"""Newton-Schulz's kernels compiled ahead: the products derived from a shape are those the
iteration makes, each goes to the backend expected to run it, and the background compiles take
turns with every other DSL compile of the process (``syrk._dsl_compiles``).

Real compiles and their timing are tests/gpu/test_cold_start_gpu.py's; here the backends are
recorders, on the CPU."""

from __future__ import annotations

import importlib
import threading
import time

import pytest
import torch

from dmuon_kernels import NewtonSchulz
from dmuon_kernels.coefficients import DEFAULT_COEFFICIENTS, KELLER_COEFFICIENTS
from dmuon_kernels.syrk import (
    SYMMETRIC_PRODUCT,
    SYRK,
    Product,
    _dsl_compiles,
    quack,
    register_backend,
    unregister_backend,
)

# The module, which the package's ``newton_schulz`` function shadows.
ns_module = importlib.import_module("dmuon_kernels.newton_schulz")

# -- the products derived from a shape are the iteration's own --------------------------------


def recorded_products(monkeypatch, X: torch.Tensor, **iteration) -> list[Product]:
    """The SYRK and symmetric products ``iterate`` really makes on X, recorded on their way."""
    calls: list[Product] = []
    batch = X.shape[0] if X.dim() == 3 else 0

    def recording(op, function):
        def record(A, *args, C=None, alpha=1.0, beta=0.0, **options):
            calls.append(Product(op, A.shape[-2], A.shape[-1], batch, C is not None, alpha, beta))
            return function(A, *args, C=C, alpha=alpha, beta=beta, **options)

        return record

    monkeypatch.setattr(ns_module, "syrk", recording(SYRK, ns_module.syrk))
    monkeypatch.setattr(
        ns_module, "symmetric_product", recording(SYMMETRIC_PRODUCT, ns_module.symmetric_product)
    )
    ns_module.iterate(X, kernel="cublas", **iteration)
    return calls


@pytest.mark.parametrize(
    ("backend", "shape", "coefficients", "restarts"),
    [
        ("gram", (3, 16, 64), DEFAULT_COEFFICIENTS, (2,)),  # the default: restarted once
        ("gram", (16, 64), DEFAULT_COEFFICIENTS, ()),
        ("gram", (2, 16, 64), KELLER_COEFFICIENTS, (2, 4)),
        ("gram", (4, 32, 32), DEFAULT_COEFFICIENTS, (2,)),  # square: the direct form
        ("direct", (16, 64), KELLER_COEFFICIENTS, ()),
    ],
    ids=["gram-batched", "gram-one", "gram-restarted-twice", "gram-square", "direct"],
)
def test_the_derived_products_are_those_the_iteration_makes(
    monkeypatch, backend, shape, coefficients, restarts
):
    X = torch.randn(shape, generator=torch.Generator().manual_seed(0)) / 8
    iteration = dict(backend=backend, coefficients=coefficients, restart_iterations=restarts)
    derived = ns_module.iteration_products(shape, **iteration)
    assert derived == recorded_products(monkeypatch, X, **iteration)
    assert {p.op for p in derived} == (
        {SYRK, SYMMETRIC_PRODUCT} if backend == "gram" and shape[-1] > shape[-2] else {SYRK}
    )


# -- each product goes to the backend expected to run it ---------------------------------------


class CompilesAhead:
    """A backend that records what it is asked to compile ahead."""

    def __init__(self) -> None:
        self.asked: list[tuple[torch.device, torch.dtype, list]] = []

    def is_available(self) -> tuple[bool, str]:
        return True, "test backend"

    def syrk(self, A, C, alpha, beta):
        raise AssertionError("compiling ahead runs no product")

    def compile_ahead(self, device, dtype, calls) -> int:
        self.asked.append((device, dtype, list(calls)))
        return len(set(calls))


@pytest.fixture
def compiles_ahead():
    backend = CompilesAhead()
    register_backend("compiles-ahead", backend)
    yield backend
    unregister_backend("compiles-ahead")


def test_newton_schulz_hands_its_backend_every_product_of_each_shape(compiles_ahead):
    ns = NewtonSchulz(kernel="compiles-ahead")
    cuda = torch.device("cuda", 0)  # only named: nothing runs on it
    queued = ns.compile_ahead([(4, 64, 16), (4, 16, 64), (64, 16)], device=cuda)
    ((device, dtype, calls),) = compiles_ahead.asked
    assert device == cuda and dtype == torch.float16  # the iteration's dtype on CUDA
    # (4, 64, 16) is (4, 16, 64) transposed: one shape, then (16, 64) unbatched.
    per_shape = {
        shape: [
            (p.op, p.has_c, p.alpha, p.beta)
            for p in ns_module.iteration_products(
                shape,
                backend=ns.backend,
                coefficients=ns.coefficients,
                restart_iterations=ns.restart_iterations,
            )
        ]
        for shape in [(4, 16, 64), (16, 64)]
    }
    assert calls == per_shape[(4, 16, 64)] + per_shape[(16, 64)]
    assert queued == len(set(calls))  # what the backend said it queued


def test_nothing_is_compiled_ahead_for_the_cpu_or_where_quack_cannot_run(compiles_ahead):
    assert NewtonSchulz(kernel="compiles-ahead").compile_ahead([(16, 64)], device="cpu") == 0
    assert compiles_ahead.asked == []  # off CUDA every product takes the torch path
    assert quack.compile_ahead(torch.device("cuda", 0), torch.float16, [(SYRK, False, 1, 0)]) == 0


# -- the background compiles take turns with every other DSL compile ---------------------------


def test_compiles_ahead_run_in_order_one_at_a_time_and_are_waited_for_by_key():
    order: list[str] = []
    release = threading.Event()

    def compile(name: str, wait: bool = False):
        def run() -> None:
            order.append(f"{name} started")
            if wait:
                release.wait(timeout=10)
            order.append(f"{name} done")

        return run

    first, second = ("test-first", object()), ("test-second", object())
    assert _dsl_compiles.compile_ahead(first, compile("first", wait=True))
    assert _dsl_compiles.compile_ahead(second, compile("second"))
    assert not _dsl_compiles.compile_ahead(first, compile("again"))  # once per process
    time.sleep(0.05)
    # A compile of the main thread waits for its turn behind the background's.
    main = threading.Thread(target=lambda: _run_in_turn(order, "main"))
    main.start()
    time.sleep(0.05)
    assert order == ["first started"]
    release.set()
    assert _dsl_compiles.finish(second) is None and _dsl_compiles.finish(first) is None
    main.join(timeout=10)
    # Never two at once: each compile is done before the next starts; first things first.
    names = [entry.split()[0] for entry in order]
    assert order == [f"{name} {event}" for name in names[::2] for event in ("started", "done")]
    assert names[:2] == ["first", "first"]
    assert sorted(set(names)) == ["first", "main", "second"]
    assert not _dsl_compiles.pending(first) and not _dsl_compiles.pending(second)


def _run_in_turn(order: list[str], name: str) -> None:
    with _dsl_compiles.one_compile_at_a_time():
        order.append(f"{name} started")
        order.append(f"{name} done")


def test_a_failed_compile_ahead_is_handed_to_whoever_waits_for_it():
    key = ("test-failing", object())

    def failing() -> None:
        raise RuntimeError("no such kernel")

    _dsl_compiles.compile_ahead(key, failing)
    assert _dsl_compiles.pending(key)
    error = _dsl_compiles.finish(key)
    assert isinstance(error, RuntimeError) and str(error) == "no such kernel"
    assert not _dsl_compiles.pending(key)
