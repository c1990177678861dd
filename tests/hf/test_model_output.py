"""HF ``ModelOutput`` objects come out of a dmuon-dedicated model with their type and attributes."""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

import dmuon
from dmuon_hf import default_predicate
from tests.hf.tiny_models import VOCAB_SIZE, tiny_llama, token_batch


def dedicated_llama():
    model = tiny_llama()
    dmuon.dedicate_params(model, None, default_predicate(model))
    return model


def test_dedicated_llama_returns_causal_lm_output_with_loss_and_logits():
    model = dedicated_llama()
    tokens = token_batch(2, seq_len=8)
    output = model(input_ids=tokens, labels=tokens)
    assert type(output) is CausalLMOutputWithPast
    assert output.logits.shape == (2, 8, VOCAB_SIZE)
    assert output.loss.ndim == 0 and output.loss.requires_grad
    assert output["loss"] is output.loss and output[0] is output.loss


def test_dedicated_llama_matches_the_plain_model_and_keeps_output_type_after_a_step():
    plain, model = tiny_llama(), dedicated_llama()
    tokens = token_batch(2, seq_len=8)
    reference = plain(input_ids=tokens, labels=tokens)
    output = model(input_ids=tokens, labels=tokens)
    torch.testing.assert_close(output.logits, reference.logits, rtol=1e-5, atol=1e-6)

    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    output.loss.backward()
    optimizer.step()
    optimizer.zero_grad()

    after = model(input_ids=tokens, labels=tokens)
    assert type(after) is CausalLMOutputWithPast
    assert torch.isfinite(after.loss)
    # The step changed the dedicated weights, so the logits moved.
    assert not torch.allclose(after.logits, output.logits)
