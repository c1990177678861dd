"""Tiny HuggingFace models built locally from configs (never downloaded), shared by the hf tests."""

from __future__ import annotations

import torch
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


def token_batch(rows: int, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    """(rows, seq_len) token ids from a fixed generator."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (rows, seq_len), generator=generator)


def selected_names(model: PreTrainedModel, predicate) -> set[str]:
    return {name for name, param in model.named_parameters() if predicate(name, param)}
