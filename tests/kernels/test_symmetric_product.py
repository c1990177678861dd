"""``symmetric_product``: alpha·A·B + beta·C for commuting symmetric A, B (the Gram form's products)."""

from __future__ import annotations

import pytest
import torch

from dmuon_kernels.syrk import symmetric_product


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
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-6
    assert torch.allclose(out, out.mT, rtol=1e-5, atol=1e-5)


def test_symmetric_product_without_c_is_the_plain_product():
    A, B = commuting_pair(10, seed=2)
    assert torch.equal(symmetric_product(A, B), A @ B)


def test_symmetric_product_rejects_non_square_or_mismatched_operands():
    with pytest.raises(
        ValueError, match=r"square A and B of the same shape; got A \(4, 4\) and B \(4, 5\)"
    ):
        symmetric_product(torch.zeros(4, 4), torch.zeros(4, 5))
