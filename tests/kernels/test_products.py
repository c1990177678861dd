"""The dispatcher's products besides ``syrk``: ``symmetric_product`` (alpha·A·B + beta·C for
commuting symmetric A, B, the Gram form's products) and ``matmul`` (the other NS products)."""

from __future__ import annotations

import pytest
import torch

from dmuon_kernels.syrk import matmul, symmetric_product
from tests.numerics import relative_error


def commuting_pair(n: int, batch: tuple[int, ...] = (), seed: int = 0):
    """A symmetric S and B = 0.5·S + 0.25·S² (a polynomial in S, so S·B = B·S is symmetric)."""
    generator = torch.Generator().manual_seed(seed)
    S = torch.randn((*batch, n, n), generator=generator, dtype=torch.float64)
    S = (S + S.mT) / 2
    return S, 0.5 * S + 0.25 * S @ S


@pytest.mark.parametrize("batch", [(), (3,), (2, 2)], ids=str)
def test_symmetric_product_equals_alpha_a_b_plus_beta_c(batch):
    A, B = commuting_pair(12, batch)
    C, _ = commuting_pair(12, batch, seed=1)
    expected = -0.75 * (A @ B) + 1.5 * C
    out = symmetric_product(A.float(), B.float(), C=C.float(), alpha=-0.75, beta=1.5)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert relative_error(out, expected) < 1e-6
    assert torch.allclose(out, out.mT, rtol=1e-5, atol=1e-5)


def test_symmetric_product_without_c_is_the_plain_product():
    A, B = commuting_pair(10, seed=2)
    assert torch.equal(symmetric_product(A, B), A @ B)


def test_symmetric_product_rejects_non_square_or_mismatched_operands():
    with pytest.raises(
        ValueError, match=r"square A and B of the same shape; got A \(4, 4\) and B \(4, 5\)"
    ):
        symmetric_product(torch.zeros(4, 4), torch.zeros(4, 5))


@pytest.mark.parametrize("batch", [(), (3,), (2, 2)], ids=str)
def test_matmul_equals_alpha_a_b_plus_beta_c(batch):
    generator = torch.Generator().manual_seed(3)
    A, B, C = (
        torch.randn((*batch, *shape), generator=generator) for shape in ((6, 9), (9, 5), (6, 5))
    )
    expected = 0.5 * (A.double() @ B.double()) - 2.0 * C.double()
    out = matmul(A, B, C=C, alpha=0.5, beta=-2.0)
    assert out.shape == expected.shape
    assert relative_error(out, expected) < 1e-6
    assert torch.equal(matmul(A, B), A @ B)


def test_matmul_rejects_mismatched_operands_with_their_shapes():
    with pytest.raises(ValueError, match=r"got A \(4, 3\) and B \(4, 5\)"):
        matmul(torch.zeros(4, 3), torch.zeros(4, 5))
    with pytest.raises(ValueError, match=r"matmul C must have shape \(4, 5\); got \(5, 4\)"):
        matmul(torch.zeros(4, 3), torch.zeros(3, 5), C=torch.zeros(5, 4))
