"""dmuon.Muon's default no_decay rule is HF Trainer's, and the routing table of HF models."""

from __future__ import annotations

import pytest
from transformers import Trainer

import dmuon
from dmuon_hf import default_predicate
from tests.hf.tiny_models import tiny_gpt2, tiny_llama


def hf_decayed(model) -> set[str]:
    # Trainer.get_decay_parameter_names reads only the model (self is unused).
    return set(Trainer.get_decay_parameter_names(None, model))


def routed(model):
    dmuon.dedicate_params(model, None, default_predicate(model))
    return dmuon.Muon(model, weight_decay=0.1, adamw_weight_decay=0.01).routing()


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_the_parameters_without_weight_decay_are_exactly_those_hf_trainer_leaves_undecayed(build):
    model = build()
    decayed = hf_decayed(model)
    rows = routed(model)
    assert {row.fqn for row in rows if row.weight_decay == 0.0} == {
        row.fqn for row in rows if row.fqn not in decayed
    }
    assert all("no_decay rule" in row.why for row in rows if row.fqn not in decayed)


def test_gpt2_layernorm_modules_are_undecayed_by_their_type_not_their_name():
    rows = {row.fqn: row for row in routed(tiny_gpt2())}
    assert rows["transformer.h.0.ln_1.weight"].weight_decay == 0.0
    assert rows["transformer.ln_f.bias"].weight_decay == 0.0
    assert rows["transformer.wte.weight"].weight_decay == 0.01  # embeddings decay, as in HF


def test_the_routing_table_of_a_tiny_llama():
    model = tiny_llama()
    rows = {row.fqn: row for row in routed(model)}
    assert rows["model.layers.0.self_attn.q_proj.weight"][2:] == (
        "muon", 0, 0.02, 0.1, "predicate", "muon",
    )  # fmt: skip
    assert rows["model.layers.1.mlp.down_proj.weight"].shape == (32, 64)
    assert rows["model.embed_tokens.weight"][2:] == (
        "sharded_adamw", None, 1e-3, 0.01, "not dedicated", "adamw",
    )  # fmt: skip
    assert rows["model.norm.weight"][2:] == (
        "sharded_adamw", None, 1e-3, 0.0, "not dedicated, no_decay rule", "adamw",
    )  # fmt: skip
    assert rows["model.layers.0.input_layernorm.weight"].weight_decay == 0.0
    assert sum(row.route == "muon" for row in rows.values()) == 14
    assert list(rows) == [name for name, p in model.named_parameters()]


def test_the_routing_table_of_a_tiny_gpt2():
    rows = {row.fqn: row for row in routed(tiny_gpt2())}
    assert rows["transformer.h.1.attn.c_attn.weight"][1:4] == ((32, 96), "muon", 0)
    assert rows["transformer.h.1.attn.c_attn.bias"].route == "sharded_adamw"
    assert sum(row.route == "muon" for row in rows.values()) == 8


# ---- dmuon_hf.default_predicate's suggestion --------------------------------------------------


def suggested_suffixes(model) -> tuple[str, ...]:
    with pytest.raises(ValueError) as error:
        default_predicate(model)
    line = next(x for x in str(error.value).splitlines() if "name.endswith(" in x)
    return eval(line[line.index("name.endswith(") + len("name.endswith") : line.rindex(")")])


def tiny_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(
        GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=64)
    )  # fmt: skip


def tiny_phi3():
    """Phi-3's fused qkv_proj / gate_up_proj, under a model type default_predicate does not know
    (phi3 itself has a default predicate), so that the suggestion is what is tested."""
    from transformers import Phi3Config, Phi3ForCausalLM

    model = Phi3ForCausalLM(
        Phi3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    )  # fmt: skip
    model.config.model_type = "new_phi3"
    return model


@pytest.mark.parametrize("build", [tiny_neox, tiny_phi3], ids=["gpt-neox", "phi3"])
def test_the_suggested_predicate_selects_every_block_matrix_of_the_model_it_was_raised_for(build):
    model = build()
    suffixes = suggested_suffixes(model)
    chosen = {n for n, p in model.named_parameters() if p.ndim == 2 and n.endswith(suffixes)}
    block_matrices = {n for n, p in model.named_parameters() if p.ndim == 2 and ".layers." in n}
    assert chosen == block_matrices and len(chosen) >= 4
