"""Pipeline parallelism as torchtitan runs it, on every rank of a gloo pool.

A ("pp", "dp") mesh; the tiny decoder cut into stage modules that keep the whole model's
parameter names (torchtitan's split); on each rank, per stage it holds (two with an interleaved
schedule): ``dedicate_params`` on the stage's dp dim, ``fully_shard`` per layer and on the stage
(when dp > 1), one ``dmuon.Muon`` sharing one ``dmuon.StepGroup`` over the pp dim; a real
schedule of ``torch.distributed.pipelining`` with ``scale_grads=False`` and the loss divided by
the number of microbatches (torchtitan's choice); ``dmuon.clip_grad_norm_`` over all the stages;
then each optimizer's step. The reference is the whole model in one process on the full batch.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows
from tests.distributed.scenarios_meta_init import init_weights
from tests.distributed.scenarios_protocol import TrainConfig, build_reference, relative_errors
from tests.distributed.shared_reference import plain_reference_step

NUM_LAYERS = 4
MICROBATCHES = 4
ROWS_PER_DP_RANK = 4  # one row per microbatch
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}


class DecoderStage(nn.Module):
    """Layers ``layer_ids`` of a ``TinyDecoder``, with its embedding on the first stage and its
    norm and head on the last. Parameter names are the whole model's (``layers.2.q_proj.weight``),
    as torchtitan's split keeps them."""

    def __init__(self, whole: TinyDecoder, layer_ids: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = whole.embed if first else None
        self.layers = nn.ModuleDict({str(i): whole.layers[i] for i in layer_ids})
        self.norm = whole.norm if last else None
        self.lm_head = whole.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


@dataclass(kw_only=True)
class PipelineConfig:
    schedule: str = "1f1b"
    dp: int = 1
    steps: int = 4
    clip_max_norm: float | None = 0.05
    on_meta: bool = False  # build the whole model on the meta device, init after to_empty
    nonfinite: str = "ignore"
    # (step, stage index, parameter name): a NaN put into that gradient on the stage's ranks of
    # dp index 0 (its owner's master for a dedicated parameter), after backward.
    nan_at: tuple[int, int, str] | None = None

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.schedule == "interleaved_1f1b" else 1


def stage_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One microbatch's mean cross-entropy over the microbatch count: the sum over microbatches
    is the loss of the rank's rows (the schedule runs with ``scale_grads=False``)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, target.reshape(-1)) / MICROBATCHES


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its stage modules, their optimizers, the schedule."""

    config: PipelineConfig
    mesh: DeviceMesh  # ("pp", "dp")
    stage_ids: list[int]
    num_stages: int
    parts: list[DecoderStage]
    optimizers: list[dmuon.Muon]
    schedule: object

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def forward_backward(self, rows: torch.Tensor) -> float:
        """One schedule step on this dp rank's ``rows``; the loss of the rows (last stage)."""
        inputs, targets = rows[:, :-1], rows[:, 1:]
        losses: list[torch.Tensor] = []
        if 0 in self.stage_ids and self.has_last_stage:
            self.schedule.step(inputs, target=targets, losses=losses)
        elif 0 in self.stage_ids:
            self.schedule.step(inputs)
        else:
            self.schedule.step(target=targets, losses=losses)
        return float(sum(loss.item() for loss in losses))

    def train_step(self, rows: torch.Tensor, after_backward=None) -> float:
        """torchtitan's train step: zero_grad, the schedule, one clip over every stage, step."""
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        loss = self.forward_backward(rows)
        if after_backward is not None:
            after_backward(self)
        if self.config.clip_max_norm is not None:
            dmuon.clip_grad_norm_(self.parts, self.optimizers, self.config.clip_max_norm)
        for optimizer in self.optimizers:
            optimizer.step()
        return loss


def build_pipeline(config: PipelineConfig) -> Pipeline:
    """This rank's stages, set up as torchtitan's ``pipeline_llm`` and parallelize function do."""
    world = dist.get_world_size()
    pp = world // config.dp
    mesh = init_device_mesh("cpu", (pp, config.dp), mesh_dim_names=("pp", "dp"))
    num_stages = pp * config.stages_per_rank
    stage_ids = [
        mesh["pp"].get_local_rank() + chunk * pp for chunk in range(config.stages_per_rank)
    ]
    torch.manual_seed(0)
    with torch.device("meta" if config.on_meta else "cpu"):
        whole = TinyDecoder(NUM_LAYERS)
    per_stage = NUM_LAYERS // num_stages
    step_group = dmuon.StepGroup(pp_mesh=mesh["pp"])
    parts, optimizers, stages = [], [], []
    for stage_id in stage_ids:
        part = DecoderStage(
            whole,
            range(stage_id * per_stage, (stage_id + 1) * per_stage),
            first=stage_id == 0,
            last=stage_id == num_stages - 1,
        )
        # The parallelize function, once per part on every rank.
        dmuon.dedicate_params(part, mesh["dp"], proj_predicate)
        if config.dp > 1:
            for layer in part.layers.values():
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(part, mesh=mesh["dp"])
        if config.on_meta:
            part.to_empty(device="cpu")
            init_weights(part, "init_weights")
        parts.append(part)
        optimizers.append(
            dmuon.Muon(
                part,
                lr=0.02,
                weight_decay=0.01,
                ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas"),
                nonfinite=config.nonfinite,
                step_group=step_group,
            )
        )
        stages.append(
            PipelineStage(
                part, stage_id, num_stages, torch.device("cpu"), group=mesh["pp"].get_group()
            )
        )
    schedule = SCHEDULES[config.schedule](
        stages if config.stages_per_rank > 1 else stages[0],
        n_microbatches=MICROBATCHES,
        loss_fn=stage_loss,
        scale_grads=False,
    )
    return Pipeline(config, mesh, stage_ids, num_stages, parts, optimizers, schedule)


def data(config: PipelineConfig) -> list[torch.Tensor]:
    """Every step's full batch: ``ROWS_PER_DP_RANK`` rows per dp rank."""
    return batches(config.steps, config.dp, per_rank=ROWS_PER_DP_RANK)


def train_pipeline_against_reference(**kwargs) -> dict:
    """Train the pipeline and the reference side by side: per step, the max relative error of
    this rank's weights, and on the last stage its loss and the reference's on the same rows."""
    config = PipelineConfig(**kwargs)
    pipeline = build_pipeline(config)
    reference, reference_optimizer = build_reference(TrainConfig(model={"num_layers": NUM_LAYERS}))
    if config.on_meta:
        init_weights(reference, "init_weights")
    max_errors, losses, reference_losses = [], [], []
    for batch in data(config):
        rows = rank_rows(batch, pipeline.dp_rank, config.dp)
        losses.append(pipeline.train_step(rows))
        with torch.no_grad():
            reference_losses.append(loss_fn(reference, rows).item())
        plain_reference_step(reference, reference_optimizer, batch, config.clip_max_norm)
        errors = relative_errors(_stage_weights(pipeline.parts), reference)
        max_errors.append(max(errors.values()))
    return {
        "max_errors": max_errors,
        "losses": losses if pipeline.has_last_stage else None,
        "reference_losses": reference_losses,
    }


def _stage_weights(parts) -> dict[str, torch.Tensor]:
    """Full weights of this rank's stages it can see: owned masters and the other parameters."""
    weights = {}
    for part in parts:
        state = get_dedicated_state(part)
        weights.update({p.fqn: p.master.detach().clone() for p in state.iter_owned_masters()})
        for name, param in part.named_parameters():
            if name not in state.params:
                value = param.full_tensor() if isinstance(param, DTensor) else param
                weights[name] = value.detach().clone()
    return weights


def nonfinite_on_one_stage(**kwargs) -> dict:
    """Train until step ``nan_at[0]``, whose gradient of ``nan_at[2]`` on stage ``nan_at[1]``
    gets a NaN: what each rank saw of that step (its outcome, its weights unchanged, the
    warnings)."""
    config = PipelineConfig(**kwargs)
    nan_step, nan_stage, nan_name = config.nan_at
    pipeline = build_pipeline(config)
    for step, batch in enumerate(data(config)[:nan_step], 1):
        rows = rank_rows(batch, pipeline.dp_rank, config.dp)
        if step < nan_step:
            pipeline.train_step(rows)
            continue
        before = _local_weights(pipeline.parts)
        outcome = "stepped"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                pipeline.train_step(
                    rows, functools.partial(_nan_into_gradient, stage=nan_stage, name=nan_name)
                )
            except RuntimeError as error:
                outcome = f"raised: {error}"
        after = _local_weights(pipeline.parts)
    return {
        "outcome": outcome,
        "unchanged": all(torch.equal(before[name], after[name]) for name in before),
        "warnings": [str(w.message) for w in caught if "dmuon.Muon" in str(w.message)],
    }


def _nan_into_gradient(pipeline: Pipeline, stage: int, name: str) -> None:
    """A NaN in ``name``'s gradient on ``stage``, on dp rank 0 (on its owner if dedicated)."""
    if stage not in pipeline.stage_ids:
        return
    part = pipeline.parts[pipeline.stage_ids.index(stage)]
    dedicated = get_dedicated_state(part).params.get(name)
    if dedicated is not None:
        target = dedicated.master  # None but on the owner
    else:
        target = dict(part.named_parameters())[name] if pipeline.dp_rank == 0 else None
    if target is not None:
        grad = target.grad.to_local() if isinstance(target.grad, DTensor) else target.grad
        grad.view(-1)[0] = math.nan


def _local_weights(parts) -> dict[str, torch.Tensor]:
    """This rank's own copies: owned masters and local shards (what a skipped step must keep)."""
    weights = {}
    for index, part in enumerate(parts):
        state = get_dedicated_state(part)
        for p in state.iter_owned_masters():
            weights[f"{index}:{p.fqn}"] = p.master.detach().clone()
        for name, param in part.named_parameters():
            if name not in state.params:
                local = param.to_local() if isinstance(param, DTensor) else param
                weights[f"{index}:{name}"] = local.detach().clone()
    return weights


def collectives_of_clip_and_steps(**kwargs) -> dict:
    """After a warm-up step, the collectives ``dmuon.clip_grad_norm_`` and then the optimizers'
    steps issue, each as (kind, group size)."""
    from tests.distributed.comm_counter import count_collectives

    config = PipelineConfig(**kwargs)
    pipeline = build_pipeline(config)
    first, second = (rank_rows(batch, pipeline.dp_rank, config.dp) for batch in data(config)[:2])
    pipeline.train_step(first)
    for optimizer in pipeline.optimizers:
        optimizer.zero_grad()
    pipeline.forward_backward(second)
    with count_collectives() as clip_log:
        if config.clip_max_norm is not None:
            dmuon.clip_grad_norm_(pipeline.parts, pipeline.optimizers, config.clip_max_norm)
    with count_collectives() as step_log:
        for optimizer in pipeline.optimizers:
            optimizer.step()
    return {
        what: sorted((c.kind, len(c.group_ranks)) for c in log.calls)
        for what, log in (("clip", clip_log), ("steps", step_log))
    }


def step_group_setup_errors() -> dict[str, str]:
    """On a pp mesh of every rank: the errors of a 2-D pp_mesh and of nonfinite policies that
    differ between pipeline stages (rank 0 "skip", the others "ignore")."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("pp", "dp"))
    messages = {}
    try:
        dmuon.StepGroup(pp_mesh=mesh)
    except ValueError as error:
        messages["2d"] = str(error)
    model = TinyDecoder()
    dmuon.dedicate_params(model, mesh["dp"], proj_predicate)
    try:
        dmuon.Muon(
            model,
            nonfinite="skip" if dist.get_rank() == 0 else "ignore",
            step_group=dmuon.StepGroup(pp_mesh=mesh["pp"]),
        )
    except ValueError as error:
        messages["policies"] = str(error)
    return messages
