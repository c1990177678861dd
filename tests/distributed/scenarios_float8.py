"""Scenarios of torchao's float8 training on dedicated projections, on every rank of a gloo pool.

A small residual MLP (every dim a multiple of 16, as ``torch._scaled_mm`` wants) is converted
with ``torchao.float8.convert_to_float8_training`` (its projections only), then prepared with
``dmuon.dedicate_params`` and ``fully_shard`` and trained with ``dmuon.Muon``. The reference is
the same float8 model in one process, trained with the plain Muon + AdamW of
``tests.reference_optim``.

[Note: a float8 reference sees each rank's rows]
Dynamic float8 scaling computes its scales from the tensor it casts: tensorwise from the whole
input, rowwise from each row of the input but each column of it for the weight gradient. A
reference that ran the global batch in one forward would therefore cast with other scales than
ranks that each see half of it, and the difference is a float8 rounding (about 2**-4 relative),
far above any tolerance worth testing. So the reference runs one forward and backward per rank's
rows, as the ranks do, and averages the summed gradients once, as dmuon's reduce and FSDP2's
reduce-scatter do: every float8 cast then sees the same tensor on both sides and the forward is
bit-equal on the first step; what remains is the order of the fp32 gradient additions.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.layouts import data_parallel_meshes
from tests.distributed.reference_errors import relative_errors_to
from tests.distributed.shared_reference import step_on_first_rank
from tests.reference_optim import ReferenceMuonAdamW

LR, WEIGHT_DECAY = 0.02, 0.01
DIM, HIDDEN, CLASSES = 32, 64, 16
ROWS_PER_RANK = 16
STEPS = 4


class Float8Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(torch.relu(self.up_proj(self.norm(x))))


class Float8Mlp(nn.Module):
    """Two residual blocks and a plain (not float8, not dedicated) head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Float8Block() for _ in range(2))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def projections(name: str, param: nn.Parameter) -> bool:
    return name.endswith("_proj.weight")


def float8_model(recipe: str) -> nn.Module:
    """The seeded model with its projections converted to torchao's ``Float8Linear``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = Float8Mlp()
    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda module, fqn: fqn.endswith("_proj"),
    )
    return model


def rank_batches(world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, each rank's (inputs, labels)."""
    generator = torch.Generator().manual_seed(1)
    return [
        [
            (
                torch.randn(ROWS_PER_RANK, DIM, generator=generator),
                torch.randint(0, CLASSES, (ROWS_PER_RANK,), generator=generator),
            )
            for _ in range(world)
        ]
        for _ in range(STEPS)
    ]


def loss_of(model: nn.Module, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, labels = rows
    return nn.functional.cross_entropy(model(inputs), labels)


def reference_step(reference, optimizer, step_rows) -> list[float]:
    """One step on every rank's rows in turn ([Note: a float8 reference sees each rank's
    rows]); the per-rank losses."""
    losses = []
    for rows in step_rows:
        loss = loss_of(reference, rows)
        loss.backward()
        losses.append(loss.item())
    for param in reference.parameters():
        param.grad.div_(len(step_rows))
    optimizer.step()
    optimizer.zero_grad()
    return losses


def train_float8_against_reference(recipe: str) -> dict:
    """Per step: this rank's loss and the reference's loss on the same rows, and the max
    relative weight error against the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = float8_model(recipe)
    shard_mesh, _, fsdp_mesh = data_parallel_meshes(1)
    dmuon.dedicate_params(model, shard_mesh, projections)
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    optimizer = dmuon.Muon(
        model,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
    )
    reference = float8_model(recipe)
    reference_optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        projections,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
    )
    losses, reference_losses, max_errors = [], [], []
    for step_rows in rank_batches(world):
        loss = loss_of(model, step_rows[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        step_losses = step_on_first_rank(
            reference, reference_step, reference, reference_optimizer, step_rows, share_result=True
        )
        reference_losses.append(step_losses[rank])
        max_errors.append(max(relative_errors_to(model, reference).values()))
    state = get_dedicated_state(model)
    return {
        "losses": losses,
        "reference_losses": reference_losses,
        "max_errors": max_errors,
        "module_types": sorted({type(p.module).__name__ for p in state.params.values()}),
        "owners": sorted({p.owner.shard for p in state.params.values()}),
    }


def converted_after_dedicate_error(swap: str = "float8") -> str:
    """A module swap after ``dedicate_params``: the first forward's error. ``swap``: "float8"
    (``convert_to_float8_training``) or "linear" (``down_proj`` replaced by a new ``nn.Linear``
    that takes over its weight, as a wrapping library might)."""
    torch.manual_seed(0)
    model = Float8Mlp()
    shard_mesh, _, fsdp_mesh = data_parallel_meshes(1)
    dmuon.dedicate_params(model, shard_mesh, projections)
    if swap == "float8":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(
            model, module_filter_fn=lambda module, fqn: fqn.endswith("_proj")
        )
    else:
        for layer in model.layers:
            replacement = nn.Linear(HIDDEN, DIM, bias=False, device="meta")
            replacement.weight = layer.down_proj.weight
            layer.down_proj = replacement
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    dmuon.Muon(model, lr=LR)
    try:
        loss_of(model, rank_batches(dist.get_world_size())[0][dist.get_rank()])
    except RuntimeError as error:
        return str(error)
    return "no error"
