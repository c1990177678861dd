"""Default ``dedicate_params`` predicates for common HuggingFace architectures.

Owns the parameter-name rules that pick, per ``config.model_type``, the 2-D hidden projection
matrices of each transformer block (attention and MLP projections) and, in mixture-of-experts
models, the (E, m, n) expert stacks (``dmuon.dedicate_params`` treats each as E matrices).
Embeddings, position embeddings, ``lm_head``, norms, biases, routers (``mlp.gate``), shared-expert
gates and classifier heads are never selected: they stay with FSDP2 and ``dmuon.Muon``'s AdamW
route. It must not touch the model beyond reading its config (and, for an unsupported type, its
parameter names and module types, to print an example).

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

import dmuon.inspect

Predicate = Callable[[str, torch.Tensor], bool]

_LLAMA_FAMILY = (
    r"(?:^|\.)layers\.\d+\."
    r"(?:self_attn\.(?:q_proj|k_proj|v_proj|o_proj)|mlp\.(?:gate_proj|up_proj|down_proj))"
    r"\.weight$"
)
# Phi-3 fuses q/k/v into one ``qkv_proj`` and gate/up into ``gate_up_proj``: each fused matrix is
# one Muon matrix (Newton-Schulz orthogonalises it as a whole).
_PHI3 = (
    r"(?:^|\.)layers\.\d+\.(?:self_attn\.(?:qkv_proj|o_proj)|mlp\.(?:gate_up_proj|down_proj))"
    r"\.weight$"
)
# Gemma 3's vision tower (SigLIP) blocks: ``encoder.layers.N`` with q/k/v/out_proj and fc1/fc2.
_SIGLIP_ENCODER = (
    r"(?:^|\.)encoder\.layers\.\d+\."
    r"(?:self_attn\.(?:q_proj|k_proj|v_proj|out_proj)|mlp\.(?:fc1|fc2))\.weight$"
)
# Mixture-of-experts blocks (transformers 5 keeps each layer's experts as two (E, m, n)
# parameters without a ``.weight`` suffix). The router ``mlp.gate`` and Qwen2-MoE's (1, H)
# ``mlp.shared_expert_gate`` are not projections and are never matched.
_EXPERT_STACKS = r"(?:^|\.)layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj)$"
_SHARED_EXPERT = (
    r"(?:^|\.)layers\.\d+\.mlp\.(?:shared_expert|shared_experts)\."
    r"(?:gate_proj|up_proj|down_proj)\.weight$"
)
# DeepSeek-V3's multi-head latent attention: low-rank q (q_a/q_b, or q_proj without q_lora_rank),
# the joint latent + rope key projection and its up-projection; its dense first layers use the
# Llama MLP names.
_DEEPSEEK_V3_ATTENTION = (
    r"(?:^|\.)layers\.\d+\.self_attn\."
    r"(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight$"
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
    """``(name, param) -> bool``: True for 2-D parameters whose name matches ``pattern`` and for
    3-D (E, m, n) expert stacks whose name matches ``expert_stacks`` (None: no stacks)."""

    model_type: str
    pattern: str
    expert_stacks: str | None = None

    def __call__(self, name: str, param: torch.Tensor) -> bool:
        if param.ndim == 2:
            return re.search(self.pattern, name) is not None
        if param.ndim == 3 and self.expert_stacks is not None:
            return re.search(self.expert_stacks, name) is not None
        return False


def _either(*patterns: str) -> str:
    return "|".join(f"(?:{pattern})" for pattern in patterns)


_LLAMA_LIKE = ("gemma", "gemma2", "gemma3_text", "granite", "llama", "mistral", "olmo2", "qwen2",
               "qwen3")  # fmt: skip

PREDICATES: Mapping[str, Predicate] = MappingProxyType(
    {
        **{
            model_type: ProjectionPredicate(model_type, _LLAMA_FAMILY) for model_type in _LLAMA_LIKE
        },
        # Gemma 3 with its vision tower (Gemma3ForConditionalGeneration): both stacks of blocks.
        "gemma3": ProjectionPredicate("gemma3", _either(_LLAMA_FAMILY, _SIGLIP_ENCODER)),
        "phi3": ProjectionPredicate("phi3", _PHI3),
        "gpt2": ProjectionPredicate("gpt2", _GPT2),
        "vit": ProjectionPredicate("vit", _VIT),
        "mixtral": ProjectionPredicate("mixtral", _LLAMA_FAMILY, _EXPERT_STACKS),
        "qwen3_moe": ProjectionPredicate("qwen3_moe", _LLAMA_FAMILY, _EXPERT_STACKS),
        "qwen2_moe": ProjectionPredicate(
            "qwen2_moe", _either(_LLAMA_FAMILY, _SHARED_EXPERT), _EXPERT_STACKS
        ),
        "deepseek_v3": ProjectionPredicate(
            "deepseek_v3",
            _either(_DEEPSEEK_V3_ATTENTION, _LLAMA_FAMILY, _SHARED_EXPERT),
            _EXPERT_STACKS,
        ),
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
        "your own that selects the projection matrices inside the blocks (nn.Linear weights; "
        "not routers, gates or embedding tables) and any (E, m, n) expert stacks, which dmuon "
        f"dedicates as E matrices each{_example(model)}"
        "and print the candidates with:\n"
        "    for name, p in model.named_parameters():\n"
        "        if p.ndim >= 2:\n"
        "            print(name, tuple(p.shape))"
    )


# A block of a transformer: ``layers.3.``, ``h.7.``, ``encoder.layer.2.``, ``blocks.5.``.
_BLOCK = re.compile(r"(?:^|\.)(?:layers|blocks|layer|h|block)\.\d+\.")
# A router or gate module (``mlp.gate``, ``router``, ``shared_expert_gate``): its weight scores
# experts and is not a projection, even when it is an nn.Linear.
_ROUTER = re.compile(r"(?:^|_)(?:gate|router)$")


def _example_candidates(model: nn.Module) -> list[str]:
    """The parameters the error message's example predicate is built from, by name: inside a
    block, the weight of an ``nn.Linear`` (or GPT-2's ``Conv1D``) with both sides above 1 that is
    no router or gate, and every 3-D parameter outside convolutions (an expert stack, as
    ``dedicate_params`` treats it). Embedding tables, norms, routers and (1, H) gate vectors are
    left out."""
    chosen = []
    for module_name, module in model.named_modules():
        own_name = module_name.rpartition(".")[2]
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if _BLOCK.search(name) is None:
                continue
            is_projection = (
                param_name == "weight"
                and (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D")
                and param.ndim == 2
                and min(param.shape) > 1
                and _ROUTER.search(own_name) is None
            )
            is_expert_stack = dmuon.inspect.is_expert_stack_by_default(module, param)
            if is_projection or is_expert_stack:
                chosen.append(name)
    return chosen


def _example(model: nn.Module) -> str:
    """A predicate for this model, built from its own names: the ``_example_candidates`` by their
    name within the block. Empty (no example) when there are none, or when a suffix would also
    match a parameter that is not a candidate."""
    chosen = _example_candidates(model)
    suffixes: list[str] = []
    for name in chosen:
        suffix = "." + name[list(_BLOCK.finditer(name))[-1].end() :]
        if suffix not in suffixes:
            suffixes.append(suffix)
    names = [name for name, _ in model.named_parameters()]
    selected = [name for name in names if name.endswith(tuple(suffixes))]
    if not suffixes or selected != [name for name in names if name in set(chosen)]:
        return ", "
    return (
        ", for this model e.g.\n"
        "    dmuon.dedicate_params(model, mesh, predicate=lambda name, p: "
        f"name.endswith({tuple(suffixes)!r}))\n"
    )
