"""The gloo worker pools of ``tests/distributed``, for the dmuon-tools scenarios.

pytest gives these fixtures their own instances here: when both folders run in one session, the
tools tests start their own pool of workers.
"""

from tests.distributed.conftest import gloo_pool, pool2, pool4  # noqa: F401
