"""The cuBLAS backend's block-column assembly of symmetric results, checked on CPU in float64
against the full product (the assembly is device-independent; CUDA only decides when to use it)."""

import itertools

import pytest
import torch

from dmuon_kernels.syrk import cublas
from tests.numerics import relative_error


def random_symmetric(batch, M, seed):
    generator = torch.Generator().manual_seed(seed)
    S = torch.randn(*batch, M, M, generator=generator, dtype=torch.float64)
    return S + S.mT


def off_diagonal_blocks_are_mirrored(out, edges):
    for start, stop in itertools.pairwise(edges[:-1]):
        if not torch.equal(out[..., start:stop, stop:], out[..., stop:, start:stop].mT):
            return False
    return True


@pytest.mark.parametrize("M", [129, 300, 1000, 4096, 8192])
@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 7])
def test_block_edges_cover_the_matrix_in_128_aligned_blocks(M, blocks):
    edges = cublas.block_edges(M, blocks)
    assert edges[0] == 0 and edges[-1] == M
    assert all(a < b for a, b in itertools.pairwise(edges))
    assert all(edge % 128 == 0 for edge in edges[:-1])
    assert len(edges) - 1 <= blocks


@pytest.mark.parametrize(
    ("M", "K", "batch", "expected"),
    [
        (1024, 4096, 8, 1),  # no room for two 1024-wide blocks
        (2048, 8192, 1, 1),  # 2^24: too small a problem to gain
        (4096, 4096, 1, 1),
        (4096, 4096, 12, 4),  # the batched square products of Newton-Schulz
        (4096, 14336, 1, 4),
        (3000, 14336, 1, 2),  # two blocks of at least 1024
        (8192, 28672, 1, 4),  # capped at MAX_SYMMETRIC_BLOCKS
    ],
)
def test_block_count_follows_the_measured_rule(M, K, batch, expected):
    assert cublas.symmetric_block_count(M, K, batch) == expected


@pytest.mark.parametrize("batch", [(), (3,)], ids=["single", "batched"])
@pytest.mark.parametrize(("M", "K", "blocks"), [(300, 77, 2), (1000, 50, 3), (520, 700, 4)])
@pytest.mark.parametrize("alpha_beta", [(1.0, 0.0), (0.75, -1.25)], ids=["plain", "with_c"])
def test_blocked_syrk_equals_the_full_product(batch, M, K, blocks, alpha_beta):
    alpha, beta = alpha_beta
    A = torch.randn(*batch, M, K, generator=torch.Generator().manual_seed(M), dtype=torch.float64)
    C = random_symmetric(batch, M, seed=1) if beta else None
    reference = alpha * A @ A.mT + (beta * C if C is not None else 0)
    out = cublas.symmetric_blocked(A, A.mT, C, alpha, beta, blocks)
    assert relative_error(out, reference) <= 1e-14
    assert off_diagonal_blocks_are_mirrored(out, cublas.block_edges(M, blocks))


def test_blocked_syrk_of_a_transposed_view_equals_the_full_product():
    X = torch.randn(90, 400, dtype=torch.float64)
    A = X.T  # (400, 90), not contiguous
    out = cublas.symmetric_blocked(A, A.T, None, 1.0, 0.0, 3)
    assert relative_error(out, A @ A.T) <= 1e-14


@pytest.mark.parametrize("batch", [(), (2,)], ids=["single", "batched"])
def test_blocked_product_of_commuting_symmetric_matrices_equals_the_full_product(batch):
    R = random_symmetric(batch, 384, seed=2) / 40
    Z = 0.5 * R + 0.25 * R @ R  # a polynomial in R: symmetric and commutes with R
    Q = 2.0 * R - R @ R @ R  # another polynomial in R
    C = random_symmetric(batch, 384, seed=3)
    reference = 1.5 * Z @ Q - 0.5 * C
    out = cublas.symmetric_blocked(Z, Q, C, 1.5, -0.5, 3)
    assert relative_error(out, reference) <= 1e-13
    assert off_diagonal_blocks_are_mirrored(out, cublas.block_edges(384, 3))


def test_blocked_syrk_propagates_nan_of_a_and_ignores_c_when_beta_is_zero():
    A = torch.randn(300, 40, dtype=torch.float64)
    A[5, 3] = float("nan")
    C = torch.full((300, 300), float("nan"), dtype=torch.float64)
    out = cublas.symmetric_blocked(A, A.T, C, 1.0, 0.0, 2)
    full = A @ A.T
    assert torch.equal(out.isnan(), full.isnan())
    assert out.isnan().sum() == 2 * 300 - 1  # row 5 and column 5
