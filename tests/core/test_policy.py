"""Parsing of param_policy= and the legacy compute_dtype= into one ParamPolicy."""

import dataclasses

import pytest
import torch

from dmuon.policy import ParamDefaults, ParamPolicy, resolve_param_policy


def test_no_policy_inherits_every_dtype():
    policy = resolve_param_policy(None, None)
    assert policy == ParamPolicy()
    assert policy.defaults.param_dtype is None
    assert policy.defaults.reduce_dtype is None


def test_a_policy_object_is_returned_as_given():
    policy = ParamPolicy(defaults=ParamDefaults(param_dtype=torch.bfloat16))
    assert resolve_param_policy(policy, None) is policy


def test_a_dict_policy_gives_the_same_policy_as_the_dataclasses():
    parsed = resolve_param_policy(
        {"defaults": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}}, None
    )
    assert parsed == ParamPolicy(
        defaults=ParamDefaults(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )


def test_a_dict_may_hold_a_defaults_object_or_nothing():
    defaults = ParamDefaults(param_dtype=torch.float16)
    assert resolve_param_policy({"defaults": defaults}, None).defaults is defaults
    assert resolve_param_policy({}, None) == ParamPolicy()
    assert resolve_param_policy({"defaults": None}, None) == ParamPolicy()


@pytest.mark.parametrize(
    ("alias", "dtype"),
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("fp64", torch.float64),
    ],
)
def test_dtype_names_are_accepted_everywhere(alias, dtype):
    assert resolve_param_policy(
        {"defaults": {"param_dtype": alias}}, None
    ).defaults.param_dtype is (dtype)
    assert resolve_param_policy(None, alias).defaults.param_dtype is dtype
    assert ParamDefaults(reduce_dtype=alias).reduce_dtype is dtype


def test_legacy_compute_dtype_maps_to_defaults_param_dtype():
    assert resolve_param_policy(None, torch.bfloat16) == ParamPolicy(
        defaults=ParamDefaults(param_dtype=torch.bfloat16)
    )


def test_policies_are_immutable():
    policy = resolve_param_policy(None, torch.bfloat16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.defaults.param_dtype = torch.float32


# --- messages -------------------------------------------------------------------------------


def test_both_compute_dtype_and_param_policy_is_an_error_that_names_the_one_to_keep():
    with pytest.raises(ValueError) as error:
        resolve_param_policy({"defaults": {"param_dtype": "bf16"}}, torch.float16)
    message = str(error.value)
    assert "got both compute_dtype=torch.float16 and param_policy={'defaults':" in message
    assert "compute_dtype is the legacy spelling of param_policy.defaults.param_dtype" in message
    assert "Pass only param_policy and set its defaults.param_dtype" in message
    assert "param_policy={'defaults': {'param_dtype': torch.bfloat16}}" in message


def test_unknown_top_level_key_is_named_with_the_accepted_keys():
    with pytest.raises(ValueError) as error:
        resolve_param_policy({"default": {"param_dtype": "bf16"}}, None)
    message = str(error.value)
    assert "param_policy: unknown key 'default' in {'default': {'param_dtype': 'bf16'}}" in message
    assert "accepted keys: 'defaults'" in message


def test_unknown_defaults_key_is_named_with_the_accepted_keys():
    with pytest.raises(ValueError) as error:
        resolve_param_policy({"defaults": {"compute_dtype": "bf16"}}, None)
    message = str(error.value)
    assert "param_policy['defaults']: unknown key 'compute_dtype'" in message
    assert "accepted keys: 'param_dtype', 'reduce_dtype'" in message


def test_integer_dtype_is_rejected_with_the_accepted_dtypes():
    with pytest.raises(ValueError) as error:
        resolve_param_policy({"defaults": {"param_dtype": torch.int64}}, None)
    message = str(error.value)
    assert (
        "param_policy['defaults']['param_dtype']=torch.int64 is not a floating-point compute "
        "dtype" in message
    )
    assert "use torch.bfloat16, torch.float16, torch.float32, torch.float64" in message
    assert "'bf16'" in message


def test_unknown_dtype_name_is_rejected_with_the_known_names():
    with pytest.raises(ValueError) as error:
        resolve_param_policy(None, "bf8")
    message = str(error.value)
    assert "compute_dtype='bf8' is not a known dtype name" in message
    assert "'bf16', 'bfloat16', 'fp16', 'float16', 'fp32', 'float32'" in message


def test_dtype_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError) as error:
        resolve_param_policy({"defaults": {"reduce_dtype": 16}}, None)
    message = str(error.value)
    assert (
        "param_policy['defaults']['reduce_dtype'] must be a torch.dtype, a dtype name or None, "
        "got int 16" in message
    )


def test_policy_of_the_wrong_type_is_a_type_error_with_an_example():
    with pytest.raises(TypeError) as error:
        resolve_param_policy(["bf16"], None)
    message = str(error.value)
    assert "param_policy must be None, a dmuon.ParamPolicy or a dict, got list ['bf16']" in message
    assert "param_policy={'defaults': {'param_dtype': torch.bfloat16}}" in message


def test_defaults_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError) as error:
        resolve_param_policy({"defaults": "bf16"}, None)
    assert (
        "param_policy['defaults'] must be a dict or a dmuon.ParamDefaults, got str 'bf16'"
        in str(error.value)
    )


def test_dataclasses_validate_when_built_directly():
    with pytest.raises(ValueError, match=r"ParamDefaults.param_dtype=torch.int32 is not a"):
        ParamDefaults(param_dtype=torch.int32)
    with pytest.raises(TypeError) as error:
        ParamPolicy(defaults={"param_dtype": "bf16"})
    assert "ParamPolicy.defaults must be a ParamDefaults, got dict" in str(error.value)
    assert "ParamPolicy(defaults=ParamDefaults(param_dtype=torch.bfloat16))" in str(error.value)
