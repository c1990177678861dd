"""One-GPU training of ``dmuon.testing.TinyDecoder`` in bf16 under ``dmuon.Muon``, for the GPU
tests of the update's last product (tests/gpu/test_update_epilogue_gpu.py,
tests/gpu/test_update_gemm_gpu.py)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon.testing import TinyDecoder, batches, loss_fn, proj_predicate


def train(monkeypatch, epilogue: bool, steps: int, profiled: bool = False):
    """(masters, the owner's bf16 segment values, the first step's CUDA kernels if
    ``profiled``) after ``steps`` steps of a bf16 tiny decoder."""
    monkeypatch.setenv("DMUON_UPDATE_EPILOGUE", "1" if epilogue else "0")
    torch.manual_seed(0)
    model = TinyDecoder(4).to("cuda", torch.bfloat16)
    dmuon.dedicate_params(model, None, proj_predicate)
    optimizer = dmuon.Muon(model, weight_decay=0.01)
    kernels = []
    for step, tokens in enumerate(batches(steps, 1, per_rank=4, seq=33)):
        loss_fn(model, tokens.cuda()).backward()
        if profiled and step == 0:
            with profile(activities=[ProfilerActivity.CUDA]) as trace:
                optimizer.step()
                torch.cuda.synchronize()
            kernels = [event.name for event in trace.events() if event.device_type.name == "CUDA"]
        else:
            optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    owned = [p for p in get_dedicated_state(model).iter_owned_masters() if p.route == "muon"]
    masters = {p.fqn: p.master.detach().clone() for p in owned}
    segments = {p.fqn: p.unsharded.detach().clone() for p in owned}
    return masters, segments, kernels
