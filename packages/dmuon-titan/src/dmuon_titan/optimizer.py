"""``DMuonOptimizers``: torchtitan's optimizers container, holding one ``dmuon.Muon`` per model
part.

Owns the optimizers of a dmuon job: one ``dmuon.Muon`` per model part (pipeline stage chunk),
all in one ``dmuon.StepGroup`` over the pipeline dim so that every stage takes or skips a step
together; the AdamW route's hyperparameters read from the job's own AdamW config; and the
container's state dict in torchtitan's flat, FQN-keyed checkpoint format
(``state.<fqn>.<name>``, ``param_groups.<fqn>.<key>``), written through ``dmuon.checkpoint`` so
that it loads on any layout. It must not touch the model's weights or the training loop.

[Note: stages without Muon matrices]
``dmuon.Muon`` refuses a model with no parameter on the Muon route unless ``allow_no_muon=True``
(almost always a predicate that matched nothing). Its check reads the model part it is given,
which every rank of that part's data-parallel group sees alike, so those ranks agree; under
pipeline parallelism, though, torchtitan's own splits make stages that hold no block matrix (with
``pipeline_parallel_layers_per_stage 1``: the embeddings alone, or the norm and the head), and a
per-stage refusal would stop those ranks while their pipeline peers wait in a collective. So the
decision here is the job's: the Muon matrices of every model part are counted and summed over
the pipeline dim (one all-reduce at construction), and a part with none trains on AdamW alone
(``allow_no_muon=True``), as it does without dmuon, whenever some stage has Muon matrices. When
no stage has any, every rank passes ``allow_no_muon=False`` and every rank raises the same error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

import dmuon
import dmuon.checkpoint
import dmuon.inspect
from dmuon_titan.config import DMuonConfig
from dmuon_titan.recipe import DIST_MUON, MuonRecipe, read_recipe

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# torchtitan's AdamW kwargs -> dmuon.Muon's AdamW route arguments.
_ADAMW_ARGUMENTS = {
    "lr": "adamw_lr",
    "betas": "adamw_betas",
    "eps": "adamw_eps",
    "weight_decay": "adamw_weight_decay",
}
_ADAMW_NAMES = ("AdamW",)


class DMuonOptimizers(OptimizersContainer):
    """``dmuon.Muon`` for every model part: Muon on the dedicated matrices, AdamW (with the
    job's AdamW settings) on everything else."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        dmuon: DMuonConfig = field(default_factory=DMuonConfig)
        # Set by DMuonTrainer once the meshes exist: the pipeline dim, None without a pipeline.
        # Not an option (the leading underscore keeps it out of the logged config).
        _pp_mesh: DeviceMesh | None = None

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        self.model_parts = model_parts
        recipe = read_recipe(config)  # the job's DistMuon group: the Muon route's settings
        adamw, param_groups = adamw_route(config.param_groups, config.dmuon, recipe)
        step_group = dmuon.StepGroup(pp_mesh=config._pp_mesh)
        options = muon_options(config.dmuon, recipe)
        # See [Note: stages without Muon matrices].
        job_has_muon = muon_matrices_in_job(model_parts, config._pp_mesh) > 0
        self.optimizers = [
            dmuon.Muon.from_options(
                part,
                options,
                param_groups=param_groups,
                # The job's param groups say what decays; dmuon's HF rule would exempt norms.
                no_decay=None,
                step_group=step_group,
                allow_no_muon=job_has_muon,
                **adamw,
            )
            for part in model_parts
        ]
        all_params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        # torch's Optimizer state (hooks such as MoE load balancing's step pre-hook).
        Optimizer.__init__(self, all_params, {})

    def state_dict(self) -> dict[str, Any]:
        """Flat and FQN-keyed, like torchtitan's own container; collective."""
        result: dict[str, Any] = {}
        for part, optimizer in zip(self.model_parts, self.optimizers, strict=True):
            result.update(dmuon.checkpoint.get_optimizer_state_dict(part, optimizer, options=_FLAT))
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, optimizer in zip(self.model_parts, self.optimizers, strict=True):
            dmuon.checkpoint.set_optimizer_state_dict(part, optimizer, state_dict, options=_FLAT)


def muon_matrices_in_job(model_parts: list[nn.Module], pp_mesh: DeviceMesh | None) -> int:
    """The dedicated parameters on the Muon route in every pipeline stage (this rank's parts,
    summed over ``pp_mesh``; collective there). See [Note: stages without Muon matrices]."""
    count = sum(
        sum(param.route == "muon" for param in dmuon.inspect.view(part).params.values())
        for part in model_parts
        if dmuon.inspect.is_prepared(part)
    )
    if pp_mesh is None:
        return count
    total = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(total, group=pp_mesh.get_group())
    return int(total.item())


def muon_options(settings: DMuonConfig, recipe: MuonRecipe | None) -> dmuon.MuonOptions:
    """dmuon.Muon's Muon-route options: ``dmuon.*``'s (``DMuonConfig.muon_options``), where the
    job's DistMuon recipe sets one, the recipe's (``lr``, ``weight_decay``, ``momentum``,
    ``nesterov``, ``adjust_lr``), checked as ``dmuon.Muon`` checks them."""
    options = settings.muon_options()
    if recipe is None:
        return options
    return replace(options, **recipe.hyperparameters)


def adamw_route(
    param_groups: list[ParamGroupConfig], config: DMuonConfig, recipe: MuonRecipe | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The AdamW route's arguments for ``dmuon.Muon`` and its ``param_groups``, from the job's
    optimizer config: the last group (torchtitan's catch-all) gives the defaults, the groups
    before it become param groups of the parameters they match off the Muon route; a value set in
    ``config`` (``dmuon.adamw_*``) wins. A DistMuon group is the Muon route (``recipe``), not an
    AdamW group."""
    if recipe is not None:
        param_groups = [g for g in param_groups if g.optimizer_name != DIST_MUON]
    if param_groups:
        refused = [g for g in param_groups if g.optimizer_name not in _ADAMW_NAMES]
        if refused:
            raise ValueError(
                f"dmuon_titan replaces the job's optimizer with dmuon.Muon, whose non-Muon "
                f"parameters train with AdamW, but optimizer.param_groups asks for "
                f"{sorted({g.optimizer_name for g in refused})} (patterns "
                f"{[g.pattern for g in refused]}). Use AdamW for those groups, or train this job "
                "without dmuon."
            )
    adamw: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    if param_groups:
        *specific, catch_all = param_groups
        adamw = _adamw_arguments(catch_all.optimizer_kwargs)
        for group in specific:
            pattern = re.compile(group.pattern)
            groups.append(
                {
                    "params": _off_muon_matching(pattern, recipe or config),
                    **{
                        key: value
                        for key, value in group.optimizer_kwargs.items()
                        if key in _ADAMW_ARGUMENTS
                    },
                }
            )
    for key, argument in _ADAMW_ARGUMENTS.items():
        value = getattr(config, argument)
        if value is not None:
            adamw[argument] = tuple(value) if key == "betas" else value
    return adamw, groups


def _adamw_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        argument: tuple(kwargs[key]) if key == "betas" else kwargs[key]
        for key, argument in _ADAMW_ARGUMENTS.items()
        if key in kwargs
    }


def _off_muon_matching(pattern: re.Pattern, config: DMuonConfig | MuonRecipe):
    def matches(name: str, param) -> bool:
        return pattern.search(name) is not None and not config.is_muon(name, param)

    return matches
