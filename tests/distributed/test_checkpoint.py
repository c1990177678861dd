"""dmuon.checkpoint on gloo: save, resume on the same and on other layouts, export, and errors.

Resuming must continue training as if uninterrupted: bit-identical on the same layout (fp32
Newton-Schulz), and within FP32_TOLERANCE when the layout (and so the order of the gradient
reductions) changes. Weights are compared on the full state dict after the last step.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import dmuon.checkpoint as dckpt
from tests.distributed import scenarios_checkpoint as scenarios
from tests.distributed.models import TinyDecoder
from tests.distributed.pool import WorkerCrash

FP32_TOLERANCE = 1e-5

# (world size, replicas, tensor-parallel size): 1-D over 4 ranks, HSDP 2 x 2, dp 2 x tp 2, ...
LAYOUTS = {
    "1d-4": (4, 1, 1),
    "hsdp-2x2": (4, 2, 1),
    "1d-2": (2, 1, 1),
    "1d-3": (3, 1, 1),
    "1d-8": (8, 1, 1),
    "dp2-tp2": (4, 1, 2),
    "dp1-tp2": (2, 1, 2),
}


def max_relative_difference(weights, expected) -> float:
    assert weights.keys() == expected.keys()
    return max(
        ((weights[k] - expected[k]).norm() / expected[k].norm().clamp_min(1e-30)).item()
        for k in expected
    )


def run(gloo_pool, layout: str, scenario, **kwargs):
    world, replicas, tp = LAYOUTS[layout]
    return gloo_pool(world).run(scenario, replicas=replicas, tp=tp, **kwargs)[0]


@pytest.fixture(scope="module")
def checkpoints(gloo_pool, tmp_path_factory):
    """Per saving layout: the checkpoint after ``SAVE_AT`` steps, the uninterrupted run's final
    weights."""
    made = {}

    def checkpoint_of(layout: str):
        if layout not in made:
            path = str(tmp_path_factory.mktemp("checkpoints") / layout)
            result = run(gloo_pool, layout, scenarios.save_midway_and_finish, path=path)
            made[layout] = (path, result["weights"])
        return made[layout]

    return checkpoint_of


def test_resume_on_the_same_layout_is_bit_identical_to_the_uninterrupted_run(
    gloo_pool, checkpoints
):
    path, uninterrupted = checkpoints("1d-4")
    resumed = run(gloo_pool, "1d-4", scenarios.resume_and_finish, path=path)
    assert resumed["weights"].keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed["weights"][key], value), key


@pytest.mark.parametrize(
    ("saved_on", "resumed_on"),
    [
        ("1d-4", "1d-2"),
        ("1d-4", "hsdp-2x2"),
        ("hsdp-2x2", "1d-4"),
        ("1d-8", "1d-3"),
        ("dp2-tp2", "1d-4"),
        ("1d-4", "dp2-tp2"),
        ("dp2-tp2", "dp1-tp2"),
    ],
)
def test_resume_on_another_layout_continues_like_the_uninterrupted_run(
    gloo_pool, checkpoints, saved_on, resumed_on
):
    path, uninterrupted = checkpoints(saved_on)
    resumed = run(gloo_pool, resumed_on, scenarios.resume_and_finish, path=path)
    assert max_relative_difference(resumed["weights"], uninterrupted) < FP32_TOLERANCE


def test_resume_in_one_process_continues_like_the_uninterrupted_run(checkpoints):
    path, uninterrupted = checkpoints("1d-4")
    resumed = scenarios.resume_and_finish(path=path, replicas=0)
    assert max_relative_difference(resumed["weights"], uninterrupted) < FP32_TOLERANCE
    assert resumed["lrs"][0] == 0.02 and set(resumed["lrs"][1:]) == {1e-3}


@pytest.mark.parametrize("layout", ["1d-4", "hsdp-2x2", "dp2-tp2"])
def test_full_state_dict_has_the_keys_and_shapes_of_the_plain_model(gloo_pool, layout):
    result = run(gloo_pool, layout, scenarios.state_dict_shapes)
    plain = TinyDecoder().state_dict()
    assert result["full"] == {key: tuple(value.shape) for key, value in plain.items()}
    assert result["full_dtypes"] == {"torch.float32"}
    # Optimizer state keyed by FQN: Muon momentum for the projections, AdamW for the rest.
    optim = result["optim_full_keys"]
    assert optim["layers.0.q_proj.weight"] == ["momentum_buffer"]
    assert optim["embed.weight"] == ["exp_avg", "exp_avg_sq", "step"]
    # Each group lists the FQNs of the whole model, on every rank.
    muon_fqns = sorted(k for k in plain if "proj" in k and plain[k].ndim == 2)
    assert result["optim_groups"][0] == muon_fqns


@pytest.mark.parametrize("layout", ["1d-4", "hsdp-2x2", "dp2-tp2", "dp1-tp2"])
def test_an_offloaded_full_state_dict_goes_to_the_first_rank_alone(gloo_pool, layout):
    # TP peers hold the same model: one full copy in host memory, not one per TP rank.
    world, replicas, tp = LAYOUTS[layout]
    holds = gloo_pool(world).run(scenarios.holds_offloaded_full_dicts, replicas=replicas, tp=tp)
    assert holds == [(True, True)] + [(False, False)] * (world - 1)


def test_sharded_state_dict_holds_each_dedicated_matrix_on_its_owner_only(pool4):
    results = pool4.run(scenarios.state_dict_shapes, replicas=1)
    for result in results:
        assert result["sharded_dedicated_keys"] == result["owned"]
    assert sorted(k for r in results for k in r["owned"]) == sorted(
        k for k, v in TinyDecoder().state_dict().items() if "proj" in k and v.ndim == 2
    )


@pytest.mark.parametrize("layout", ["1d-2", "dp1-tp2"])
def test_plain_saving_paths_that_need_full_values_raise_naming_dmuon_checkpoint(gloo_pool, layout):
    # dp1-tp2: one owner slot, yet each rank holds only its TP chunk of a matrix, so torch's full
    # state dict must raise rather than return a chunk. (A plain model.state_dict() is sharded:
    # tests/distributed/test_model_state_dict.py.)
    result = run(gloo_pool, layout, scenarios.state_dict_shapes)
    path = result["torch_get_model_state_dict"]
    assert "dmuon.checkpoint.get_model_state_dict" in path and "RuntimeError" in path
    assert "get_model_state_dict(full_state_dict=True) asks model.state_dict()" in path
    assert "dmuon.checkpoint.get_optimizer_state_dict" in result["torch_get_optimizer_state_dict"]
    for path in ("named_parameters_save", "detach"):
        assert "placeholder of a dedicated parameter" in result[path], path
        assert "dmuon.checkpoint" in result[path]


def test_one_process_state_dict_holds_the_real_values():
    model, optimizer = scenarios.build(replicas=0)
    scenarios.train(model, optimizer, range(2))
    state = model.state_dict()
    plain = TinyDecoder()
    assert {k: v.shape for k, v in state.items()} == {
        k: v.shape for k, v in plain.state_dict().items()
    }
    owned = {p.fqn: p.master for p in scenarios.get_dedicated_state(model).params.values()}
    for fqn, master in owned.items():
        assert torch.equal(state[fqn], master)
    plain.load_state_dict(state)
    tokens = torch.randint(0, 37, (2, 9))
    assert torch.equal(plain(tokens), model(tokens))


def test_load_names_missing_extra_and_mis_shaped_keys_and_refuses_an_incomplete_checkpoint(
    checkpoints,
):
    path, _ = checkpoints("1d-4")
    messages = scenarios.load_errors(path)
    assert "size mismatch for model.layers.0.q_proj.weight" in messages["mis-shaped"]
    assert "(30, 30)" in messages["mis-shaped"] and "(3, 3)" in messages["mis-shaped"]
    assert (
        "in the checkpoint but not in the state dict: model.layers.2.q_proj.weight"
        in messages["not-in-model"]
    )
    assert (
        "missing in the checkpoint: model.layers.3.q_proj.weight" in messages["not-in-checkpoint"]
    )
    assert "is not a complete checkpoint" in messages["incomplete"]


def test_another_optimizers_state_keeps_every_groups_hyperparameters_and_says_so():
    # Moving from torch's AdamW to dmuon: its groups (no "route") must not set Muon's lr.
    torch.manual_seed(0)
    plain = TinyDecoder()
    adamw = torch.optim.AdamW(plain.parameters(), lr=3e-4, weight_decay=0.1)
    plain(torch.randint(0, 37, (2, 9))).square().mean().backward()
    adamw.step()
    saved = get_optimizer_state_dict(plain, adamw)
    model, optimizer = scenarios.build(replicas=0)
    before = [dict(group, params=None) for group in optimizer.param_groups]
    with pytest.warns(UserWarning) as caught:
        dckpt.set_optimizer_state_dict(model, optimizer, saved)
    assert [dict(group, params=None) for group in optimizer.param_groups] == before
    messages = [str(warning.message) for warning in caught]
    assert any("the saved param groups [0] have no 'route' key" in m for m in messages)
    assert any("the optimizer state of 15 parameters" in m for m in messages)  # the matrices
    norm = dict(model.named_parameters())["norm.weight"]
    assert torch.equal(optimizer.state[norm]["exp_avg"], saved["state"]["norm.weight"]["exp_avg"])


@pytest.mark.parametrize(
    "param_groups",
    [[{"params": ["layers.0.q_proj.weight"], "lr": 0.01}], None],
    ids=["one-group-more", "same-groups"],
)
def test_groups_loaded_from_disk_match_groups_loaded_from_memory(tmp_path, param_groups):
    # A checkpoint's groups are a list: read by position into other groups, they used to break.
    loaded = scenarios.groups_after_loading_other_groups(str(tmp_path / "ckpt"), param_groups)
    assert loaded["disk"] == loaded["memory"]


def test_a_parameter_frozen_when_saved_and_resumed_keeps_its_optimizer_state(pool2, tmp_path):
    result = pool2.run(scenarios.frozen_for_a_while, path=str(tmp_path / "ckpt"))[0]
    for key, value in result["uninterrupted"].items():
        assert torch.equal(result["resumed"][key], value), key


def test_a_partial_load_reports_every_missing_key_on_every_rank(pool2):
    # Each dedicated matrix is looked for by its owner only; the report must still be whole.
    for result in pool2.run(scenarios.partial_load_keys):
        assert result["missing"] == result["lacking"]
        assert result["unexpected"] == []


def test_a_checkpoint_with_other_routes_loads_and_warns_naming_the_parameters_that_start_fresh(
    checkpoints,
):
    path, _ = checkpoints("1d-4")
    warnings = scenarios.route_change_warning(path)
    assert len(warnings) == 1
    assert "layers.0.q_proj.weight" in warnings[0] and "lm_head.weight" in warnings[0]
    assert "starts fresh" in warnings[0]


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint_and_no_loadable_one(
    pool2, tmp_path
):
    path = tmp_path / "checkpoint"
    with pytest.raises(WorkerCrash):
        pool2.run(scenarios.save_then_die_in_the_next_save, path=str(path))
    # The interrupted save never replaced the complete one; its staging folder is refused.
    loaded = scenarios.load_in_one_process(str(path))
    assert max_relative_difference(loaded, scenarios.trained_in_one_process(2)) < FP32_TOLERANCE
    staging = tmp_path / f".{path.name}.incomplete"
    assert staging.is_dir()
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint"):
        scenarios.load_in_one_process(str(staging))
    (path / ".metadata").unlink()  # as if the kill had come between the two renames
    with pytest.raises(FileNotFoundError, match="a save into it did not finish"):
        scenarios.load_in_one_process(str(path))


def test_the_model_part_of_a_checkpoint_loads_alone(checkpoints):
    path, _ = checkpoints("1d-4")
    model_only = scenarios.load_model_only(path)
    with_optimizer = scenarios.load_in_one_process(path)
    assert model_only.keys() == with_optimizer.keys()
    for key, value in with_optimizer.items():
        assert torch.equal(model_only[key], value), key


def test_a_checkpoint_that_predates_a_group_option_loads_and_keeps_the_current_value(tmp_path):
    result = scenarios.older_checkpoint_without_a_group_option(str(tmp_path / "older"))
    assert result["group"]["adjust_lr"] == "match_rms_adamw"
    assert "retired_option" not in result["group"]
    for key, value in result["expected"].items():
        assert torch.equal(result["weights"][key], value), key


def test_a_flattened_optimizer_state_dict_saves_and_resumes_bit_identically(tmp_path):
    result = scenarios.flattened_round_trip(str(tmp_path / "flat"))
    assert all(key.startswith(("state.", "param_groups.")) for key in result["flat_keys"])
    for key, value in result["expected"].items():
        assert torch.equal(result["weights"][key], value), key
