"""A dmuon model the program drops is freed like any other (gloo, 4 ranks): nothing dmuon keeps
across models (registries, caches, hooks on torch's objects) may hold a model, its optimizer or
its masters. The benchmark of several variants in one process found one that did: every FSDP2
model that a dmuon.Muon had looked at stayed allocated until exit."""

import pytest

from tests.distributed.scenarios_release import LAYOUTS, outlives_the_program


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dropped_model_and_its_optimizer_are_freed(pool4, layout):
    alive = pool4.run(outlives_the_program, layout=layout)
    for rank, survivors in enumerate(alive):
        assert not any(survivors.values()), (
            f"rank {rank}: after the program dropped its {layout} model, a garbage collection "
            f"left alive: {[what for what, is_alive in survivors.items() if is_alive]}"
        )
