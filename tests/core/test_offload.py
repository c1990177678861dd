"""``dmuon.Muon(offload_masters=True)`` in one process (no torch.distributed): where the masters
live between steps, how many the update holds at once, the readers outside the step (QK-clip,
``load_full_value``, ``model.state_dict()``, ``dmuon.inspect``), and every refusal's message.
The distributed runs (1-D, HSDP, checkpoints) are in ``tests/distributed/test_offload.py``."""

import functools

import pytest
import torch

import dmuon
import dmuon.inspect
import dmuon.optim
from dmuon.hooks import get_dedicated_state
from dmuon.testing import TinyDecoder, batches, loss_fn, proj_predicate
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models_moe import MoEDecoder, moe_predicate
from tests.distributed.scenarios_qk_clip import attention_heads, loss_of, make_model, predicate_of

BF16 = {"defaults": {"param_dtype": torch.bfloat16}}
FP32_NS = NewtonSchulz(dtype=torch.float32, kernel="cublas")


def bf16_model(**dedicate_options):
    torch.manual_seed(0)
    model = TinyDecoder().to(torch.bfloat16)
    dmuon.dedicate_params(model, None, proj_predicate, **dedicate_options)
    return model


def train(model, optimizer, steps: int) -> list[float]:
    losses = []
    for tokens in batches(steps, 1):
        loss = loss_fn(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def masters(model) -> dict[str, torch.Tensor]:
    state = get_dedicated_state(model)
    return {p.fqn: p.master_value().clone() for p in state.iter_owned_masters()}


def test_between_steps_each_master_is_a_cpu_home_and_the_parameter_a_nan_stand_in():
    model = bf16_model()
    optimizer = dmuon.Muon(model, ns_backend=FP32_NS, offload_masters=True)
    train(model, optimizer, 1)
    offloaded = [p for p in get_dedicated_state(model).iter_owned_masters() if p.route == "muon"]
    assert len(offloaded) == 15 and all(p.offload is not None for p in offloaded)
    for p in offloaded:
        assert p.master_value().device.type == "cpu" and p.master_value().is_contiguous()
        assert p.master.shape == p.shape and p.master.untyped_storage().nbytes() == 4
        assert p.master.isnan().all()  # a reader that bypasses master_value() sees NaN
        assert not p.master_value().isnan().any()
    # dmuon.inspect still describes them (dtype and identity, no value read).
    view = dmuon.inspect.view(model)
    assert {v.master_dtype for v in view.params.values() if v.is_owner} == {torch.float32}


def test_the_update_holds_the_masters_of_at_most_two_newton_schulz_calls(monkeypatch):
    # One matrix per call: the call computing and the next one's upload.
    monkeypatch.setattr(dmuon.muon_state, "NS_CALL_BYTES", 1)
    model = bf16_model()
    optimizer = dmuon.Muon(model, ns_backend=FP32_NS, offload_masters=True)
    offload = next(iter(get_dedicated_state(model).iter_owned_masters())).offload
    upload, arrive = offload._upload, offload._arrive
    uploading, held = [], []  # uploads not arrived yet; masters on the device at each arrival

    def counting_upload(params):
        transfer = upload(params)
        uploading.append(transfer)
        return transfer

    def counting_arrive(transfer):
        arrive(transfer)
        uploading.remove(transfer)
        held.append(len(offload._resident) + sum(len(t.params) for t in uploading))

    monkeypatch.setattr(offload, "_upload", counting_upload)
    monkeypatch.setattr(offload, "_arrive", counting_arrive)
    train(model, optimizer, 2)
    assert len(held) == 2 * 15  # every master arrived once per step, one call at a time
    assert max(held) == 2 and held[14] == 1  # the last call has no next one
    assert not offload._resident  # all home after the step


def test_offloaded_and_resident_masters_are_bit_identical_with_row_blocks_in_one_process():
    blocks = {"row_blocks": {"layers.1.up_proj.weight": [40, 12], "layers.*.q_proj.weight": 6}}
    results = []
    for offload in (False, True):
        model = bf16_model(**blocks)
        optimizer = dmuon.Muon(
            model, ns_backend=FP32_NS, offload_masters=offload, momentum_dtype=torch.bfloat16
        )
        results.append((train(model, optimizer, 3), masters(model)))
    (losses, expected), (offloaded_losses, offloaded) = results
    assert offloaded_losses == losses
    assert all(torch.equal(offloaded[k], expected[k]) for k in expected)


def test_qk_clip_rescales_offloaded_masters_as_it_does_resident_ones():
    results = []
    for offload in (False, True):
        model = make_model()
        dmuon.dedicate_params(model, None, predicate_of(False), param_policy=BF16)
        optimizer = dmuon.Muon(
            model, lr=0.02, weight_decay=0.01, ns_backend=FP32_NS, offload_masters=offload
        )
        clip = dmuon.QKClip(model, optimizer, attention_heads(model), threshold=1.5)
        for i, layer in enumerate(model.layers):
            layer.attn.record = functools.partial(clip.record, f"layers.{i}.attn")
        clipped = []
        for tokens in batches(3, 1):
            with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 weights, fp32 norms
                loss = loss_of(model, tokens % 37)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            clipped.append(clip.clipped_heads)
        results.append((clipped, masters(model)))
    (clipped, expected), (offloaded_clipped, offloaded) = results
    assert clipped == offloaded_clipped and clipped[0] > 0
    assert all(torch.equal(offloaded[k], expected[k]) for k in expected)


def test_readers_and_writers_outside_the_step_reach_the_cpu_home():
    model = bf16_model()
    optimizer = dmuon.Muon(model, ns_backend=FP32_NS, offload_masters=True)
    train(model, optimizer, 1)
    state = get_dedicated_state(model)
    p = state.params["layers.0.q_proj.weight"]
    # model.state_dict() hands out the home itself: a loader writing into it writes the master.
    entry = model.state_dict()["layers.0.q_proj.weight"]
    assert entry.data_ptr() == p.master_value().data_ptr()
    value = torch.randn(p.shape)
    state.load_full_value(p, value)
    assert torch.equal(p.master_value(), value)
    loaded = torch.randn(p.shape)
    model.load_state_dict({**model.state_dict(), "layers.0.q_proj.weight": loaded})
    assert torch.equal(p.master_value(), loaded)
    # The next forward publishes it: the weights it computes with are the loaded ones, rounded.
    seen = {}
    handle = model.layers[0].q_proj.register_forward_pre_hook(
        lambda module, args: seen.update(weight=module.weight.detach().clone())
    )
    loss_fn(model, batches(1, 1)[0])
    handle.remove()
    assert torch.equal(seen["weight"], loaded.to(torch.bfloat16))


# ---- refusals ---------------------------------------------------------------------------------


def test_offload_refuses_fp32_parameters_whose_master_is_the_broadcast_weight():
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    with pytest.raises(ValueError) as raised:
        dmuon.Muon(model, offload_masters=True)
    assert str(raised.value) == (
        "dmuon.Muon(offload_masters=True): the Muon matrices layers.0.q_proj.weight, "
        "layers.0.o_proj.weight, layers.0.gate_proj.weight, layers.0.up_proj.weight, "
        "layers.0.down_proj.weight, ... 10 more compute in torch.float32, so each owner's fp32 "
        "master is the weight that forward broadcasts, not a separate copy, and there is nothing "
        "to offload. Compute them in bf16: dmuon.dedicate_params(..., param_policy={'defaults': "
        "{'param_dtype': torch.bfloat16}}) (with FSDP2's MixedPrecisionPolicy(param_dtype="
        "torch.bfloat16) for the rest of the model), or drop offload_masters=True."
    )


def test_offload_refuses_the_overlapped_step():
    with pytest.raises(ValueError, match=r"does not combine with overlap_step=True.*Drop one"):
        dmuon.Muon(bf16_model(), offload_masters=True, overlap_step=True)


def test_offload_refuses_expert_stacks():
    model = MoEDecoder().to(torch.bfloat16)
    dmuon.dedicate_params(model, None, moe_predicate)
    with pytest.raises(ValueError) as raised:
        dmuon.Muon(model, offload_masters=True)
    message = str(raised.value)
    assert message.startswith(
        "dmuon.Muon(offload_masters=True) is not supported yet for expert stacks (layers.0."
    )
    assert "Drop offload_masters=True, or leave the stacks out of the predicate" in message


@pytest.mark.parametrize("offload_masters", [True, False])
def test_a_second_optimizer_of_an_offloaded_model_is_refused_and_the_masters_kept(offload_masters):
    # A second offload copied the first's NaN stand-ins into its homes: every master NaN.
    model = bf16_model()
    optimizer = dmuon.Muon(model, ns_backend=FP32_NS, offload_masters=True)
    train(model, optimizer, 1)
    kept = masters(model)
    with pytest.raises(ValueError, match=r"already has an optimizer with offload_masters=True"):
        dmuon.Muon(model, ns_backend=FP32_NS, offload_masters=offload_masters)
    for name, value in masters(model).items():
        assert torch.equal(value, kept[name]), name
    train(model, optimizer, 1)  # the first still steps
    assert not any(value.isnan().any() for value in masters(model).values())


def test_offload_masters_must_be_a_bool():
    with pytest.raises(TypeError, match=r"offload_masters must be True or False, got 'yes'"):
        dmuon.Muon(bf16_model(), offload_masters="yes")
