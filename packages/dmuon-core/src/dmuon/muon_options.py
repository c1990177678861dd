"""``dmuon.MuonOptions``: every option of ``dmuon.Muon`` but the model, typed and validated once.

Owns the options' names, types (``Literal`` for each string choice), defaults and their
validation: every check that needs no model, with the messages ``dmuon.Muon`` has always given.
``dmuon.Muon``'s keywords are these fields, with these defaults; a package that passes the
options on (``dmuon_titan``'s config) takes its defaults and choices from here instead of
listing them again. It must not read a model, a mesh or a process group, nor build anything
(``dmuon.Muon`` resolves ``ns_backend`` into a ``NewtonSchulz`` and plans the param groups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from dmuon.muon_update import NORMUON_BETA2, NORMUON_EPS
from dmuon.nonfinite import check_policy
from dmuon.routing import ADJUST_LR, HF_NO_DECAY, NoDecay, momentum_dtype_name
from dmuon.step_group import StepGroup
from dmuon_kernels.newton_schulz import NewtonSchulz, NSBackend, validate_backend

AdjustLr = Literal["match_rms_adamw", "spectral"]
"""``adjust_lr``'s rules (or None: lr as given); ``dmuon.routing.ADJUST_LR`` at run time."""
NonfinitePolicy = Literal["skip", "raise", "ignore"]
"""``nonfinite``'s policies; ``dmuon.nonfinite.NONFINITE_POLICIES`` at run time."""
MomentumDtype = Literal["float32", "bfloat16", "int8"]
"""``momentum_dtype`` by name (or the ``torch.dtype``); ``muon_update.MOMENTUM_DTYPES``' keys."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MuonOptions:
    """The options of ``dmuon.Muon``, validated at construction (the messages ``dmuon.Muon``
    raises). ``dmuon.Muon(model, lr=..., ...)`` builds one from its keywords;
    ``dmuon.Muon.from_options(model, options, **overrides)`` takes one, with ``overrides`` (any
    field by keyword) replacing its values.

    Fields:
        lr, momentum, nesterov, weight_decay: the Muon route (decoupled weight decay).
        ns_backend: ``"gram"``, ``"direct"`` or a configured ``dmuon.NewtonSchulz``; every rank
            must use the same one (checked once at construction).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW route.
        replicate_async: under HSDP, publish the new weights across replicas asynchronously
            after ``step()`` (waited for by the next forward) instead of synchronously.
        nonfinite: what a step does when a gradient holds NaN or inf on any rank: ``"skip"``
            (the default: every rank skips the step, weights and optimizer state untouched,
            with a warning naming the step and the parameters), ``"raise"`` (RuntimeError
            naming the parameters, nothing updated) or ``"ignore"`` (torch's behaviour: no
            check, and the update makes every weight it reaches NaN). The check reads the norm
            of a ``dmuon.clip_grad_norm_`` over these gradients when one ran (a scalar to the
            host, nothing recomputed); otherwise it costs one fused max-abs pass over this
            rank's gradients, one all-reduce of a flag and one host synchronisation.
        step_group: a ``dmuon.StepGroup`` shared by the optimizers of every part of a model
            that trains in one step (pipeline stages, here and on the ranks of its ``pp_mesh``):
            the non-finite decision, and ``dmuon.clip_grad_norm_``'s norm, then span them all.
            None: this optimizer alone.
        normuon, normuon_beta2, normuon_eps: NorMuon (Li et al., 2025, arXiv 2510.05491):
            after Newton-Schulz, each row of the update is divided by the root of an EMA
            (``normuon_beta2``) of its mean square, then the whole is rescaled to the
            Frobenius norm of an orthogonal matrix, so ``adjust_lr`` keeps its meaning (the
            update's RMS is 0.2 lr under ``"match_rms_adamw"``, as the paper's rule). State:
            one fp32 number per row. See [Note: NorMuon] in ``dmuon.muon_update``.
        momentum_dtype: the dtype the Muon momentum is stored in: ``torch.float32`` (the
            default), ``torch.bfloat16`` (half its memory) or ``torch.int8`` (int8 with an fp32
            scale per 256 elements of a row: about a quarter; [Note: 8-bit momentum] in
            ``dmuon.muon_update``); the arithmetic is fp32 either way, the buffer rounded once
            per step on store.
        offload_masters: keep the fp32 masters of the Muon route in CPU memory (pinned under
            CUDA) between steps, so they take no device memory during forward and backward;
            ``step()`` brings them to the device one Newton-Schulz call ahead on a side stream
            and copies them home on another ([Note: offloaded masters] in
            ``dmuon.offload``). Bit-identical to the run without it; costs 2 x 4 bytes of
            host-device traffic per owned element per step. Needs parameters in a dtype other
            than fp32 (the master is then a copy of its own); not with ``overlap_step``,
            tensor-parallel matrices or expert stacks (each refused with a message). The AdamW
            route's masters (norms, biases) stay on the device.
        adjust_lr: the Muon learning rate of an (m, n) matrix is ``lr`` times
            ``0.2 * sqrt(max(m, n))`` (``"match_rms_adamw"``, the default: the update's RMS is
            AdamW's), ``sqrt(max(1, m / n))`` (``"spectral"``, torch.optim.Muon's default) or 1
            (None). ``Muon.torch_compatible(model, ...)`` reproduces torch.optim.Muon.
        allow_no_muon: construct even when no dedicated parameter is a matrix (AdamW alone);
            otherwise that raises, since it is almost always a predicate that matched nothing.
            The check reads ``model``, which every rank of its mesh dedicated alike, so those
            ranks all raise or none does; across pipeline stages (different models) the caller
            decides: a stage without matrices passes True when another stage has some
            (``dmuon_titan`` sums the stages' counts over the ``pp`` dim and does so).
        param_groups: ``[{"params": fqns | (name, param) -> bool, "lr": ..., ...}, ...]``,
            applied in order on top of the routes (a parameter takes the first group that
            matches). A group may set ``lr`` and ``weight_decay`` (any route), ``momentum``,
            ``nesterov``, ``adjust_lr``, ``normuon``, ``normuon_beta2``, ``normuon_eps`` and
            ``momentum_dtype`` (Muon), ``betas`` and ``eps`` (AdamW); a key that
            does not apply to a parameter the group matches raises. Each becomes one torch
            param group per update rule it covers. A predicate sees a dedicated parameter as a
            meta tensor of its full shape (its value lives on the owner only), so every rank
            decides alike.
        no_decay: which parameters get no weight decay. ``"hf"`` (the default) is HF
            Trainer's rule: biases, the parameters of ``nn.LayerNorm`` modules and parameters
            named like norms (``layernorm``, ``rmsnorm``, ``norm``, ``*_norm``). Embeddings
            are decayed, as in HF. A function ``(name, param) -> bool`` chooses them itself;
            None or False decays every parameter by its group's ``weight_decay``. A group that
            sets ``weight_decay`` explicitly wins over this rule.
    """

    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.0
    ns_backend: NSBackend | NewtonSchulz = "gram"
    adamw_lr: float = 1e-3
    adamw_betas: tuple[float, float] = (0.9, 0.999)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.01
    replicate_async: bool = True
    nonfinite: NonfinitePolicy = "skip"
    allow_no_muon: bool = False
    adjust_lr: AdjustLr | None = "match_rms_adamw"
    param_groups: list[dict] | None = None
    no_decay: NoDecay = HF_NO_DECAY
    step_group: StepGroup | None = None
    overlap_step: bool = False
    normuon: bool = False
    normuon_beta2: float = NORMUON_BETA2
    normuon_eps: float = NORMUON_EPS
    momentum_dtype: torch.dtype | MomentumDtype = torch.float32
    offload_masters: bool = False

    def __post_init__(self) -> None:
        _check_hyperparameters(self)
        momentum_dtype_name(self.momentum_dtype)
        if self.adjust_lr not in ADJUST_LR:
            raise ValueError(
                f"dmuon.Muon: adjust_lr={self.adjust_lr!r} is not one of {ADJUST_LR}: "
                "'match_rms_adamw' (lr x 0.2 sqrt(max(m, n)), the default), 'spectral' "
                "(lr x sqrt(max(1, m / n)), torch.optim.Muon's default) or None (lr as given)."
            )
        if not isinstance(self.ns_backend, (str, NewtonSchulz)):
            raise TypeError(
                f"ns_backend must be 'gram', 'direct' or a dmuon.NewtonSchulz, got "
                f"{type(self.ns_backend).__name__}: {self.ns_backend!r}."
            )
        if isinstance(self.ns_backend, str):
            validate_backend(self.ns_backend)  # NewtonSchulz's message, before any model
        check_policy(self.nonfinite)

    @property
    def momentum_dtype_name(self) -> MomentumDtype:
        """``momentum_dtype`` by name (``torch.bfloat16`` or ``"bfloat16"``: ``"bfloat16"``)."""
        return momentum_dtype_name(self.momentum_dtype)

    def newton_schulz(self) -> NewtonSchulz:
        """``ns_backend`` as a ``NewtonSchulz`` (a name: that backend's defaults)."""
        if isinstance(self.ns_backend, NewtonSchulz):
            return self.ns_backend
        return NewtonSchulz(backend=self.ns_backend)


def _check_hyperparameters(options: MuonOptions) -> None:
    """Refuse what torch.optim would take silently or fail on later, showing the value."""
    numbers = ("lr", "weight_decay", "adamw_lr", "adamw_eps", "adamw_weight_decay", "normuon_eps")
    for name in (*numbers, "momentum", "normuon_beta2"):
        value = getattr(options, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ValueError(f"dmuon.Muon: {name} must be a finite number, got {value!r}.")
        if value < 0:
            raise ValueError(f"dmuon.Muon: {name} must be a non-negative number, got {value!r}.")
    momentum, normuon_beta2 = options.momentum, options.normuon_beta2
    if not 0 <= momentum < 1:
        raise ValueError(f"dmuon.Muon: momentum must be in [0, 1), got {momentum!r}.")
    if not 0 <= normuon_beta2 < 1:
        raise ValueError(f"dmuon.Muon: normuon_beta2 must be in [0, 1), got {normuon_beta2!r}.")
    for name in ("nesterov", "replicate_async", "overlap_step", "normuon", "offload_masters"):
        value = getattr(options, name)
        if not isinstance(value, bool):
            raise TypeError(f"dmuon.Muon: {name} must be True or False, got {value!r}.")
    adamw_betas = options.adamw_betas
    if (
        not isinstance(adamw_betas, (tuple, list))
        or len(adamw_betas) != 2
        or not all(
            isinstance(beta, (int, float)) and not isinstance(beta, bool) and 0 <= beta < 1
            for beta in adamw_betas
        )
    ):
        raise ValueError(
            "dmuon.Muon: adamw_betas must be a pair of numbers in [0, 1), e.g. (0.9, 0.999), "
            f"got {adamw_betas!r}."
        )
