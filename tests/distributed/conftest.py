"""Session-wide gloo worker pools: one per world size, started on first use, shared by all tests.

Use the ``gloo_pool`` factory (``gloo_pool(4).run(scenario, **kwargs)``) or the ``pool2``,
``pool4``, ``pool8`` shortcuts. See ``tests/distributed/pool.py`` for what a scenario may do.
"""

from collections.abc import Callable, Iterator

import pytest

from tests.distributed.pool import WorkerPool


@pytest.fixture(scope="session")
def gloo_pool() -> Iterator[Callable[[int], WorkerPool]]:
    pools: dict[int, WorkerPool] = {}

    def pool_of(world_size: int) -> WorkerPool:
        if world_size not in pools:
            pools[world_size] = WorkerPool(world_size)
        return pools[world_size]

    yield pool_of
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def pool2(gloo_pool: Callable[[int], WorkerPool]) -> WorkerPool:
    return gloo_pool(2)


@pytest.fixture(scope="session")
def pool4(gloo_pool: Callable[[int], WorkerPool]) -> WorkerPool:
    return gloo_pool(4)


@pytest.fixture(scope="session")
def pool8(gloo_pool: Callable[[int], WorkerPool]) -> WorkerPool:
    return gloo_pool(8)
