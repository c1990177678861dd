"""Save, resume, export and reshard a dmuon model and its ``dmuon.Muon`` optimizer.

The functions and semantics of ``torch.distributed.checkpoint.state_dict``, for dmuon models
(torch's own cannot serve them: the optimizer's state lives on the owners' fp32 masters, and a
full state dict needs each dedicated weight from its owner; they raise, naming these)::

    from torch.distributed.checkpoint.state_dict import StateDictOptions
    import dmuon.checkpoint as dckpt

    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)            # sharded
    dckpt.save({"model": model_sd, "optim": optim_sd}, "ckpt/step-100")    # collective

    # later, on any number of ranks and any layout (1-D, HSDP, one process):
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dckpt.load({"model": model_sd, "optim": optim_sd}, "ckpt/step-100")
    dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    # one plain dict FQN -> full CPU tensor on the first rank (for from_pretrained, export):
    full = dckpt.get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )

Sharded dicts go straight into ``torch.distributed.checkpoint.save/load`` too; ``save`` and
``load`` here add an atomic commit, a check of every key before reading (see ``_storage``), and
a checksum of every item written, checked on every rank before any value loads: a damaged file
raises ``CheckpointIntegrityError`` naming it (see ``_integrity``). A framework that calls DCP
itself (torchtitan's ``CheckpointManager``) gets the same checksums from
``checksumming_writer(path)`` and ``verifying_reader(path)`` as its storage writer and reader.
Every function is collective over the ranks of the model's ownership grid and drains pending
post-step publishes first. A Muon matrix's state is its ``MOMENTUM_BUFFER`` entry
(``"momentum_buffer"``, torch.optim.Muon's name): a checkpoint without it was not written by
``dmuon.Muon``. ``StateDictOptions``: ``full_state_dict``, ``cpu_offload``,
``ignore_frozen_params``, ``strict`` and ``flatten_optimizer_state_dict`` are honoured;
``broadcast_from_rank0`` in ``set_model_state_dict`` (a big model loaded from one full dict on
the first rank, each owner receiving only its matrices; a meta-device model after ``to_empty``
included: ``to_empty_for_load`` materialises it without allocating the dedicated weights, which
the load fills); elsewhere it and ``dsd_fqn_modifiers`` raise::

    dckpt.to_empty_for_load(model, device=device)  # after dedicate_params and fully_shard on meta
    full = torch.load("model.pt", mmap=True) if dist.get_rank() == 0 else {}
    dckpt.set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from dmuon._torch_internals import IncompatibleKeys
from dmuon.checkpoint._from_source import to_empty_for_load
from dmuon.checkpoint._integrity import CheckpointIntegrityError
from dmuon.checkpoint._model import get_model_state_dict, set_model_state_dict
from dmuon.checkpoint._optim import get_optimizer_state_dict, set_optimizer_state_dict
from dmuon.checkpoint._storage import checksumming_writer, load, save, verifying_reader
from dmuon.muon_state import MOMENTUM_BUFFER
from dmuon.optim import Muon


def get_state_dict(
    model: nn.Module,
    optimizers: Muon | Iterable[Muon],
    *,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, object], dict[str, object]]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizers))``."""
    return (
        get_model_state_dict(model, options=options),
        get_optimizer_state_dict(model, optimizers, options=options),
    )


def set_state_dict(
    model: nn.Module,
    optimizers: Muon | Iterable[Muon],
    *,
    model_state_dict: dict[str, object],
    optim_state_dict: dict[str, object],
    options: StateDictOptions | None = None,
) -> IncompatibleKeys:
    """Load both; the model first, so the weights every copy serves are the loaded ones."""
    if options is not None and options.broadcast_from_rank0:
        raise ValueError(
            "dmuon.checkpoint.set_state_dict does not take StateDictOptions(broadcast_from_rank0="
            "True): the optimizer state cannot come from the first rank alone. Load the model "
            "with set_model_state_dict(model, full, options=...) and the optimizer from a "
            "sharded checkpoint (dmuon.checkpoint.load) with set_optimizer_state_dict."
        )
    result = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return result


__all__ = [
    "MOMENTUM_BUFFER",
    "CheckpointIntegrityError",
    "StateDictOptions",
    "checksumming_writer",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "load",
    "save",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "to_empty_for_load",
    "verifying_reader",
]
