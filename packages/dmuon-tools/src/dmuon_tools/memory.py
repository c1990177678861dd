"""Memory per GPU of one training step: persistent state, gathered weights, activations, logits.

Owns the byte counts the simulator reports per system, by component, and the peak over three
moments of a step: the end of forward (activations saved, no gradients yet), the end of backward
(every gradient, one layer's working set) and the optimizer step (state, gradients, the step's
workspace). It must not time anything. The components and their sizes are the ones
``benchmarks/e2e/profile_host.py`` records after a step (fp32 masters, momentum, master gradients,
resident segments, FSDP2 shards, AdamW state), so they can be compared one by one.

[Note: what the memory model leaves out]
The CUDA context and the caching allocator's fragmentation (the machine's ``memory_gib`` is what
can be allocated), NCCL's buffers, the first step's lazily allocated optimizer state, and the
attention kernel's workspace. A layer's saved activations are ``(8 hidden + 3 kv width + 4 ffn)
x 2 bytes`` a token (the inputs of the norms, projections, rotary, attention and SwiGLU in bf16);
the loss keeps ``10 bytes`` a token per vocabulary entry (bf16 logits, their fp32 copy, and the
fp32 gradient the cross-entropy returns).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
FP32 = 4
ACTIVATION_BYTES = 2  # activations in the compute dtype
LOGIT_BYTES_PER_ENTRY = 2 + 4 + 4
# dmuon's owner step workspace: at most 256 MiB of fp32 copies of whole matrices (the torch
# fallback's FALLBACK_BATCH_BYTES, muon_update's MATERIALISED_BATCH_BYTES for int8 momentum and
# NorMuon; none on CUDA with the fused kernels) and the Newton-Schulz call's input with its
# iteration buffers (about 4x NS_CALL_BYTES).
DMUON_STEP_WORKSPACE_BYTES = 256 * 2**20 + 4 * 256 * 2**20
# The overlapped step holds, per owned Muon element from its landing in backward to step(), a
# scratch momentum (fp32) and the Newton-Schulz output (fp16 on CUDA): dmuon.overlap's Note.
OVERLAP_BYTES_PER_OWNED_ELEMENT = FP32 + 2


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryInputs:
    """Element counts per GPU the three systems' memory depends on."""

    family: str  # "fsdp2", "dmuon", "naive"
    reshard_after_forward: bool
    num_layers: int
    dedicated_numel: float  # Muon matrices of the model (per TP rank)
    other_numel: float  # embedding, LM head, norms (per TP rank)
    root_numel: float  # what FSDP2's root group holds: embedding, LM head, final norm
    layer_numel: float  # one layer's parameters, norms included (per TP rank)
    layer_dedicated_numel: float  # one layer's Muon matrices (per TP rank)
    owned_numel: float  # dmuon: Muon elements on the heaviest owner (per TP rank)
    largest_matrix_numel: float  # naive: the biggest all-gathered matrix
    shard_size: int  # G: FSDP2 shards its parameters over this many ranks
    tokens: int  # tokens per GPU in one micro-batch (a TP group shares them)
    hidden: int
    kv_width: int
    ffn: int
    vocab: int  # per TP rank
    tp: int
    param_bytes: int
    reduce_bytes: int
    activation_checkpointing: bool
    overlap_step: bool = False  # dmuon.Muon(overlap_step=True), not under TP
    # Gradients accumulated unsharded on every rank under no_sync (FSDP2's in the reduce dtype,
    # dmuon's on its unsharded parameters, priced the same), from the first micro-batch's
    # backward to the last one's reduce.
    accumulated_grad_numel: float = 0.0


def memory_gib(inputs: MemoryInputs) -> dict[str, float]:
    """GiB per GPU by component, and ``peak`` (the largest of the three moments)."""
    m = inputs
    shard = m.shard_size
    parts: dict[str, float] = {}
    if m.family == "dmuon":
        parts["dmuon fp32 masters"] = FP32 * m.owned_numel
        parts["dmuon master grads"] = FP32 * m.owned_numel
        parts["dmuon optimizer state (momentum)"] = FP32 * m.owned_numel
        parts["dmuon resident segments (compute dtype)"] = m.param_bytes * m.owned_numel
        sharded = m.other_numel
    else:
        sharded = m.dedicated_numel + m.other_numel
    parts["FSDP2 sharded params"] = FP32 * sharded / shard
    parts["FSDP2 grads"] = FP32 * sharded / shard
    if m.family == "naive":
        parts["Muon momentum"] = FP32 * m.dedicated_numel / shard
        parts["AdamW state"] = 2 * FP32 * m.other_numel / shard
    else:
        parts["AdamW state"] = 2 * FP32 * sharded / shard
    grads = ("dmuon master grads", "FSDP2 grads")
    persistent_without_grads = sum(v for k, v in parts.items() if k not in grads)
    persistent = sum(parts.values())

    # Weights gathered for compute (compute dtype): FSDP2's root group stays gathered from its
    # forward to the end of backward; layers are gathered one ahead (two at once), or all kept
    # from forward through backward without resharding. A dmuon owner broadcasts from its
    # resident segment, so a rank allocates buffers for the others' share of a layer only.
    gathered_layers = m.num_layers if not m.reshard_after_forward else min(2, m.num_layers)
    layer_gathered = m.layer_numel
    if m.family == "dmuon":
        layer_gathered -= m.layer_dedicated_numel / shard
    gathered = m.param_bytes * (m.root_numel + gathered_layers * layer_gathered)
    layer_activations = m.tokens * (8 * m.hidden + 3 * m.kv_width + 4 * m.ffn) * ACTIVATION_BYTES
    if m.tp > 1:
        layer_activations /= m.tp
    saved = (
        m.num_layers * m.tokens * m.hidden * ACTIVATION_BYTES + layer_activations
        if m.activation_checkpointing
        else m.num_layers * layer_activations
    )
    logits = m.tokens * m.vocab * LOGIT_BYTES_PER_ENTRY
    # The gradient of the layer being reduced, in the reduce dtype, and of the root group.
    reduce_buffer = m.reduce_bytes * (m.layer_numel + m.root_numel)

    speculation = OVERLAP_BYTES_PER_OWNED_ELEMENT * m.owned_numel if m.overlap_step else 0.0
    accumulated = m.reduce_bytes * m.accumulated_grad_numel
    end_of_forward = persistent_without_grads + gathered + saved + logits + accumulated
    end_of_backward = (
        persistent + gathered + layer_activations + reduce_buffer + speculation + accumulated
    )
    if m.family == "dmuon":
        step_workspace = DMUON_STEP_WORKSPACE_BYTES
    elif m.family == "naive":
        # The all-gathered fp32 matrix and torch.optim.Muon's bf16 iteration buffers.
        step_workspace = (FP32 + 4 * 2) * m.largest_matrix_numel
    else:
        step_workspace = 0.0
    # The overlapped step's commit runs no Newton-Schulz: its workspace is the speculation's.
    step = persistent + (speculation if m.overlap_step else step_workspace)
    result = {name: value / GIB for name, value in parts.items()}
    if m.overlap_step:
        result["dmuon speculation (backward to step)"] = speculation / GIB
    if accumulated:
        result["accumulated unsharded grads (no_sync)"] = accumulated / GIB
    result["gathered weights (peak)"] = gathered / GIB
    result["activations saved (end of forward)"] = saved / GIB
    result["logits and loss"] = logits / GIB
    result["end of forward"] = end_of_forward / GIB
    result["end of backward"] = end_of_backward / GIB
    result["optimizer step"] = step / GIB
    result["peak"] = max(end_of_forward, end_of_backward, step) / GIB
    return result
