"""The Muon matrices of a decoder from its config, without building the model.

Owns the presets (published configs of common decoders) and the reading of a HuggingFace
``config.json`` into the matrices dmuon would dedicate: per layer ``q/k/v/o_proj`` and either the
dense MLP ``gate/up/down_proj`` or, in a mixture-of-experts layer, the two fused expert stacks
``mlp.experts.gate_up_proj`` (E, 2 * ffn, hidden) and ``mlp.experts.down_proj`` (E, hidden, ffn)
(Qwen2-MoE adds its shared expert's ``gate/up/down_proj``), named and shaped as in
``transformers`` 5 (``(out_features, in_features)``). dmuon dedicates an (E, m, n) stack as E
matrices (m, n). Embeddings, the LM head, norms, routers (``mlp.gate``) and gate vectors
(``shared_expert_gate``) are not dedicated and are left out of ``matrices()``; the vocabulary
size and whether the embedding is tied are kept for the simulator. Pure: no tensors, no torch.

It must not guess a layout: a config of a ``model_type`` outside ``DENSE_MODEL_TYPES`` and
``MOE_MODEL_TYPES`` (BERT, ViT, GPT-2, T5, DeepSeek-V3, Phi-3, ...) is refused, since planning it as
a Llama decoder would list matrices the model does not have. Each supported layout is checked
against the parameters of the ``transformers`` model built from the same config
(``tests/tools/test_model_shapes.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Llama-style decoders: q/k/v/o_proj and gate/up/down_proj in every layer.
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Llama-style attention with (E, m, n) expert stacks in the MLP of some or all layers.
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Keys that announce experts; a config holding one must say its model_type.
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# The expert count's keys per type, first found wins: Mixtral's and Qwen3-MoE's configs map
# ``num_experts`` to ``num_local_experts`` (transformers' ``attribute_map``), Qwen2-MoE's do not.
_EXPERT_COUNT_KEYS_OF = {
    "mixtral": ("num_local_experts", "num_experts"),
    "qwen2_moe": ("num_experts",),
    "qwen3_moe": ("num_local_experts", "num_experts"),
}
# head_dim of a config that has none: Qwen3Config's default is 128, the others' hidden / heads.
_DEFAULT_HEAD_DIM = {"qwen3": 128}


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertLayout:
    """The mixture-of-experts MLPs of a decoder (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

    num_experts: int  # E: the leading dim of each stack
    expert_intermediate_size: int  # one expert's ffn width
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the expert block; others are dense
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert MLP; 0 = none


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderShape:
    """The sizes of a decoder: Llama, Mistral, Qwen2/2.5/3 dense, and with ``experts`` Mixtral,
    Qwen2-MoE and Qwen3-MoE."""

    name: str
    hidden_size: int
    intermediate_size: int  # the dense MLP's width (Mixtral: each expert's)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    experts: ExpertLayout | None = None
    # The token embedding and LM head (not dedicated; the simulator needs their size): None when
    # a config does not say.
    vocab_size: int | None = None
    tie_word_embeddings: bool = False  # one (vocab, hidden) matrix serves both

    def matrices(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(FQN, shape)`` of every dedicated matrix, layer by layer, as ``transformers`` names
        them: ``(out, in)`` for a projection, ``(E, out, in)`` for an expert stack."""
        hidden = self.hidden_size
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        attention = (
            ("self_attn.q_proj.weight", (q_out, hidden)),
            ("self_attn.k_proj.weight", (kv_out, hidden)),
            ("self_attn.v_proj.weight", (kv_out, hidden)),
            ("self_attn.o_proj.weight", (hidden, q_out)),
        )
        dense = _mlp("mlp", hidden, self.intermediate_size)
        sparse: tuple[tuple[str, tuple[int, ...]], ...] = ()
        sparse_layers: frozenset[int] = frozenset()
        if self.experts is not None:
            experts, ffn = self.experts.num_experts, self.experts.expert_intermediate_size
            sparse = (
                ("mlp.experts.gate_up_proj", (experts, 2 * ffn, hidden)),
                ("mlp.experts.down_proj", (experts, hidden, ffn)),
            )
            if self.experts.shared_expert_intermediate_size:
                sparse += _mlp(
                    "mlp.shared_expert", hidden, self.experts.shared_expert_intermediate_size
                )
            sparse_layers = frozenset(self.experts.sparse_layers)
        return [
            (f"model.layers.{layer}.{module}", shape)
            for layer in range(self.num_hidden_layers)
            for module, shape in attention + (sparse if layer in sparse_layers else dense)
        ]

    def describe(self) -> str:
        text = (
            f"{self.name}: {self.num_hidden_layers} layers, hidden {self.hidden_size}, "
            f"ffn {self.intermediate_size}, heads {self.num_attention_heads} "
            f"(kv {self.num_key_value_heads}), head_dim {self.head_dim}"
        )
        if self.experts is not None:
            layout = self.experts
            shared = (
                f", shared expert ffn {layout.shared_expert_intermediate_size}"
                if layout.shared_expert_intermediate_size
                else ""
            )
            text += (
                f"; {layout.num_experts} experts of ffn {layout.expert_intermediate_size}"
                f"{shared} in {len(layout.sparse_layers)} of {self.num_hidden_layers} layers"
            )
        return text

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str) -> DecoderShape:
        """From a HuggingFace config dict (a VLM's ``text_config`` is used when the top level
        has no ``hidden_size``). A config without ``model_type`` (written by hand) is read as a
        dense Llama-style decoder."""
        if "hidden_size" not in config and isinstance(config.get("text_config"), Mapping):
            config = config["text_config"]
        model_type = config.get("model_type")
        _check_model_type(model_type, config, name)
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
        head_dim = config.get("head_dim") or _DEFAULT_HEAD_DIM.get(model_type)
        # A non-integer size leaves head_dim None; the check below names the size at fault.
        if head_dim is None and _positive_int(sizes["hidden_size"]) and _positive_int(heads):
            if sizes["hidden_size"] % heads:
                raise ValueError(
                    f"{name}: hidden_size {sizes['hidden_size']} is not divisible by "
                    f"num_attention_heads {heads} and the config has no head_dim; add head_dim."
                )
            head_dim = sizes["hidden_size"] // heads
        sizes["head_dim"] = head_dim
        for key, value in sizes.items():
            _require_positive_int(name, key, value)
        experts = (
            _expert_layout(model_type, config, sizes["num_hidden_layers"], name)
            if model_type in MOE_MODEL_TYPES
            else None
        )
        vocab_size = config.get("vocab_size")
        if vocab_size is not None:
            _require_positive_int(name, "vocab_size", vocab_size)
        tied = config.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise ValueError(
                f"{name}: tie_word_embeddings must be true or false, got {tied!r}; fix the config."
            )
        return cls(
            name=name, experts=experts, vocab_size=vocab_size, tie_word_embeddings=tied, **sizes
        )


def _mlp(prefix: str, hidden: int, ffn: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return (
        (f"{prefix}.gate_proj.weight", (ffn, hidden)),
        (f"{prefix}.up_proj.weight", (ffn, hidden)),
        (f"{prefix}.down_proj.weight", (hidden, ffn)),
    )


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _require_positive_int(name: str, key: str, value: Any) -> None:
    if not _positive_int(value):
        raise ValueError(
            f"{name}: {key} must be a positive integer, got {value!r}; fix the config."
        )


def _check_model_type(model_type: Any, config: Mapping[str, Any], name: str) -> None:
    """Refuse a layout this module does not model, rather than plan it as a Llama decoder."""
    if model_type is None:
        expert_keys = [key for key in _EXPERT_COUNT_KEYS if key in config]
        if expert_keys:
            raise ValueError(
                f"{name}: the config has {', '.join(expert_keys)} but no model_type, so its "
                'expert layout is unknown; add "model_type" (one of '
                f"{', '.join(MOE_MODEL_TYPES)})."
            )
        return
    if model_type not in DENSE_MODEL_TYPES + MOE_MODEL_TYPES:
        raise ValueError(
            f"{name}: model_type {model_type!r} is not a layout dmuon-tools plan models (dense: "
            f"{', '.join(DENSE_MODEL_TYPES)}; mixture-of-experts: {', '.join(MOE_MODEL_TYPES)}), "
            "and planning it as a Llama decoder would list matrices it does not have. Use a "
            "preset (--list-presets); if its blocks are exactly Llama's (q/k/v/o_proj, "
            "gate/up/down_proj), write its sizes into a config.json without model_type."
        )


def _expert_layout(
    model_type: str, config: Mapping[str, Any], num_layers: int, name: str
) -> ExpertLayout | None:
    """The expert MLPs as ``transformers`` 5 builds them (``MixtralSparseMoeBlock`` in every
    layer; Qwen-MoE's in layer ``i`` when ``i`` is not in ``mlp_only_layers`` and ``(i + 1) %
    decoder_sparse_step == 0``); None when no layer has experts."""
    count_key = next(
        (key for key in _EXPERT_COUNT_KEYS_OF[model_type] if key in config),
        _EXPERT_COUNT_KEYS_OF[model_type][0],
    )
    num_experts = config.get(count_key)
    if model_type == "mixtral":
        _require_positive_int(name, count_key, num_experts)
        return ExpertLayout(
            num_experts=num_experts,
            expert_intermediate_size=config["intermediate_size"],
            sparse_layers=tuple(range(num_layers)),
        )
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 0:
        raise ValueError(
            f"{name}: {count_key} must be an integer >= 0 for model_type {model_type!r}, got "
            f"{num_experts!r}; fix the config."
        )
    step = config.get("decoder_sparse_step", 1)
    _require_positive_int(name, "decoder_sparse_step", step)
    mlp_only = config.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in mlp_only
    ):
        raise ValueError(
            f"{name}: mlp_only_layers must be a list of layer indices, got {mlp_only!r}; fix "
            "the config."
        )
    sparse_layers = tuple(
        layer
        for layer in range(num_layers)
        if layer not in mlp_only and num_experts > 0 and (layer + 1) % step == 0
    )
    if not sparse_layers:
        return None
    ffn = config.get("moe_intermediate_size")
    _require_positive_int(name, "moe_intermediate_size", ffn)
    shared = 0
    if model_type == "qwen2_moe":
        shared = config.get("shared_expert_intermediate_size")
        _require_positive_int(name, "shared_expert_intermediate_size", shared)
    return ExpertLayout(
        num_experts=num_experts,
        expert_intermediate_size=ffn,
        sparse_layers=sparse_layers,
        shared_expert_intermediate_size=shared,
    )


def _preset(
    name: str,
    hidden,
    ffn,
    layers,
    heads,
    kv_heads,
    *,
    vocab,
    head_dim=None,
    experts=None,
    tied=False,
) -> DecoderShape:
    return DecoderShape(
        name=name,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        experts=experts,
        vocab_size=vocab,
        tie_word_embeddings=tied,
    )


def _experts_in_every_layer(layers: int, num_experts: int, ffn: int) -> ExpertLayout:
    return ExpertLayout(
        num_experts=num_experts, expert_intermediate_size=ffn, sparse_layers=tuple(range(layers))
    )


# Sizes from the published config.json of each model.
PRESETS: dict[str, DecoderShape] = {
    shape.name: shape
    for shape in (
        _preset("llama2-7b", 4096, 11008, 32, 32, 32, vocab=32000),
        _preset("llama2-13b", 5120, 13824, 40, 40, 40, vocab=32000),
        _preset("llama3-8b", 4096, 14336, 32, 32, 8, vocab=128256),
        _preset("llama3-70b", 8192, 28672, 80, 64, 8, vocab=128256),
        _preset("llama3.1-405b", 16384, 53248, 126, 128, 8, vocab=128256),
        _preset("llama3.2-1b", 2048, 8192, 16, 32, 8, vocab=128256, head_dim=64, tied=True),
        _preset("llama3.2-3b", 3072, 8192, 28, 24, 8, vocab=128256, head_dim=128, tied=True),
        _preset("mistral-7b", 4096, 14336, 32, 32, 8, vocab=32000),
        _preset("qwen2.5-0.5b", 896, 4864, 24, 14, 2, vocab=151936, tied=True),
        _preset("qwen2.5-1.5b", 1536, 8960, 28, 12, 2, vocab=151936, tied=True),
        _preset("qwen2.5-3b", 2048, 11008, 36, 16, 2, vocab=151936, tied=True),
        _preset("qwen2.5-7b", 3584, 18944, 28, 28, 4, vocab=152064),
        _preset("qwen2.5-14b", 5120, 13824, 48, 40, 8, vocab=152064),
        _preset("qwen2.5-32b", 5120, 27648, 64, 40, 8, vocab=152064),
        _preset("qwen2.5-72b", 8192, 29568, 80, 64, 8, vocab=152064),
        _preset("qwen3-0.6b", 1024, 3072, 28, 16, 8, vocab=151936, head_dim=128, tied=True),
        _preset("qwen3-8b", 4096, 12288, 36, 32, 8, vocab=151936, head_dim=128),
        _preset(
            "mixtral-8x7b",
            4096,
            14336,
            32,
            32,
            8,
            vocab=32000,
            experts=_experts_in_every_layer(32, 8, 14336),
        ),
        _preset(
            "qwen3-30b-a3b",
            2048,
            6144,
            48,
            32,
            4,
            vocab=151936,
            head_dim=128,
            experts=_experts_in_every_layer(48, 128, 768),
        ),
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
