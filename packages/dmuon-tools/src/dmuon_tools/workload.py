"""What a step is simulated for: the model's sizes, the layout of the ranks, the workload.

Owns the typed inputs of ``dmuon-tools simulate`` (``ModelSizes`` of a dense decoder, ``Layout``
of G shards x R replicas x TP in nodes, ``Workload`` of tokens and dtypes), their validation with
messages that name the fix, and the FLOPs of a layer. Pure: no timing, no partition.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dmuon_tools.costs import layer_backward_flops_per_token, layer_forward_flops_per_token
from dmuon_tools.model_shapes import DecoderShape

MAX_SIMULATED_GPUS = 1_000_000  # the partition keeps a list per owner slot
_LAYER_INDEX = re.compile(r"\.layers\.([0-9]+)\.")


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """Where the ranks are: G shards x R replicas x TP, and how they sit in nodes.

    Ranks are numbered TP fastest, then shard, then replica (``init_device_mesh(device, (R, G,
    TP), ("replicate", "shard", "tp"))``), so a group lies in one node when its span of ranks
    does. ``ranks_per_gpu`` > 1 models several processes sharing one GPU (the gloo calibration
    runs): their forward and backward, held in step by the collectives, take turns on it; their
    optimizer steps do not meet (measured: FSDP2's AdamW on 4 gloo ranks sharing the H200 takes
    one rank's shard's time), so a step is one rank's.
    """

    num_shards: int
    num_replicas: int = 1
    tp: int = 1
    gpus_per_node: int = 8
    ranks_per_gpu: int = 1

    def __post_init__(self) -> None:
        for name in ("num_shards", "num_replicas", "tp", "gpus_per_node", "ranks_per_gpu"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"layout: {name} must be a positive integer, got {value!r}.")
        if self.tp > self.ranks_per_node:
            raise ValueError(
                f"layout: TP {self.tp} spans more than one node of {self.gpus_per_node} GPUs; "
                "the simulator keeps a TP group inside a node (use --tp <= --gpus-per-node)."
            )
        if self.world_size > MAX_SIMULATED_GPUS:
            raise ValueError(
                f"layout: {self.world_size:,} ranks, more than the {MAX_SIMULATED_GPUS:,} the "
                "simulator plans; use fewer GPUs."
            )

    @property
    def world_size(self) -> int:
        return self.num_shards * self.num_replicas * self.tp

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node * self.ranks_per_gpu

    def link_class(self, group: str) -> str:
        """``"nvlink"`` when every group of that kind lies in one node, else ``"network"``."""
        span = {
            "tp": self.tp,
            "shard": self.tp * self.num_shards,
            "replicate": self.world_size,
        }[group]
        return "nvlink" if span <= self.ranks_per_node else "network"

    def ranks_per_node_in(self, group: str) -> int:
        """How many ranks of one group of that kind share a node (the NICs its rings use when
        it spans nodes)."""
        per_node = self.ranks_per_node
        if group == "tp":
            return self.tp
        if group == "shard":
            return min(self.num_shards, max(1, per_node // self.tp))
        return min(self.num_replicas, max(1, per_node // (self.tp * self.num_shards)))

    def group_size(self, group: str) -> int:
        return {"tp": self.tp, "shard": self.num_shards, "replicate": self.num_replicas}[group]

    def describe(self) -> str:
        text = f"{self.world_size} GPUs = G {self.num_shards} x R {self.num_replicas}"
        text += f" x TP {self.tp}" if self.tp > 1 else ""
        text += f", {self.gpus_per_node} GPUs a node"
        if self.ranks_per_gpu > 1:
            text += f", {self.ranks_per_gpu} ranks sharing each GPU"
        return text


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What one step processes, per data-parallel rank: ``accumulation`` micro-batches of
    ``micro_batch`` sequences each, then one optimizer step. Each micro-batch's gradients are
    reduced when its backward ends (a loop without ``dmuon.no_sync``, dmuon's and FSDP2's
    default); with ``no_sync`` only the last micro-batch's are, the others kept unsharded on every
    rank ([Note: gradient accumulation] in ``steps``)."""

    seq_len: int = 8192
    micro_batch: int = 1  # sequences per data-parallel rank (a TP group shares them)
    accumulation: int = 1  # micro-batches per optimizer step
    no_sync: bool = False  # micro-batches before the last run under dmuon.no_sync
    activation_checkpointing: bool = True
    param_bytes: int = 2  # forward compute dtype (bf16)
    reduce_bytes: int = 4  # gradient reduce dtype (fp32)

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "accumulation", "param_bytes", "reduce_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"workload: {name} must be a positive integer, got {value!r}.")

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one data-parallel rank."""
        return self.seq_len * self.micro_batch

    def tokens_per_step(self, data_parallel_ranks: int) -> int:
        """Tokens one optimizer step consumes over ``data_parallel_ranks`` (G x R)."""
        return self.tokens * self.accumulation * data_parallel_ranks

    def describe(self) -> str:
        checkpointing = "on" if self.activation_checkpointing else "off"
        text = f"seq {self.seq_len} x micro-batch {self.micro_batch} per data-parallel rank"
        if self.accumulation > 1:
            reduced = (
                "gradients reduced on the last only (no_sync)"
                if self.no_sync
                else "gradients reduced on each"
            )
            text += f" x {self.accumulation} micro-batches a step, {reduced}"
        return (
            f"{text}, {self.param_bytes}-byte compute, {self.reduce_bytes}-byte gradient reduce, "
            f"activation checkpointing {checkpointing}"
        )


def accumulation_for(tokens_per_step: int, workload: Workload, data_parallel_ranks: int) -> int:
    """The micro-batches per optimizer step that make ``tokens_per_step`` tokens over
    ``data_parallel_ranks`` ranks of ``workload.tokens`` tokens a micro-batch each."""
    one_round = workload.tokens * data_parallel_ranks
    if tokens_per_step < one_round or tokens_per_step % one_round:
        lower = max(one_round, tokens_per_step // one_round * one_round)
        raise ValueError(
            f"--tokens-per-step {tokens_per_step:,} is not a whole number of micro-batches: one "
            f"micro-batch on each of the {data_parallel_ranks:,} data-parallel ranks is "
            f"{one_round:,} tokens (seq {workload.seq_len} x micro-batch {workload.micro_batch}"
            f" x {data_parallel_ranks:,}); use a multiple of it, e.g. {lower:,} or "
            f"{lower + one_round:,}, or fewer GPUs."
        )
    return tokens_per_step // one_round


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSizes:
    """A dense decoder as the simulator needs it."""

    name: str
    layers: tuple[tuple[tuple[str, tuple[int, int]], ...], ...]  # per layer: (FQN, shape)
    hidden: int
    attention_width: int  # heads x head_dim
    kv_width: int
    ffn: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, shape: DecoderShape) -> ModelSizes:
        if shape.experts is not None:
            raise ValueError(
                f"{shape.name} is a mixture-of-experts decoder; simulate models dense decoders "
                "only (token routing and expert all-to-all are not modelled). Use dmuon-tools "
                "plan for its partition."
            )
        if shape.vocab_size is None:
            raise ValueError(
                f"{shape.name}: the config has no vocab_size, which the simulator needs for the "
                'embedding and the LM head; add "vocab_size" to the config.'
            )
        layers: list[list[tuple[str, tuple[int, int]]]] = [
            [] for _ in range(shape.num_hidden_layers)
        ]
        for name, dims in shape.matrices():
            layers[layer_index(name)].append((name, (dims[0], dims[1])))
        return cls(
            name=shape.name,
            layers=tuple(tuple(layer) for layer in layers),
            hidden=shape.hidden_size,
            attention_width=shape.num_attention_heads * shape.head_dim,
            kv_width=shape.num_key_value_heads * shape.head_dim,
            ffn=shape.intermediate_size,
            vocab=shape.vocab_size,
            tied=shape.tie_word_embeddings,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_matrix_numel(self, layer: int) -> int:
        return sum(math.prod(dims) for _, dims in self.layers[layer])

    @property
    def norm_numel_per_layer(self) -> int:
        return 2 * self.hidden

    @property
    def root_numel(self) -> int:
        """Embedding, LM head (unless tied) and the final norm: FSDP2's root group."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def dedicated_numel(self) -> int:
        return sum(self.layer_matrix_numel(i) for i in range(self.num_layers))

    @property
    def other_numel(self) -> int:
        return self.root_numel + self.num_layers * self.norm_numel_per_layer

    @property
    def num_matrices(self) -> int:
        return sum(len(layer) for layer in self.layers)


def layer_index(name: str) -> int:
    match = _LAYER_INDEX.search(name)
    if match is None:
        raise ValueError(f"{name!r} has no .layers.N. in its name")
    return int(match.group(1))


def layer_flops(model: ModelSizes, workload: Workload, layer: int) -> tuple[float, float]:
    """Forward and backward FLOPs of one layer for one micro-batch (backward includes the
    recomputed forward under activation checkpointing)."""
    args = (model.layer_matrix_numel(layer), model.attention_width, workload.seq_len)
    forward = workload.tokens * layer_forward_flops_per_token(*args)
    backward = workload.tokens * layer_backward_flops_per_token(*args)
    if workload.activation_checkpointing:
        backward += forward
    return forward, backward


def head_flops(model: ModelSizes, workload: Workload) -> float:
    """The LM head's forward and backward FLOPs (2 + 4 per weight and token)."""
    return workload.tokens * 6.0 * model.hidden * model.vocab


def forward_backward_flops(model: ModelSizes, workload: Workload) -> float:
    """FLOPs of one micro-batch's forward and backward on one GPU without TP."""
    return head_flops(model, workload) + math.fsum(
        sum(layer_flops(model, workload, layer)) for layer in range(model.num_layers)
    )
