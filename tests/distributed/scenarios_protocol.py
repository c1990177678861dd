"""Scenarios of the ownership protocol, run on every rank of a gloo pool.

Each builds the same tiny decoder on every rank and a single-process reference of it, trains
both on the same data (the reference on the full batch, each rank on its rows) and reports what
the test asserts. Collectives run for real; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon.testing import dedicate_and_shard
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows
from tests.distributed.reference_errors import relative_errors_to
from tests.distributed.shared_reference import step_on_first_rank
from tests.reference_optim import ReferenceMuonAdamW


@dataclass(kw_only=True)
class TrainConfig:
    replicas: int = 1  # > 1: HSDP with a ("replicate", "shard") mesh
    steps: int = 10
    ns_backend: str = "gram"
    ns_dtype: str = "float32"
    reshard_after_forward: bool = True
    replicate_async: bool = True
    micro_batches: int = 1  # > 1: gradient accumulation under dmuon.no_sync
    model: dict = field(default_factory=dict)
    weight_decay: float = 0.01
    two_steps_without_forward: bool = False
    frozen: tuple[str, ...] = ()  # parameter names with requires_grad=False
    # Frozen only once dedicate_params and Muon are set up (the reference: from the start).
    frozen_after_setup: tuple[str, ...] = ()
    # A second loss backpropagated through the first one's retained graph.
    second_backward: bool = False
    # A grad-enabled forward never backpropagated (a validation loss) just before each step.
    forward_before_step: bool = False
    compile_backend: str | None = None  # torch.compile each layer after fully_shard
    clip_max_norm: float | None = None  # clip gradients before each step
    clip_norm_type: float = 2.0
    clip_foreach: bool | None = None


def make_model(config: TrainConfig, frozen: tuple[str, ...] | None = None) -> TinyDecoder:
    torch.manual_seed(0)
    model = TinyDecoder(**config.model)
    freeze(model, config.frozen if frozen is None else frozen)
    return model


def freeze(model, names: tuple[str, ...]) -> None:
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(False)


def build(config: TrainConfig):
    """The dmuon model (dedicated + fully_shard) and its optimizer, as a user writes it."""
    model = make_model(config)
    owners = dedicate_and_shard(model, "cpu", config.replicas, config.reshard_after_forward)
    if config.compile_backend is not None:
        for layer in model.layers:
            layer.compile(backend=config.compile_backend)
    ns_dtype = getattr(torch, config.ns_dtype)
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=config.weight_decay,
        ns_backend=NewtonSchulz(backend=config.ns_backend, dtype=ns_dtype, kernel="cublas"),
        replicate_async=config.replicate_async,
    )
    freeze(model, config.frozen_after_setup)
    return model, optimizer, owners


def build_reference(config: TrainConfig):
    reference = make_model(config, frozen=config.frozen + config.frozen_after_setup)
    orthogonalize = functools.partial(
        newton_schulz, backend=config.ns_backend, dtype=getattr(torch, config.ns_dtype)
    )
    optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        proj_predicate,
        lr=0.02,
        weight_decay=config.weight_decay,
        orthogonalize=orthogonalize,
    )
    return reference, optimizer


def train_step(model, optimizer, batch: torch.Tensor, config: TrainConfig) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = rank_rows(batch, rank, world)
    micro = rows.chunk(config.micro_batches)
    total = 0.0
    for index, chunk in enumerate(micro):
        last = index == len(micro) - 1
        context = dmuon.no_sync(model) if not last else contextlib.nullcontext()
        with context:
            loss = forward_backward(model, chunk, config, len(micro))
        total += loss.item()
    if config.forward_before_step:
        loss_fn(model, rows)
        # FSDP2 leaves its own parameters unsharded (stale after the step) under Z2; only the
        # dedicated ones are under test here.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    if config.clip_max_norm is not None:
        dmuon.clip_grad_norm_(
            model,
            optimizer,
            config.clip_max_norm,
            norm_type=config.clip_norm_type,
            foreach=config.clip_foreach,
        )
    optimizer.step()
    if config.two_steps_without_forward:
        optimizer.step()
    optimizer.zero_grad()
    return total


def forward_backward(model, tokens: torch.Tensor, config: TrainConfig, parts: int = 1):
    """The loss on ``tokens`` divided by ``parts``, backpropagated. With ``second_backward`` a
    second loss of another direction (the logits' mean square) then goes through the retained
    graph, so its gradients must add to the first's."""
    if not config.second_backward:
        loss = loss_fn(model, tokens) / parts
        loss.backward()
        return loss
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)) / parts
    loss.backward(retain_graph=True)
    (logits.square().mean() / parts).backward()
    return loss


def reference_step(reference, optimizer, batch: torch.Tensor, config: TrainConfig) -> float:
    loss = forward_backward(reference, batch, config)
    if config.clip_max_norm is not None:
        torch.nn.utils.clip_grad_norm_(
            reference.parameters(), config.clip_max_norm, norm_type=config.clip_norm_type
        )
    optimizer.step()
    if config.two_steps_without_forward:
        optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def current_weights(model) -> dict[str, torch.Tensor]:
    """Full weights this rank can see: owned dedicated masters and every FSDP2 parameter."""
    state = get_dedicated_state(model)
    weights = {p.fqn: p.master.detach().clone() for p in state.iter_owned_masters()}
    for name, param in model.named_parameters():
        if name in state.params:
            continue
        weights[name] = param.full_tensor().detach().clone()
    return weights


def relative_errors(weights: dict[str, torch.Tensor], reference) -> dict[str, float]:
    expected = dict(reference.named_parameters())
    return {
        name: ((value - expected[name]).norm() / expected[name].norm().clamp_min(1e-30)).item()
        for name, value in weights.items()
    }


def train_against_reference(**kwargs) -> dict:
    """Train dmuon and the reference side by side; per-step max relative parameter error."""
    config = TrainConfig(**kwargs)
    model, optimizer, owners = build(config)
    reference, reference_optimizer = build_reference(config)
    world = dist.get_world_size()
    max_errors, losses = [], []
    for batch in batches(config.steps, world):
        losses.append(train_step(model, optimizer, batch, config))
        step_on_first_rank(reference, reference_step, reference, reference_optimizer, batch, config)
        errors = relative_errors_to(model, reference)
        max_errors.append(max(errors.values()))
    return {
        "max_errors": max_errors,
        "losses": losses,
        "owned": {
            p.fqn: p.master.detach().clone()
            for p in get_dedicated_state(model).iter_owned_masters()
        },
        "owners": {name: (c.shard, c.replicate) for name, c in owners.items()},
    }


def counted_second_step(model, optimizer, config: TrainConfig):
    """The c10d ops one training step issues, after a warm-up step, as a ``CollectiveLog``."""
    from tests.distributed.comm_counter import count_collectives

    first, second = batches(2, dist.get_world_size())
    train_step(model, optimizer, first, config)
    with count_collectives() as log:
        train_step(model, optimizer, second, config)
        dmuon.wait_all_replicate_broadcasts(model)
    return log


def count_step_communication(**kwargs) -> dict:
    """Bytes moved by dmuon's collectives in one training step (after a warm-up step)."""
    config = TrainConfig(**kwargs)
    model, optimizer, _ = build(config)
    log = counted_second_step(model, optimizer, config)
    state = get_dedicated_state(model)
    return {
        "broadcast_received": log.broadcast_bytes_received(),
        "reduce_sent": log.reduce_bytes_sent(),
        "numels": [p.numel for p in state.params.values()],
        "element_size": 4,
    }


def ns_request_mismatch() -> str:
    """Rank 1 asks for a different Newton-Schulz backend; every rank must get the error."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = TinyDecoder()
    dmuon.dedicate_params(model, mesh, proj_predicate)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)  # replicated, so Muon takes it
    backend = "direct" if dist.get_rank() == 1 else "gram"
    try:
        dmuon.Muon(model, ns_backend=backend)
    except ValueError as error:
        return str(error)
    finally:
        del ddp_model
    return "no error"


def dedicated_set_mismatch() -> str:
    """Rank 1 dedicates fewer parameters than the others."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = TinyDecoder()
    if dist.get_rank() == 1:
        predicate = lambda name, p: proj_predicate(name, p) and "q_proj" not in name  # noqa: E731
    else:
        predicate = proj_predicate
    try:
        dmuon.dedicate_params(model, mesh, predicate)
        dmuon.Muon(model)
    except ValueError as error:
        return str(error)
    return "no error"


def dedicate_option_mismatch(option: str) -> str:
    """Rank 1 passes ``dedicate_params`` another value of ``option`` than the others."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = TinyDecoder()
    odd = dist.get_rank() == 1
    options = {
        "reshard_after_forward": {"reshard_after_forward": not odd},
        "layer_id_fn": {"layer_id_fn": (lambda name: "one") if odd else None},
        "reduce_dtype": {
            "param_policy": {"defaults": {"reduce_dtype": torch.float64 if odd else None}}
        },
        "hook_boundary_predicate": {
            "hook_boundary_predicate": (lambda module: module is model) if odd else None
        },
    }[option]
    try:
        dmuon.dedicate_params(model, mesh, proj_predicate, **options)
    except ValueError as error:
        return str(error)
    return "no error"


def three_line_integration() -> list[float]:
    """SPEC.md's integration, verbatim, on a model with a ``.layers`` list."""
    world = dist.get_world_size()
    dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    torch.manual_seed(0)
    model = TinyDecoder()

    import dmuon

    dmuon.dedicate_params(model, dp_mesh, predicate=lambda name, p: "proj" in name and p.ndim == 2)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)  # Muon for dedicated, AdamW for the rest

    losses = []
    batch = batches(1, world)[0]  # the same batch each step: memorising it lowers the loss
    for _ in range(6):
        loss = loss_fn(model, rank_rows(batch, dist.get_rank(), world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def error_messages() -> dict[str, str]:
    """Bad meshes and call orders on 2 ranks; each entry is the message dmuon raised."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    hsdp = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    other = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_replicate", "fsdp"))
    parts = init_device_mesh("cpu", (1, world), mesh_dim_names=("outer", "inner"))
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    cases = {
        "unnamed": lambda: dict(
            mesh=hsdp["shard"], replicate_mesh=DeviceMesh("cpu", list(range(world)))
        ),
        "1d": lambda: dict(mesh=hsdp["shard"], replicate_mesh=flat),
        "two_meshes": lambda: dict(mesh=other["fsdp"], replicate_mesh=hsdp["replicate"]),
        "same_dim": lambda: dict(mesh=hsdp["shard"], replicate_mesh=hsdp["shard"]),
        "overlapping": lambda: dict(
            mesh=parts["outer", "inner"]._flatten("outer_inner"), replicate_mesh=parts["inner"]
        ),
        "2d_as_mesh": lambda: dict(mesh=hsdp, replicate_mesh=None),
        # Any names: the roles come from the arguments.
        "other_names": lambda: dict(mesh=other["fsdp"], replicate_mesh=other["dp_replicate"]),
    }
    messages = {}
    for case, meshes in cases.items():
        try:
            dmuon.dedicate_params(TinyDecoder(), predicate=proj_predicate, **meshes())
            messages[case] = "no error"
        except (ValueError, TypeError) as error:
            messages[case] = str(error)

    model = TinyDecoder()
    fully_shard(model, mesh=flat)
    try:
        dmuon.dedicate_params(model, flat, proj_predicate)
        messages["after_fully_shard"] = "no error"
    except RuntimeError as error:
        messages["after_fully_shard"] = str(error)

    try:
        dmuon.dedicate_params(TinyDecoder(), None, proj_predicate)
        messages["mesh_none"] = "no error"
    except ValueError as error:
        messages["mesh_none"] = str(error)

    unnamed = DeviceMesh("cpu", list(range(world)))
    model = TinyDecoder()
    weight = model.layers[0].q_proj.weight
    model.layers[0].q_proj.weight = torch.nn.Parameter(
        distribute_tensor(weight, unnamed, [Shard(0)])
    )
    try:
        dmuon.dedicate_params(model, flat, proj_predicate)
        messages["tp_unnamed"] = "no error"
    except ValueError as error:
        messages["tp_unnamed"] = str(error)
    return messages


def fully_shard_skips_dedicated_parameters() -> dict:
    """What FSDP2 manages after dedicate_params: nothing dedicated, everything else."""
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = TinyDecoder()
    dmuon.dedicate_params(model, mesh, proj_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return {
        name: (isinstance(param, DTensor), tuple(param.shape))
        for name, param in model.named_parameters()
    }


def sent_messages_alive_during_backward(num_layers: int) -> dict:
    """How many gradient messages this rank had sent to other owners and still held, at most,
    each time it issued a reduce (a spy around ``collectives.reduce_sum``, still reducing)."""
    import weakref

    from dmuon import collectives

    config = TrainConfig(model={"num_layers": num_layers})
    model, optimizer, _ = build(config)
    rank = dist.get_rank()
    sent: list[weakref.ref] = []
    most_alive = 0
    reduce_sum = collectives.reduce_sum

    def spy(tensor, dst_rank, group, purpose=None):
        nonlocal most_alive
        most_alive = max(most_alive, sum(ref() is not None for ref in sent))
        if dst_rank != rank:
            sent.append(weakref.ref(tensor))
        return reduce_sum(tensor, dst_rank, group, purpose)

    collectives.reduce_sum = spy
    try:
        for batch in batches(2, dist.get_world_size()):
            train_step(model, optimizer, batch, config)
    finally:
        collectives.reduce_sum = reduce_sum
    boundaries = get_dedicated_state(model).boundaries
    return {
        "most_alive": most_alive,
        "sent": len(sent),
        "segments_per_boundary": max(len(b.segments) for b in boundaries),
    }
