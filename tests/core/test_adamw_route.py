"""The AdamW route is torch's own AdamW, and a Muon optimizer without Muon parameters is refused."""

import pytest
import torch

import dmuon
from tests.distributed.models import TinyDecoder, batches, loss_fn

HYPERPARAMETERS = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)


def test_the_adamw_route_is_bit_identical_to_torch_adamw_foreach():
    torch.manual_seed(0)
    model = TinyDecoder()
    torch.manual_seed(0)
    plain = TinyDecoder()
    with pytest.warns(UserWarning, match="no parameters matched the predicate"):
        dmuon.dedicate_params(model, None, lambda name, p: False)
    optimizer = dmuon.Muon(
        model,
        adamw_lr=HYPERPARAMETERS["lr"],
        adamw_betas=HYPERPARAMETERS["betas"],
        adamw_eps=HYPERPARAMETERS["eps"],
        adamw_weight_decay=HYPERPARAMETERS["weight_decay"],
        allow_no_muon=True,
        no_decay=None,  # torch's AdamW decays every parameter
    )
    reference = torch.optim.AdamW(plain.parameters(), foreach=True, **HYPERPARAMETERS)
    for batch in batches(4, 1):
        for net, opt in ((model, optimizer), (plain, reference)):
            loss_fn(net, batch).backward()
            opt.step()
            opt.zero_grad()
    for (name, actual), expected in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(actual, expected), name


def test_muon_without_any_matrix_on_the_muon_route_is_refused_with_the_fix():
    model = TinyDecoder()
    with pytest.warns(UserWarning):
        dmuon.dedicate_params(model, None, lambda name, p: "linear" in name)
    with pytest.raises(ValueError, match=r"no parameter is on the Muon route .*allow_no_muon=True"):
        dmuon.Muon(model)


def test_dedicated_vectors_alone_are_not_a_muon_route():
    model = TinyDecoder()
    with pytest.warns(UserWarning, match="no hook boundary found"):
        dmuon.dedicate_params(model, None, lambda name, p: "norm" in name)
    with pytest.raises(ValueError, match=r"selected 14 parameters, none a matrix"):
        dmuon.Muon(model)
    assert dmuon.Muon(model, allow_no_muon=True).param_groups[0]["params"] == []
