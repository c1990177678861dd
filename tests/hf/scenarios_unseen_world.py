"""Launch-mismatch scenarios, run on every rank of a gloo pool (see tests/distributed/pool.py).

Each rank is one of a 2-process gloo world, but the TrainingArguments or the Accelerator is
built without ``use_cpu=True`` / ``cpu=True``, so on this CPU machine transformers and Accelerate
see one process (see [Note: an unseen world] in dmuon_hf.launch). Each scenario catches the
error and returns its message, with what the world looked like to each side.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import torch.distributed as dist
from accelerate.state import AcceleratorState
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import TrainingArguments

from dmuon_hf import DMuonAccelerator, DMuonTrainer
from tests.hf import scenarios_hf
from tests.hf.tiny_models import tiny_llama


@contextlib.contextmanager
def _fresh_accelerate_state() -> Iterator[str]:
    """An output folder, and Accelerate's process-wide state reset before and after (a state
    built without cpu=True must not leak into the pool's next scenario)."""
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # one host: local = global rank
    AcceleratorState._reset_state(reset_partial_state=True)
    output_dir = tempfile.mkdtemp(prefix="dmuon-hf-unseen-world-")
    try:
        yield output_dir
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        shutil.rmtree(output_dir, ignore_errors=True)


def _error_of(build) -> str:
    try:
        build()
    except ValueError as error:
        return str(error)
    return ""


def hand_sharded_trainer_without_use_cpu() -> dict:
    with _fresh_accelerate_state() as output_dir:
        model, optimizer = scenarios_hf._prepared_llama()
        args = TrainingArguments(output_dir=output_dir, report_to=[], save_strategy="no")
        message = _error_of(
            lambda: DMuonTrainer(
                model=model,
                args=args,
                train_dataset=scenarios_hf._dataset(4),
                optimizers=(optimizer, None),
            )
        )
        return {"message": message, "seen_world_size": args.world_size}


def fsdp_arguments_trainer_without_use_cpu() -> dict:
    with _fresh_accelerate_state() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            report_to=[],
            save_strategy="no",
            fsdp=True,
            fsdp_config={"fsdp_version": 2},
        )
        message = _error_of(
            lambda: DMuonTrainer(
                model=tiny_llama(seed=0),
                args=args,
                train_dataset=scenarios_hf._dataset(4),
                optimizer_cls_and_kwargs=scenarios_hf._MUON_FP32,
            )
        )
        return {"message": message, "seen_world_size": args.world_size}


def accelerator_without_cpu() -> dict:
    with _fresh_accelerate_state():
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap"
        )
        return {"message": _error_of(lambda: DMuonAccelerator(fsdp_plugin=plugin))}


def accelerator_with_cpu() -> dict:
    with _fresh_accelerate_state():
        accelerator = DMuonAccelerator(cpu=True)
        return {"num_processes": accelerator.num_processes}
