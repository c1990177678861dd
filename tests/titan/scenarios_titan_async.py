"""torchtitan's asynchronous checkpointing (``--checkpoint.async_mode async``) with dmuon-titan on
CPU: ``scenarios_titan.train`` with that one setting changed.

torchtitan's ``CheckpointManager`` then saves with ``torch.distributed.checkpoint.async_save`` on
a gloo group of its own, and waits for the previous save before the next one and at close.
"""

from __future__ import annotations

from tests.titan import scenarios_titan


def train_with_async_checkpoints(job_options: dict, checkpoint_root: str) -> dict:
    """``scenarios_titan.train``, its checkpoints saved with ``async_mode = "async"``."""
    plain = scenarios_titan._checkpointing

    def asynchronous(checkpoint, job) -> None:
        plain(checkpoint, job)
        checkpoint.async_mode = "async"

    scenarios_titan._checkpointing = asynchronous
    try:
        return scenarios_titan.train(job_options, checkpoint_root)
    finally:
        scenarios_titan._checkpointing = plain
