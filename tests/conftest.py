"""Makes the test support modules importable as ``tests.<area>.<module>``, here and in workers.

pytest runs with ``--import-mode=importlib``: it imports every test module under a name derived
from its path (``tests/distributed/test_pool.py`` -> ``tests.distributed.test_pool``) without
touching ``sys.path``. Support modules (the worker pool, the reference optimizer, scenario
modules) are imported by that same scheme: ``from tests.reference_optim import ...``,
``from tests.distributed.pool import ...``. Putting the repository root on ``sys.path`` makes those
names resolve here and in the "spawn" worker processes, which inherit the parent's ``sys.path``.
``tests`` has no ``__init__.py``: it is a namespace package rooted in this directory.

This file must stay small: fixtures belong in the conftest of the area that uses them.
"""

import sys
from pathlib import Path

REPOSITORY_ROOT = str(Path(__file__).resolve().parents[1])

if REPOSITORY_ROOT not in sys.path:
    sys.path.insert(0, REPOSITORY_ROOT)
