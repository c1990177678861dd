"""Canonical parameter names: a module path with the segments that wrappers insert left out.

Owns the one rule by which dmuon names parameters and state-dict keys, everywhere it writes or
matches a name (the dedicated parameters' FQNs and the partition, predicates, ``routes=``,
``param_groups``, ``optimizer.routing()``, checkpoint keys), and the way back from such a name
to the key a model's own ``load_state_dict`` expects. It must not know anything else.

[Note: canonical FQNs]
Wrappers applied to blocks before ``dedicate_params`` insert a module between a block and its
parent, so ``model.named_parameters()`` spells ``layers.0.attn.wq.weight`` as
``layers.0._checkpoint_wrapped_module.attn.wq.weight`` under activation checkpointing or
``layers.0._orig_mod.attn.wq.weight`` under ``torch.compile(block)``. A name recorded that way
would tie a checkpoint to the wrappers of the run that wrote it. The canonical FQN drops every
segment in ``WRAPPER_SEGMENTS`` — the segments ``torch.distributed.checkpoint.state_dict``
drops too (its ``_get_fqns``):

- ``_checkpoint_wrapped_module``: ``checkpoint_wrapper`` / ``offload_wrapper``
  (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``); its own state-dict hooks
  already drop it from ``state_dict()`` keys and add it back on load;
- ``_orig_mod``: the ``OptimizedModule`` that ``torch.compile(module)`` returns (the in-place
  ``module.compile()`` adds no segment); it stays in ``state_dict()`` keys;
- ``_fsdp_wrapped_module``: FSDP1's ``FullyShardedDataParallel``.

DDP's ``module`` is not dropped: it is an ordinary name elsewhere, and dmuon is given the model
inside ``DistributedDataParallel``, never the wrapper. Nor is a child that a module names in
its own ``_fqn_modifiers()`` (torch's hook for modules whose state-dict hooks rename keys).
"""

from __future__ import annotations

from torch import nn

WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})

# Wrappers whose own state-dict hooks hide their segment: ``state_dict()`` keys lack it and
# ``load_state_dict`` takes keys without it (its pre-hook adds it back).
_HIDDEN_IN_STATE_DICT = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def canonical_fqn(name: str) -> str:
    """``name`` without wrapper segments: ``layers.0._orig_mod.attn.wq.weight`` ->
    ``layers.0.attn.wq.weight`` (see [Note: canonical FQNs])."""
    if not any(segment in name for segment in WRAPPER_SEGMENTS):
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def state_dict_key(model: nn.Module, fqn: str) -> str:
    """The key ``model.load_state_dict`` expects for the canonical ``fqn``: the wrapper
    segments that ``model``'s own state dict keeps (``_orig_mod``) put back where the model has
    them. A key the model's modules do not reach (one another module's hook makes up, such as
    a fused projection's ``wq.weight``) is followed as far as the modules go."""
    parts = fqn.split(".")
    module = model
    spelled: list[str] = []
    for index, part in enumerate(parts):
        while part not in module._modules and (wrapper := _wrapper_segment(module)) is not None:
            if wrapper not in _HIDDEN_IN_STATE_DICT:
                spelled.append(wrapper)
            module = module._modules[wrapper]
        child = module._modules.get(part)
        if child is None:
            return ".".join(spelled + parts[index:])
        spelled.append(part)
        module = child
    return ".".join(spelled)


def _wrapper_segment(module: nn.Module) -> str | None:
    for name in module._modules:
        if name in WRAPPER_SEGMENTS:
            return name
    return None
