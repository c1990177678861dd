"""Canonical FQNs in one process: the rule, the way back to a model's keys, and what users see.

Distributed runs (owners, checkpoints between wrapped and plain blocks, stock FSDP2) are in
``tests/distributed/test_canonical_names.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import dmuon
import dmuon.checkpoint as dckpt
from dmuon.fqn import WRAPPER_SEGMENTS, canonical_fqn, state_dict_key
from tests.distributed.models import TinyDecoder, proj_predicate
from tests.distributed.scenarios_canonical_names import build, wrapped_model


def test_canonical_names_leave_out_every_wrapper_segment_at_any_depth():
    assert {"_checkpoint_wrapped_module", "_orig_mod"} <= WRAPPER_SEGMENTS
    assert canonical_fqn("layers.0._checkpoint_wrapped_module.attn.wq.weight") == (
        "layers.0.attn.wq.weight"
    )
    assert canonical_fqn("_orig_mod.layers.0._orig_mod._checkpoint_wrapped_module.w") == (
        "layers.0.w"
    )
    assert canonical_fqn("model.module.orig_mod.weight") == "model.module.orig_mod.weight"


def test_a_canonical_key_maps_back_to_the_key_the_models_own_load_state_dict_expects():
    model = wrapped_model("ac+compile")
    own_keys = set(model.state_dict())
    for key in TinyDecoder().state_dict():
        assert state_dict_key(model, key) in own_keys, key
    # The compile wrapper keeps its segment in state_dict keys; the checkpoint wrapper hides it.
    assert state_dict_key(model, "layers.0.q_proj.weight") == "layers.0._orig_mod.q_proj.weight"
    # A key no module reaches (one a hook makes up) is followed as far as the modules go.
    assert state_dict_key(model, "layers.1.qkv.wq.weight") == "layers.1._orig_mod.qkv.wq.weight"


def test_names_given_with_wrapper_segments_mean_the_canonical_parameter():
    model = TinyDecoder()
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        owners = dmuon.dedicate_params(
            model,
            None,
            proj_predicate,
            routes={"layers.0._checkpoint_wrapped_module.o_proj.bias": "adamw"},
        )
        optimizer = dmuon.Muon(
            model,
            param_groups=[
                {"params": ["layers.0._checkpoint_wrapped_module.q_proj.weight"], "lr": 0.5}
            ],
        )
    assert "layers.0.o_proj.bias" in owners and "layers.0.q_proj.weight" in owners
    rows = {row.fqn: row for row in optimizer.routing()}
    assert rows["layers.0.q_proj.weight"].lr == 0.5
    assert rows["layers.0.o_proj.bias"].route == "adamw"
    assert not any(segment in fqn for fqn in rows for segment in WRAPPER_SEGMENTS)


def test_an_unknown_name_in_routes_is_still_refused():
    with pytest.raises(ValueError, match="routes names 1 parameters the model does not have"):
        dmuon.dedicate_params(TinyDecoder(), None, proj_predicate, routes={"layers.9.x": "adamw"})


def _train(model, optimizer, steps: range) -> None:
    data = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 37, (4, 9), generator=data) for _ in range(steps.stop)]
    for step in steps:
        tokens = batches[step]
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_checkpoint_written_with_wrappers_resumes_without_them_in_one_process(tmp_path):
    wrapped, wrapped_optimizer = build("ac+compile", replicas=0)
    _train(wrapped, wrapped_optimizer, range(2))
    model_sd, optim_sd = dckpt.get_state_dict(wrapped, wrapped_optimizer)
    dckpt.save({"model": model_sd, "optim": optim_sd}, tmp_path / "ckpt")
    _train(wrapped, wrapped_optimizer, range(2, 4))
    resumed, resumed_optimizer = build("", replicas=0)
    model_sd, optim_sd = dckpt.get_state_dict(resumed, resumed_optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every entry loads: no state starts fresh
        dckpt.load({"model": model_sd, "optim": optim_sd}, tmp_path / "ckpt")
        dckpt.set_state_dict(
            resumed, resumed_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
        )
    _train(resumed, resumed_optimizer, range(2, 4))
    expected = dckpt.get_model_state_dict(wrapped)
    for key, value in dckpt.get_model_state_dict(resumed).items():
        assert torch.equal(value, expected[key]), key
