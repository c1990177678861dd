"""``DMuonTrainer``: torchtitan's ``Trainer`` with dmuon switched on.

Owns the five places where a dmuon job differs from a stock one, and nothing else:

- the model spec's parallelize function dedicates the Muon matrices before the first
  ``fully_shard`` (``parallelize``), on every pipeline stage;
- the optimizers are ``DMuonOptimizers`` (``optimizer``);
- the gradient clip of ``train_step`` is ``dmuon.clip_grad_norm_`` over every model part and
  pipeline stage (see [Note: the train step's clip]);
- torchtitan's DCP ``CheckpointManager`` becomes ``ChecksummedCheckpointManager``
  (``checkpoint``): its checkpoints carry dmuon's checksums and are verified at load;
- with ``--dmuon.qk_clip_threshold`` set, each model part with multi-head latent attention gets
  MuonClip's QK-clip (``qk_clip_titan``) on its own optimizer, built after it. The clip runs
  inside that optimizer's ``step()`` (its step pre-hook reduces the maxima the forwards since the
  previous step recorded, its master-update hook rescales): once per optimizer step, however
  many microbatches (gradient accumulation, pipeline) the step's forwards ran. Under pipeline
  parallelism the stages' metadata inference is not observed (see [Note: the pipeline's
  metadata inference]).

Settings dmuon cannot work with are set or refused here, with the reason: CUDA graphs of the
forward/backward are turned off (dmuon's hooks issue collectives and host-side waits that a
captured graph cannot replay); the default ``spmd_types`` backend becomes ``partial_dtensor``.
A job whose optimizer is one of torchtitan's Muon recipes (a ``DistMuon`` param group and its
compute layouts) keeps its Muon matrices, hyperparameters and per-matrix cuts
(``dmuon_titan.recipe``), read once here for the parallelize function and in the optimizers.
A checkpoint without dmuon's optimizer state (a stock run's) fails to load with an error naming
the flag that loads it (``--checkpoint.exclude_from_loading optimizer``), not DCP's bare
missing key.

[Note: the train step's clip]
torchtitan's ``train_step`` clips with ``torchtitan.distributed.utils.clip_grad_norm_`` over
``model.parameters()``, which never sees the owners' fp32 masters (they are not module
parameters): the norm would leave out every Muon matrix, and clipping would not scale them.
``train_step`` looks the function up on that module at call time, so for the duration of the
step ``DMuonTrainer`` puts ``dmuon.clip_grad_norm_`` over its parts and optimizers in its place
(same arguments, same returned total norm, logged by torchtitan as usual), rather than
re-implementing the whole step. It is the one place dmuon-titan reaches into torchtitan's
modules.

[Note: the pipeline's metadata inference]
In its first step a pipeline schedule runs each stage's forward once more, before the
microbatches, to learn the shapes the stages exchange (torch's
``PipelineStage._forward_metadata_inference``, torch 2.13 and 2.14): the first stage on a real
microbatch, every other stage on tensors made from the received shapes, ``torch.empty``'s
uninitialized memory, with gradients on; then a backward (``_backward_metadata_inference``),
which under activation checkpointing runs the forward again. The QK-clip's observing hook would
record those forwards like training ones: attention logits of garbage inputs, taken into the
step's maxima (measured on the DeepSeek-V3 debug model, pp 2: the second stage's first clip
scaled its heads over the threshold by the garbage's maxima, 46% off the reference's update of
one of them). So both run inside ``qk_clip.unobserved()`` (both: a checkpointed region must
recompute the operations its forward ran, and the observation is some of them). A torch whose
stages lack these methods infers the shapes some other way, unknown here: the clip under
pipeline parallelism is then refused, naming the method.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torchtitan.distributed.utils as titan_dist_utils
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

import dmuon
from dmuon.checkpoint import MOMENTUM_BUFFER
from dmuon_titan.checkpoint import ChecksummedCheckpointManager
from dmuon_titan.config import DMuonConfig
from dmuon_titan.optimizer import DMuonOptimizers
from dmuon_titan.parallelize import dedicating
from dmuon_titan.qk_clip import mla_attention_heads, qk_clip_titan, unobserved
from dmuon_titan.recipe import read_recipe


class DMuonTrainer(Trainer):
    """torchtitan's ``Trainer``, training with dmuon: build it with ``enable(config).build()``
    or ``--module dmuon_titan`` on the command line."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        dmuon: DMuonConfig = field(default_factory=DMuonConfig)
        """dmuon's settings (Muon hyperparameters, Newton-Schulz, which parameters)."""

    def __init__(self, config: Config) -> None:
        _switch_on(config)
        super().__init__(config)
        self.checkpointer.load = _naming_the_fix_for_stock_checkpoints(self.checkpointer.load)
        self.qk_clips = _qk_clips(
            self.model_parts,
            self.optimizers.optimizers,
            self.config.dmuon,
            pipeline=self.parallel_dims.pp_enabled,
        )
        if self.qk_clips and self.parallel_dims.pp_enabled:
            _without_observing_metadata_inference(self.pp_schedule)

    def init_distributed(self) -> ParallelDims:
        parallel_dims = super().init_distributed()
        self.config.optimizer._pp_mesh = parallel_dims.get_optional_mesh("pp")
        return parallel_dims

    def train_step(self, data_iterator) -> None:
        with self._clipping_with_dmuon():
            super().train_step(data_iterator)

    @contextlib.contextmanager
    def _clipping_with_dmuon(self) -> Iterator[None]:
        """See [Note: the train step's clip]."""
        stock = titan_dist_utils.clip_grad_norm_
        titan_dist_utils.clip_grad_norm_ = self._clip_grad_norm
        try:
            yield
        finally:
            titan_dist_utils.clip_grad_norm_ = stock

    def _clip_grad_norm(
        self,
        parameters: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        pp_mesh: Any = None,
        ep_enabled: bool = False,
    ) -> torch.Tensor:
        # ``parameters`` are the model parts' (placeholders included); the optimizers know
        # where every gradient they update lives, and their step group spans the pipeline.
        return dmuon.clip_grad_norm_(
            self.model_parts,
            self.optimizers.optimizers,
            max_norm,
            norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
        )


def _qk_clips(
    model_parts: list, optimizers: list, settings: DMuonConfig, *, pipeline: bool
) -> list[dmuon.QKClip]:
    """One ``qk_clip_titan`` per model part with MLA layers, on its own ``dmuon.Muon``; none
    without ``dmuon.qk_clip_threshold``. A pipeline stage without attention (the embeddings, or
    the norm and the head) has nothing to clip; a job without a pipeline and without MLA is
    refused by ``qk_clip_titan``, naming the model."""
    if settings.qk_clip_threshold is None:
        return []
    clips = [
        qk_clip_titan(
            part,
            optimizer,
            threshold=settings.qk_clip_threshold,
            alpha=settings.qk_clip_alpha,
            gqa=settings.qk_clip_gqa,
        )
        for part, optimizer in zip(model_parts, optimizers, strict=True)
        if not pipeline or mla_attention_heads(part)
    ]
    logger.info(
        f"dmuon_titan: QK-clip at threshold {settings.qk_clip_threshold} on "
        f"{sum(len(clip.layers) for clip in clips)} attention layers of this rank's model parts."
    )
    return clips


# The pipeline stage's methods that run its forward once for shapes, and its backward (with
# activation checkpointing, the forward again) for the gradients' (torch 2.13, 2.14).
_METADATA_INFERENCE = ("_forward_metadata_inference", "_backward_metadata_inference")


def _without_observing_metadata_inference(schedule) -> None:
    """Each of this rank's stages of ``schedule`` runs its metadata inference inside
    ``qk_clip.unobserved()``; see [Note: the pipeline's metadata inference]."""
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage, method in ((stage, method) for stage in stages for method in _METADATA_INFERENCE):
        infer = getattr(stage, method, None)
        if infer is None:
            raise ValueError(
                f"dmuon_titan: QK-clip under pipeline parallelism keeps each stage's passes for "
                f"shapes (torch's PipelineStage.{method}, on uninitialized inputs) out of the "
                f"clip's maxima, and this torch's {type(stage).__name__} has no such method "
                f"(torch {torch.__version__}; tested: 2.13, 2.14). Run the clip without pipeline "
                "parallelism (--parallelism.pipeline_parallel_degree 1), or without "
                "--dmuon.qk_clip_threshold."
            )

        @functools.wraps(infer)
        def infer_unobserved(*args, _infer=infer, **kwargs):
            with unobserved():
                return _infer(*args, **kwargs)

        stage.__dict__[method] = infer_unobserved


# DCP's planner, for a key the loading state dict has and the checkpoint lacks; Muon's momentum.
_MISSING_KEY = "Missing key in checkpoint state_dict: "


def _naming_the_fix_for_stock_checkpoints(load):
    """``CheckpointManager.load``, raising with the fix when the checkpoint has no Muon state:
    a stock torchtitan run's (AdamW) lacks every ``MOMENTUM_BUFFER`` of the Muon matrices."""

    @functools.wraps(load)
    def load_naming_the_fix(*args, **kwargs):
        try:
            return load(*args, **kwargs)
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            missing = sorted(
                {
                    line.split(_MISSING_KEY, 1)[1].strip().rstrip(".")
                    for line in str(error).splitlines()
                    if _MISSING_KEY in line and line.rstrip(".").endswith(MOMENTUM_BUFFER)
                }
            )
            if not missing:
                raise
            step = kwargs.get("step", args[0] if args else -1)
            matrix = missing[0].removeprefix("optimizer.state.").removesuffix("." + MOMENTUM_BUFFER)
            raise ValueError(
                f"dmuon_titan: the checkpoint (checkpoint.load_step={step}) has no dmuon "
                f"optimizer state: DCP finds no {MOMENTUM_BUFFER} for {matrix} ({len(missing)} "
                "Muon matrices without one), so a run without dmuon (torchtitan's stock AdamW) "
                "wrote it, and Muon cannot take its optimizer state. Resume it with "
                "--checkpoint.exclude_from_loading optimizer: the weights, the learning-rate "
                "schedule, the data position and the step load; Muon's momentum and the AdamW "
                "route's moments start from zero."
            ) from error

    return load_naming_the_fix


def enable(config: Trainer.Config, dmuon_config: DMuonConfig | None = None) -> DMuonTrainer.Config:
    """``config`` (a torchtitan job) training with dmuon; ``config.build()`` then gives a
    ``DMuonTrainer``. Every other setting stays as it was, but for the two the module docstring
    names (each logged)."""
    _settings_for_dmuon(config)
    if isinstance(config, DMuonTrainer.Config):
        return dataclasses.replace(config, dmuon=dmuon_config or config.dmuon)
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return DMuonTrainer.Config(**values, dmuon=dmuon_config or DMuonConfig())


def _switch_on(config: DMuonTrainer.Config) -> None:
    """Runs on the trainer's own copy of the config (``Config.build`` copies it)."""
    _settings_for_dmuon(config)
    spec = config.model_spec
    recipe = read_recipe(config.optimizer)  # the job's own Muon recipe, if it has one
    config.model_spec = dataclasses.replace(
        spec, parallelize_fn=dedicating(spec.parallelize_fn, config.dmuon, recipe)
    )
    if not isinstance(config.optimizer, DMuonOptimizers.Config):
        stock: OptimizersContainer.Config = config.optimizer
        config.optimizer = DMuonOptimizers.Config(
            param_groups=stock.param_groups,
            implementation=stock.implementation,
            optimizer_factory_kwargs_by_name=stock.optimizer_factory_kwargs_by_name,
        )
    config.optimizer.dmuon = config.dmuon
    if type(config.checkpoint) is CheckpointManager.Config:  # another manager is the job's own
        manager = config.checkpoint
        config.checkpoint = ChecksummedCheckpointManager.Config(
            **{f.name: getattr(manager, f.name) for f in dataclasses.fields(manager) if f.init}
        )


def _settings_for_dmuon(config: Trainer.Config) -> None:
    if not config.training.disable_cuda_graphs:
        logger.info(
            "dmuon_titan: CUDA graphs of the forward/backward turned off "
            "(training.disable_cuda_graphs=True): dmuon's hooks issue collectives that a "
            "captured graph cannot replay."
        )
        config.training.disable_cuda_graphs = True
    if config.parallelism.spmd_backend == "spmd_types":
        logger.info(
            "dmuon_titan: parallelism.spmd_backend 'spmd_types' -> 'partial_dtensor' (dmuon "
            "dedicates parameters before FSDP2 makes them DTensors)."
        )
        config.parallelism.spmd_backend = "partial_dtensor"
