"""The gloo worker pools of tests/distributed, for the Trainer scenarios."""

from tests.distributed.conftest import gloo_pool, pool2  # noqa: F401
