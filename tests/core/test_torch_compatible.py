"""``dmuon.Muon.torch_compatible`` reproduces ``torch.optim.Muon`` (and ``adjust_lr`` its lr rules).

One process, the tiny decoder: dmuon on the projections (Muon) and the rest (AdamW), against
``torch.optim.Muon`` on the projections and ``torch.optim.AdamW`` (foreach) on the rest, with the
same hyperparameters, for a few steps on the same batches. The batches have more tokens than a
matrix has rows, so gradients are full rank: on a rank-deficient gradient both bf16 iterations
turn rounding noise in its null space into different junk, and no bound below a few percent
holds (not even between torch's own bf16 and fp32 runs).
"""

import math

import pytest
import torch

import dmuon
from dmuon.hooks import get_dedicated_state
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate

STEPS = 5
BF16_EPS = torch.finfo(torch.bfloat16).eps


def updates_against_torch(adjust_lr: str | None, torch_adjust_lr_fn: str | None):
    torch.manual_seed(0)
    model = TinyDecoder()
    torch.manual_seed(0)
    plain = TinyDecoder()
    start = {name: p.detach().clone() for name, p in plain.named_parameters()}
    dmuon.dedicate_params(model, None, proj_predicate)
    optimizer = dmuon.Muon.torch_compatible(model, adjust_lr=adjust_lr)
    named = dict(plain.named_parameters())
    muon_names = [n for n, p in named.items() if proj_predicate(n, p)]
    torch_muon = torch.optim.Muon(
        [named[n] for n in muon_names], lr=1e-3, weight_decay=0.1, adjust_lr_fn=torch_adjust_lr_fn
    )
    torch_adamw = torch.optim.AdamW(
        [p for n, p in named.items() if n not in muon_names],
        lr=1e-3,
        weight_decay=0.01,
        foreach=True,
    )
    for batch in batches(STEPS, 1, per_rank=64):
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_fn(plain, batch).backward()
        torch_muon.step()
        torch_adamw.step()
        plain.zero_grad()
    masters = {p.fqn: p.master for p in get_dedicated_state(model).iter_owned_masters()}
    return {
        name: (masters[name].detach() - start[name], named[name].detach() - start[name])
        for name in muon_names
    }


@pytest.mark.parametrize(
    ("adjust_lr", "torch_adjust_lr_fn"),
    [("spectral", None), ("match_rms_adamw", "match_rms_adamw")],
    ids=["torch-default", "match-rms"],
)
def test_torch_compatible_updates_equal_torch_muon_within_bf16_rounding(
    adjust_lr, torch_adjust_lr_fn
):
    for name, (ours, theirs) in updates_against_torch(adjust_lr, torch_adjust_lr_fn).items():
        error = ((ours - theirs).norm() / theirs.norm()).item()
        # Both iterate in bf16 from inputs that differ by bf16 roundings (torch normalises in
        # bf16, dmuon in fp32; torch's EMA momentum is (1 - mu) times dmuon's sum). Five Keller
        # iterations multiply a small singular value's error by up to a^5 ~ 480, so the
        # directions of the smallest singular values differ most: measured 3% (4 bf16 ulps)
        # after 5 steps with full-rank gradients; 8 ulps of room.
        assert error < 8 * BF16_EPS, f"{name}: {error:.2e}"


@pytest.mark.parametrize("adjust_lr", ["match_rms_adamw", None])
def test_adjust_lr_scales_the_update_against_torch_muons_default_rule(adjust_lr):
    """Against torch's default sqrt(max(1, m/n)), the update grows by the ratio of the rules."""
    for name, (ours, theirs) in updates_against_torch(adjust_lr, None).items():
        rows, cols = ours.shape
        ours_scale = 0.2 * math.sqrt(max(rows, cols)) if adjust_lr else 1.0
        ratio = ours.norm() / theirs.norm()
        # The decay term (lr * wd * W, about 2% of the update here) does not scale with the rule.
        assert ratio == pytest.approx(ours_scale / math.sqrt(max(1, rows / cols)), rel=0.05), name


def test_an_unknown_adjust_lr_lists_the_rules():
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    with pytest.raises(
        ValueError, match=r"adjust_lr='rms' is not one of \('match_rms_adamw', 'spectral', None\)"
    ):
        dmuon.Muon(model, adjust_lr="rms")
