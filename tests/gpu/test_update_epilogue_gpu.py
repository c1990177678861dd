"""The Muon update written by Newton-Schulz's last product on CUDA
([Note: the update epilogue] in ``dmuon_kernels.update_epilogue``): fp16 factors into fp32
masters, in place, through cuBLAS's ``beta·C + alpha·A·B``. Closer to the exact product than the
update applied from a written-out fp16 output; the same through eager calls and CUDA-graph
replays; a ``dmuon.Muon`` step with it launches no separate update pass and lands where the
written-out step does. (The CPU path: tests/kernels/test_update_epilogue.py and
tests/core/test_update_epilogue_step.py.)"""

from __future__ import annotations

import pytest
import torch

from dmuon_kernels import NewtonSchulz
from dmuon_kernels.fused import muon_apply_updates_, muon_normalize
from dmuon_kernels.update_epilogue import final_update_
from tests.gpu.tiny_training import train
from tests.numerics import relative_error

DECAY, STEPS = 0.998, [0.01, 0.03]
SHAPES = {"square": (512, 512), "wide": (256, 1024), "odd": (200, 770)}


def factors(shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    n, m = shape
    left = torch.randn(2, n, n, device="cuda", generator=generator).half() / n**0.5
    X = torch.randn(2, n, m, device="cuda", generator=generator).half() / m**0.5
    return left, X


def masters_for(shape: tuple[int, int]) -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(1)
    n, m = shape
    return [
        torch.randn(n, m, device="cuda", generator=generator) * 0.02,
        torch.randn(m, n, device="cuda", generator=generator) * 0.02,  # a tall weight
    ]


@pytest.mark.parametrize("diagonal", [None, 3.0], ids=["gram", "direct"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_the_epilogue_update_is_the_exact_products_and_closer_than_the_written_out_one(
    shape, diagonal
):
    """Exact: in float64, from the factors as the GEMM gets them (the direct form's factor
    ``a·I + poly`` carries its diagonal, rounded to fp16 once)."""
    left, X = factors(shape)
    if diagonal is not None:
        left.diagonal(dim1=-2, dim2=-1).add_(diagonal)
    masters = masters_for(shape)
    before = [master.clone() for master in masters]
    outputs = torch.bmm(left, X)  # fp16, as the written-out step stores it
    final_update_(left, X, masters, decay=DECAY, steps=STEPS)
    for i, (master, old) in enumerate(zip(masters, before)):
        exact = left[i].double() @ X[i].double()
        tall = master.shape != exact.shape
        exact_update = -STEPS[i] * (exact.mT if tall else exact)
        decayed = DECAY * old.double()
        ours = relative_error(master.double() - decayed, exact_update)
        applied = old.clone()
        muon_apply_updates_(
            [applied], [outputs[i].mT if tall else outputs[i]], 1.0, 1.0 - DECAY, STEPS[i]
        )
        theirs = relative_error(applied.double() - decayed, exact_update)
        assert ours < 1e-5, (i, ours)
        assert ours < theirs, (i, ours, theirs)


def test_update_masters_is_the_same_eager_and_through_graph_replays():
    ns = NewtonSchulz()
    generator = torch.Generator(device="cuda").manual_seed(2)
    G = torch.randn(2, 256, 1024, device="cuda", generator=generator)
    X = ns.normalized_buffer((2, 256, 1024), G.device)
    for index, matrix in enumerate(G):
        muon_normalize(matrix, dtype=X.dtype, out=X[index])
    X = X.clone()
    masters = masters_for((256, 1024))
    results = []
    for _ in range(3):  # eager, captured, replayed
        updated = [master.clone() for master in masters]
        ns.update_masters_(X.clone(), updated, lr=0.02, weight_decay=0.1, scales=[1.0, 2.0])
        results.append(updated)
    assert ns.iteration_graphs.graph_count == 1
    for later in results[1:]:
        for a, b in zip(results[0], later):
            assert torch.equal(a, b)


def test_a_muon_step_with_the_epilogue_launches_no_update_pass_and_lands_where_the_other_does(
    monkeypatch,
):
    """One step from the same weights: the same gradients, momenta and Newton-Schulz factors,
    so the updates differ by the fp16 rounding of the written-out output (about 2^-12 relative).
    (Over several steps of this bf16 model such a difference becomes a bf16 weight apart, which
    small singular directions amplify.)"""
    initial, _, _ = train(monkeypatch, epilogue=True, steps=0)
    masters, segments, kernels = train(monkeypatch, epilogue=True, steps=1, profiled=True)
    written_out, _, written_kernels = train(monkeypatch, epilogue=False, steps=1, profiled=True)
    assert any("apply_update" in name for name in written_kernels), written_kernels
    assert not any("apply_update" in name for name in kernels), kernels
    for name in masters:
        update, expected = masters[name] - initial[name], written_out[name] - initial[name]
        assert relative_error(update, expected) < 2e-3, name
        # the weights forward broadcasts: the owner's bf16 segment, refreshed after the step
        assert torch.equal(segments[name], masters[name].to(torch.bfloat16)), name
