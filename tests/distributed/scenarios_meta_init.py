"""Models built on the meta device, in torchtitan's order, run on every rank of a gloo pool.

torchtitan builds the model on the meta device, parallelizes it (here ``dedicate_params``, then
``fully_shard`` per block and on the root), materialises it with ``model.to_empty(device=...)``
and only then initialises the weights in place (``model.init_weights()`` under ``no_grad``).
dmuon must take each owner's fp32 master from those initialised weights. The reference is the
same model built directly in one process and initialised by the same function with the same seed.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import dmuon
from dmuon.testing import dedicate_and_shard
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import DIM, FFN, TinyDecoder, batches, proj_predicate
from tests.distributed.reference_errors import relative_errors_to
from tests.distributed.scenarios_protocol import (
    TrainConfig,
    build_reference,
    reference_step,
    train_step,
)
from tests.distributed.shared_reference import step_on_first_rank

INIT_SEED = 7
INIT_STYLES = ("init_weights", "apply")


def init_weights(model: nn.Module, style: str) -> None:
    """Initialise every weight of ``model`` in place, after ``to_empty``.

    ``style="init_weights"`` writes through each parameter under ``no_grad``, as torchtitan's
    ``model.init_weights()``; ``style="apply"`` runs ``model.apply(fn)`` with ``nn.init.*_`` on
    each module's weights. Both give the same values.

    The dedicated matrices (``proj_predicate``) are plain full tensors on every rank until
    dmuon adopts them, and draw in place from the global generator, as torchtitan's do; it is
    seeded by the parameter's name just before, so a pipeline stage that initialises only its
    own layers draws what one process does. The other weights may be FSDP2's DTensors, whose
    random draws on a CPU mesh depend on the layout (torch's DTensor RNG tracker does not cover
    CPU meshes): each takes its piece of a full draw from a generator seeded by its name. Norms
    are ones and zeros.
    """
    names = {id(param): name for name, param in model.named_parameters()}
    with torch.no_grad():
        if style == "init_weights":
            for name, param in model.named_parameters():
                _init_param(name, param)
        elif style == "apply":
            model.apply(lambda module: _init_module(module, names))
        else:
            raise ValueError(f"style must be one of {INIT_STYLES}, got {style!r}")


def _init_param(name: str, param: nn.Parameter) -> None:
    if proj_predicate(name, param):
        torch.manual_seed(_seed(name))
        param.normal_(0.0, 0.1)
    elif "norm" in name:
        param.fill_(1.0 if name.endswith("weight") else 0.0)
    else:
        _set_from_named_draw(name, param)


def _init_module(module: nn.Module, names: dict[int, str]) -> None:
    for attr, param in module.named_parameters(recurse=False):
        name = names[id(param)]
        if proj_predicate(name, param):
            torch.manual_seed(_seed(name))
            nn.init.normal_(param, std=0.1)
        elif isinstance(module, nn.LayerNorm):
            (nn.init.ones_ if attr == "weight" else nn.init.zeros_)(param)
        else:
            _set_from_named_draw(name, param)


def _set_from_named_draw(name: str, param: torch.Tensor) -> None:
    """``param`` (a DTensor: its local piece) from a full draw seeded by ``name``."""
    generator = torch.Generator().manual_seed(_seed(name))
    std = 1.0 if "embed" in name else 0.1
    full = torch.randn(param.shape, generator=generator) * std
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)


def fp32_newton_schulz() -> NewtonSchulz:
    """The reference's Newton-Schulz (``TrainConfig``'s default): exact comparisons."""
    return NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas")


def _seed(name: str) -> int:
    return INIT_SEED + zlib.crc32(name.encode())


def build_on_meta(config: TrainConfig, style: str):
    """torchtitan's order: meta model, dedicate + fully_shard, to_empty, init; then Muon."""
    with torch.device("meta"):
        model = TinyDecoder(**config.model)
    dedicate_and_shard(model, "cpu", config.replicas, config.reshard_after_forward)
    model.to_empty(device="cpu")
    init_weights(model, style)
    optimizer = dmuon.Muon(
        model, lr=0.02, weight_decay=config.weight_decay, ns_backend=fp32_newton_schulz()
    )
    return model, optimizer


def train_meta_initialised(style: str, **kwargs) -> dict:
    """Train a meta-built model next to the reference initialised alike: the relative error of
    the weights after initialisation and after each step, and both losses."""
    config = TrainConfig(**kwargs)
    model, optimizer = build_on_meta(config, style)
    reference, reference_optimizer = build_reference(config)
    init_weights(reference, style)
    initial_error = max(relative_errors_to(model, reference).values())
    max_errors, losses, reference_losses = [], [], []
    for batch in batches(config.steps, dist.get_world_size()):
        losses.append(_mean_over_ranks(train_step(model, optimizer, batch, config)))
        reference_losses.append(
            step_on_first_rank(
                reference,
                reference_step,
                reference,
                reference_optimizer,
                batch,
                config,
                share_result=True,
            )
        )
        max_errors.append(max(relative_errors_to(model, reference).values()))
    return {
        "initial_error": initial_error,
        "max_errors": max_errors,
        "losses": losses,
        "reference_losses": reference_losses,
    }


def _mean_over_ranks(value: float) -> float:
    """The loss of the full batch from each rank's loss on its equal share of rows."""
    total = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


# Ways user code writes into a weight after ``to_empty``, each on a dedicated matrix.
LATE_INITS = {
    "nn.init.normal_": lambda block: nn.init.normal_(block.up_proj.weight, std=0.1),
    "reset_parameters": lambda block: block.up_proj.reset_parameters(),  # kaiming_uniform_
    "copy_": lambda block: block.up_proj.weight.copy_(torch.ones(FFN, DIM)),
    "fill_": lambda block: block.q_proj.weight.fill_(0.5),
}


def init_after_adoption(adopt_by: str) -> dict[str, str]:
    """The weights initialised only after dmuon adopted them (``adopt_by``: constructing
    ``dmuon.Muon``, or a first forward): the error each way of initialising raises."""
    with torch.device("meta"):
        model = TinyDecoder()
    dedicate_and_shard(model, "cpu", 1, True)
    model.to_empty(device="cpu")
    if adopt_by == "muon":
        dmuon.Muon(model, ns_backend=fp32_newton_schulz())
    else:
        with torch.no_grad():
            model(torch.zeros(1, 4, dtype=torch.long))
    messages = {}
    for way, init in LATE_INITS.items():
        try:
            with torch.no_grad():
                init(model.layers[0])
            messages[way] = "no error"
        except RuntimeError as error:
            messages[way] = str(error)
    return messages
