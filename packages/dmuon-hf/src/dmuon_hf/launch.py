"""The launch check: a world of several processes that transformers or Accelerate does not see.

Owns one question, asked by ``DMuonTrainer`` and ``DMuonAccelerator`` at construction: is this
process one of several (``torch.distributed`` is initialised with a world size above 1, or the
launcher's ``WORLD_SIZE`` says so) while ``TrainingArguments`` / the ``Accelerator`` believe they
run alone? It must not change any setting or initialise anything; it only raises, naming the fix.

[Note: an unseen world]
Accelerate runs distributed on CPU only when asked (``Accelerator(cpu=True)``,
``TrainingArguments(use_cpu=True)``), and on a GPU only when ``LOCAL_RANK`` is set (``torchrun``
and ``accelerate launch`` set it). Otherwise it reports one process even under ``torchrun
--nproc-per-node 2``, and each way in fails away from the cause: the hand-sharded Trainer trains
and then fails at its first save ("Build that mesh over every rank"), the ``fsdp``-argument
Trainer fails with transformers' "Using fsdp only works in distributed training", and an
Accelerate loop runs every rank alone on every batch (each rank's data loader yields the whole
data set). dmuon itself works on the process group either way, so the mismatch is silent until
then; checking the two world sizes against each other names the fix at once.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def launched_world_size() -> int:
    """The number of processes this one was launched among: the process group's world size once
    it is initialised, else the launcher's ``WORLD_SIZE`` (1 without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_world_is_seen(owner: str, seer: str, seen_world_size: int, *, cpu_fix: str) -> None:
    """Raise (as ``owner``) if this process is one of several but ``seer`` (``TrainingArguments``,
    the ``Accelerator``) sees ``seen_world_size`` processes.

    ``cpu_fix`` is the argument that makes ``seer`` run distributed on CPU
    (``"TrainingArguments(use_cpu=True, ...)"``); see [Note: an unseen world].
    """
    launched = launched_world_size()
    if launched <= 1 or seen_world_size == launched:
        return
    if not torch.cuda.is_available():
        fix = f"on CPU, transformers and Accelerate run distributed only when asked: pass {cpu_fix}"
    elif os.environ.get("LOCAL_RANK") is None:
        fix = (
            "LOCAL_RANK is not set, and Accelerate needs it to run distributed on a GPU: launch "
            "with torchrun or accelerate launch (they set it), or set LOCAL_RANK in each process"
        )
    else:
        fix = "launch every process the same way (torchrun or accelerate launch)"
    raise ValueError(
        f"{owner}: this process is one of {launched} (torch.distributed / WORLD_SIZE), but "
        f"{seer} sees a world size of {seen_world_size}: every rank would train alone on every "
        f"batch, or fail later (at the first save, or at the fsdp setup). Fix: {fix}."
    )
