"""``ChecksummedCheckpointManager``: torchtitan's DCP ``CheckpointManager``, its checkpoints
written with dmuon's checksums and verified when they load.

Owns the two calls where torchtitan's manager hands a state dict to
``torch.distributed.checkpoint``: ``dcp_save`` (interval saves, synchronous or ``async_mode
"async"``, and the last step's save, the model-only export in ``export_dtype`` included) and
``dcp_load`` (the resume, ``initial_load_path``). Each gets ``dmuon.checkpoint``'s storage
writer or reader in place of DCP's default file system one; every other decision (which step,
which states, when, async, purging) stays torchtitan's. It must not change what is saved or
loaded, nor reach into the manager's other methods.

[Note: checksums of torchtitan's checkpoints]
Save: ``checksumming_writer`` writes ``.checksums.json`` beside ``.metadata`` (a crc32 per
item), in the step folder torchtitan chose; the files are DCP's own, so stock torchtitan and
``torch.distributed.checkpoint`` read them. Load: ``verifying_reader`` checks every file and
item a rank reads on every rank before any value is copied; a damaged one raises
``CheckpointIntegrityError`` naming the file on every rank (DCP's ``CheckpointException``,
which wraps it, is unwrapped here), so a resume never trains on flipped bytes. A checkpoint
without checksums (a stock torchtitan run's, an earlier dmuon-titan's) loads with dmuon's
warning that it cannot be verified. Not covered, left to torchtitan as before: HuggingFace
safetensors (``last_save_in_hf``, ``initial_load_in_hf``), written and read by DCP's HF storage
classes; ``async_mode "async_with_pinned_mem"``, whose writer runs in another process (GPU
jobs; not tried here). torchtitan writes into the step folder in place: a save cut short can
leave a folder whose ``.metadata`` is written and its checksum file not, which then loads
with the warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools.utils import GarbageCollection

import dmuon.checkpoint


class ChecksummedCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager``; its DCP checkpoints carry and check dmuon's
    checksums (see [Note: checksums of torchtitan's checkpoints])."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        if to_hf or async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            return CheckpointManager.dcp_save(
                self, state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        writer = dmuon.checkpoint.checksumming_writer(checkpoint_id)
        if async_mode == AsyncMode.ASYNC:
            result = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        else:
            result = dcp.save(state_dict, storage_writer=writer)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        if from_hf:
            CheckpointManager.dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized)
            return
        reader = dmuon.checkpoint.verifying_reader(checkpoint_id)
        try:
            dcp.load(state_dict, storage_reader=reader)
        except CheckpointException as failure:
            damaged = _integrity_error(failure)
            if damaged is None:
                raise
            raise damaged from None
        if MODEL in self.states:  # torchtitan flattens the model's entries into the dict
            self.states[MODEL].load_state_dict(state_dict)


def _integrity_error(failure: CheckpointException) -> BaseException | None:
    """The ``CheckpointIntegrityError`` a rank raised inside DCP's load, if any."""
    for _rank, (error, _trace) in sorted(failure.failures.items()):
        if isinstance(error, dmuon.checkpoint.CheckpointIntegrityError):
            return error
    return None
