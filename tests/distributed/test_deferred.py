"""``dmuon.dedicate_before_fully_shard``: a model dedicated inside a parallelize function the
caller does not own, at its first ``fully_shard``, trains like the single-process reference."""

from tests.distributed.scenarios_deferred import (
    a_failing_dedication_raises_from_fully_shard,
    train_dedicated_inside_an_engines_parallelize,
)
from tests.distributed.test_protocol import FP32_TOLERANCE


def test_a_model_dedicated_at_its_first_fully_shard_trains_like_the_reference(pool2):
    results = pool2.run(train_dedicated_inside_an_engines_parallelize, shard=True)
    for result in results:
        # Not yet dedicated when the engine's function started; FSDP2 then skipped every
        # dedicated parameter (none became a DTensor) and wrapped every layer and the root.
        assert result["calls"] == ["dedicated before parallelize: False"]
        assert result["dedicated"] and result["sharded_dedicated"] == []
        assert result["fsdp_modules"] == result["layers"] + 1
        assert max(result["max_errors"]) < FP32_TOLERANCE


def test_a_model_never_fully_sharded_is_dedicated_when_the_block_exits(pool2):
    results = pool2.run(train_dedicated_inside_an_engines_parallelize, shard=False)
    for result in results:
        assert result["dedicated"] and result["fsdp_modules"] == 0


def test_a_dedication_that_fails_raises_from_the_fully_shard_call_on_every_rank(pool2):
    messages = pool2.run(a_failing_dedication_raises_from_fully_shard)
    for message in messages:
        assert "timeout must be a datetime.timedelta" in message
