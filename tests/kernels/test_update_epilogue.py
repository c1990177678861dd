"""The Muon update written by Newton-Schulz's last product (``dmuon_kernels.update_epilogue``),
on the CPU in fp32, against the output written out and applied (its CUDA operands in fp16 with
fp32 masters: tests/gpu/test_update_epilogue_gpu.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from dmuon_kernels import NewtonSchulz
from dmuon_kernels.fused import muon_apply_updates_, muon_normalize
from dmuon_kernels.update_epilogue import epilogue_enabled, final_update_
from tests.numerics import relative_error

LR, WEIGHT_DECAY = 0.05, 0.1
# (n, m) of the iteration: direct (aspect below 2) and gram (aspect 2 or more)
SHAPES = {"direct": (12, 16), "gram": (8, 40)}


def normalized_batch(ns: NewtonSchulz, shape: tuple[int, int], count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    G = torch.randn(count, *shape, generator=generator)
    X = ns.normalized_buffer((count, *shape), G.device)
    for index, matrix in enumerate(G):
        muon_normalize(matrix, dtype=torch.float32, out=X[index])
    return X


def masters_for(shape: tuple[int, int]) -> list[torch.Tensor]:
    """One master of the iteration's shape, one of its transpose (a tall weight)."""
    generator = torch.Generator().manual_seed(4)
    n, m = shape
    return [torch.randn(n, m, generator=generator), torch.randn(m, n, generator=generator)]


def written_out(ns, X, masters, scales) -> list[torch.Tensor]:
    """The update applied from the output written out: what the overlapped step does."""
    result = [master.clone() for master in masters]
    for master, ortho, scale in zip(result, ns.iterate_normalized(X.clone()), scales):
        update = ortho if master.shape == ortho.shape else ortho.mT
        muon_apply_updates_([master], [update], LR, WEIGHT_DECAY, scale)
    return result


@pytest.mark.parametrize("form", SHAPES)
def test_the_last_product_writes_the_update_of_wide_and_tall_masters(monkeypatch, form):
    # the CUDA path on the CPU (the package attribute ``newton_schulz`` is the function)
    module = sys.modules["dmuon_kernels.newton_schulz"]
    monkeypatch.setattr(module, "epilogue_enabled", lambda X: True)
    ns = NewtonSchulz(kernel="cublas", dtype=torch.float32)
    X = normalized_batch(ns, SHAPES[form], 2)
    masters, scales = masters_for(SHAPES[form]), [0.7, 1.3]
    expected = written_out(ns, X, masters, scales)
    updated = [master.clone() for master in masters]
    ns.update_masters_(X.clone(), updated, lr=LR, weight_decay=WEIGHT_DECAY, scales=scales)
    for master, before, reference in zip(updated, masters, expected):
        # a rounding of fp32 apart, on an update of about LR·scale per entry
        assert relative_error(master - before, reference - before) < 1e-5


def test_the_epilogue_is_off_on_the_cpu_and_there_equals_the_written_out_update_bit_for_bit():
    ns = NewtonSchulz(kernel="cublas", dtype=torch.float32)
    X = normalized_batch(ns, SHAPES["gram"], 2)
    assert not epilogue_enabled(X)
    masters, scales = masters_for(SHAPES["gram"]), [0.7, 1.3]
    expected = written_out(ns, X, masters, scales)
    ns.update_masters_(X, masters, lr=LR, weight_decay=WEIGHT_DECAY, scales=scales)
    for master, reference in zip(masters, expected):
        assert torch.equal(master, reference)


@pytest.mark.parametrize("form", SHAPES)
def test_final_update_is_the_update_of_the_exact_product(form):
    """Against float64: decay·W − step·L·X, for wide and tall masters."""
    generator = torch.Generator().manual_seed(5)
    n, m = SHAPES[form]
    left = torch.randn(2, n, n, generator=generator)
    X = torch.randn(2, n, m, generator=generator)
    masters, steps, decay = masters_for((n, m)), [0.01, 0.02], 0.99
    expected = []
    for L, x, master, step in zip(left.double(), X.double(), masters, steps):
        product = L @ x
        product = product if master.shape == product.shape else product.mT
        expected.append(decay * master.double() - step * product)
    final_update_(left, X, masters, decay=decay, steps=steps)
    for master, reference in zip(masters, expected):
        assert relative_error(master.double(), reference) < 1e-6


def test_final_update_refuses_a_master_of_another_shape_and_a_count_mismatch():
    left, X = torch.zeros(1, 4, 4), torch.zeros(1, 4, 6)
    with pytest.raises(ValueError, match=r"a master of shape \(5, 6\) for a Newton-Schulz output"):
        final_update_(left, X, [torch.zeros(5, 6)], decay=1.0, steps=[1.0])
    with pytest.raises(ValueError, match="1 Newton-Schulz outputs, 2 masters and 1 steps"):
        final_update_(left, X, [torch.zeros(4, 6)] * 2, decay=1.0, steps=[1.0])


def test_the_switch_reads_its_variable_and_refuses_a_typo(monkeypatch):
    X = torch.zeros(1, 2, 2)
    monkeypatch.setenv("DMUON_UPDATE_EPILOGUE", "disabled")
    with pytest.raises(ValueError, match="DMUON_UPDATE_EPILOGUE='disabled' is not an on/off"):
        epilogue_enabled(X)
    monkeypatch.setenv("DMUON_UPDATE_EPILOGUE", "0")
    assert not epilogue_enabled(X)
