"""dedicate_params + dmuon.Muon in one process without torch.distributed (the smoke-test setup)."""

import copy
import datetime
import functools
import itertools
import warnings

import pytest
import torch
from torch import nn

import dmuon
import dmuon.checkpoint
from dmuon.hooks import get_dedicated_state
from dmuon_kernels import newton_schulz
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate
from tests.reference_optim import ReferenceMuonAdamW

FP32_NS = functools.partial(NewtonSchulz, dtype=torch.float32, kernel="cublas")


def test_single_process_training_matches_the_reference_without_torch_distributed():
    torch.manual_seed(0)
    model = TinyDecoder()
    torch.manual_seed(0)
    reference = TinyDecoder()
    owners = dmuon.dedicate_params(model, None, proj_predicate)
    assert set(owners) == {n for n, p in reference.named_parameters() if proj_predicate(n, p)}
    assert all(owner == dmuon.OwnerCoord(0, 0) for owner in owners.values())
    optimizer = dmuon.Muon(model, ns_backend=FP32_NS())
    reference_optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        proj_predicate,
        orthogonalize=functools.partial(newton_schulz, dtype=torch.float32),
    )
    masters = {p.fqn: p.master for p in get_dedicated_state(model).iter_owned_masters()}
    for batch in batches(5, 1):
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_fn(reference, batch).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    for name, expected in reference.named_parameters():
        actual = masters.get(name, dict(model.named_parameters())[name])
        assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_owners_gradients_start_32_byte_aligned_with_the_reference_values(param_dtype):
    """[Note: aligned gradients in a message]: each owner gradient is a view of its message; it
    starts on a 32-byte boundary whatever the sizes before it (odd ones here), so the fused
    step reads it with vector loads."""
    torch.manual_seed(0)
    sizes = (7, 13, 5, 11, 3)
    model = nn.Sequential(*[nn.Linear(a, b, bias=False) for a, b in itertools.pairwise(sizes)])
    reference = copy.deepcopy(model)
    policy = dmuon.ParamPolicy(defaults=dmuon.ParamDefaults(param_dtype=param_dtype))
    dmuon.dedicate_params(
        model, None, lambda name, p: True, param_policy=policy, layer_id_fn=lambda name: "0",
        hook_boundary_predicate=lambda module: module is model,  # one message for all four
    )  # fmt: skip
    dmuon.Muon(model)
    x = torch.randn(4, 7)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=param_dtype == torch.bfloat16):
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
    owned = {p.fqn: p.master.grad for p in get_dedicated_state(model).iter_owned_masters()}
    assert len(owned) == len(sizes) - 1
    tolerance = 1e-6 if param_dtype == torch.float32 else 5e-2
    for name, expected in reference.named_parameters():
        assert owned[name].data_ptr() % 32 == 0, name
        torch.testing.assert_close(owned[name], expected.grad, rtol=tolerance, atol=tolerance)


def test_placeholders_keep_parameter_names_and_hold_no_memory_outside_forward():
    model = TinyDecoder()
    names = [name for name, _ in model.named_parameters()]
    dmuon.dedicate_params(model, None, proj_predicate)
    assert [name for name, _ in model.named_parameters()] == names
    assert model.layers[0].q_proj.weight.numel() == 0
    assert set(model.state_dict()) >= {"layers.0.q_proj.weight"}


def test_forward_uses_the_param_dtype_of_the_policy_and_masters_stay_fp32():
    model = TinyDecoder()
    seen = {}

    def record_dtype(module, args):
        seen["dtype"] = module.weight.dtype

    model.layers[0].q_proj.register_forward_pre_hook(record_dtype)
    model.to(torch.bfloat16)
    dmuon.dedicate_params(
        model,
        None,
        proj_predicate,
        param_policy=dmuon.ParamPolicy(defaults=dmuon.ParamDefaults(param_dtype=torch.bfloat16)),
    )
    dmuon.Muon(model)
    loss_fn(model, batches(1, 1)[0]).backward()
    assert seen["dtype"] == torch.bfloat16
    masters = list(get_dedicated_state(model).iter_owned_masters())
    assert masters and all(p.master.dtype == torch.float32 for p in masters)
    assert all(p.master.grad is not None and p.master.grad.dtype == torch.float32 for p in masters)


def test_meta_device_models_take_their_masters_from_the_initialised_weights():
    with torch.device("meta"):
        model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(0.5 if "q_proj" in name else 0.25)
    dmuon.Muon(model)
    state = get_dedicated_state(model)
    assert torch.all(state.params["layers.0.q_proj.weight"].master == 0.5)
    assert torch.all(state.params["layers.2.down_proj.weight"].master == 0.25)


def test_meta_device_model_used_before_materialisation_says_how_to_fix_it():
    with torch.device("meta"):
        model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    with pytest.raises(RuntimeError, match=r"still on the meta device.*to_empty"):
        dmuon.Muon(model)


# ---- bad input ---------------------------------------------------------------------------------


def test_a_predicate_that_matches_nothing_warns_with_the_debugging_hint():
    model = TinyDecoder()
    with pytest.warns(UserWarning) as record:
        dmuon.dedicate_params(model, None, lambda name, p: "linear" in name)
    message = str(record[0].message)
    assert message.startswith("dedicate_params: no parameters matched the predicate")
    assert "print(name, param.shape)" in message and "param.ndim == 2" in message


def test_dedicating_a_model_twice_is_refused():
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    with pytest.raises(RuntimeError, match="dedicate_params was already called on this model"):
        dmuon.dedicate_params(model, None, proj_predicate)


def test_muon_without_dedicate_params_says_to_call_it_first():
    with pytest.raises(ValueError, match=r"call dmuon\.dedicate_params\(model, mesh, predicate\)"):
        dmuon.Muon(TinyDecoder())


def test_unfreezing_a_matrix_frozen_before_dedicate_params_is_refused_with_the_fix():
    model = TinyDecoder()
    model.layers[0].q_proj.weight.requires_grad_(False)
    dmuon.dedicate_params(model, None, proj_predicate)
    dmuon.Muon(model)
    model.layers[0].q_proj.weight.requires_grad_(True)
    with pytest.raises(
        RuntimeError, match=r"layers\.0\.q_proj\.weight was frozen.*freeze it after"
    ):
        loss_fn(model, batches(1, 1)[0]).backward()


class _TiedHead(nn.Module):
    """The embedding's weight is used again by the root's forward, outside the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.layers[0](self.embed(tokens))
        return nn.functional.linear(hidden, self.embed.weight)


def test_a_dedicated_weight_used_outside_its_boundary_names_the_placeholder_and_the_fix():
    model = _TiedHead()
    with pytest.warns(UserWarning, match="no hook boundary found"):
        dmuon.dedicate_params(model, None, lambda name, p: p.ndim == 2)
    with pytest.raises(
        RuntimeError, match=r"(?s)linear\(\) failed with the placeholder.*hook_boundary_predicate"
    ):
        model(torch.randint(0, 11, (2, 3)))
    # The fix the message gives: one boundary around every use (here the whole model).
    fixed = _TiedHead()
    dmuon.dedicate_params(
        fixed, None, lambda name, p: p.ndim == 2, hook_boundary_predicate=lambda m: m is fixed
    )
    assert fixed(torch.randint(0, 11, (2, 3))).shape == (2, 3, 11)


@pytest.mark.parametrize(
    ("timeout", "error", "message"),
    [
        (5, TypeError, r"timeout must be a datetime\.timedelta, got int 5"),
        (
            datetime.timedelta(0),
            ValueError,
            r"timeout must be positive, got datetime\.timedelta\(0\)",
        ),
    ],
)
def test_a_bad_timeout_is_refused_with_the_fix(timeout, error, message):
    with pytest.raises(error, match=message):
        dmuon.dedicate_params(TinyDecoder(), None, proj_predicate, timeout=timeout)


def test_a_block_of_a_dedicated_model_says_to_pass_the_whole_model():
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    with pytest.raises(ValueError, match=r"is a part of the model dmuon\.dedicate_params prepared"):
        dmuon.checkpoint.get_model_state_dict(model.layers[0])


def test_muon_given_model_parameters_says_to_pass_the_model():
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    with pytest.raises(
        TypeError,
        match=r"takes the model itself, got generator.*not dmuon\.Muon\(model\.parameters\(\)",
    ):
        dmuon.Muon(model.parameters())


def test_compute_dtype_together_with_param_policy_is_refused():
    with pytest.raises(ValueError, match="param_policy"):
        dmuon.dedicate_params(
            TinyDecoder(),
            None,
            proj_predicate,
            compute_dtype=torch.bfloat16,
            param_policy={"defaults": {"param_dtype": torch.bfloat16}},
        )


def test_legacy_compute_dtype_sets_the_forward_dtype():
    model = TinyDecoder().to(torch.bfloat16)
    dmuon.dedicate_params(model, None, proj_predicate, compute_dtype=torch.bfloat16)
    assert all(p.param_dtype == torch.bfloat16 for p in get_dedicated_state(model).params.values())


def test_unknown_process_group_policy_lists_the_choices():
    with pytest.raises(ValueError, match=r"process_group_policy='private'.*'isolated'"):
        dmuon.dedicate_params(TinyDecoder(), None, proj_predicate, process_group_policy="private")


def test_parameters_without_a_layer_name_warn_and_fall_back_to_their_parent_module():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dmuon.dedicate_params(model, None, lambda name, p: p.ndim == 2)
    messages = " ".join(str(w.message) for w in record)
    assert "no layer id found for 2 parameters (0.weight, 1.weight)" in messages
    assert "no hook boundary found for 2 parameters" in messages
    model(torch.randn(3, 4)).sum().backward()


def test_tools_names_without_dmuon_tools_give_an_install_hint(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "dmuon_tools", None)
    with pytest.raises(ImportError, match="pip install dmuon-tools"):
        dmuon.summarize_param_groups  # noqa: B018
