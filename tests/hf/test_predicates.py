"""dmuon_hf.default_predicate selects exactly the block projection matrices of each architecture."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from torch import nn

import dmuon
from dmuon_hf import PREDICATES, default_predicate
from tests.hf.tiny_models import (
    FAMILIES,
    selected_names,
    tiny_gemma3_vlm,
    tiny_gpt2,
    tiny_llama,
    tiny_mistral,
    tiny_qwen2,
    tiny_qwen3,
    tiny_vit,
)

LLAMA_FAMILY_PROJECTIONS = [
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
]  # fmt: skip


def expected(prefix: str, projections: list[str], layers: int = 2) -> set[str]:
    return {f"{prefix}.{i}.{p}.weight" for i in range(layers) for p in projections}


@pytest.mark.parametrize("build", [tiny_llama, tiny_mistral, tiny_qwen2, tiny_qwen3])
def test_llama_family_selects_the_seven_projections_of_every_layer(build):
    model = build()
    assert selected_names(model, default_predicate(model)) == expected(
        "model.layers", LLAMA_FAMILY_PROJECTIONS
    )


def test_qwen2_attention_biases_and_qwen3_qk_norms_are_not_selected():
    for model in (tiny_qwen2(), tiny_qwen3()):
        chosen = selected_names(model, default_predicate(model))
        assert not any(name.endswith(".bias") or "_norm" in name for name in chosen)


def test_gpt2_selects_its_conv1d_matrices_and_not_embeddings_or_norms():
    model = tiny_gpt2()
    chosen = selected_names(model, default_predicate(model))
    assert chosen == expected(
        "transformer.h", ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    )
    # Conv1D keeps (in, out) weights: c_fc is (hidden, 4 * hidden), still 2-D.
    assert model.get_parameter("transformer.h.0.mlp.c_fc.weight").shape == (32, 128)


def test_vit_selects_block_projections_and_not_patch_embedding_or_classifier():
    model = tiny_vit()
    chosen = selected_names(model, default_predicate(model))
    assert chosen == expected(
        "vit.layers",
        ["attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj",
         "mlp.fc1", "mlp.fc2"],
    )  # fmt: skip


def test_vit_predicate_also_matches_the_encoder_layer_names_of_transformers_4():
    predicate = PREDICATES["vit"]
    matrix, vector = torch.empty(4, 4), torch.empty(4)
    block = "vit.encoder.layer.3"
    for suffix in (
        "attention.attention.query", "attention.attention.key", "attention.attention.value",
        "attention.output.dense", "intermediate.dense", "output.dense",
    ):  # fmt: skip
        assert predicate(f"{block}.{suffix}.weight", matrix)
        assert not predicate(f"{block}.{suffix}.bias", vector)
    assert not predicate("vit.pooler.dense.weight", matrix)
    assert not predicate("classifier.weight", matrix)
    assert not predicate(
        "vit.embeddings.patch_embeddings.projection.weight", torch.empty(4, 3, 2, 2)
    )


def test_bare_backbone_names_without_task_prefix_are_selected():
    backbone = tiny_llama().model  # LlamaModel: "layers.0...." with no "model." prefix
    assert selected_names(backbone, default_predicate(backbone)) == expected(
        "layers", LLAMA_FAMILY_PROJECTIONS
    )


SUPPORTED = ["deepseek_v3", "gemma", "gemma2", "gemma3", "gemma3_text", "gpt2", "granite", "llama",
             "mistral", "mixtral", "olmo2", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
             "vit"]  # fmt: skip


def block_matrices(model: nn.Module) -> set[str]:
    """The oracle, from the model's modules rather than its names: inside a ``layers.N`` block,
    the weight of every ``nn.Linear`` that is not a router (``gate``) or a shared-expert gate, and
    every 3-D parameter (an (E, m, n) expert stack)."""
    chosen = set()
    for module_name, module in model.named_modules():
        if re.search(r"(?:^|\.)layers\.\d+\.", module_name + ".") is None:
            continue
        own_name = module_name.rpartition(".")[2]
        if isinstance(module, nn.Linear) and own_name not in ("gate", "shared_expert_gate"):
            chosen.add(f"{module_name}.weight")
        for param_name, param in module.named_parameters(recurse=False):
            if param.ndim == 3:
                chosen.add(f"{module_name}.{param_name}")
    return chosen


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_selects_every_block_matrix_and_expert_stack_and_nothing_else(family):
    model = FAMILIES[family]()
    assert model.config.model_type == family
    chosen = selected_names(model, default_predicate(model))
    assert chosen == block_matrices(model)
    assert not any(
        name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "norm.weight", ".bias"))
        for name in chosen
    )


@pytest.mark.parametrize(
    ("family", "per_layer"),
    [("mixtral", 6), ("qwen3_moe", 6), ("qwen2_moe", 9), ("phi3", 4)],
)
def test_moe_and_fused_families_select_the_expected_number_of_matrices_per_layer(family, per_layer):
    model = FAMILIES[family]()
    assert len(selected_names(model, default_predicate(model))) == 2 * per_layer


def test_deepseek_v3_takes_the_latent_attention_the_dense_mlp_and_the_experts_not_the_router():
    model = FAMILIES["deepseek_v3"]()
    chosen = selected_names(model, default_predicate(model))
    attention = {f"model.layers.{i}.self_attn.{p}.weight" for i in (0, 1)
                 for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}  # fmt: skip
    dense = {f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    moe = {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"} | {
        f"model.layers.1.mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")
    }
    assert chosen == attention | dense | moe
    assert "model.layers.1.mlp.gate.weight" not in chosen  # the router


def test_gemma3_with_its_vision_tower_selects_both_stacks_of_blocks_and_not_the_projector():
    model = tiny_gemma3_vlm()
    chosen = selected_names(model, default_predicate(model))
    assert chosen == block_matrices(model)
    assert sum(name.startswith("model.vision_tower.encoder.layers.0.") for name in chosen) == 6
    assert sum(name.startswith("model.language_model.layers.0.") for name in chosen) == 7
    assert not any("multi_modal_projector" in name or ".head." in name for name in chosen)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_dedicate_params_takes_the_default_predicates_stacks_as_expert_stacks(family):
    model = FAMILIES[family]()
    dmuon.dedicate_params(model, None, default_predicate(model))
    stacks = {name for name, p in FAMILIES[family]().named_parameters() if p.ndim == 3}
    assert set(dmuon.inspect.view(model).expert_stacks) == stacks


def test_predicates_mapping_lists_the_supported_model_types_and_is_read_only():
    assert sorted(PREDICATES) == SUPPORTED
    with pytest.raises(TypeError):
        PREDICATES["bert"] = PREDICATES["llama"]  # type: ignore[index]


def test_unsupported_model_type_raises_with_the_supported_list_and_a_custom_predicate():
    model = tiny_llama()
    model.config.model_type = "bert"
    with pytest.raises(ValueError) as error:
        default_predicate(model)
    message = str(error.value)
    assert "no default predicate for LlamaForCausalLM with model_type 'bert'" in message
    assert f"Supported model types: {', '.join(SUPPORTED)}." in message
    assert "dmuon.dedicate_params(model, mesh, predicate=lambda name, p: name.endswith((" in message


def test_plain_module_without_config_raises_naming_the_missing_model_type():
    with pytest.raises(ValueError, match=r"Linear with no config.model_type"):
        default_predicate(nn.Linear(2, 2))


def test_dedicate_params_with_the_default_predicate_dedicates_exactly_the_projections():
    model = tiny_llama()
    owners = dmuon.dedicate_params(model, None, default_predicate(model))
    assert set(owners) == expected("model.layers", LLAMA_FAMILY_PROJECTIONS)


def unknown_type(family: str):
    """A supported MoE model presented under a model type default_predicate does not know, as a
    new MoE architecture would be: the error's suggested predicate is what is left to test."""

    def build():
        model = FAMILIES[family]()
        model.config.model_type = f"new_{family}"
        return model

    return build


tiny_mixtral = unknown_type("mixtral")
tiny_qwen2_moe = unknown_type("qwen2_moe")


def tiny_t5():
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8
    )
    return transformers.T5ForConditionalGeneration(config)


def suggested_predicate(model):
    """The predicate the error message of ``default_predicate(model)`` suggests, as code."""
    with pytest.raises(ValueError) as error:
        default_predicate(model)
    match = re.search(r"predicate=(lambda name, p: .*)\)\n", str(error.value))
    assert match is not None, str(error.value)
    return eval(match.group(1), {})  # the message's own code, run as a user would paste it


ATTENTION = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight"]  # fmt: skip
EXPERT_STACKS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def in_layers(modules: list[str], layers: int = 2) -> set[str]:
    return {f"model.layers.{i}.{m}" for i in range(layers) for m in modules}


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (tiny_mixtral, in_layers(ATTENTION + EXPERT_STACKS)),
        (
            tiny_qwen2_moe,
            in_layers(
                ATTENTION + EXPERT_STACKS
                + [f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
            ),
        ),
    ],
    ids=["mixtral", "qwen2_moe"],
)  # fmt: skip
def test_the_suggested_moe_predicate_takes_the_expert_stacks_and_leaves_routers_and_gates(
    build, expected
):
    model = build()
    predicate = suggested_predicate(model)
    chosen = selected_names(model, predicate)
    assert chosen == expected
    assert not any(
        name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) for name in chosen
    )


def test_dmuon_dedicates_the_suggested_mixtral_predicates_stacks_as_expert_stacks():
    model = tiny_mixtral()
    dmuon.dedicate_params(model, None, suggested_predicate(model))
    assert set(dmuon.inspect.view(model).expert_stacks) == in_layers(EXPERT_STACKS)


def test_the_suggested_t5_predicate_takes_the_linear_projections_and_not_the_position_bias():
    model = tiny_t5()
    chosen = selected_names(model, suggested_predicate(model))
    linear_weights = {
        f"{module_name}.weight"
        for module_name, module in model.named_modules()
        if isinstance(module, nn.Linear) and ".block." in module_name
    }
    assert chosen == linear_weights
    assert len(chosen) == 2 * 6 + 2 * 10  # encoder: q, k, v, o, wi, wo; decoder: + cross q/k/v/o
    assert not any("relative_attention_bias" in name for name in chosen)
