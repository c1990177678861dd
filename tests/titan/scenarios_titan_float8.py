"""Scenarios of dmuon-titan with torchtitan's float8 converter, on every rank of a gloo pool.

torchtitan 0.3.0's ``Float8LinearConverter`` swaps the model *config*'s ``Linear.Config`` entries
for ``Float8Linear.Config`` before the model is built, so the modules dmuon-titan dedicates in
its parallelize hook already are torchao ``Float8Linear`` s: the order [Note: float8 training on
dedicated weights] in ``dmuon.float8`` asks for comes with torchtitan's set-up. The converter
refuses GPUs before SM89 and the CPU unless ``emulate=True`` (eager only), the mode torchtitan
keeps for testing: torchao's tensorwise float8 casts, the matmuls emulated in high precision.
``llama3_float8_debugmodel`` is torchtitan's ``llama3_debugmodel_float8`` job with that mode and
the output head left out (``filter_fqns=["lm_head"]``, as torchtitan's 405B float8 job),
registered in ``scenarios_titan.MODELS`` (as ``FLOAT8_MODEL``) so that ``scenarios_titan.train``
runs it like any registry job. With the head converted too, the 2-rank run's first loss differed
from the one-process model's by 4.5e-4 (relative): the head is FSDP2's, not dmuon's, and that
difference was not investigated further.

The reference (``train_reference_per_rank``) is ``scenarios_titan.train_reference``'s single
process run on the same converted model, except that it runs one forward and backward per
data-parallel rank's rows and lets the gradients add up: dynamic float8 scaling computes each
input's scale from the tensor it casts, so a forward over the global batch would cast with other
scales than the ranks do ([Note: a float8 reference sees each rank's rows] in
``tests/distributed/scenarios_float8.py``). torchtitan's loss is a token sum over the global
token count, so the per-rank pieces add up to the global batch's loss and gradient.
"""

from __future__ import annotations

import tempfile

# First: its import-time workarounds must precede torchtitan's own import (see its docstring).
import tests.titan.titan_on_cpu as titan_on_cpu

# isort: split
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchtitan.components.quantization import Float8LinearConverter
from torchtitan.models.llama3 import config_registry as llama3_registry
from torchtitan.models.llama3 import model_registry

from dmuon.hooks import find_dedicated_state
from tests.titan import scenarios_titan as titan

FLOAT8_MODEL = "llama3_float8"


def llama3_float8_debugmodel():
    """torchtitan's ``llama3_debugmodel_float8`` job with the converter's CPU mode
    (``emulate=True``) and the output head unconverted; its other settings are the registry's."""
    config = llama3_registry.llama3_debugmodel()
    config.model_spec = model_registry(
        "debugmodel",
        converters=[Float8LinearConverter.Config(emulate=True, filter_fqns=["lm_head"])],
    )
    return config


titan.MODELS.setdefault(FLOAT8_MODEL, llama3_float8_debugmodel)


def train(job_options: dict) -> dict:
    """``scenarios_titan.train`` of a job on ``FLOAT8_MODEL`` (run from this module, so the pool's
    workers import it and its registration first)."""
    return titan.train({**job_options, "model": FLOAT8_MODEL})


def dedicated_modules(job_options: dict) -> dict[str, str]:
    """Built, not trained: each dedicated parameter's module type (canonical name -> class
    name), and, under "(not dedicated) <module>", each float8 module dmuon did not dedicate."""
    job = titan.Job(**{**job_options, "model": FLOAT8_MODEL})
    with tempfile.TemporaryDirectory() as scratch:
        trainer = titan.make_config(job, titan._shared_folder(scratch)).build()
        try:
            found: dict[str, str] = {}
            for part in trainer.model_parts:
                state = find_dedicated_state(part)
                for p in state.params.values():
                    found[p.fqn] = type(p.module).__name__
                dedicated_modules = {id(p.module) for p in state.params.values()}
                for name, module in part.named_modules():
                    if "Float8" in type(module).__name__ and id(module) not in dedicated_modules:
                        found[f"(not dedicated) {name}"] = type(module).__name__
        finally:
            trainer.close()
    everyone: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    return everyone[0] if dist.get_rank() == 0 else {}


def train_reference_per_rank(run: dict, ranks: int) -> dict:
    """``scenarios_titan.train_reference`` for a float32 job, with one forward and backward per
    data-parallel rank's rows (see the module docstring)."""
    job = titan.Job(**run["job"])
    assert not job.mixed_precision, "the per-rank reference replays float32 jobs"
    torch.manual_seed(0)
    spec = titan.MODELS[job.model]().model_spec
    titan_on_cpu.small_model(spec, titan.LAYERS, job.width)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # the buffers (RoPE's), which no state dict holds
    model.load_state_dict(run["initial"])
    optimizers = titan._reference_optimizers(dict(model.named_parameters()), run, job.ns)
    logged = []
    for step in range(run["first_step"], run["first_step"] + len(run["logged"])):
        for optimizer, base_lr in optimizers:
            titan._set_lr(optimizer, base_lr * run["lr_factors"][step])
        tokens = titan_on_cpu.step_rows(step - 1, run["global_batch"], job.seq_len)
        global_tokens = tokens[:, 1:].numel()
        loss_sum = 0.0
        for rows in tokens.chunk(ranks):
            output = model(rows[:, :-1], positions=titan_on_cpu.positions_of(rows))
            labels = rows[:, 1:]
            loss = (
                F.cross_entropy(output.float().flatten(0, 1), labels.flatten(), reduction="sum")
                / global_tokens
            )
            loss.backward()
            loss_sum += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), job.max_norm)
        for optimizer, _ in optimizers:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        logged.append((loss_sum, norm.item()))
    final = {key: value.detach().float().clone() for key, value in model.state_dict().items()}
    return {"final": final, "logged": logged, "module_types": _module_types(model)}


def _module_types(model) -> dict[str, str]:
    return {name: type(module).__name__ for name, module in model.named_modules()}
