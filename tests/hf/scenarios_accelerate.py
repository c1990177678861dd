"""DMuonAccelerator scenarios, run on every rank of a gloo pool (see tests/distributed/pool.py).

A plain tiny Llama goes through ``accelerator.prepare`` with an FSDP2 plugin (dedicated with
default_predicate, sharded per decoder layer), trains on the rows of one global batch split over
the ranks, clips with ``accelerator.clip_grad_norm_`` and saves with ``accelerator.save_state``;
the single-process reference of scenarios_hf trains on the whole batch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin

import dmuon
from dmuon_hf import DMuonAccelerator
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.hf import scenarios_hf
from tests.hf.tiny_models import tiny_llama, token_batch

ROWS = 4  # one global batch, split over the ranks
MAX_GRAD_NORM = 0.5


def _prepared():
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap"
    )
    accelerator = DMuonAccelerator(cpu=True, fsdp_plugin=plugin)
    model = accelerator.prepare(tiny_llama(seed=0))
    optimizer = dmuon.Muon(
        model,
        lr=scenarios_hf.MUON_LR,
        adamw_lr=scenarios_hf.ADAMW_LR,
        ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas"),
    )
    return accelerator, model, accelerator.prepare(optimizer)


def _steps(
    accelerator, model, optimizer, count: int, max_abs: list[float] | None = None
) -> tuple[list[float], list[float]]:
    """``count`` steps, clipping each; ``max_abs`` collects each step's inf-norm first (asked
    with max_norm=inf, which scales nothing)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = token_batch(ROWS, seq_len=scenarios_hf.SEQ_LEN).chunk(world)[rank]
    losses, norms = [], []
    for _ in range(count):
        loss = model(input_ids=mine, labels=mine).loss
        accelerator.backward(loss)
        if max_abs is not None:
            inf = float("inf")
            max_abs.append(accelerator.clip_grad_norm_(model.parameters(), inf, inf).item())
        norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss.detach_())
        losses.append(loss.item() / world)
        print(f"step loss {losses[-1]:.6f} grad norm {norms[-1]:.6f}")
    return losses, norms


def train_clip_save(*, steps: int, save_dir: str) -> dict:
    """``steps`` steps against the reference, then save_state, then two more steps."""
    accelerator, model, optimizer = _prepared()
    partial_clip = ""
    try:
        accelerator.clip_grad_norm_(list(model.parameters())[:3], 1.0)
    except ValueError as error:
        partial_clip = str(error)
    max_abs: list[float] = []
    losses, norms = _steps(accelerator, model, optimizer, steps, max_abs)
    accelerator.save_state(save_dir)
    after_save, _ = _steps(accelerator, model, optimizer, 2)
    reference = scenarios_hf._reference_run(steps, ROWS, MAX_GRAD_NORM)
    return {
        "losses": losses,
        "grad_norms": norms,
        "max_abs_gradient": max_abs[0],
        "reference": {key: reference[key] for key in ("losses", "grad_norms")},
        "reference_max_abs_gradient": _reference_first_max_abs_gradient(),
        "after_save": after_save,
        "saved_files": sorted(os.listdir(save_dir)),
        "partial_clip_error": partial_clip,
    }


def load_and_continue(*, save_dir: str) -> dict:
    """A fresh model and optimizer, load_state, then the two steps after the save."""
    accelerator, model, optimizer = _prepared()
    accelerator.load_state(save_dir)
    losses, _ = _steps(accelerator, model, optimizer, 2)
    return {"losses": losses}


def _reference_first_max_abs_gradient() -> float:
    """The largest absolute gradient of the first step, in one process on the whole batch."""
    model = tiny_llama(seed=0)
    tokens = token_batch(ROWS, seq_len=scenarios_hf.SEQ_LEN)
    model(input_ids=tokens, labels=tokens).loss.backward()
    return max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)
