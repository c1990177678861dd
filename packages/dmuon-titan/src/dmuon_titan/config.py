"""``DMuonConfig``: what the dmuon switch of a torchtitan job sets.

Owns the options dmuon adds to a torchtitan ``Trainer.Config`` (its ``dmuon`` section, so
``--dmuon.lr 0.02`` works on the command line) and the choice of the Muon parameters. It must
not build anything: ``parallelize`` and ``optimizer`` read it.

The AdamW route (embeddings, norms, the output head, routers) keeps the job's own AdamW
settings: an AdamW hyperparameter left at None here is read from the job's optimizer config.
The Muon route's options take their defaults, choices (``Literal`` types, so the command line
lists them) and checks from ``dmuon.MuonOptions``, the one place that lists them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import get_args

import torch

from dmuon import (
    KELLER_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    YOU_COEFFICIENTS,
    AdjustLr,
    GQAClip,
    MomentumDtype,
    MuonOptions,
    NewtonSchulz,
    NonfinitePolicy,
    NSBackend,
)

COEFFICIENTS = {
    "polar_express": POLAR_EXPRESS_COEFFICIENTS,
    "you": YOU_COEFFICIENTS,
    "keller": KELLER_COEFFICIENTS,
}
NS_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
MOMENTUM_DTYPES = get_args(MomentumDtype)
GQA_CLIPS = get_args(GQAClip)
# dmuon.Muon's defaults, which the Muon route's options here take.
_MUON = MuonOptions()


@dataclass(kw_only=True, slots=True)
class DMuonConfig:
    lr: float = _MUON.lr
    """Muon learning rate (scaled per matrix by ``adjust_lr``)."""

    momentum: float = _MUON.momentum
    nesterov: bool = _MUON.nesterov
    weight_decay: float = _MUON.weight_decay
    """Decoupled weight decay of the Muon matrices."""

    adjust_lr: AdjustLr | None = _MUON.adjust_lr
    """'match_rms_adamw' (lr x 0.2 sqrt(max(m, n))), 'spectral' or None; see dmuon.Muon."""

    normuon: bool = _MUON.normuon
    """NorMuon: per-row second moment after Newton-Schulz (docs/update-rules.md)."""

    momentum_dtype: MomentumDtype = _MUON.momentum_dtype_name
    """Muon momentum storage: 'float32', 'bfloat16' (half the memory) or 'int8' (block scales,
    about a quarter); fp32 arithmetic either way."""

    ns_backend: NSBackend = "gram"
    """Newton-Schulz algorithm: 'gram' or 'direct'."""

    ns_kernel: str = "auto"
    """SYRK kernel: 'auto', 'quack', 'cute' or 'cublas'."""

    ns_coefficients: str = "polar_express"
    """'polar_express', 'you' or 'keller' (torch.optim.Muon's)."""

    ns_dtype: str = "float16"
    """Iteration dtype: 'float16', 'bfloat16' (torch.optim.Muon's) or 'float32'."""

    adamw_lr: float | None = None
    adamw_betas: tuple[float, float] | None = None
    adamw_eps: float | None = None
    adamw_weight_decay: float | None = None
    """The AdamW route's hyperparameters; None takes the job's AdamW optimizer setting."""

    muon_params: str = r"^layers\.\d+\."
    """Regex searched in each parameter's canonical FQN: matching parameters of 2 or more dims
    take the Muon route (3-D ones are expert stacks). Default: the transformer blocks'."""

    adamw_params: str = r"(^|\.)(router|norm|attention_norm|ffn_norm)(\.|$)|_norm\.|embed"
    """Regex of parameters kept on AdamW even where ``muon_params`` matches them (routers,
    norms, embeddings)."""

    replicate_async: bool = _MUON.replicate_async
    """Under HSDP, publish new weights across replicas behind the next forward."""

    nonfinite: NonfinitePolicy | None = None
    """dmuon.Muon's non-finite gradient policy; None keeps dmuon's default."""

    qk_clip_threshold: float | None = None
    """MuonClip's QK-clip (``dmuon_titan.qk_clip_titan``) on every multi-head latent attention
    layer, with this threshold tau on each head's largest logit (Kimi K2: 100); None: off."""

    qk_clip_alpha: float = 0.5
    """The QK-clip's split of gamma between the query (gamma^alpha) and key rows."""

    qk_clip_gqa: str = "per_query_head"
    """The QK-clip's convention where query heads share a key head: 'per_query_head' or
    'per_key_group' (dmuon.GQAClip)."""

    def __post_init__(self) -> None:
        if self.ns_coefficients not in COEFFICIENTS:
            raise ValueError(
                f"dmuon.ns_coefficients={self.ns_coefficients!r} is not one of "
                f"{sorted(COEFFICIENTS)}."
            )
        if self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"dmuon.ns_dtype={self.ns_dtype!r} is not one of {sorted(NS_DTYPES)}.")
        if self.momentum_dtype not in MOMENTUM_DTYPES:
            raise ValueError(
                f"dmuon.momentum_dtype={self.momentum_dtype!r} is not one of "
                f"{list(MOMENTUM_DTYPES)}."
            )
        self._muon_route()  # checked as dmuon.Muon checks them (its messages)
        if self.qk_clip_threshold is not None and not self.qk_clip_threshold > 0:
            raise ValueError(
                f"dmuon.qk_clip_threshold={self.qk_clip_threshold!r} is not a positive logit; "
                "give the largest logit a head may reach (Kimi K2: 100), or leave it unset to "
                "train without the QK-clip."
            )
        if not 0.0 <= self.qk_clip_alpha <= 1.0:
            raise ValueError(
                f"dmuon.qk_clip_alpha={self.qk_clip_alpha!r} is not in [0, 1] (the query's share "
                "of the clip; 0.5 is Kimi K2's)."
            )
        if self.qk_clip_gqa not in GQA_CLIPS:
            raise ValueError(
                f"dmuon.qk_clip_gqa={self.qk_clip_gqa!r} is not one of {list(GQA_CLIPS)}."
            )
        for field_name in ("muon_params", "adamw_params"):
            try:
                re.compile(getattr(self, field_name))
            except re.error as error:
                raise ValueError(
                    f"dmuon.{field_name}={getattr(self, field_name)!r} is not a regular "
                    f"expression: {error}."
                ) from error

    def muon_options(self) -> MuonOptions:
        """The Muon route's options for ``dmuon.Muon.from_options``: this section's values, the
        Newton-Schulz built from its ``ns_*``. The AdamW route's values and the job's param
        groups are left at dmuon's defaults: ``dmuon_titan.optimizer`` reads them from the job's
        optimizer config and passes them over these."""
        return replace(self._muon_route(), ns_backend=self.newton_schulz())

    def _muon_route(self) -> MuonOptions:
        return MuonOptions(
            lr=self.lr,
            momentum=self.momentum,
            nesterov=self.nesterov,
            weight_decay=self.weight_decay,
            adjust_lr=self.adjust_lr,
            normuon=self.normuon,
            momentum_dtype=self.momentum_dtype,
            ns_backend=self.ns_backend,
            replicate_async=self.replicate_async,
            **({"nonfinite": self.nonfinite} if self.nonfinite is not None else {}),
        )

    def newton_schulz(self) -> NewtonSchulz:
        return NewtonSchulz(
            backend=self.ns_backend,
            kernel=self.ns_kernel,
            coefficients=COEFFICIENTS[self.ns_coefficients],
            dtype=NS_DTYPES[self.ns_dtype],
        )

    def is_muon(self, canonical_name: str, param: torch.Tensor) -> bool:
        """The Muon route for ``canonical_name``: a block matrix, not a router/norm/embedding."""
        return (
            param.ndim >= 2
            and re.search(self.muon_params, canonical_name) is not None
            and re.search(self.adamw_params, canonical_name) is None
        )
