"""torchtitan 0.3.0 on CPU processes (gloo), for dmuon-titan's tests: the one place that bends it.

torchtitan targets GPUs and a newer torch than CI's. Each workaround below says what it bends
and why; none is in the product. Importing this module applies the import-time ones, so import
it before anything imports torchtitan (``tests/titan/scenarios_titan.py`` does it first).

Also here: a dataloader and a tokenizer that need no files (the counting task of the README's
demo, with the per-document positions torchtitan's data carry), and ``on_cpu(config)``, which
makes a registry job config small and CPU-ready.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch._utils
import torch.distributed as dist

# Device detection: torchtitan reads the accelerator once, when ``torchtitan.tools.utils`` is
# imported, and takes "cuda" when there is none; on CPU it must find "cpu" and a device module
# with the calls its memory monitor makes (torch.cpu lacks them). Patched only while torchtitan
# is imported, so nothing else in the process sees it.
_CPU_MEMORY = 24 << 30


class _CpuDeviceProperties:
    total_memory = _CPU_MEMORY


_CPU_DEVICE_MODULE = types.SimpleNamespace(
    get_device_name=lambda *args: "cpu",
    current_device=lambda: 0,
    get_device_properties=lambda *args: _CpuDeviceProperties,
    reset_peak_memory_stats=lambda *args: None,
    empty_cache=lambda: None,
    memory_stats=lambda *args: {},
    set_device=lambda *args: None,
    device_count=lambda: 1,
    synchronize=lambda *args: None,
    is_available=lambda: True,
)


@contextlib.contextmanager
def _cpu_as_the_accelerator() -> Iterator[None]:
    saved = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type: _CPU_DEVICE_MODULE
    try:
        yield
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = saved


if "torchtitan.tools.utils" in sys.modules:
    raise RuntimeError(
        "torchtitan was imported before tests/titan/titan_on_cpu.py: its device detection then "
        "took 'cuda'. Import this module first."
    )
with _cpu_as_the_accelerator():
    import torchtitan.components.metrics
    import torchtitan.tools.utils  # noqa: F401

import torchtitan.distributed.fsdp as titan_fsdp  # noqa: E402
import torchtitan.distributed.utils as titan_dist_utils  # noqa: E402
import torchtitan.trainer as titan_trainer  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.pipelining.schedules import (  # noqa: E402
    PipelineScheduleMulti,
    PipelineScheduleSingle,
)
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention,
    ScaledDotProductAttention,
)
from torchtitan.models.common.config_utils import (  # noqa: E402
    make_ffn_config,
    make_gqa_config,
    make_moe_config,
    make_routed_experts_config,
)

# Reduction op: with the gradient divide factor torchtitan sets (1.0) and bf16 parameters,
# FSDP2 reduces with ReduceOp.PREMUL_SUM, which gloo lacks; forcing plain sums makes it scale
# before and after instead (same values).
_stock_disable_division = titan_fsdp.disable_fsdp_gradient_division


def _disable_division_with_plain_sums(model) -> None:
    _stock_disable_division(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


titan_fsdp.disable_fsdp_gradient_division = _disable_division_with_plain_sums

# Group timeouts: after the first step torchtitan shortens every group's timeout with
# ``torch.distributed.set_timeout``, which torch 2.13 does not have (torchtitan 0.3 targets a
# later nightly). The test pool's groups keep their own short timeout.
titan_dist_utils.set_pg_timeouts = lambda **kwargs: None


# End of training: rank 0 sleeps 2 s "for other ranks to complete" (their logs), every run. The
# scenarios' own collectives after training already wait for every rank.
_time_without_sleep = types.ModuleType("time")
_time_without_sleep.__dict__.update(vars(time), sleep=lambda seconds: None)
titan_trainer.time = _time_without_sleep


def _steps_given_microbatches(step):
    """Pipeline schedules: torchtitan 0.3 hands ``step`` its microbatches already split
    (``arg_mbs=``, ``kwarg_mbs=``, ``target_mbs=``), an API of a later torch nightly; torch
    2.13's ``step`` takes the whole batch and splits it itself. Given microbatches, this does
    what 2.13's ``step`` does after its split."""

    @functools.wraps(step)
    def step_microbatches(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, **kwargs):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return step(self, *args, **kwargs)
        for stage in getattr(self, "_stages", None) or [self._stage]:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(
            arg_mbs,
            kwarg_mbs,
            target_mbs,
            kwargs.get("losses"),
            kwargs.get("return_outputs", True),
            loss_kwargs=kwargs.get("loss_kwargs"),
        )
        return None

    return step_microbatches


for _schedule in (PipelineScheduleSingle, PipelineScheduleMulti):
    _schedule.step = _steps_given_microbatches(_schedule.step)

VOCAB = 2048  # the llama3 debug model's


class CountingTokenizer(BaseTokenizer):
    """A tokenizer of ``VOCAB`` ids that the counting data never need to encode."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = VOCAB

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.eos_id = 0

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("the counting data are made of ids")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("the counting data are made of ids")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class CountingData(BaseDataLoader):
    """Sequences that count up by one (mod VOCAB), one document each, from an endless stream of
    rows: row ``i`` starts at ``row_start(i)``.

    Step ``s`` reads rows ``[s * B, (s + 1) * B)`` of the stream, ``B`` the global batch (the
    data-parallel degree times ``rows_per_step``), data-parallel rank ``r`` its ``r``-th block of
    ``rows_per_step`` rows, in pieces of the size torchtitan asks for (a pipeline's
    microbatches). So a single-process reference reads step ``s``'s rows whole, and a run resumed
    on another layout the same rows after its checkpoint.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        rows_per_step: int = 2  # the local batch, which torchtitan gives a pipeline as microbatches

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        seq_len: int,
        local_batch_size: int,
        **kwargs,
    ) -> None:
        if config.rows_per_step % local_batch_size:
            raise ValueError(
                f"rows_per_step {config.rows_per_step} is not a multiple of the "
                f"{local_batch_size} rows torchtitan asks for at a time"
            )
        self.seq_len = seq_len
        self.global_batch = dp_world_size * config.rows_per_step
        self.first_row = dp_rank * config.rows_per_step
        self.rows_per_item = local_batch_size
        self.items_per_step = config.rows_per_step // local_batch_size
        self.items = 0

    def __iter__(self):
        while True:
            step, piece = divmod(self.items, self.items_per_step)
            first = step * self.global_batch + self.first_row + piece * self.rows_per_item
            tokens = counting_rows(range(first, first + self.rows_per_item), self.seq_len)
            self.items += 1
            yield {"input": tokens[:, :-1], "positions": positions_of(tokens)}, tokens[:, 1:]

    def state_dict(self) -> dict:
        step, piece = divmod(self.items, self.items_per_step)
        assert piece == 0, "torchtitan checkpoints between steps"
        return {"step": step}  # the same on every rank: loads on any layout

    def load_state_dict(self, state_dict: dict) -> None:
        self.items = state_dict["step"] * self.items_per_step


def row_start(index: torch.Tensor) -> torch.Tensor:
    """Where row ``index`` of the data stream starts counting (a fixed scramble of the index)."""
    return (index * 7919 + 104_729) % VOCAB


def counting_rows(indices, seq_len: int) -> torch.Tensor:
    """Rows ``indices`` of the data stream: (len(indices), seq_len + 1) token ids."""
    index = torch.as_tensor(list(indices), dtype=torch.int64)[:, None]
    return (row_start(index) + torch.arange(seq_len + 1)) % VOCAB


def step_rows(step: int, global_batch: int, seq_len: int) -> torch.Tensor:
    """The rows of training step ``step`` (counted from 0) of every data-parallel rank."""
    return counting_rows(range(step * global_batch, (step + 1) * global_batch), seq_len)


def positions_of(tokens: torch.Tensor) -> torch.Tensor:
    """Each input position's index in its document (one document per row)."""
    batch, length = tokens[:, :-1].shape
    return torch.arange(length).expand(batch, -1).contiguous()


def on_cpu(
    config,
    *,
    dump_folder: str,
    steps: int,
    layers: int = 2,
    width: int | None = None,
    seq_len: int = 16,
    batch: int = 2,
):
    """A registry job config made small (``layers`` blocks, model dimension ``width`` if given)
    and CPU-ready, in place; returns it."""
    # torchtitan picks its device by LOCAL_RANK, which torchrun sets; the test pool's workers
    # are not started by torchrun.
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    small_model(config.model_spec, layers, width)
    config.tokenizer = CountingTokenizer.Config()
    config.dataloader = CountingData.Config(rows_per_step=batch)
    config.training.steps = steps
    config.training.seq_len = seq_len
    config.training.local_batch_size = batch
    config.validator.enable = False
    config.dump_folder = dump_folder
    config.metrics.log_freq = 1
    return config


def small_model(model_spec, layers: int, width: int | None = None) -> None:
    """The model of ``model_spec`` cut to its first ``layers`` blocks, with SDPA attention;
    with ``width``, also narrowed to that model dimension (see ``narrow``)."""
    model_spec.model.layers = model_spec.model.layers[:layers]
    if width is not None:
        narrow(model_spec, width)
    sdpa_attention(model_spec)


def narrow(model_spec, width: int) -> None:
    """The llama3 model of ``model_spec`` with model dimension ``width`` (a multiple of its
    heads' size) and a SwiGLU hidden size of 3 x ``width``, as the debug model's 256 and 768.

    Why: CPUs without bfloat16 matrix units multiply bf16 matrices some 50 times slower than
    float32 ones, and a Newton-Schulz step costs width^3; the bf16 tests narrow the model."""
    model = model_spec.model
    head_dim = model.dim // model.layers[0].attention.n_heads
    model.dim = width
    model.tok_embeddings = dataclasses.replace(model.tok_embeddings, embedding_dim=width)
    model.norm = dataclasses.replace(model.norm, normalized_shape=width)
    std = width**-0.5  # the output head's init scale, as the debug model's (dim ** -0.5)
    head_init = {"weight": functools.partial(torch.nn.init.trunc_normal_, std=std)}
    model.lm_head = dataclasses.replace(model.lm_head, in_features=width, param_init=head_init)
    model.layers = [_narrow_block(block, width, head_dim) for block in model.layers]


def _narrow_block(block, width: int, head_dim: int):
    attention, feed_forward = block.attention, block.feed_forward
    linear_init = {"weight": functools.partial(torch.nn.init.trunc_normal_, std=0.02)}
    return dataclasses.replace(
        block,
        attention_norm=dataclasses.replace(block.attention_norm, normalized_shape=width),
        ffn_norm=dataclasses.replace(block.ffn_norm, normalized_shape=width),
        attention=make_gqa_config(
            dim=width,
            n_heads=width // head_dim,
            wqkv_param_init=linear_init,
            wo_param_init=attention.wo.param_init,
            inner_attention=attention.inner_attention,
            rope=attention.rope,
            fuse_qkv=True,
        ),
        feed_forward=make_ffn_config(
            dim=width,
            hidden_dim=3 * width,
            w1_param_init=feed_forward.w1.param_init,
            w2w3_param_init=feed_forward.w2.param_init,
        ),
    )


def sdpa_attention(model_spec) -> None:
    """Attention backend: FlexAttention has no backward on CPU. One document per sequence makes
    causal SDPA compute what block-causal flex attention would."""
    for _, _, parent, attr in list(model_spec.model.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())


def few_experts(
    model_spec,
    num_experts: int = 4,
    hidden: int = 64,
    top_k: int = 2,
    load_balancing: bool = True,
) -> None:
    """The MoE blocks of ``model_spec`` with ``num_experts`` experts of hidden size ``hidden``,
    ``top_k`` of them per token (the debug models' 64 experts of 768 would make every step some
    400 Newton-Schulz runs, minutes on two shared CPU cores). Initialisations, routing and
    dispatch stay as the model defines them; without ``load_balancing``, the router's expert
    bias (moved by an optimizer pre-hook torchtitan registers) is off, so that a single-process
    reference with its own optimizer routes alike."""
    for block in model_spec.model.layers:
        moe = getattr(block, "moe", None)
        if moe is None:
            continue
        router, routed = moe.router, moe.routed_experts
        dim = router.gate.in_features
        block.moe = make_moe_config(
            num_experts=num_experts,
            router=dataclasses.replace(
                router,
                num_experts=num_experts,
                top_k=top_k,
                gate=dataclasses.replace(router.gate, out_features=num_experts),
            ),
            routed_experts=make_routed_experts_config(
                dim=dim,
                hidden_dim=hidden,
                num_experts=num_experts,
                top_k=top_k,
                param_init=routed.inner_experts.param_init,
                comm_backend="standard",
            ),
            shared_experts=moe.shared_experts,
            load_balance_coeff=moe.load_balance_coeff if load_balancing else None,
        )


def narrow_mla(model_spec, width: int, vocab: int = VOCAB) -> None:
    """The multi-head latent attention model of ``model_spec`` (DeepSeek-V3, Kimi: Moonlight's
    2048-wide text tower of a 163840-token vocabulary) with model dimension ``width`` and
    ``vocab`` tokens, through its config's own fields: every projection from or to the model
    dimension (MLA's ``wq`` / ``wq_a`` and ``wkv_a`` in, ``wo`` out; the dense and shared-expert
    MLPs; the router gate), the norms, the embeddings and the output head (its init scale
    ``width ** -0.5``, as the debug models'). The heads (count, dims, the latent ranks), hidden
    sizes, routing and inits stay. Call ``few_experts`` after it: it sizes the routed experts
    from the router's width."""
    model = model_spec.model
    model.dim, model.vocab_size = width, vocab
    model.tok_embeddings = dataclasses.replace(
        model.tok_embeddings, num_embeddings=vocab, embedding_dim=width
    )
    model.norm = dataclasses.replace(model.norm, normalized_shape=width)
    std = width**-0.5
    head_init = {"weight": functools.partial(torch.nn.init.trunc_normal_, std=std)}
    model.lm_head = dataclasses.replace(
        model.lm_head, in_features=width, out_features=vocab, param_init=head_init
    )
    model.layers = [_narrow_mla_block(block, width) for block in model.layers]


def _narrow_mla_block(block, width: int):
    def linear(config, **sizes):
        return None if config is None else dataclasses.replace(config, **sizes)

    def mlp(config):
        if config is None:
            return None
        return dataclasses.replace(
            config,
            w1=linear(config.w1, in_features=width),
            w2=linear(config.w2, out_features=width),
            w3=linear(config.w3, in_features=width),
        )

    attention = block.attention
    attention = dataclasses.replace(
        attention,
        dim=width,
        wq=linear(attention.wq, in_features=width),
        wq_a=linear(attention.wq_a, in_features=width),
        wkv_a=linear(attention.wkv_a, in_features=width),
        wo=linear(attention.wo, out_features=width),
    )
    moe = block.moe
    if moe is not None:
        router = dataclasses.replace(moe.router, gate=linear(moe.router.gate, in_features=width))
        moe = dataclasses.replace(moe, router=router, shared_experts=mlp(moe.shared_experts))
    return dataclasses.replace(
        block,
        attention=attention,
        attention_norm=dataclasses.replace(block.attention_norm, normalized_shape=width),
        ffn_norm=dataclasses.replace(block.ffn_norm, normalized_shape=width),
        feed_forward=mlp(block.feed_forward),
        moe=moe,
    )
