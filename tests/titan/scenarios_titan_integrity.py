"""Resuming a dmuon-titan job from a damaged checkpoint: ``scenarios_titan.train`` (or its
asynchronous-checkpoint form), returning the ``CheckpointIntegrityError`` each rank raised."""

from __future__ import annotations

# First: scenarios_titan applies titan_on_cpu's import-time workarounds before torchtitan loads.
from tests.titan import scenarios_titan, scenarios_titan_async

# isort: split
import dmuon.checkpoint


def resume_integrity_error(
    job_options: dict, checkpoint_root: str, asynchronous: bool = False
) -> str | None:
    """The ``CheckpointIntegrityError`` training the job raises on this rank (None if it
    trains)."""
    train = (
        scenarios_titan_async.train_with_async_checkpoints
        if asynchronous
        else scenarios_titan.train
    )
    try:
        train(job_options, checkpoint_root)
    except dmuon.checkpoint.CheckpointIntegrityError as error:
        return str(error)
    return None
