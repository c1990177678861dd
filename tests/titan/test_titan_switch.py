"""The dmuon-titan switch itself, in one process: which parameters it gives Muon, the settings it
changes, and every setting it refuses, with the fix in the message."""

# First: its import-time workarounds must precede torchtitan's own import (see its docstring).
import tests.titan.titan_on_cpu as titan_on_cpu

# isort: split
import importlib.util

import pytest
import torch
from torchtitan.components.optimizer import ParamGroupConfig, default_adamw
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.models.llama3 import config_registry as llama3_registry

import dmuon_titan
from dmuon.inspect import canonical_fqn
from dmuon_titan.optimizer import adamw_route
from dmuon_titan.parallelize import check_supported
from dmuon_titan.recipe import read_recipe


def test_the_default_muon_parameters_are_the_blocks_matrices_not_norms_embeddings_or_head():
    spec = llama3_registry.llama3_debugmodel().model_spec
    titan_on_cpu.small_model(spec, layers=2)
    with torch.device("meta"):
        model = spec.model.build()
    config = dmuon_titan.DMuonConfig()
    muon = sorted(n for n, p in model.named_parameters() if config.is_muon(canonical_fqn(n), p))
    per_block = [
        "attention.qkv_linear.wqkv.weight",
        "attention.wo.weight",
        "feed_forward.w1.weight",
        "feed_forward.w2.weight",
        "feed_forward.w3.weight",
    ]
    assert muon == sorted(f"layers.{i}.{name}" for i in range(2) for name in per_block)


def test_the_command_line_switch_runs_torchtitans_own_job_with_dmuon_options():
    config = ConfigManager().parse_args(
        ["--module", "dmuon_titan", "--config", "llama3_debugmodel", "--dmuon.lr", "0.01"]
    )
    stock = llama3_registry.llama3_debugmodel()
    assert isinstance(config, dmuon_titan.DMuonTrainer.Config)
    assert config.dmuon.lr == 0.01
    assert config.training.steps == stock.training.steps  # the job as torchtitan defines it
    # The two settings the switch changes (module docstring of dmuon_titan.trainer).
    assert config.parallelism.spmd_backend == "partial_dtensor"
    assert config.training.disable_cuda_graphs


def test_the_update_rule_options_reach_the_config_from_the_command_line():
    config = ConfigManager().parse_args(
        ["--module", "dmuon_titan", "--config", "llama3_debugmodel", "--dmuon.normuon",
         "--dmuon.momentum_dtype", "bfloat16"]
    )  # fmt: skip
    assert config.dmuon.normuon is True
    assert config.dmuon.momentum_dtype == "bfloat16"


def test_an_unknown_config_name_lists_torchtitans_own_configs():
    with pytest.raises(ValueError, match=r"'llama9_debugmodel' not found.*'llama3_debugmodel'"):
        ConfigManager().parse_args(["--module", "dmuon_titan", "--config", "llama9_debugmodel"])


def test_the_adamw_route_keeps_the_jobs_adamw_settings():
    config = dmuon_titan.DMuonConfig()
    job = default_adamw(lr=3e-4, weight_decay=0.05).param_groups
    adamw, groups = adamw_route(job, config)
    assert adamw == {
        "adamw_lr": 3e-4,
        "adamw_betas": (0.9, 0.95),
        "adamw_eps": 1e-8,
        "adamw_weight_decay": 0.05,
    }
    assert groups == []
    # A group before the catch-all applies to what it matches off the Muon route; dmuon.adamw_*
    # wins over the job's value.
    specific = ParamGroupConfig(
        pattern=r"\.bias$", optimizer_name="AdamW", optimizer_kwargs={"weight_decay": 0.0}
    )
    adamw, (group,) = adamw_route([specific, *job], dmuon_titan.DMuonConfig(adamw_lr=1e-3))
    assert adamw["adamw_lr"] == 1e-3 and group["weight_decay"] == 0.0
    assert group["params"]("layers.0.ffn_norm.bias", torch.empty(4))
    assert not group["params"]("layers.0.attention.wo.weight", torch.empty(4, 4))


def test_an_optimizer_other_than_adamw_in_the_job_is_refused_with_the_fix():
    job = [ParamGroupConfig(pattern=".*", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-3})]
    with pytest.raises(ValueError, match=r"asks for \['Adam'\].*Use AdamW for those groups"):
        adamw_route(job, dmuon_titan.DMuonConfig())


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        (
            {"dp_shard": 2, "ep": 1, "spmd_backend": "full_dtensor"},
            r"needs parallelism.spmd_backend='partial_dtensor', got 'full_dtensor'.*"
            r"--parallelism.spmd_backend partial_dtensor",
        ),
        (
            {"dp_shard": 2, "ep": 2, "spmd_backend": "full_dtensor"},
            r"needs parallelism.spmd_backend='partial_dtensor', got 'full_dtensor'",
        ),
        (
            {"dp_shard": 2, "ep": 2, "tp": 2, "spmd_backend": "partial_dtensor"},
            r"expert parallelism \(parallelism.expert_parallel_degree=2\) only without tensor "
            r"parallelism, got parallelism.tensor_parallel_degree=2. torchtitan has no expert "
            r"tensor parallelism.*\(efsdp = dp_shard x cp x tp / ep = 2\).*"
            r"--parallelism.tensor_parallel_degree 1 \(EP with FSDP\).*"
            r"--parallelism.expert_parallel_degree 1 instead, TP shards the expert stacks.*"
            r"--dmuon.adamw_params",
        ),
    ],
    ids=["full-dtensor", "full-dtensor-expert-parallel", "expert-and-tensor-parallel"],
)
def test_layouts_dmuon_does_not_dedicate_are_refused_with_the_fix(dims, message):
    sizes = {"dp_replicate": 1, "cp": 1, "tp": 1, "pp": 1, **dims}
    world = sizes["dp_replicate"] * sizes["cp"] * sizes["tp"] * sizes["pp"] * sizes["dp_shard"]
    parallel_dims = ParallelDims(**sizes, world_size=world)
    with pytest.raises(ValueError, match=message):
        check_supported(parallel_dims)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ns_coefficients": "newton"}, r"dmuon.ns_coefficients='newton' is not one of"),
        ({"ns_dtype": "float8"}, r"dmuon.ns_dtype='float8' is not one of"),
        ({"muon_params": "layers.(["}, r"dmuon.muon_params='layers.\(\[' is not a regular"),
        ({"momentum_dtype": "fp8"}, r"dmuon.momentum_dtype='fp8' is not one of \['float32', "),
    ],
)
def test_bad_dmuon_options_are_refused_naming_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        dmuon_titan.DMuonConfig(**options)


def test_a_distmuon_recipe_is_read_as_row_blocks_expert_stacks_and_owned_matrices():
    from tests.titan.scenarios_titan import distmuon_recipe

    recipe = read_recipe(distmuon_recipe())
    assert recipe.row_blocks == {
        f"layers.{i}.attention.qkv_linear.wqkv.weight": 128 for i in range(2)
    }
    assert recipe.owned == {
        f"layers.{i}.{name}"
        for i in range(2)
        for name in ("attention.wo.weight", "moe.router.gate.weight")
    }
    assert sorted(recipe.expert_layouts) == sorted(
        f"layers.{i}.moe.routed_experts.inner_experts.{w}"
        for i in range(2)
        for w in ("w1_EFD", "w2_EDF", "w3_EFD")
    )
    # torch.optim.Muon's hyperparameter names, as dmuon.Muon's.
    assert dict(recipe.hyperparameters) == {
        "lr": 0.01, "weight_decay": 0.1, "adjust_lr": "match_rms_adamw"
    }  # fmt: skip
    # The recipe's group is the Muon route, not an AdamW group the switch would refuse.
    adamw, groups = adamw_route(distmuon_recipe().param_groups, dmuon_titan.DMuonConfig(), recipe)
    assert adamw["adamw_lr"] == 3e-4 and groups == []
    assert read_recipe(llama3_registry.llama3_debugmodel().optimizer) is None


def test_a_compute_layout_dmuon_does_not_read_is_refused_naming_the_matrix():
    from torch.distributed.tensor import Shard
    from torchtitan.distributed.flex_shard import ComputeLayout

    from tests.titan.scenarios_titan import distmuon_recipe

    config = distmuon_recipe()
    layouts = config.optimizer_factory_kwargs_by_name["DistMuon"]["compute_sharding_by_fqn"]
    layouts["layers.0.attention.wo.weight"] = ComputeLayout(
        shardings_by_mesh_axis={"dp_shard": Shard(1)}
    )
    with pytest.raises(ValueError, match=r"layout of layers.0.attention.wo.weight on 'dp_shard' is"
                       r" Shard\(dim=1\); dmuon reads Owned\(\)"):  # fmt: skip
        read_recipe(config)


def test_a_config_whose_registry_does_not_import_names_the_missing_module():
    # kimi_k2_7's registry (the Muon recipes) imports torchvision for its image data; torchtitan's
    # lookup would call the config unknown and list the others.
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: kimi_k2_7's registry imports here")
    with pytest.raises(ImportError, match=r"'kimi_k2_5_debugmodel' is in torchtitan.models."
                       r"kimi_k2_7.config_registry, which does not import here .*torchvision"):  # fmt: skip
        ConfigManager().parse_args(["--module", "dmuon_titan", "--config", "kimi_k2_5_debugmodel"])
