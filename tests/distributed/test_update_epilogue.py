"""The Muon update written by Newton-Schulz's last product on gloo, 1-D and HSDP, resident and
offloaded masters: bit-identical to each other and within bf16 compute of the single-process
fp32 reference (``scenarios_update_epilogue``; one process: tests/core/test_update_epilogue_step.py,
CUDA: tests/gpu/test_update_epilogue_gpu.py)."""

import pytest

from tests.distributed import scenarios_update_epilogue as scenarios
from tests.distributed.test_offload import LAYOUT_IDS, LAYOUTS, REFERENCE_TOLERANCE


@pytest.mark.parametrize(("world_size", "replicas"), LAYOUTS, ids=LAYOUT_IDS)
def test_the_written_update_trains_like_the_reference_on_several_ranks(
    gloo_pool, world_size, replicas
):
    results = gloo_pool(world_size).run(scenarios.epilogue_against_reference, replicas=replicas)
    for rank, result in enumerate(results):
        assert all(result["identical"]), f"rank {rank}: offloaded and resident runs differ"
        worst = max(result["max_errors"])
        assert worst < REFERENCE_TOLERANCE, f"rank {rank}: max relative error {worst:.3e}"
    # every owner's every Newton-Schulz call (one matrix each) went through the epilogue: 15
    # matrices (3 layers x 5 projections), each updated by both runs in each step
    assert sum(result["products"] for result in results) == 15 * 2 * scenarios.offload.STEPS
