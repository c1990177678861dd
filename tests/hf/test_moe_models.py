"""HuggingFace mixture-of-experts models: transformers 5 keeps Qwen3-MoE's experts as fused
(E, m, n) tensors (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``); dmuon dedicates
them as E matrices each and trains like the per-expert reference, in one process and on 2 gloo
ranks with FSDP2."""

from __future__ import annotations

import torch

from dmuon_hf import default_predicate
from tests.hf import scenarios_moe_hf as scenarios
from tests.hf.tiny_models import selected_names

# fp32 Newton-Schulz: what is left is the order of float additions.
FP32_TOLERANCE = 1e-5


def assert_matches_reference(result):
    assert result["stacks"] == result["expected_stacks"]
    assert len(result["stacks"]) == 4  # two fused stacks in each of the two layers
    worst = max(result["max_errors"])
    assert worst < FP32_TOLERANCE, f"max relative error {worst:.3e}"


def test_default_predicate_selects_what_a_user_writes_by_hand_for_qwen3_moe():
    model = scenarios.tiny_qwen3_moe()
    by_hand = selected_names(model, scenarios.predicate)
    assert selected_names(model, default_predicate(model)) == by_hand
    assert sum(name.endswith(("gate_up_proj", "experts.down_proj")) for name in by_hand) == 4


def test_qwen3_moe_expert_stacks_train_like_the_per_expert_reference_in_one_process():
    assert_matches_reference(scenarios.train_against_reference())


def test_qwen3_moe_expert_stacks_train_like_the_per_expert_reference_on_two_ranks(pool2):
    for result in pool2.run(scenarios.train_against_reference):
        assert_matches_reference(result)


def test_full_weights_load_the_expert_stacks_transformers_saves_one_tensor_per_expert(tmp_path):
    result = scenarios.full_weights_round_trip(str(tmp_path))
    assert result["loaded"].keys() == result["saved"].keys()
    assert any(key.endswith("experts.gate_up_proj") for key in result["saved"])
    for key, value in result["saved"].items():
        assert torch.equal(result["loaded"][key], value), key
