"""``dmuon_tools.model_shapes``: the matrices read from a config are exactly the ones the
``transformers`` model built from that config has, and layouts it cannot model are refused."""

from __future__ import annotations

import json
import math

import pytest
import transformers

from dmuon_tools.model_shapes import PRESETS, load_decoder_shape
from dmuon_tools.planner import plan_report

_SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
)

# Tiny configs of every supported model_type, with the MoE layouts' dense/sparse mixes.
SUPPORTED_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_SIZES, num_hidden_layers=2),
    "mistral": lambda: transformers.MistralConfig(**_SIZES, num_hidden_layers=2),
    "qwen2": lambda: transformers.Qwen2Config(**_SIZES, num_hidden_layers=2),
    "qwen3": lambda: transformers.Qwen3Config(**_SIZES, num_hidden_layers=2, head_dim=16),
    "mixtral": lambda: transformers.MixtralConfig(
        **_SIZES, num_hidden_layers=2, num_local_experts=4
    ),
    # Layers 1 and 3 sparse (decoder_sparse_step=2), with a shared expert.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **_SIZES,
        num_hidden_layers=4,
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        decoder_sparse_step=2,
    ),
    # Layer 0 dense (mlp_only_layers), layers 1 and 2 sparse.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_SIZES,
        num_hidden_layers=3,
        num_experts=6,
        moe_intermediate_size=16,
        head_dim=8,
        mlp_only_layers=[0],
    ),
}


def dedicated_matrices(model) -> dict[str, tuple[int, ...]]:
    """What dmuon would dedicate: the blocks' projection weights and 3-D expert stacks (never
    the routers ``mlp.gate``, the (1, H) ``shared_expert_gate``, norms or biases)."""
    return {
        name: tuple(param.shape)
        for name, param in model.named_parameters()
        if ".layers." in name
        and (param.ndim == 3 or (param.ndim == 2 and name.endswith("_proj.weight")))
    }


def saved_config(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("model_type", sorted(SUPPORTED_CONFIGS))
def test_a_saved_config_gives_exactly_the_matrices_of_the_model_built_from_it(tmp_path, model_type):
    config = SUPPORTED_CONFIGS[model_type]()
    assert config.model_type == model_type
    shape = load_decoder_shape(saved_config(tmp_path, config))
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert dict(shape.matrices()) == dedicated_matrices(model)
    assert list(dict(shape.matrices())) == list(dedicated_matrices(model))  # the same order


def test_mixtral_plans_each_expert_as_a_matrix_and_cuts_the_stacks_over_the_owners(tmp_path):
    config = SUPPORTED_CONFIGS["mixtral"]()
    report = plan_report(load_decoder_shape(saved_config(tmp_path, config)), 8)
    model = transformers.MixtralForCausalLM(config)
    matrices = dedicated_matrices(model)
    # 2 layers x (4 attention projections + 2 stacks of 4 experts each).
    assert report["model"]["num_matrices"] == 2 * (4 + 2 * 4)
    assert report["model"]["num_expert_stacks"] == 4
    assert report["model"]["numel"] == sum(math.prod(dims) for dims in matrices.values())
    assert {"shape": "96x32", "count": 8} in report["model"]["shapes"]  # gate_up: (2 x 48, 32)
    # Each 4-expert stack on 8 owners is cut into 4 one-expert slices.
    assert "4 expert stacks in 16 slices" in report["partition"]


def test_the_mixtral_preset_has_the_sizes_of_transformers_default_mixtral_config():
    # MixtralConfig's defaults are Mixtral-8x7B's published config.json.
    default = transformers.MixtralConfig()
    preset = PRESETS["mixtral-8x7b"]
    assert (preset.hidden_size, preset.intermediate_size, preset.num_hidden_layers) == (
        default.hidden_size, default.intermediate_size, default.num_hidden_layers,
    )  # fmt: skip
    assert (preset.num_attention_heads, preset.num_key_value_heads) == (
        default.num_attention_heads,
        default.num_key_value_heads,
    )
    assert preset.experts.num_experts == default.num_local_experts
    assert preset.experts.sparse_layers == tuple(range(default.num_hidden_layers))


def test_a_qwen3_config_without_head_dim_uses_qwen3s_default_of_128(tmp_path):
    config = {**_SIZES, "model_type": "qwen3", "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_decoder_shape(str(tmp_path))
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_SIZES, num_hidden_layers=1))
    assert shape.head_dim == 128
    assert dict(shape.matrices()) == dedicated_matrices(model)


@pytest.mark.parametrize(
    "config_class",
    [
        transformers.BertConfig,
        transformers.ViTConfig,
        transformers.DeepseekV3Config,
        transformers.Phi3Config,
        transformers.GPT2Config,
        transformers.T5Config,
    ],
    ids=lambda cls: cls.model_type,
)
def test_a_layout_it_does_not_model_is_refused_naming_the_type_and_the_supported_ones(
    tmp_path, config_class
):
    path = saved_config(tmp_path, config_class())
    with pytest.raises(ValueError) as error:
        load_decoder_shape(path)
    message = str(error.value)
    assert f"model_type {config_class.model_type!r} is not a layout dmuon-tools plan models" in (
        message
    )
    assert "(dense: llama, mistral, qwen2, qwen3; mixture-of-experts: mixtral, qwen2_moe, " in (
        message
    )
    assert "\n" not in message


def test_a_config_with_experts_but_no_model_type_is_refused(tmp_path):
    config = {**_SIZES, "num_hidden_layers": 2, "num_local_experts": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"has num_local_experts but no model_type, so its expert"):
        load_decoder_shape(str(tmp_path))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("num_experts", -1, "num_experts must be an integer >= 0 for model_type 'qwen2_moe', got -1"),
        ("moe_intermediate_size", None, "moe_intermediate_size must be a positive integer, got None"),
        ("decoder_sparse_step", 0, "decoder_sparse_step must be a positive integer, got 0"),
        ("mlp_only_layers", "0,1", "mlp_only_layers must be a list of layer indices, got '0,1'"),
    ],
)  # fmt: skip
def test_bad_expert_sizes_are_refused_with_the_value(tmp_path, key, value, message):
    config = SUPPORTED_CONFIGS["qwen2_moe"]().to_dict()
    config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        load_decoder_shape(str(tmp_path))
    assert message in str(error.value)


def test_a_saved_config_gives_its_vocabulary_and_whether_the_embedding_is_tied(tmp_path):
    config = transformers.Qwen2Config(**_SIZES, num_hidden_layers=1, tie_word_embeddings=True)
    shape = load_decoder_shape(saved_config(tmp_path, config))
    assert (shape.vocab_size, shape.tie_word_embeddings) == (64, True)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("vocab_size", 0, "vocab_size must be a positive integer, got 0"),
        ("tie_word_embeddings", "yes", "tie_word_embeddings must be true or false, got 'yes'"),
    ],
)
def test_a_bad_vocabulary_entry_is_refused_with_the_value(tmp_path, key, value, message):
    config = {**_SIZES, "model_type": "llama", "num_hidden_layers": 1, key: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_decoder_shape(str(tmp_path))


def test_every_preset_knows_its_vocabulary():
    assert all(shape.vocab_size for shape in PRESETS.values())
    assert PRESETS["llama3-8b"].vocab_size == 128256
    assert PRESETS["llama3.2-1b"].tie_word_embeddings
