"""Dedicating a model inside a parallelize function someone else wrote.

Owns ``dedicate_before_fully_shard``: the way to run ``dedicate_params`` at the one moment it
belongs to (after tensor parallelism, activation checkpointing and ``torch.compile`` have
wrapped the model, before FSDP2 collects its parameters) when that moment lies inside code the
user does not own: an engine's parallelize function (torchtitan's ``parallelize_llama``), a
framework's ``prepare`` (accelerate). It must not know any engine.

[Note: dedicating at the first fully_shard]
Engines apply TP, AC, compile and FSDP2 in one function, so there is no line between the last
wrapper and the first ``fully_shard`` where a caller could call ``dedicate_params``. FSDP2 calls
``_get_managed_states`` at the start of each ``fully_shard`` (``dmuon.fsdp2`` wraps it already,
to skip dedicated parameters); the first call for a module of a pending model dedicates that
model right there, so ``fully_shard`` then skips its dedicated parameters as usual. Every rank
applies the same parallelize function to the same model, so every rank reaches that first call
at the same point and ``dedicate_params``'s collectives pair up. A model whose parallelize
function never calls ``fully_shard`` (DDP, one device) is dedicated when the block exits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from dmuon import fsdp2
from dmuon.dedicate import Predicate, dedicate_params
from dmuon.hooks import find_dedicated_state


@contextlib.contextmanager
def dedicate_before_fully_shard(
    model: nn.Module, mesh, predicate: Predicate, **kwargs: Any
) -> Iterator[None]:
    """Inside, the first ``fully_shard`` of ``model`` or of one of its modules first runs
    ``dedicate_params(model, mesh, predicate, **kwargs)``; if none runs, the block's exit does.

    For code that applies TP, activation checkpointing, compile and ``fully_shard`` in one
    function you do not own::

        with dmuon.dedicate_before_fully_shard(model, mesh["fsdp"], predicate):
            model = parallelize_fn(model, ...)  # TP, AC, compile, then fully_shard
        optimizer = dmuon.Muon(model, lr=0.02)

    The owner map is then ``dmuon.inspect`` 's to read. An error inside ``dedicate_params`` is
    raised from that ``fully_shard`` call, on every rank.
    """
    pending = _PendingDedication(model, mesh, predicate, kwargs)
    fsdp2.fully_shard_listeners.append(pending.before_fully_shard)
    try:
        yield
    finally:
        fsdp2.fully_shard_listeners.remove(pending.before_fully_shard)
    pending.dedicate()


class _PendingDedication:
    def __init__(self, model: nn.Module, mesh, predicate: Predicate, kwargs: dict) -> None:
        if find_dedicated_state(model) is not None:
            raise RuntimeError(
                "dedicate_before_fully_shard: this model is already dedicated; call "
                "dedicate_params once, on the whole model."
            )
        self.model = model
        self.mesh = mesh
        self.predicate = predicate
        self.kwargs = kwargs
        self.done = False

    def before_fully_shard(self, modules: list[nn.Module]) -> None:
        if self.done:
            return
        ours = {id(module) for module in self.model.modules()}
        if any(id(module) in ours for module in modules):
            self.dedicate()

    def dedicate(self) -> None:
        if self.done:
            return
        self.done = True
        dedicate_params(self.model, self.mesh, self.predicate, **self.kwargs)
