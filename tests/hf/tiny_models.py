"""Tiny HuggingFace models built locally from configs (never downloaded), shared by the hf tests."""

from __future__ import annotations

import torch
import transformers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

VOCAB_SIZE = 64
_DECODER = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    # Ids inside the tiny vocabulary (the defaults point past its end).
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**_DECODER))


def tiny_mistral(seed: int = 0) -> MistralForCausalLM:
    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(**_DECODER))


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**_DECODER))


def tiny_qwen3(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**_DECODER, head_dim=8))


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def tiny_vit(seed: int = 0) -> ViTForImageClassification:
    torch.manual_seed(seed)
    config = ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        image_size=8, patch_size=4, num_labels=3,
    )  # fmt: skip
    return ViTForImageClassification(config)


def _causal_lm(config_class: str, model_class: str, seed: int, **overrides) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**_DECODER, "head_dim": 8, **overrides})
    return getattr(transformers, model_class)(config)


# One tiny model per family default_predicate supports beyond the ones above (two layers each;
# the MoE ones with 4 experts, DeepSeek-V3 with a dense first layer and an MoE second one).
FAMILIES = {
    "gemma": lambda seed=0: _causal_lm("GemmaConfig", "GemmaForCausalLM", seed),
    "gemma2": lambda seed=0: _causal_lm("Gemma2Config", "Gemma2ForCausalLM", seed),
    "gemma3_text": lambda seed=0: _causal_lm("Gemma3TextConfig", "Gemma3ForCausalLM", seed),
    "granite": lambda seed=0: _causal_lm("GraniteConfig", "GraniteForCausalLM", seed),
    "olmo2": lambda seed=0: _causal_lm("Olmo2Config", "Olmo2ForCausalLM", seed),
    "phi3": lambda seed=0: _causal_lm("Phi3Config", "Phi3ForCausalLM", seed),
    "mixtral": lambda seed=0: _causal_lm(
        "MixtralConfig", "MixtralForCausalLM", seed, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen2_moe": lambda seed=0: _causal_lm(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", seed, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=32,
    ),
    "qwen3_moe": lambda seed=0: _causal_lm(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", seed, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16,
    ),
    "deepseek_v3": lambda seed=0: _causal_lm(
        "DeepseekV3Config", "DeepseekV3ForCausalLM", seed, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
        n_shared_experts=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
    ),
}  # fmt: skip


def tiny_gemma3_vlm(seed: int = 0) -> PreTrainedModel:
    """Gemma 3 with its SigLIP vision tower (model_type "gemma3"), one block each."""
    torch.manual_seed(seed)
    text = {**_DECODER, "head_dim": 8, "num_hidden_layers": 1}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, image_size=16, patch_size=8)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    return transformers.Gemma3ForConditionalGeneration(config)


def token_batch(rows: int, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    """(rows, seq_len) token ids from a fixed generator."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (rows, seq_len), generator=generator)


def selected_names(model: PreTrainedModel, predicate) -> set[str]:
    return {name for name, param in model.named_parameters() if predicate(name, param)}
