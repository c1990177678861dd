"""Per-rank ``optimizer.state_dict()`` files (torch's habit) on every rank of a gloo pool: the
normal resume, and the files of another rank or layout, which must be refused on every rank.

Each run trains ``scenarios_checkpoint``'s tiny decoder on the same global batches; the per-rank
files are written after ``SAVE_AT`` steps with ``torch.save`` (the model beside them, through
``dmuon.checkpoint``), into ``<path>/optim-rank<r>.pt``.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

import dmuon.checkpoint as dckpt
from dmuon.optim_layout import LAYOUT_KEY
from tests.distributed import scenarios_pipeline
from tests.distributed.models import rank_rows
from tests.distributed.scenarios_checkpoint import SAVE_AT, STEPS, build, full_weights, train


def _file_of(path: str, rank: int) -> str:
    return os.path.join(path, f"optim-rank{rank}.pt")


def save_per_rank_and_finish(path: str, replicas: int = 1, tp: int = 1) -> dict:
    """Train ``SAVE_AT`` steps, write the model (``dmuon.checkpoint``) and this rank's
    ``optimizer.state_dict()`` (``torch.save``), train to ``STEPS``: the uninterrupted run."""
    model, optimizer = build(replicas, tp=tp)
    train(model, optimizer, range(SAVE_AT))
    dckpt.save({"model": dckpt.get_model_state_dict(model)}, os.path.join(path, "model"))
    torch.save(optimizer.state_dict(), _file_of(path, dist.get_rank()))
    train(model, optimizer, range(SAVE_AT, STEPS))
    return {"weights": full_weights(model)}


def _fresh_with_model(path: str, replicas: int, tp: int):
    model, optimizer = build(replicas, tp=tp)
    model_sd = dckpt.get_model_state_dict(model)
    dckpt.load({"model": model_sd}, os.path.join(path, "model"))
    dckpt.set_model_state_dict(model, model_sd)
    return model, optimizer


def resume_from_own_file(path: str, replicas: int = 1, tp: int = 1) -> dict:
    """Each rank loads its own file (the normal resume) and trains to ``STEPS``."""
    model, optimizer = _fresh_with_model(path, replicas, tp)
    optimizer.load_state_dict(torch.load(_file_of(path, dist.get_rank())))
    train(model, optimizer, range(SAVE_AT, STEPS))
    return {"weights": full_weights(model)}


def load_another_file(
    path: str, file_rank: int | None = None, drop_record: bool = False, tp: int = 1
) -> dict:
    """After one step of its own, each rank loads the file of rank ``file_rank`` (None: of its
    rank modulo the ranks that wrote files); ``drop_record``: that file less its layout record.
    Returns the error (None if it loaded), whether this optimizer's state and groups are what
    they were before, and whether a step after it still runs in step with the other ranks."""
    model, optimizer = build(tp=tp)
    train(model, optimizer, range(1))
    before = copy.deepcopy(torch.optim.Optimizer.state_dict(optimizer))
    written = len([name for name in os.listdir(path) if name.startswith("optim-rank")])
    saved = torch.load(
        _file_of(path, dist.get_rank() % written if file_rank is None else file_rank)
    )
    if drop_record:
        del saved[LAYOUT_KEY]
    error = None
    try:
        optimizer.load_state_dict(saved)
    except ValueError as caught:
        error = str(caught)
    after = torch.optim.Optimizer.state_dict(optimizer)
    unchanged = _same(before, after)
    train(model, optimizer, range(1, 2))
    return {"error": error, "unchanged": unchanged, "stepped": True}


def pipeline_stage_loads_the_first_ranks_file(path: str) -> dict:
    """A pipeline of one stage a rank (dp 1: each rank its own ownership grid): each rank saves
    its stage's optimizer state dict, then loads the first rank's, then its own, and steps on."""
    config = scenarios_pipeline.PipelineConfig(schedule="gpipe", dp=1, steps=2)
    pipeline = scenarios_pipeline.build_pipeline(config)
    first, second = (rank_rows(b, 0, 1) for b in scenarios_pipeline.data(config))
    pipeline.train_step(first)
    optimizer = pipeline.optimizers[0]
    torch.save(optimizer.state_dict(), _file_of(path, dist.get_rank()))
    dist.barrier()
    before = copy.deepcopy(torch.optim.Optimizer.state_dict(optimizer))
    error = None
    try:
        optimizer.load_state_dict(torch.load(_file_of(path, 0)))
    except ValueError as caught:
        error = str(caught)
    unchanged = _same(before, torch.optim.Optimizer.state_dict(optimizer))
    optimizer.load_state_dict(torch.load(_file_of(path, dist.get_rank())))
    pipeline.train_step(second)
    return {"error": error, "unchanged": unchanged, "stepped": True}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def record(replicas: int = 1) -> dict:
    """This rank's layout record, as ``optimizer.state_dict()`` writes it."""
    _, optimizer = build(replicas)
    return optimizer.state_dict()[LAYOUT_KEY]
