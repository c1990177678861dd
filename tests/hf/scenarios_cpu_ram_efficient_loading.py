"""``cpu_ram_efficient_loading``: a saved tiny Llama whose weights only the first rank reads.

The first rank loads it with ``from_pretrained`` (under the variables ``accelerate launch
--fsdp_cpu_ram_efficient_loading true`` sets); the others build it on the meta device from its
config (``others="meta"``), or hold other weights (``others="random"``: a model of another seed,
which must not matter). ``DMuonAccelerator`` (or ``DMuonTrainer``) then dedicates and shards the
model on the meta device and loads the first rank's weights into it with ``dmuon.checkpoint``'s
``broadcast_from_rank0``. The same scenario with the option off loads the saved weights on every
rank: the two must give the same model and the same training.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import LlamaConfig, LlamaForCausalLM

import dmuon
from dmuon.checkpoint._from_source import recording_received
from dmuon_hf import DMuonAccelerator, DMuonTrainer
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.hf import scenarios_hf
from tests.hf.tiny_models import tiny_llama, token_batch

# What `accelerate launch --use_fsdp --fsdp_cpu_ram_efficient_loading true` sets (among others).
LAUNCHER = {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}
ROWS = 4  # one global batch, split over the ranks


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` set inside; every variable they or Accelerate's plugin set restored after."""
    names = [*LAUNCHER, "LOCAL_RANK", *values]
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _load(path: str, efficient: bool, others: str) -> tuple[LlamaForCausalLM, list[str]]:
    """The model this rank starts from, and its parameters on the meta device."""
    if efficient and dist.get_rank() != 0:
        if others == "meta":
            with torch.device("meta"):
                model = LlamaForCausalLM(LlamaConfig.from_pretrained(path))
        else:
            model = tiny_llama(seed=99)
    else:
        with environment(LAUNCHER if efficient else {}):
            model = LlamaForCausalLM.from_pretrained(path)
    return model, [name for name, param in model.named_parameters() if param.is_meta]


def _muon(model) -> dmuon.Muon:
    return dmuon.Muon(
        model,
        lr=scenarios_hf.MUON_LR,
        adamw_lr=scenarios_hf.ADAMW_LR,
        ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas"),
    )


def with_accelerator(*, path: str, efficient: bool, others: str = "meta", steps: int = 2) -> dict:
    """Load, prepare with DMuonAccelerator, train ``steps`` steps; what rank 0 saw of it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with environment({"LOCAL_RANK": str(rank)}):
        model, meta = _load(path, efficient, others)
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            cpu_ram_efficient_loading=efficient,
        )
        accelerator = DMuonAccelerator(cpu=True, fsdp_plugin=plugin)
        with recording_received() as received:
            model = accelerator.prepare(model)
        optimizer = accelerator.prepare(_muon(model))
        loaded = {key: value.clone() for key, value in accelerator.get_state_dict(model).items()}
        probe = token_batch(2, seq_len=scenarios_hf.SEQ_LEN, seed=5)
        with torch.no_grad():
            logits = model(input_ids=probe).logits
        mine = token_batch(ROWS, seq_len=scenarios_hf.SEQ_LEN).chunk(world)[rank]
        losses = []
        for _ in range(steps):
            loss = model(input_ids=mine, labels=mine).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        trained = {key: value.clone() for key, value in accelerator.get_state_dict(model).items()}
    return {
        "meta": meta,
        "parameters": [
            name for name, _ in LlamaForCausalLM.from_pretrained(path).named_parameters()
        ],
        "received": received.received,
        "peak": received.peak,
        "loaded": loaded,
        "logits": logits,
        "losses": losses,
        "trained": trained,
    }


def with_trainer(*, path: str, efficient: bool, others: str = "meta", steps: int = 2) -> dict:
    """Load, hand to DMuonTrainer with TrainingArguments(fsdp_config={...,
    "cpu_ram_efficient_loading": efficient}), train ``steps`` steps; the losses and weights."""
    rank = dist.get_rank()
    with environment({"LOCAL_RANK": str(rank)}):
        model, meta = _load(path, efficient, others)
        output_dir = os.path.join(os.path.dirname(path), f"trainer-{int(efficient)}-{rank}")
        args = scenarios_hf._fsdp_arguments(
            output_dir,
            {"cpu_ram_efficient_loading": efficient},
            per_device_train_batch_size=ROWS // dist.get_world_size(),
            max_steps=steps,
        )
        trainer = DMuonTrainer(
            model=model,
            args=args,
            train_dataset=scenarios_hf._dataset(ROWS),
            optimizer_cls_and_kwargs=scenarios_hf._MUON_FP32,
        )
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        weights = dmuon.checkpoint.get_model_state_dict(
            trainer.model, options=scenarios_hf._FULL_ON_FIRST_RANK
        )
    return {"meta": meta, "losses": losses, "trained": {k: v.clone() for k, v in weights.items()}}
