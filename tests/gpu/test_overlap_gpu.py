"""``dmuon.Muon(overlap_step=True)`` on CUDA at world size 1 (no torch.distributed): the
speculation on its side stream, each of its Newton-Schulz calls a CUDA graph up to
``dmuon.overlap.SPECULATION_GRAPH_MAX_NUMEL``. What ``step()`` commits equals, bit for bit, the
same step computed by ``step()`` itself from the same gradients; both are close to the plain
schedule, which batches Newton-Schulz across chunks. (On CPU and gloo:
tests/core/test_overlap_step_single_process.py, tests/distributed/test_overlap_step.py.)"""

from __future__ import annotations

import pytest
import torch

import dmuon
import dmuon_kernels.graphs
from dmuon.hooks import get_dedicated_state
from dmuon.testing import TinyDecoder, batches, loss_fn, proj_predicate
from tests.numerics import relative_error

LAYERS, STEPS = 8, 3  # eight layers: two chunks of four


SLOW_CYCLES = 50_000_000  # about 25 ms of an idle kernel on an H200


def train(
    overlap: bool,
    recompute: bool = False,
    max_norm: float | None = None,
    slow: bool = False,
    steps: int = STEPS,
):
    """Masters and momenta after ``steps`` steps; ``recompute``: every gradient is multiplied by 1
    in place before ``step()`` (same values, a new version), so ``step()`` discards each
    speculation and computes the unit itself; ``max_norm``: ``dmuon.clip_grad_norm_`` before
    each step; ``slow``: each unit's speculation starts ``SLOW_CYCLES`` late on its stream, so
    the clip, the non-finite check and ``step()`` are queued while it still runs."""
    torch.manual_seed(0)
    model = TinyDecoder(LAYERS).to("cuda", torch.bfloat16)
    dmuon.dedicate_params(model, None, proj_predicate)
    optimizer = dmuon.Muon(model, weight_decay=0.01, overlap_step=overlap)
    if slow:
        speculate = optimizer._overlap._speculate

        def late(*args):
            torch.cuda._sleep(SLOW_CYCLES)
            return speculate(*args)

        optimizer._overlap._speculate = late
    owned = [p for p in get_dedicated_state(model).iter_owned_masters() if p.route == "muon"]
    for tokens in batches(steps, 1, per_rank=4, seq=33):
        loss_fn(model, tokens.cuda()).backward()
        if recompute:
            for p in owned:
                p.master.grad.mul_(1.0)
        if max_norm is not None:
            dmuon.clip_grad_norm_(model, optimizer, max_norm)
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    weights = {p.fqn: p.master.detach().clone() for p in owned}
    momenta = {  # none before the first step
        p.fqn: optimizer.state[p.master]["momentum_buffer"].clone()
        for p in owned
        if p.master in optimizer.state
    }
    return weights, momenta, optimizer


@pytest.mark.parametrize("plain_graph_limit", [None, 1], ids=["default", "plain-step-eager"])
def test_committed_speculation_is_the_step_recomputed_bit_for_bit(monkeypatch, plain_graph_limit):
    """With the plain limit at 1 element no plain call replays a graph, while the overlapped
    step's calls still do (their own limit): committed and recomputed take the same graphs."""
    if plain_graph_limit is not None:
        monkeypatch.setattr(dmuon_kernels.graphs, "GRAPH_MAX_NUMEL", plain_graph_limit)
    weights, momenta, optimizer = train(overlap=True)
    stats = optimizer.overlap_stats()
    matrices = len(momenta)
    assert stats.speculated == stats.committed == STEPS * matrices and stats.recomputed == 0
    assert optimizer.newton_schulz.iteration_graphs.graph_count >= 1
    again, again_momenta, recomputing = train(overlap=True, recompute=True)
    stats = recomputing.overlap_stats()
    assert stats.committed == 0 and stats.recomputed == stats.discarded == STEPS * matrices
    for name in weights:
        assert torch.equal(weights[name], again[name]), name
        assert torch.equal(momenta[name], again_momenta[name]), name
    if plain_graph_limit is not None:
        _, _, plain = train(overlap=False)
        assert plain.newton_schulz.iteration_graphs.graph_count == 0


def test_the_overlapped_step_is_close_to_the_plain_schedule():
    """The plain schedule batches each shape's Newton-Schulz over all layers, the overlapped one
    over a chunk's, and its last product writes the update where the overlapped step applies the
    fp16 output ([Note: the update epilogue] in ``dmuon_kernels.update_epilogue``): one step from
    the same weights differs by those roundings, never by more. (Over several steps of this bf16
    model a rounding apart becomes a bf16 weight apart, and small singular directions amplify
    it: a comparison there measures the model, not the step.)"""
    initial, _, _ = train(overlap=False, steps=0)
    weights, momenta, _ = train(overlap=False, steps=1)
    overlapped, overlapped_momenta, _ = train(overlap=True, steps=1)
    for name in weights:
        update = weights[name] - initial[name]
        assert relative_error(overlapped[name] - initial[name], update) < 2e-3, name
        assert relative_error(overlapped_momenta[name], momenta[name]) < 1e-6, name


@pytest.mark.parametrize("max_norm", [None, 1e9, 1e-3], ids=["no-clip", "clip-by-1", "clip"])
def test_a_speculation_still_running_at_the_step_is_waited_for(max_norm):
    """The compute stream waits for the side stream only before the clip scales and before the
    commit, not at the end of backward: a speculation that runs late must still be what the
    commit applies (bit for bit what step() computes itself), and a clip that scales must still
    discard it."""
    weights, momenta, optimizer = train(overlap=True, max_norm=max_norm, slow=True)
    stats = optimizer.overlap_stats()
    matrices = STEPS * len(momenta)
    if max_norm == 1e-3:
        assert stats.committed == 0 and stats.discarded == stats.recomputed == matrices
    else:
        assert stats.committed == stats.speculated == matrices and stats.recomputed == 0
    again, again_momenta, _ = train(overlap=True, recompute=True, max_norm=max_norm)
    for name in weights:
        assert torch.equal(weights[name], again[name]), name
        assert torch.equal(momenta[name], again_momenta[name]), name
