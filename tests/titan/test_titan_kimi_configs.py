"""torchtitan's own Muon jobs, as its ``kimi_k2_7`` registry writes them
(``torchtitan/models/kimi_k2_7/config_registry.py``: ``kimi_k2_5_debugmodel``, and
``moonlight_16b_a3b`` at debug size), run with dmuon-titan: the per-matrix semantics dmuon reads
from each config's own DistMuon group and compute layouts are the ones those layouts state, and
4 gloo ranks at EP 2 train like the single-process reference written from the same recipe, and
resume from torchtitan's checkpoint at step 3 repeating steps 4-6 bit for bit.

The registry imports ``torchvision`` (its image data, at module level), so these tests are
skipped where torchvision is not installed beside torch: the hatch env's CPU torch 2.13 has no
torchvision wheel. They run in an env with torch 2.14.1 and torchvision 0.29.1 (the dmuon-titan
README says how); ``benchmarks/results/titan-kimi-configs-cpu-2026-12-06.log`` is such a run.
Like the recipe tests, the jobs run at ``titan_on_cpu``'s size (two blocks: one dense, one MoE of
4 small experts, the routers' load balancing off for the reference), on the counting data.
"""

from __future__ import annotations

# First: its import-time workarounds must precede torchtitan's own import (see its docstring).
import tests.titan.titan_on_cpu  # noqa: F401

# isort: split
import pytest
import torch

import dmuon_titan
from dmuon_titan.optimizer import adamw_route, muon_options
from dmuon_titan.recipe import read_recipe
from tests.titan.scenarios_titan import (
    EXPERT_PROJECTIONS,
    LAYERS,
    MODELS,
    kimi_registry_missing,
    train,
    train_reference,
)
from tests.titan.test_titan_expert_parallel import (
    assert_experts_owned_inside_their_ep_slot,
    assert_resumed_repeats,
)
from tests.titan.test_titan_training import BF16_UPDATE_TOLERANCE, assert_like_reference

pytestmark = pytest.mark.skipif(
    kimi_registry_missing() is not None,
    reason=f"{kimi_registry_missing()} (install torchvision matching torch to run these)",
)

# Each job: (the registry's name, its DistMuon group's lr; both groups' weight decay is 0.1).
KIMI_JOBS = {"kimi_k2_5": 8e-4, "moonlight": 3e-4}


def expected_cuts(model) -> dict[str, tuple[str, int | None]]:
    """What the kimi_k2_7 recipe's layouts say for each matrix of a built ``model``, written
    from the model itself: per query head (the MLA query projection, ``wq`` or ``wq_b``: blocks
    of qk_nope + qk_rope rows) and per key/value head (``wkv_b``: qk_nope + v rows), owned
    (``wq_a``, ``wkv_a``, ``wo``, the dense block's MLP, the router gate, the shared experts),
    per expert (the routed experts' (E, m, n) stacks). Name -> (cut, rows per block)."""
    cuts: dict[str, tuple[str, int | None]] = {}
    for name, module in model.named_modules():
        if hasattr(module, "wkv_b") and hasattr(module, "inner_attention"):
            query = "wq_b" if getattr(module, "wq_b", None) is not None else "wq"
            query_rows = module.qk_nope_head_dim + module.qk_rope_head_dim
            cuts[f"{name}.{query}.weight"] = ("row_blocks", query_rows)
            cuts[f"{name}.wkv_b.weight"] = (
                "row_blocks",
                module.qk_nope_head_dim + module.v_head_dim,
            )
            for owned in ("wq_a", "wkv_a", "wo"):
                if getattr(module, owned, None) is not None:
                    cuts[f"{name}.{owned}.weight"] = ("owned", None)
        if name.endswith(("feed_forward", "shared_experts")) and name.startswith("layers."):
            for projection in ("w1", "w2", "w3"):
                cuts[f"{name}.{projection}.weight"] = ("owned", None)
        if name.endswith("moe.router.gate"):
            cuts[f"{name}.weight"] = ("owned", None)
        if name.endswith("routed_experts.inner_experts"):
            for projection in EXPERT_PROJECTIONS:
                cuts[f"{name}.{projection}"] = ("expert_stack", None)
    return cuts


@pytest.mark.parametrize("job", list(KIMI_JOBS))
def test_the_kimi_configs_own_recipe_gives_each_matrix_the_cut_its_compute_layout_states(job):
    config = MODELS[job]()
    recipe = read_recipe(config.optimizer)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    params = dict(model.named_parameters())
    expected = expected_cuts(model)
    # The whole model (all its blocks; Kimi K2.5's vision tower too): the Muon matrices are the
    # recipe's, each cut as its layout says; embeddings, norms, the head and the vision tower
    # stay on AdamW.
    assert {name for name, param in params.items() if recipe.is_muon(name, param)} == set(expected)
    heads = config.model_spec.model.layers[0].attention.n_heads
    for name, (cut, rows) in expected.items():
        param = params[name]
        if cut == "row_blocks":
            assert recipe.rows_per_block(name) == rows, name
            assert param.shape[0] == heads * rows, name  # one block per head
        else:
            assert recipe.rows_per_block(name) is None, name
        assert (name in recipe.owned) == (cut == "owned"), name
        assert recipe.is_expert_stack(name, param) == (cut == "expert_stack"), name
    experts = config.model_spec.model.layers[-1].moe.router.num_experts
    stacks = [name for name, (cut, _) in expected.items() if cut == "expert_stack"]
    assert stacks and all(params[name].shape[0] == experts for name in stacks)
    assert any(name.endswith("moe.router.gate.weight") for name in expected)
    assert any(".shared_experts." in name for name in expected)
    # The Muon route's hyperparameters are the recipe's, over dmuon's own defaults; the AdamW
    # route's, its catch-all group's.
    muon = muon_options(dmuon_titan.DMuonConfig(), recipe)
    assert (muon.lr, muon.weight_decay, muon.adjust_lr) == (
        KIMI_JOBS[job],
        0.1,
        "match_rms_adamw",
    )
    adamw, groups = adamw_route(config.optimizer.param_groups, dmuon_titan.DMuonConfig(), recipe)
    assert groups == []
    lr = KIMI_JOBS[job]
    assert adamw == {
        "adamw_lr": lr,
        "adamw_betas": (0.9, 0.95),
        "adamw_eps": 1e-8,
        "adamw_weight_decay": 0.1,
    }


def test_module_dmuon_titan_finds_the_kimi_configs_by_name_with_their_recipe():
    # What --module dmuon_titan --config <name> builds: the registry's job, dmuon switched on.
    from dmuon_titan import config_registry

    for name in ("kimi_k2_5_debugmodel", "moonlight_16b_a3b"):
        assert name in dir(config_registry)
        config = getattr(config_registry, name)()
        assert isinstance(config, dmuon_titan.DMuonTrainer.Config)
        assert read_recipe(config.optimizer).pattern == config.optimizer.param_groups[0].pattern


# 4 ranks, EP 2 of dp_shard 4 (efsdp 2); 256 tokens a step, as the EP tests'.
EP_JOB = {"ns": "fp32", "ep": 2, "dp_shard": 4, "seq_len": 64, "local_batch": 1}
# Per run, at two blocks: block 0's attention (wq, wkv_a, wkv_b, wo) and dense MLP; block 1's
# attention, router gate, shared experts and three expert stacks.
DEDICATED = (4 + 3) + (4 + 1 + 3 + 3)


@pytest.mark.parametrize("job", list(KIMI_JOBS))
def test_the_kimi_configs_on_4_ranks_at_ep_2_train_like_the_reference_from_their_recipe(pool4, job):
    run = pool4.run(train, job_options={**EP_JOB, "model": job})[0]
    assert len(run["dedicated"]) == DEDICATED
    assert_experts_owned_inside_their_ep_slot(run, job)
    settings = run["optimizer"]
    assert settings["muon"]["lr"] == KIMI_JOBS[job]
    # The recipe names every block of the registry's model; these two's row blocks, per head:
    blocks = {k: v for k, v in settings["row_blocks"].items() if k in run["dedicated"]}
    assert blocks == {
        f"layers.{layer}.attention.{name}.weight": rows
        for layer in range(LAYERS)
        for name, rows in (("wq", 128 + 64), ("wkv_b", 128 + 128))
    }
    reference = train_reference(run)
    assert_like_reference(
        run, reference, weights=1e-2, losses=1e-3, matrix_updates=BF16_UPDATE_TOLERANCE
    )


SAVING = {**EP_JOB, "model": "kimi_k2_5", "steps": 6, "checkpoint_folder": "ckpt"}


def test_kimi_k2_5s_debug_job_at_ep_2_resumed_at_step_3_repeats_steps_4_to_6(pool4, tmp_path):
    root = str(tmp_path)
    run = pool4.run(train, job_options={**SAVING, "checkpoint_interval": 3}, checkpoint_root=root)[
        0
    ]
    resumed = pool4.run(train, job_options={**SAVING, "load_step": 3}, checkpoint_root=root)[0]
    assert_resumed_repeats(resumed, run, load_step=3)
