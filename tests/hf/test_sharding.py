"""dmuon_hf.sharding picks the FSDP2 units Accelerate's FSDP2 auto-wrap policy picks (its
``fsdp2_prepare_auto_wrap_policy`` is the oracle), and refuses what it cannot apply."""

from __future__ import annotations

import pytest
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import (
    fsdp2_prepare_auto_wrap_policy,
    get_module_children_bottom_up,
)

from dmuon_hf.sharding import ShardingRequest, _units
from tests.hf.tiny_models import FAMILIES, tiny_gemma3_vlm, tiny_gpt2, tiny_llama


def accelerates_units(model, plugin_args: dict) -> list:
    """What Accelerate's FSDP2 prepare shards before the root (its plugin set up as there)."""
    if plugin_args.get("auto_wrap_policy") == "TRANSFORMER_BASED_WRAP":
        # Accelerate raises for a _no_split_modules class the model lacks (Gemma 3's vision-only
        # tower has no SiglipTextEmbeddings); dmuon_hf skips it. Compare on the present ones.
        present = {type(module).__name__ for module in model.modules()}
        named = [name for name in model._no_split_modules if name in present]
        plugin_args = {**plugin_args, "transformer_cls_names_to_wrap": named}
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **plugin_args)
    plugin.set_auto_wrap_policy(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is None:
        return []
    return [module for module in get_module_children_bottom_up(model)[:-1] if policy(module)]


def names(model, modules) -> list[str]:
    by_module = {module: name for name, module in model.named_modules()}
    return [by_module[module] for module in modules]


@pytest.mark.parametrize(
    "build",
    [tiny_llama, tiny_gpt2, tiny_gemma3_vlm, FAMILIES["qwen3_moe"], FAMILIES["deepseek_v3"]],
    ids=["llama", "gpt2", "gemma3_vlm", "qwen3_moe", "deepseek_v3"],
)
@pytest.mark.parametrize(
    "plugin_args",
    [
        {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},  # TrainingArguments' default
        {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 3000},
        {"auto_wrap_policy": "SIZE_BASED_WRAP"},  # no size: no units
        {},  # the plugin's own default: NO_WRAP
    ],
    ids=["no_split_modules", "size_based", "size_based_without_size", "plugin_default"],
)
def test_the_units_are_accelerates_and_children_come_before_parents(build, plugin_args):
    model = build()
    ours = _units(model, FullyShardedDataParallelPlugin(fsdp_version=2, **plugin_args))
    theirs = accelerates_units(model, plugin_args)
    assert sorted(names(model, ours)) == sorted(names(model, theirs))
    if plugin_args.get("auto_wrap_policy") == "TRANSFORMER_BASED_WRAP":
        assert ours and all(type(unit).__name__ in model._no_split_modules for unit in ours)
    for index, unit in enumerate(ours):  # fully_shard needs a child before its parent
        assert not any(later in set(unit.modules()) for later in ours[index + 1 :])


def test_named_layer_classes_are_used_and_an_unknown_one_is_refused():
    model = tiny_llama()
    wrap = dict(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    plugin = FullyShardedDataParallelPlugin(**wrap, transformer_cls_names_to_wrap=["LlamaMLP"])
    assert names(model, _units(model, plugin)) == ["model.layers.1.mlp", "model.layers.0.mlp"]
    plugin = FullyShardedDataParallelPlugin(
        **wrap, transformer_cls_names_to_wrap=["MistralDecoderLayer"]
    )
    with pytest.raises(ValueError) as error:
        _units(model, plugin)
    assert str(error.value) == (
        "dmuon_hf: transformer_layer_cls_to_wrap names ['MistralDecoderLayer'], which "
        "LlamaForCausalLM does not contain. Name its block classes (e.g. ['LlamaDecoderLayer']) "
        "or leave it unset."
    )


def test_hsdp_sizes_other_than_data_parallel_are_refused():
    from accelerate import ParallelismConfig

    request = ShardingRequest(
        plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
        parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2),
    )
    with pytest.raises(ValueError, match="dmuon_hf builds data-parallel meshes only"):
        request.check()
