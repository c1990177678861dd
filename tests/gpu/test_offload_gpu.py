"""``dmuon.Muon(offload_masters=True)`` on CUDA at world size 1 (no torch.distributed): the
masters bit-identical to the run without offload over a few steps, in pinned CPU memory between
steps, and forward/backward's peak device memory lower by the masters' bytes."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz

VOCAB, DIM, LAYERS, STEPS = 256, 1024, 4, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up_proj = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down_proj = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(F.gelu(self.up_proj(self.norm(x))))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def train(offload: bool) -> dict:
    # Peaks are counted from what is allocated before the model exists, so whatever an earlier
    # run left (its model and optimizer wait for the cyclic collector) does not count here.
    gc.collect()
    baseline = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = Decoder().to("cuda", torch.bfloat16)
    dmuon.dedicate_params(model, None, lambda name, p: "proj" in name and p.ndim == 2)
    optimizer = dmuon.Muon(model, ns_backend=NewtonSchulz(kernel="cublas"), offload_masters=offload)
    generator = torch.Generator().manual_seed(1)
    owned = [p for p in get_dedicated_state(model).iter_owned_masters() if p.route == "muon"]
    losses, peaks, homes = [], [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (8, 257), generator=generator).cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - baseline)
        del logits
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        homes.append([(p.master_value().device.type, p.master_value().is_pinned()) for p in owned])
    masters = {p.fqn: p.master_value().detach().cpu().clone() for p in owned}
    master_bytes = sum(p.master.numel() * 4 for p in owned)
    stand_ins = [p.master.untyped_storage().nbytes() for p in owned]
    del model, optimizer, owned
    gc.collect()  # a dedicated model and its hooks form cycles
    torch.cuda.empty_cache()
    return dict(
        losses=losses,
        peaks=peaks,
        homes=homes,
        masters=masters,
        master_bytes=master_bytes,
        stand_ins=stand_ins,
    )


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {name: train(offload) for name, offload in (("a", False), ("b", False), ("on", True))}


def test_offloaded_masters_are_bit_identical_to_resident_ones_on_cuda(runs):
    # Two runs without offload first: a difference there is the GPU's nondeterminism, not
    # the offload's.
    assert runs["a"]["losses"] == runs["b"]["losses"]
    assert runs["on"]["losses"] == runs["a"]["losses"]
    for fqn, value in runs["a"]["masters"].items():
        assert torch.equal(runs["b"]["masters"][fqn], value), fqn
        assert torch.equal(runs["on"]["masters"][fqn], value), fqn


def test_offloaded_masters_live_in_pinned_cpu_memory_between_steps(runs):
    assert runs["on"]["master_bytes"] == LAYERS * 2 * 2 * DIM * DIM * 4
    for step in runs["on"]["homes"]:
        assert step == [("cpu", True)] * (LAYERS * 2)
    assert set(runs["on"]["stand_ins"]) == {4}  # the parameter holds a 4-byte NaN stand-in
    assert {device for step in runs["a"]["homes"] for device, _ in step} == {"cuda"}


def test_forward_and_backward_peak_lower_by_the_masters_bytes(runs):
    # From step 1 on both runs hold their optimizer state; the offloaded one lacks the masters.
    saved = [r - o for r, o in zip(runs["a"]["peaks"][1:], runs["on"]["peaks"][1:])]
    master_bytes = runs["on"]["master_bytes"]
    for step, bytes_saved in enumerate(saved, start=1):
        assert bytes_saved >= 0.95 * master_bytes, (
            f"step {step}: peak lower by {bytes_saved / 2**20:.1f} MiB, masters are "
            f"{master_bytes / 2**20:.1f} MiB; peaks without / with offload "
            f"{runs['a']['peaks']} / {runs['on']['peaks']}"
        )
