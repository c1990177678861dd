"""The oracle of ``run_protocol_cuda.py``: a plain, single-process Muon + AdamW on the full model.

The benchmark's own copy of the test suite's oracle (``tests/reference_optim.py``, whose
docstring gives the update rules), so that no benchmark imports the test suite. It must not be
fast, clever or shared with dmuon: no torch.optim inside, no fused or foreach kernels, no import
of dmuon; orthogonalization is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

# Scale that gives Muon's update the RMS of a typical AdamW update (Moonshot's "match RMS").
MUON_RMS_MATCHING_FACTOR = 0.2


class ReferenceMuonAdamW:
    """Muon on the parameters ``is_muon(name, param)`` selects, AdamW on the others."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, Tensor]],
        is_muon: Callable[[str, Tensor], bool],
        *,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        orthogonalize: Callable[[Tensor], Tensor],
    ) -> None:
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.weight_decay = weight_decay
        self.adamw_lr = adamw_lr
        self.adamw_betas = adamw_betas
        self.adamw_eps = adamw_eps
        self.adamw_weight_decay = adamw_weight_decay
        self.orthogonalize = orthogonalize
        self.params: dict[str, Tensor] = dict(named_params)
        self.muon_names: list[str] = []
        self.adamw_names: list[str] = []
        for name, param in self.params.items():
            if is_muon(name, param):
                if param.ndim < 2:
                    raise ValueError(
                        f"is_muon selected {name!r} of shape {tuple(param.shape)}, but Muon needs "
                        "a parameter with at least 2 dimensions; make is_muon return False for it "
                        "so it goes to AdamW"
                    )
                self.muon_names.append(name)
            else:
                self.adamw_names.append(name)
        # name -> {"momentum_buffer"} for Muon, {"step", "exp_avg", "exp_avg_sq"} for AdamW.
        self.state: dict[str, dict[str, Tensor | int]] = {}

    def zero_grad(self) -> None:
        for param in self.params.values():
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for name in self.muon_names:
            param = self.params[name]
            if param.grad is not None:
                self._muon_update(name, param, param.grad)
        for name in self.adamw_names:
            param = self.params[name]
            if param.grad is not None:
                self._adamw_update(name, param, param.grad)

    def _muon_update(self, name: str, param: Tensor, grad: Tensor) -> None:
        rows = param.shape[0]
        grad = grad.reshape(rows, -1)  # (m, n): trailing dims flattened into n
        columns = grad.shape[1]
        state = self.state.setdefault(name, {})
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = grad.clone()
        else:
            state["momentum_buffer"] = self.momentum * state["momentum_buffer"] + grad
        buf = state["momentum_buffer"]
        update = grad + self.momentum * buf if self.nesterov else buf
        # (m, n), in the parameter's dtype: torch.optim.Muon's orthogonalizer returns bf16, and
        # scaling a bf16 tensor would round the update to bf16.
        orthogonal = self.orthogonalize(update).to(param.dtype)
        scale = MUON_RMS_MATCHING_FACTOR * math.sqrt(max(rows, columns))
        new_weight = param * (1 - self.lr * self.weight_decay)
        new_weight = new_weight - self.lr * scale * orthogonal.reshape(param.shape)
        param.copy_(new_weight)

    def _adamw_update(self, name: str, param: Tensor, grad: Tensor) -> None:
        beta1, beta2 = self.adamw_betas
        state = self.state.setdefault(name, {})
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        step = state["step"]
        state["exp_avg"] = beta1 * state["exp_avg"] + (1 - beta1) * grad
        state["exp_avg_sq"] = beta2 * state["exp_avg_sq"] + (1 - beta2) * grad * grad
        exp_avg_corrected = state["exp_avg"] / (1 - beta1**step)
        exp_avg_sq_corrected = state["exp_avg_sq"] / (1 - beta2**step)
        new_weight = param * (1 - self.adamw_lr * self.adamw_weight_decay)
        new_weight = new_weight - self.adamw_lr * exp_avg_corrected / (
            exp_avg_sq_corrected.sqrt() + self.adamw_eps
        )
        param.copy_(new_weight)
