"""NewtonSchulz's entry for callers that normalise their own input (the fused optimizer step)."""

import pytest
import torch

from dmuon_kernels import NewtonSchulz
from dmuon_kernels.fused import muon_normalize


@pytest.mark.parametrize("shape", [(3, 8, 24), (2, 16, 16)])
def test_iterating_a_normalised_input_equals_the_full_call(shape):
    ns = NewtonSchulz(dtype=torch.float32, kernel="cublas")
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    X = ns.normalized_buffer(shape, G.device)
    for index, matrix in enumerate(G):
        muon_normalize(matrix, dtype=torch.float32, out=X[index])
    expected = ns(G)
    torch.testing.assert_close(ns.iterate_normalized(X), expected, rtol=1e-5, atol=1e-6)


def test_iterate_normalized_refuses_tall_or_wrongly_typed_input_and_names_the_fix():
    ns = NewtonSchulz(dtype=torch.float32, kernel="cublas")
    with pytest.raises(
        ValueError, match=r"takes \(B, n, m\) with n <= m in torch.float32; got \(2, 9, 4\)"
    ):
        ns.iterate_normalized(torch.zeros(2, 9, 4))
    with pytest.raises(ValueError, match=r"Use ns\(G\)"):
        ns.iterate_normalized(torch.zeros(2, 4, 9, dtype=torch.float16))
