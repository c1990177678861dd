"""Scenarios of dmuon-titan on every rank of a gloo pool: torchtitan's own ``Trainer`` and its
llama3 debug model (cut to two blocks; ``Job.width`` narrows it), trained with dmuon switched
on, or stock (AdamW).

``train`` runs one job and returns, on rank 0, the full weights the first step started from
and the final ones, each step's logged loss and gradient norm, and what a single-process
reference needs to replay the job: ``train_reference`` is the same torchtitan model in one
process, given those starting weights, on the full batch of every step, with the loss torchtitan
computes (token sum over the global token count), the same learning-rate schedule, one global
gradient clip, and ``torch.optim.Muon`` (or ``dmuon.testing``'s float32 oracle, for tight bounds)
on the dedicated matrices next to ``torch.optim.AdamW`` on the rest. Under mixed precision the
reference runs its forward and backward on a bfloat16 copy of its float32 weights, as FSDP2's
``param_dtype`` does.
"""

from __future__ import annotations

import copy
import functools
import re
import tempfile
from dataclasses import asdict, dataclass, field

# First: its import-time workarounds must precede torchtitan's own import (see its docstring).
import tests.titan.titan_on_cpu as titan_on_cpu

# isort: split
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, Shard
from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3_registry
from torchtitan.models.llama3 import config_registry as llama3_registry
from torchtitan.models.qwen3 import config_registry as qwen3_registry

import dmuon.checkpoint
import dmuon_titan
from dmuon.hooks import find_dedicated_state
from dmuon.testing import ReferenceMuonAdamW
from dmuon_kernels import KELLER_COEFFICIENTS
from dmuon_kernels.newton_schulz import newton_schulz
from dmuon_titan.optimizer import muon_options
from dmuon_titan.recipe import read_recipe

FULL = StateDictOptions(full_state_dict=True)
LAYERS = 2


@dataclass(kw_only=True)
class Job:
    """One torchtitan run: its layout, precision and options."""

    model: str = "llama3"  # a key of MODELS
    steps: int = 3
    dp_shard: int = -1  # -1: every rank no other dim uses
    dp_replicate: int = 1
    pp: int = 1
    # torchtitan's own split into (virtual) stages of this many blocks each; None: one stage a
    # rank. With 1, the embeddings and the norm + head are stages of their own, with no block.
    pp_layers_per_stage: int | None = None
    pp_schedule: str = "1F1B"
    tp: int = 1
    ep: int = 1  # expert parallelism: borrows its ranks from dp_shard (torchtitan's efsdp x ep)
    local_batch: int = 2
    # Gradient accumulation: each rank's ``local_batch`` rows a step in forwards of this many
    # (torchtitan's local_batch_size; the global batch stays ``local_batch`` x the DP degree).
    microbatch: int | None = None
    seq_len: int = 16
    width: int | None = None  # the model dimension: None keeps the debug model's 256
    dmuon: bool = True
    mixed_precision: bool = False  # torchtitan's default: bf16 parameters, fp32 reduce
    compile: bool = False  # torchtitan's per-block torch.compile (fullgraph), eager backend
    full_ac: bool = False  # torchtitan's full activation checkpointing (else the job's own)
    ns: str = "torch"  # "torch": torch.optim.Muon's NS (Keller, direct, bf16); "fp32": exact
    max_norm: float = 1.0
    # Checkpoints: saved every ``checkpoint_interval`` steps under ``checkpoint_folder``;
    # ``load_step`` >= 0 resumes from that step (``load_model_only``: the weights alone).
    checkpoint_folder: str | None = None
    checkpoint_interval: int = 10_000
    load_step: int = -1
    load_model_only: bool = False
    exclude_from_loading: list[str] = field(default_factory=list)
    # The job's optimizer: a DistMuon recipe as torchtitan's kimi_k2_7 configs write one
    # (``distmuon_recipe``), which dmuon-titan reads; MoE models only. Its jobs turn the router's
    # load balancing off (``titan_on_cpu.few_experts``), for the reference.
    distmuon_recipe: bool = False
    # The last step's checkpoint: the model alone in this dtype (torchtitan's final export), or
    # None for a full checkpoint.
    export_dtype: str | None = None
    dmuon_options: dict = field(default_factory=dict)


def kimi_job(name: str):
    """A job config function of torchtitan's ``kimi_k2_7`` registry, by name, imported when
    called: the registry imports torchvision (its image data), which the test env may lack
    (``kimi_registry_missing``). ``moonlight_16b_a3b`` comes at debug size (the kimi debug
    model's width 256 and vocabulary, ``titan_on_cpu.narrow_mla``; the debug flavors' 2 warm-up
    steps); its optimizer config, the recipe under test, is its own."""

    def job():
        from torchtitan.models.kimi_k2_7 import config_registry

        config = getattr(config_registry, name)()
        if name == "moonlight_16b_a3b":
            titan_on_cpu.narrow_mla(config.model_spec, KIMI_DEBUG_WIDTH)
            config.lr_scheduler.warmup_steps = 2
        return config

    return job


def kimi_registry_missing() -> str | None:
    """Why torchtitan's ``kimi_k2_7`` config registry does not import here, or None."""
    try:
        from torchtitan.models.kimi_k2_7 import config_registry  # noqa: F401
    except ImportError as error:
        return f"torchtitan.models.kimi_k2_7.config_registry does not import: {error}"
    return None


KIMI_DEBUG_WIDTH = 256  # kimi_k2_5_debugmodel's model dimension

# The registry job each ``Job.model`` runs: llama3's dense debug model, or an MoE one (its
# experts cut to a few small ones, ``titan_on_cpu.few_experts``): qwen3's, DeepSeek-V3's, or
# torchtitan's own Muon jobs of ``kimi_k2_7`` (Kimi K2.5's debug model, Moonlight at debug size).
MODELS = {
    "llama3": llama3_registry.llama3_debugmodel,
    "qwen3_moe": qwen3_registry.qwen3_moe_debug,
    "deepseek_v3": deepseek_v3_registry.deepseek_v3_debugmodel,
    "kimi_k2_5": kimi_job("kimi_k2_5_debugmodel"),
    "moonlight": kimi_job("moonlight_16b_a3b"),
}
# Jobs whose own optimizer config is a DistMuon recipe (torchtitan's kimi_k2_7 registry): like
# ``Job.distmuon_recipe``'s, read as they are, with the routers' load balancing off.
OWN_RECIPE_MODELS = ("kimi_k2_5", "moonlight")
MOE_MODELS = ("qwen3_moe", "deepseek_v3", *OWN_RECIPE_MODELS)


def make_config(job: Job, dump_folder: str):
    registry_config = MODELS[job.model]()
    if job.model in MOE_MODELS:
        titan_on_cpu.few_experts(registry_config.model_spec, load_balancing=not _has_recipe(job))
    if job.distmuon_recipe:
        registry_config.optimizer = distmuon_recipe(job.model)
    config = titan_on_cpu.on_cpu(
        registry_config,
        dump_folder=dump_folder,
        steps=job.steps,
        layers=LAYERS,
        width=job.width,
        seq_len=job.seq_len,
        batch=job.local_batch,
    )
    parallelism = config.parallelism
    parallelism.data_parallel_shard_degree = job.dp_shard
    parallelism.data_parallel_replicate_degree = job.dp_replicate
    parallelism.pipeline_parallel_degree = job.pp
    parallelism.tensor_parallel_degree = job.tp
    parallelism.expert_parallel_degree = job.ep
    if job.pp > 1:
        parallelism.pipeline_parallel_schedule = job.pp_schedule
        parallelism.pipeline_parallel_layers_per_stage = job.pp_layers_per_stage
        parallelism.pipeline_parallel_microbatch_size = 1
    config.training.max_norm = job.max_norm
    if job.microbatch is not None:
        config.training.global_batch_size = job.local_batch * _batch_degree(job)
        config.training.local_batch_size = job.microbatch
    if job.full_ac:
        from torchtitan.distributed.activation_checkpoint import FullAC

        config.activation_checkpoint = FullAC.Config()
    if job.compile:
        config.compile.enable = True
        config.compile.components = ["model"]
        config.compile.backend = "eager"  # dynamo's capture, without inductor's C++ build
    if not job.mixed_precision:
        config.training.mixed_precision_param = "float32"
    config.debug.seed = 0
    _checkpointing(config.checkpoint, job)
    if not job.dmuon:
        parallelism.spmd_backend = "partial_dtensor"  # torch 2.13 runs no other (stock too)
        config.training.disable_cuda_graphs = True
        return config
    options = {"ns_coefficients": "keller", "ns_backend": "direct", "ns_kernel": "cublas"}
    options["ns_dtype"] = "bfloat16" if job.ns == "torch" else "float32"
    return dmuon_titan.enable(config, dmuon_titan.DMuonConfig(**options, **job.dmuon_options))


def _has_recipe(job: Job) -> bool:
    return job.distmuon_recipe or job.model in OWN_RECIPE_MODELS


# qwen3's MoE debug model: every head (query, key and value) has 128 rows of the fused QKV.
QWEN3_MOE_HEAD_DIM = 128
# DeepSeek-V3's debug model (MLA): a query head's rows (qk_nope 128 + qk_rope 64) in wq, a key /
# value head's (qk_nope 128 + v 128) in wkv_b; its block 0 is dense, the others MoE.
DEEPSEEK_QUERY_HEAD_ROWS = 128 + 64
DEEPSEEK_KEY_VALUE_HEAD_ROWS = 128 + 128
EXPERT_PROJECTIONS = ("w1_EFD", "w2_EDF", "w3_EFD")


def distmuon_recipe(model: str = "qwen3_moe"):
    """A DistMuon optimizer config for the MoE blocks of ``model``, written as torchtitan's
    kimi_k2_7 registry writes its own (``_dist_muon_optimizer``): attention projections per
    head where a head owns rows (qwen3's fused QKV; MLA's wq and wkv_b), owned otherwise; the
    router gate, dense and shared-expert MLPs owned; the routed experts per expert
    (``Shard(0)``); AdamW for the rest. Torch's Muon hyperparameters, as Kimi's."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.distributed.flex_shard import BlockShard, ComputeLayout, Owned

    def on_shard_axis(placement):
        return ComputeLayout(shardings_by_mesh_axis={"dp_shard": placement})

    owned, per_expert = (
        on_shard_axis(Owned()),
        ComputeLayout(
            shardings_by_mesh_axis={"dp_shard": Shard(0), "efsdp": Shard(0), "ep": Shard(0)}
        ),
    )
    if model == "qwen3_moe":
        attention = {
            "qkv_linear.wqkv": on_shard_axis(BlockShard(0, QWEN3_MOE_HEAD_DIM)),
            "wo": owned,
        }
    else:
        attention = {
            "wq": on_shard_axis(BlockShard(0, DEEPSEEK_QUERY_HEAD_ROWS)),
            "wkv_a": owned,
            "wkv_b": on_shard_axis(BlockShard(0, DEEPSEEK_KEY_VALUE_HEAD_ROWS)),
            "wo": owned,
        }
    layouts = {}
    for layer in range(LAYERS):
        prefix = f"layers.{layer}"
        for name, layout in attention.items():
            layouts[f"{prefix}.attention.{name}.weight"] = layout
        if model == "deepseek_v3" and layer == 0:  # the dense block
            for projection in ("w1", "w2", "w3"):
                layouts[f"{prefix}.feed_forward.{projection}.weight"] = owned
            continue
        layouts[f"{prefix}.moe.router.gate.weight"] = owned
        for projection in EXPERT_PROJECTIONS:
            layouts[f"{prefix}.moe.routed_experts.inner_experts.{projection}"] = per_expert
        if model == "deepseek_v3":
            for projection in ("w1", "w2", "w3"):
                layouts[f"{prefix}.moe.shared_experts.{projection}.weight"] = owned
    muon_pattern = "|".join(re.escape(name) for name in layouts)
    muon_pattern = rf"^(?:{muon_pattern})$"
    muon_kwargs = {"lr": 0.01, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    adamw_kwargs = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    return OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=muon_pattern, optimizer_name="DistMuon", optimizer_kwargs=muon_kwargs
            ),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs=adamw_kwargs),
        ],
        optimizer_factory_kwargs_by_name={
            "DistMuon": {"bucket_configs": (), "compute_sharding_by_fqn": layouts}
        },
    )


def _checkpointing(checkpoint, job: Job) -> None:
    checkpoint.enable = job.checkpoint_folder is not None
    if not checkpoint.enable:
        return
    checkpoint.folder = job.checkpoint_folder
    checkpoint.interval = job.checkpoint_interval
    checkpoint.last_save_model_only = job.export_dtype is not None
    checkpoint.export_dtype = job.export_dtype or "float32"
    checkpoint.keep_latest_k = 0
    checkpoint.load_step = job.load_step
    checkpoint.exclude_from_loading = list(job.exclude_from_loading)
    if job.load_model_only:
        checkpoint.exclude_from_loading = ["optimizer", "lr_scheduler", "dataloader", "train_state"]


def train(job_options: dict, checkpoint_root: str | None = None) -> dict:
    """Run the job; on rank 0 return what ``train_reference`` and the tests read (see the
    module docstring). ``checkpoint_root``: a folder the ranks share, for checkpoints that
    outlive the run (``Job.checkpoint_folder`` is relative to it)."""
    job = Job(**job_options)
    with tempfile.TemporaryDirectory() as scratch:
        dump_folder = checkpoint_root or _shared_folder(scratch)
        trainer = make_config(job, dump_folder).build()
        try:
            logged: list[tuple[float, float]] = []
            starts: list[dict[str, torch.Tensor]] = []
            _record(trainer, logged, starts)
            trainer.train()
            logged = _from_a_last_stage(trainer, logged)
            final = full_weights(trainer)
            lr_lambda = trainer.lr_schedulers.schedulers[0].lr_lambdas[0]
            dedicated = _dedicated_names(trainer)
            owned_experts = _owned_experts(trainer)
            first_step = trainer.step - len(logged) + 1
            accumulation_steps = trainer.gradient_accumulation_steps
        finally:
            trainer.close()
    if dist.get_rank() != 0:
        return {}
    return {
        "job": asdict(job),
        "initial": starts[0],
        "final": final,
        "logged": logged,
        "first_step": first_step,
        "accumulation_steps": accumulation_steps,
        "lr_factors": {step: lr_lambda(step - 1) for step in range(first_step, trainer.step + 1)},
        "dedicated": dedicated,
        "owned_experts": owned_experts,
        "global_batch": job.local_batch * _batch_degree(job),
        "optimizer": _optimizer_settings(trainer),
    }


def _from_a_last_stage(trainer, logged: list) -> list:
    """The losses a last pipeline stage logged (the others log a placeholder)."""
    last = not trainer.parallel_dims.pp_enabled or trainer.pp_has_last_stage
    everyone: list[tuple | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (last, logged))
    return next(values for is_last, values in everyone if is_last)


def _batch_degree(job: Job) -> int:
    others = job.dp_replicate * job.pp * job.tp
    shard = dist.get_world_size() // others if job.dp_shard == -1 else job.dp_shard
    return job.dp_replicate * shard


def _shared_folder(scratch: str) -> str:
    """One folder for every rank: rank 0's (the ranks share a file system)."""
    folders = [None] * dist.get_world_size()
    dist.all_gather_object(folders, scratch)
    return folders[0]


def _record(trainer, logged: list, starts: list) -> None:
    """Each logged (loss, gradient norm), and the weights the first step starts from (after a
    checkpoint load, which ``train()`` does first)."""
    log = trainer.metrics_processor.log
    train_step = trainer.train_step

    def record_log(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        logged.append((float(global_avg_loss), float(grad_norm)))
        return log(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    def record_start(data_iterator):
        if not starts:
            starts.append(full_weights(trainer))
        return train_step(data_iterator)

    trainer.metrics_processor.log = record_log
    trainer.train_step = record_start


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """Every weight of the model (all pipeline stages), full and in float32, keyed as the
    model's state dict (torchtitan's fused-QKV hooks split ``wqkv`` into ``wq``/``wk``/``wv``).
    Collective."""
    mine: dict[str, torch.Tensor] = {}
    for part in trainer.model_parts:
        if isinstance(trainer, dmuon_titan.DMuonTrainer):
            state = dmuon.checkpoint.get_model_state_dict(part, options=FULL)
        else:
            # torch's get_model_state_dict cannot follow keys another module's hook makes up
            # (the fused QKV's wq/wk/wv): gather FSDP2's shards of the model's own state dict.
            state = {
                key: value.full_tensor() if isinstance(value, DTensor) else value
                for key, value in part.state_dict().items()
            }
        mine.update({key: value.detach().float().clone() for key, value in state.items()})
    everyone: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {key: value for part in everyone for key, value in part.items()}


def _dedicated_names(trainer) -> list[str]:
    names: list[str] = []
    for part in trainer.model_parts:
        state = find_dedicated_state(part)
        # An expert stack's pieces (``<fqn>[start:stop]``) by the stack's own name.
        names += [] if state is None else [name.split("[")[0] for name in state.params]
    everyone: list[list | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, names)
    return sorted({name for part in everyone for name in part})


def _owned_experts(trainer) -> list[list[tuple[str, int, int]]]:
    """Per rank, the expert slices it owns: (stack name, first expert, end), experts numbered in
    the whole stack. Collective."""
    mine: list[tuple[str, int, int]] = []
    for part in trainer.model_parts:
        state = find_dedicated_state(part)
        if state is not None:
            mine += [(p.stack.fqn, *p.experts) for p in state.iter_owned_masters() if p.experts]
    everyone: list[list | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(mine))
    return everyone


def _optimizer_settings(trainer) -> dict:
    config = trainer.config
    catch_all = config.optimizer.param_groups[-1]
    adamw = {key: catch_all.optimizer_kwargs[key] for key in ("lr", "betas", "eps", "weight_decay")}
    if not isinstance(trainer, dmuon_titan.DMuonTrainer):
        return {"adamw": adamw, "muon": None}
    recipe = read_recipe(config.optimizer)
    options = muon_options(config.dmuon, recipe)
    assert options.adjust_lr == "match_rms_adamw"  # the references' rule
    muon = {key: getattr(options, key) for key in ("lr", "momentum", "nesterov", "weight_decay")}
    layouts = {"row_blocks": {}, "expert_stacks": []}
    if recipe is not None:
        layouts = {
            "row_blocks": dict(recipe.row_blocks),
            "expert_stacks": list(recipe.expert_layouts),
        }
    return {"adamw": adamw, "muon": muon, **layouts}


# ---- the single-process reference -----------------------------------------------------------


def train_reference(run: dict, *, steps: int | None = None, after_step=None) -> dict:
    """Replay ``run`` (what ``train`` returned on rank 0) in one process, from its starting
    weights, for its steps (or the first ``steps``); the final weights and each step's loss and
    gradient norm before clipping. ``after_step(model)``, if given, returns what runs after each
    step's optimizers (a reference QK-clip: ``test_titan_qk_clip.py``)."""
    job = Job(**run["job"])
    torch.manual_seed(0)
    spec = MODELS[job.model]().model_spec
    if job.model in MOE_MODELS:
        titan_on_cpu.few_experts(spec, load_balancing=not _has_recipe(job))
    titan_on_cpu.small_model(spec, LAYERS, job.width)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # the buffers (RoPE's), which no state dict holds
    model.load_state_dict(run["initial"])
    params = dict(model.named_parameters())
    optimizers = _reference_optimizers(params, run, job.ns)
    each_step = after_step(model) if after_step is not None else lambda: None
    logged = []
    for step in range(run["first_step"], run["first_step"] + (steps or len(run["logged"]))):
        for optimizer, base_lr in optimizers:
            _set_lr(optimizer, base_lr * run["lr_factors"][step])
        tokens = titan_on_cpu.step_rows(step - 1, run["global_batch"], job.seq_len)
        computing = _bf16_copy(model) if job.mixed_precision else model
        output = computing(tokens[:, :-1], positions=titan_on_cpu.positions_of(tokens))
        labels = tokens[:, 1:]
        loss = (
            F.cross_entropy(output.float().flatten(0, 1), labels.flatten(), reduction="sum")
            / labels.numel()
        )
        loss.backward()
        if job.mixed_precision:
            for param, low in zip(model.parameters(), computing.parameters(), strict=True):
                param.grad = low.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), job.max_norm)
        for optimizer, _ in optimizers:
            optimizer.step()
        each_step()
        model.zero_grad(set_to_none=True)
        logged.append((loss.item(), norm.item()))
    final = {key: value.detach().float().clone() for key, value in model.state_dict().items()}
    return {"final": final, "logged": logged}


def _bf16_copy(model):
    """The model with bfloat16 parameters and its buffers as they are, as FSDP2's
    ``param_dtype`` computes (RoPE's tables stay float32)."""
    low = copy.deepcopy(model)
    for param in low.parameters():
        param.data = param.data.to(torch.bfloat16)
    return low


def _reference_optimizers(params: dict, run: dict, ns: str):
    settings = run["optimizer"]
    adamw_kwargs = dict(settings["adamw"])
    dedicated = set(run["dedicated"])
    rest = [param for name, param in params.items() if name not in dedicated]
    optimizers = [(torch.optim.AdamW(rest, foreach=False, **adamw_kwargs), adamw_kwargs["lr"])]
    muon_kwargs = settings["muon"]
    if muon_kwargs is None:  # a stock run: AdamW for everything
        return optimizers
    matrices = [(name, params[name]) for name in sorted(dedicated)]
    if ns == "torch":
        # torch.optim.Muon's own Newton-Schulz: Keller's coefficients, direct, in bf16.
        muon = torch.optim.Muon(
            [param for _, param in matrices], adjust_lr_fn="match_rms_adamw", **muon_kwargs
        )
    else:
        # A registry's recipe names every block of its model; the reference has LAYERS.
        row_blocks = {
            name: [rows] * (params[name].shape[0] // rows)
            for name, rows in settings.get("row_blocks", {}).items()
            if name in params
        }
        muon = ReferenceMuonAdamW(
            matrices,
            lambda name, param: True,
            **muon_kwargs,
            expert_stacks=[name for name in settings.get("expert_stacks", ()) if name in params],
            row_blocks=row_blocks,
            orthogonalize=functools.partial(
                newton_schulz,
                backend="direct",
                coefficients=KELLER_COEFFICIENTS,
                dtype=torch.float32,
            ),
        )
    return [*optimizers, (muon, muon_kwargs["lr"])]


def _set_lr(optimizer, lr: float) -> None:
    if isinstance(optimizer, ReferenceMuonAdamW):
        optimizer.lr = lr
        return
    for group in optimizer.param_groups:
        group["lr"] = lr


# ---- what torchtitan's checkpointing does with the model's state dict -----------------------


def model_wrapper_entries(job_options: dict) -> dict:
    """On every rank, what torchtitan's ``ModelWrapper`` (the model's part of every checkpoint)
    and a user do with the expert stacks' entries of the model's state dict: the wrapper's
    ``state_dict()`` twice (a cached dict, its storages compared each save), each entry's
    ``full_tensor()`` against dmuon's full state dict, and the chunks' storage. Collective."""
    from torchtitan.components.checkpoint import ModelWrapper

    job = Job(**job_options)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = make_config(job, _shared_folder(scratch)).build()
        try:
            (part,) = trainer.model_parts
            wrapper = ModelWrapper(trainer.model_parts)
            first = wrapper.state_dict()
            second = wrapper.state_dict()
            full = dmuon.checkpoint.get_model_state_dict(part, options=FULL)
            stacks = sorted(key for key in first if key.endswith(("w1_EFD", "w2_EDF", "w3_EFD")))
            entries = {}
            for key in stacks:
                entry = second[key]
                gathered = entry.full_tensor() if isinstance(entry, DTensor) else entry
                expected = full.get(key)
                entries[key] = {
                    "same_cached_entry": second[key] is first[key],
                    "storage": entry._local_tensor.untyped_storage().data_ptr()
                    if isinstance(entry, DTensor)
                    else entry.untyped_storage().data_ptr(),
                    "chunk_storages": [
                        chunk.untyped_storage().data_ptr()
                        for chunk in entry._local_tensor.local_shards()
                    ]
                    if isinstance(entry, DTensor)
                    else [entry.untyped_storage().data_ptr()],
                    "full_tensor_equal": None
                    if expected is None
                    else torch.equal(gathered, expected),
                }
        finally:
            trainer.close()
    return entries


def build_error(job_options: dict) -> str | None:
    """The error building the job's trainer raises on this rank (None if it builds)."""
    job = Job(**job_options)
    with tempfile.TemporaryDirectory() as scratch:
        try:
            trainer = make_config(job, _shared_folder(scratch)).build()
        except ValueError as error:
            return str(error)
        trainer.close()
    return None


def train_error(job_options: dict, checkpoint_root: str) -> str | None:
    """The error training the job raises on this rank (None if it trains)."""
    try:
        train(job_options, checkpoint_root)
    except ValueError as error:
        return str(error)
    return None
