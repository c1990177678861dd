"""Makes the test support modules importable as ``tests.<area>.<module>``, here and in workers.

pytest runs with ``--import-mode=importlib``: it imports every test module under a name derived
from its path (``tests/distributed/test_pool.py`` -> ``tests.distributed.test_pool``) without
touching ``sys.path``. Support modules (the worker pool, the reference optimizer, scenario
modules) are imported by that same scheme: ``from tests.reference_optim import ...``,
``from tests.distributed.pool import ...``. Putting the repository root on ``sys.path`` makes those
names resolve here and in the gloo worker processes, whose fork server starts with this process's
``sys.path``.
``tests`` has no ``__init__.py``: it is a namespace package rooted in this directory.

It also holds the session-wide gloo worker pools (one per world size, started on first use):
every test folder that runs distributed scenarios (distributed, tools, hf) shares them, so a
session spawns each world size once. Use the ``gloo_pool`` factory
(``gloo_pool(4).run(scenario, **kwargs)``) or the ``pool2``, ``pool4``, ``pool8`` shortcuts; see
``tests/distributed/pool.py`` for what a scenario may do. Other fixtures belong in the conftest
of the area that uses them.
"""

import sys
from pathlib import Path

REPOSITORY_ROOT = str(Path(__file__).resolve().parents[1])

if REPOSITORY_ROOT not in sys.path:
    sys.path.insert(0, REPOSITORY_ROOT)


from collections.abc import Callable, Iterator  # noqa: E402

import pytest  # noqa: E402

from tests.distributed.pool import WorkerPool, preload_in_workers  # noqa: E402

# dmuon takes under 0.1 s of CPU to import (making its dataclasses, mostly), but every gloo worker
# of every generation paid it: 12% of the workers' CPU in a profile of the checkpoint tests. No
# dmuon module reads an environment variable on import.
preload_in_workers("dmuon", "dmuon.checkpoint", "dmuon.testing")

# A session's pools stop their workers after this long without a scenario (see
# [Note: idle pools stop] in tests/distributed/pool.py).
POOL_IDLE_STOP_S = 2.0


@pytest.fixture(scope="session")
def gloo_pool() -> Iterator[Callable[[int], WorkerPool]]:
    pools: dict[int, WorkerPool] = {}

    def pool_of(world_size: int) -> WorkerPool:
        if world_size not in pools:
            pools[world_size] = WorkerPool(world_size, stop_when_idle_s=POOL_IDLE_STOP_S)
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
