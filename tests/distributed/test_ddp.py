"""The DDP path on gloo: torch's DistributedDataParallel around a dedicated model.

DDP averages the gradients of the parameters that are not dedicated (it skips the dedicated ones
by itself, no ``find_unused_parameters``); dmuon reduces the dedicated ones to their owners. The
result must match the single-process reference on the full batch, like the FSDP2 path does, and
a model that is neither sharded nor replicated must be refused, never left to drift.
"""

from __future__ import annotations

import pytest

from tests.distributed import scenarios_ddp as scenarios

# fp32 Newton-Schulz: dmuon and the reference differ only by the order of float additions.
FP32_TOLERANCE = 1e-5
# The first step, steady ones, and the momentum carried between them; more repeat the steady state.
STEPS = 4


def assert_matches_reference(results, tolerance=FP32_TOLERANCE):
    for rank, result in enumerate(results):
        worst = max(result["max_errors"])
        assert worst < tolerance, f"rank {rank}: max relative error {worst:.3e} >= {tolerance:.1e}"
        assert result["replicas_differ"] == 0.0, f"rank {rank}: replicated parameters drifted"


@pytest.mark.parametrize("entry_point", ["ddp", "dedicate_params_ddp"])
def test_ddp_on_four_ranks_matches_the_single_process_reference(pool4, entry_point):
    results = pool4.run(scenarios.ddp_against_reference, steps=STEPS, entry_point=entry_point)
    assert_matches_reference(results)


def test_no_sync_accumulation_under_ddp_equals_one_large_batch(pool2):
    results = pool2.run(scenarios.ddp_against_reference, steps=4, micro_batches=2)
    assert_matches_reference(results)


def test_no_sync_stops_ddp_all_reduce_and_restores_it(pool2):
    for result in pool2.run(scenarios.no_sync_skips_ddp_all_reduce):
        assert result == {"local_grads_differ": True, "sync_restored": True}


def test_tied_embeddings_under_ddp_train_like_the_reference(pool2):
    results = pool2.run(scenarios.ddp_against_reference, steps=4, model={"tie_embeddings": True})
    assert_matches_reference(results)


NOT_AVERAGED = (
    "dmuon.Muon: {count} trainable parameters are neither sharded by fully_shard nor averaged by "
    "DistributedDataParallel ({names}), and this model spans 2 ranks: each rank would step "
    "AdamW on its own local gradient and the copies would drift apart. After "
    "dmuon.dedicate_params, and before dmuon.Muon(model, ...), either wrap the model in "
    "torch.nn.parallel.DistributedDataParallel(model) (no find_unused_parameters needed: "
    "dedicate_params makes DDP skip the dedicated parameters), or call dmuon.dedicate_params_ddp"
    "(model, mesh, predicate), which does both; or shard it with fully_shard(layer, mesh=mesh) "
    "for each layer, then fully_shard(model, mesh=mesh)."
)
FIRST_NOT_DEDICATED = (
    "embed.weight, layers.0.attn_norm.weight, layers.0.attn_norm.bias, layers.0.o_proj.bias, "
    "layers.0.mlp_norm.weight, ... {more} more"
)


def _not_dedicated_count() -> int:
    from tests.distributed.models import TinyDecoder, proj_predicate

    return sum(1 for n, p in TinyDecoder().named_parameters() if not proj_predicate(n, p))


def test_a_model_neither_sharded_nor_replicated_is_refused_on_every_rank(pool2):
    count = _not_dedicated_count()
    expected = NOT_AVERAGED.format(count=count, names=FIRST_NOT_DEDICATED.format(more=count - 5))
    assert pool2.run(scenarios.neither_sharded_nor_replicated) == [expected, expected]


def test_ddp_built_before_dedicate_params_is_refused(pool2):
    expected = (
        "dmuon.Muon: the DistributedDataParallel around this model was built before "
        "dmuon.dedicate_params: it averages 15 parameters that dedicate_params has since "
        "replaced with its placeholders, and would wait for their gradients forever. Call "
        "dmuon.dedicate_params(model, mesh, predicate) first, then DistributedDataParallel(model) "
        "(or dmuon.dedicate_params_ddp(model, mesh, predicate))."
    )
    assert pool2.run(scenarios.ddp_before_dedicate_params) == [expected, expected]


def test_ddp_around_a_parent_of_the_dedicated_model_fails_at_construction(pool2):
    """DDP reads the ignore list of the module it wraps; its first broadcast then meets a
    placeholder, which refuses to hand out its (empty) value."""
    for message in pool2.run(scenarios.ddp_around_a_parent_module):
        assert message.startswith(
            "detach() on the placeholder of a dedicated parameter: dmuon keeps this parameter's "
            "full value on its owner rank"
        )


def test_ddp_over_other_ranks_than_dmuons_mesh_is_refused(pool2):
    messages = pool2.run(scenarios.ddp_over_other_ranks)
    for rank, message in enumerate(messages):
        assert message == (
            f"dmuon.Muon: the DistributedDataParallel around this model averages over ranks "
            f"[{rank}], but dmuon's mesh spans ranks [0, 1]: the two halves of each gradient "
            "would be averaged over different ranks. Pass the mesh's group: "
            "DistributedDataParallel(model, process_group=mesh.get_group()), or use "
            "dmuon.dedicate_params_ddp(model, mesh, predicate)."
        )


def test_giving_dmuon_the_ddp_wrapper_names_model_module(pool2):
    expected = (
        "DistributedDataParallel wraps the model dedicate_params prepared; dmuon takes that "
        "model itself: pass model.module (dmuon.Muon(ddp_model.module, ...), "
        "dmuon.no_sync(ddp_model.module), dmuon.checkpoint.get_state_dict(ddp_model.module, "
        "optimizer))."
    )
    assert pool2.run(scenarios.wrapper_given_to_muon) == [expected, expected]


def test_composable_replicate_is_refused_with_the_ddp_fix(pool2):
    expected = (
        "dmuon.Muon: the model is wrapped by torch.distributed._composable.replicate, which "
        "averages every parameter it finds, the dedicated placeholders included (it reads no "
        "ignore list), so its DDP would wait for gradients dmuon sends to their owners. Use "
        "torch.nn.parallel.DistributedDataParallel(model) after dmuon.dedicate_params (or "
        "dmuon.dedicate_params_ddp(model, mesh, predicate)) instead."
    )
    assert pool2.run(scenarios.composable_replicate) == [expected, expected]


def test_dedicate_params_ddp_refuses_a_replicate_mesh(pool2):
    for message in pool2.run(scenarios.replicate_mesh_given_to_dedicate_params_ddp):
        assert message.startswith(
            "dmuon.dedicate_params_ddp takes a 1-D mesh: replicated training has no "
            "(replicate, shard) layout, got replicate_mesh=DeviceMesh("
        )
        assert message.endswith(
            "Pass the whole data-parallel mesh as mesh, or use dedicate_params(..., "
            "replicate_mesh=) with fully_shard for HSDP."
        )


# ---- checkpoints ------------------------------------------------------------------------------


def max_relative_difference(weights, expected) -> float:
    assert weights.keys() == expected.keys()
    return max(
        ((weights[k] - expected[k]).norm() / expected[k].norm().clamp_min(1e-30)).item()
        for k in expected
    )


@pytest.mark.parametrize(("saved_on", "resumed_on"), [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_a_checkpoint_moves_between_ddp_and_fsdp2_and_training_continues(
    pool2, tmp_path, saved_on, resumed_on
):
    path = str(tmp_path / saved_on)
    uninterrupted = pool2.run(scenarios.save_midway_and_finish, path=path, layout=saved_on)[0]
    resumed = pool2.run(scenarios.resume_and_finish, path=path, layout=resumed_on)[0]
    difference = max_relative_difference(resumed["weights"], uninterrupted["weights"])
    assert difference < FP32_TOLERANCE
