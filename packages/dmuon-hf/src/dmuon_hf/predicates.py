"""Default ``dedicate_params`` predicates for common HuggingFace architectures.

Owns the parameter-name rules that pick, per ``config.model_type``, the 2-D hidden projection
matrices of each transformer block (attention and MLP projections). Embeddings, position
embeddings, ``lm_head``, norms, biases and classifier heads are never selected: they stay with
FSDP2 and ``dmuon.Muon``'s AdamW route. It must not touch the model beyond reading its config.

Names are matched on their suffix, so the same rule holds for the bare backbone
(``LlamaModel``: ``layers.0.mlp.up_proj.weight``) and for the task models around it
(``LlamaForCausalLM``: ``model.layers.0.mlp.up_proj.weight``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn

Predicate = Callable[[str, torch.Tensor], bool]

_LLAMA_FAMILY = (
    r"(?:^|\.)layers\.\d+\."
    r"(?:self_attn\.(?:q_proj|k_proj|v_proj|o_proj)|mlp\.(?:gate_proj|up_proj|down_proj))"
    r"\.weight$"
)
# GPT-2's Conv1D stores (in, out) weights; still one 2-D matrix each.
_GPT2 = r"(?:^|\.)h\.\d+\.(?:attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$"
# transformers 5.x names ViT blocks ``layers.N`` with q/k/v/o_proj and mlp.fc1/fc2; 4.x named
# them ``encoder.layer.N`` with attention.attention.query/key/value, attention.output.dense,
# intermediate.dense and output.dense. Both are matched so one predicate serves either release.
_VIT = (
    r"(?:^|\.)layers\.\d+\.(?:attention\.(?:q_proj|k_proj|v_proj|o_proj)|mlp\.(?:fc1|fc2))"
    r"\.weight$"
    r"|(?:^|\.)encoder\.layer\.\d+\."
    r"(?:attention\.attention\.(?:query|key|value)|attention\.output\.dense"
    r"|intermediate\.dense|output\.dense)\.weight$"
)


@dataclass(frozen=True, slots=True)
class ProjectionPredicate:
    """``(name, param) -> bool``: True for 2-D parameters whose name matches ``pattern``."""

    model_type: str
    pattern: str

    def __call__(self, name: str, param: torch.Tensor) -> bool:
        return param.ndim == 2 and re.search(self.pattern, name) is not None


PREDICATES: Mapping[str, Predicate] = MappingProxyType(
    {
        "gpt2": ProjectionPredicate("gpt2", _GPT2),
        "llama": ProjectionPredicate("llama", _LLAMA_FAMILY),
        "mistral": ProjectionPredicate("mistral", _LLAMA_FAMILY),
        "qwen2": ProjectionPredicate("qwen2", _LLAMA_FAMILY),
        "qwen3": ProjectionPredicate("qwen3", _LLAMA_FAMILY),
        "vit": ProjectionPredicate("vit", _VIT),
    }
)


def default_predicate(model: nn.Module) -> Predicate:
    """The predicate for ``model.config.model_type`` (see ``PREDICATES``).

    Raises ``ValueError`` for a model without a config or of an unsupported type; the message
    shows how to pass a predicate of your own to ``dmuon.dedicate_params``.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in PREDICATES:
        return PREDICATES[model_type]
    what = (
        f"model_type {model_type!r}"
        if model_type is not None
        else "no config.model_type (not a HuggingFace PreTrainedModel?)"
    )
    raise ValueError(
        f"dmuon_hf.default_predicate: no default predicate for {type(model).__name__} with "
        f"{what}. Supported model types: {', '.join(sorted(PREDICATES))}. Pass a predicate of "
        f"your own that selects the 2-D projection matrices inside the blocks{_example(model)}"
        "and print the candidates with:\n"
        "    for name, p in model.named_parameters():\n"
        "        if p.ndim == 2:\n"
        "            print(name, tuple(p.shape))"
    )


# A block of a transformer: ``layers.3.``, ``h.7.``, ``encoder.layer.2.``, ``blocks.5.``.
_BLOCK = re.compile(r"(?:^|\.)(?:layers|blocks|layer|h|block)\.\d+\.")


def _example(model: nn.Module) -> str:
    """A predicate for this model, built from its own names: the 2-D weights inside its
    blocks, by their name within the block. Empty (no example) when it has none."""
    suffixes: list[str] = []
    for name, param in model.named_parameters():
        found = list(_BLOCK.finditer(name))
        if param.ndim == 2 and found and name.endswith(".weight"):
            suffix = name[found[-1].end() :]
            if suffix not in suffixes:
                suffixes.append(suffix)
    if not suffixes:
        return ", "
    return (
        ", for this model e.g.\n"
        "    dmuon.dedicate_params(model, mesh, predicate=lambda name, p: p.ndim == 2 and "
        f"name.endswith({tuple('.' + s for s in suffixes)!r}))\n"
    )
