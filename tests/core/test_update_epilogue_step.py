"""``dmuon.Muon``'s plain step with the update written by Newton-Schulz's last product
([Note: the update epilogue] in ``dmuon_kernels.update_epilogue``), its CUDA path run on the CPU
in fp32: against the single-process reference optimizer, and against the same step with the
output written out. The variants that need the output (NorMuon, the overlapped step) never take
it. (On CUDA, fp16 operands into fp32 masters: tests/gpu/test_update_epilogue_gpu.py.)"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon_kernels import newton_schulz
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate
from tests.reference_optim import ReferenceMuonAdamW

FP32_NS = functools.partial(NewtonSchulz, dtype=torch.float32, kernel="cublas")
STEPS, WEIGHT_DECAY = 4, 0.1


def force_epilogue(monkeypatch, on: bool) -> list[int]:
    """Turn the epilogue on (the CUDA path) or off; returns a list that counts its products."""
    module = sys.modules["dmuon_kernels.newton_schulz"]  # ``newton_schulz`` is the function
    monkeypatch.setattr(module, "epilogue_enabled", lambda X: on)
    real, calls = module.final_update_, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "final_update_", counted)
    return calls


def train(steps: int = STEPS, **options) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Masters and momenta after ``steps`` steps of the tiny decoder (fp32 Newton-Schulz)."""
    torch.manual_seed(0)
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    optimizer = dmuon.Muon(model, ns_backend=FP32_NS(), weight_decay=WEIGHT_DECAY, **options)
    for batch in batches(steps, 1):
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    owned = list(get_dedicated_state(model).iter_owned_masters())
    masters = {p.fqn: p.master.detach().clone() for p in owned}
    state = {p.fqn: optimizer.state[p.master] for p in owned}
    momenta = {name: entry.get("momentum_buffer") for name, entry in state.items()}
    return masters, momenta


def test_the_written_update_matches_the_reference_optimizer(monkeypatch):
    calls = force_epilogue(monkeypatch, True)
    masters, _ = train()
    assert calls, "the epilogue did not run"
    torch.manual_seed(0)
    reference = TinyDecoder()
    reference_optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        proj_predicate,
        weight_decay=WEIGHT_DECAY,
        orthogonalize=functools.partial(newton_schulz, dtype=torch.float32),
    )
    for batch in batches(STEPS, 1):
        loss_fn(reference, batch).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    expected = dict(reference.named_parameters())
    for name, master in masters.items():
        torch.testing.assert_close(master, expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "momentum_dtype, adjust_lr",
    [("float32", "spectral"), ("float32", "match_rms_adamw"), ("int8", "match_rms_adamw")],
)
def test_written_and_written_out_updates_agree_within_fp32_rounding(
    monkeypatch, momentum_dtype, adjust_lr
):
    """ "spectral" scales a tall matrix's update unlike its transpose's. An int8 momentum rounds a
    rounding's difference to a whole quantisation step: one step there."""
    steps = 1 if momentum_dtype == "int8" else STEPS
    options = {"momentum_dtype": momentum_dtype, "adjust_lr": adjust_lr}
    force_epilogue(monkeypatch, False)
    expected, expected_momenta = train(steps, **options)
    calls = force_epilogue(monkeypatch, True)
    masters, momenta = train(steps, **options)
    assert calls
    for name in masters:
        torch.testing.assert_close(masters[name], expected[name], rtol=1e-5, atol=1e-6)
        if momentum_dtype == "float32":
            torch.testing.assert_close(momenta[name], expected_momenta[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("options", [{"normuon": True}, {"overlap_step": True}])
def test_normuon_and_the_overlapped_step_write_the_output_out(monkeypatch, options):
    calls = force_epilogue(monkeypatch, True)
    train(**options)
    assert not calls
