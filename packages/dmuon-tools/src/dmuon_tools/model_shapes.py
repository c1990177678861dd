"""The Muon matrices of a Llama-style decoder from its config, without building the model.

Owns the presets (published configs of common decoders) and the reading of a HuggingFace
``config.json`` into the projection matrices dmuon would dedicate with the usual predicate
(``"proj" in name and p.ndim == 2``): per layer ``q/k/v/o_proj`` and ``gate/up/down_proj``, named
and shaped as in ``transformers`` (``(out_features, in_features)``). Embeddings, the LM head and
norms are not dedicated by that predicate and are left out. Pure: no tensors, no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderShape:
    """The sizes of a Llama-style decoder (Llama, Mistral, Qwen2/2.5/3 dense)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    def matrices(self) -> list[tuple[str, tuple[int, int]]]:
        """``(FQN, (out, in))`` of every projection, layer by layer, as ``transformers`` names them."""
        hidden, ffn = self.hidden_size, self.intermediate_size
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        per_layer = (
            ("self_attn.q_proj", (q_out, hidden)),
            ("self_attn.k_proj", (kv_out, hidden)),
            ("self_attn.v_proj", (kv_out, hidden)),
            ("self_attn.o_proj", (hidden, q_out)),
            ("mlp.gate_proj", (ffn, hidden)),
            ("mlp.up_proj", (ffn, hidden)),
            ("mlp.down_proj", (hidden, ffn)),
        )
        return [
            (f"model.layers.{layer}.{module}.weight", shape)
            for layer in range(self.num_hidden_layers)
            for module, shape in per_layer
        ]

    def describe(self) -> str:
        return (
            f"{self.name}: {self.num_hidden_layers} layers, hidden {self.hidden_size}, "
            f"ffn {self.intermediate_size}, heads {self.num_attention_heads} "
            f"(kv {self.num_key_value_heads}), head_dim {self.head_dim}"
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str) -> DecoderShape:
        """From a HuggingFace config dict (a VLM's ``text_config`` is used when the top level
        has no ``hidden_size``)."""
        if "hidden_size" not in config and isinstance(config.get("text_config"), Mapping):
            config = config["text_config"]
        missing = [key for key in REQUIRED_KEYS if config.get(key) is None]
        if missing:
            raise ValueError(
                f"{name}: the config has no {', '.join(missing)} (keys present: "
                f"{', '.join(sorted(config)) or 'none'}). dmuon-tools plan reads Llama-style "
                f"decoder configs with {', '.join(REQUIRED_KEYS)} (num_key_value_heads and "
                "head_dim optional); use a preset (--list-presets) or write those keys."
            )
        sizes = {key: config[key] for key in REQUIRED_KEYS}
        heads = sizes["num_attention_heads"]
        sizes["num_key_value_heads"] = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim")
        if head_dim is None:
            if sizes["hidden_size"] % heads:
                raise ValueError(
                    f"{name}: hidden_size {sizes['hidden_size']} is not divisible by "
                    f"num_attention_heads {heads} and the config has no head_dim; add head_dim."
                )
            head_dim = sizes["hidden_size"] // heads
        sizes["head_dim"] = head_dim
        for key, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{name}: {key} must be a positive integer, got {value!r}; fix the config."
                )
        return cls(name=name, **sizes)


def _preset(name: str, hidden, ffn, layers, heads, kv_heads, head_dim=None) -> DecoderShape:
    return DecoderShape(
        name=name,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
    )


# Sizes from the published config.json of each model.
PRESETS: dict[str, DecoderShape] = {
    shape.name: shape
    for shape in (
        _preset("llama2-7b", 4096, 11008, 32, 32, 32),
        _preset("llama2-13b", 5120, 13824, 40, 40, 40),
        _preset("llama3-8b", 4096, 14336, 32, 32, 8),
        _preset("llama3-70b", 8192, 28672, 80, 64, 8),
        _preset("llama3.1-405b", 16384, 53248, 126, 128, 8),
        _preset("llama3.2-1b", 2048, 8192, 16, 32, 8, head_dim=64),
        _preset("llama3.2-3b", 3072, 8192, 28, 24, 8, head_dim=128),
        _preset("mistral-7b", 4096, 14336, 32, 32, 8),
        _preset("qwen2.5-0.5b", 896, 4864, 24, 14, 2),
        _preset("qwen2.5-1.5b", 1536, 8960, 28, 12, 2),
        _preset("qwen2.5-3b", 2048, 11008, 36, 16, 2),
        _preset("qwen2.5-7b", 3584, 18944, 28, 28, 4),
        _preset("qwen2.5-14b", 5120, 13824, 48, 40, 8),
        _preset("qwen2.5-32b", 5120, 27648, 64, 40, 8),
        _preset("qwen2.5-72b", 8192, 29568, 80, 64, 8),
        _preset("qwen3-0.6b", 1024, 3072, 28, 16, 8, head_dim=128),
        _preset("qwen3-8b", 4096, 12288, 36, 32, 8, head_dim=128),
    )
}


def load_decoder_shape(config: str) -> DecoderShape:
    """A preset name (``llama3-8b``) or the path of a HuggingFace ``config.json``."""
    path = Path(config)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON ({error}); pass a config.json.") from error
        if not isinstance(data, Mapping):
            raise ValueError(f"{path} holds a JSON {type(data).__name__}, not a config object.")
        return DecoderShape.from_config(data, name=str(path))
    preset = PRESETS.get(config.lower())
    if preset is None:
        raise ValueError(
            f"--config {config!r} is neither a file nor a preset. Presets: "
            f"{', '.join(PRESETS)}; or pass the path of a HuggingFace config.json."
        )
    return preset
