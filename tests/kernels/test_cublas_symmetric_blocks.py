"""The cuBLAS backend's block-column assembly of symmetric results, checked on CPU in float64
against the full product (the assembly is device-independent; CUDA only decides when to use it)."""

import itertools

import pytest
import torch

from dmuon_kernels.syrk import cublas


def random_symmetric(batch, M, seed):
    generator = torch.Generator().manual_seed(seed)
    S = torch.randn(*batch, M, M, generator=generator, dtype=torch.float64)
    return S + S.mT


def relative_error(actual, reference):
    return ((actual - reference).norm() / reference.norm()).item()


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


def test_block_count_keeps_small_problems_whole_and_every_block_wide():
    for M in (64, 1024, 2047, 2048, 4096, 6000, 8192, 16384, 65536):
        for K, batch in ((M, 1), (4 * M, 1), (M, 12)):
            blocks = cublas.symmetric_block_count(M, K, batch)
            assert 1 <= blocks <= cublas.MAX_SYMMETRIC_BLOCKS
            assert blocks == 1 or M // blocks >= cublas.MIN_BLOCK_WIDTH
            if M * K * batch < cublas.MIN_BLOCKED_VOLUME:
                assert blocks == 1


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
