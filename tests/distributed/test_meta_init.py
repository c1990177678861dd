"""Meta-device models in torchtitan's order (meta model -> dedicate_params + fully_shard ->
``to_empty`` -> initialise in place -> ``dmuon.Muon``) train like the reference initialised with
the same weights, on gloo; initialising after dmuon adopted the weights is refused with the fix."""

import pytest

from tests.distributed.scenarios_meta_init import init_after_adoption, train_meta_initialised
from tests.distributed.scenarios_pipeline import train_pipeline_against_reference

FP32_TOLERANCE = 1e-5


@pytest.mark.parametrize("style", ["init_weights", "apply"])
@pytest.mark.parametrize(
    ("world_size", "replicas"), [(2, 1), (4, 1), (4, 2)], ids=["1d-2", "1d-4", "hsdp-2x2"]
)
def test_a_meta_built_model_initialised_after_to_empty_trains_like_the_reference(
    gloo_pool, world_size, replicas, style
):
    results = gloo_pool(world_size).run(
        train_meta_initialised, style=style, replicas=replicas, steps=4
    )
    for rank, result in enumerate(results):
        # The owners' masters are the initialised weights, not to_empty's memory.
        assert result["initial_error"] == 0.0, f"rank {rank}: {result['initial_error']:.3e}"
        worst = max(result["max_errors"])
        assert worst < FP32_TOLERANCE, f"rank {rank}: max relative error {worst:.3e}"
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5)


@pytest.mark.parametrize("adopt_by", ["muon", "forward"])
def test_initialising_after_dmuon_adopted_the_weights_raises_with_the_fix(pool2, adopt_by):
    for messages in pool2.run(init_after_adoption, adopt_by=adopt_by):
        # nn.init's functions, Linear.reset_parameters and in-place tensor methods alike.
        assert set(messages) == {"nn.init.normal_", "reset_parameters", "copy_", "fill_"}
        for way, message in messages.items():
            assert "writes into the placeholder of a dedicated parameter" in message, way
            assert "after model.to_empty(device=...) and before dmuon.Muon(...)" in message, way


@pytest.mark.parametrize(
    ("world_size", "dp", "schedule"),
    [(2, 1, "1f1b"), (4, 2, "interleaved_1f1b")],
    ids=["pp2-1f1b", "pp2xdp2-interleaved"],
)
def test_pipeline_stages_built_on_meta_train_like_the_reference(
    gloo_pool, world_size, dp, schedule
):
    # The whole model on meta, cut into stages; each stage dedicated, sharded, materialised and
    # initialised on its own, as torchtitan's pipeline_llm and its parallelize function do.
    results = gloo_pool(world_size).run(
        train_pipeline_against_reference, schedule=schedule, dp=dp, on_meta=True
    )
    for rank, result in enumerate(results):
        worst = max(result["max_errors"])
        assert worst < FP32_TOLERANCE, f"rank {rank}: max relative error {worst:.3e}"
        if result["losses"] is not None:
            assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5)
