"""The parameter policy of dedicated parameters: which dtypes they compute and reduce in.

Owns: the ``ParamPolicy`` / ``ParamDefaults`` dataclasses and the parsing of the user's
``param_policy=`` (None, a ParamPolicy or a dict) and of the legacy ``compute_dtype=`` into one
validated ``ParamPolicy``.

Must not: cast tensors or look at a model; applying the policy belongs to the hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import torch

_DTYPE_BY_ALIAS: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}
_ACCEPTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_ACCEPTED_TEXT = (
    "torch.bfloat16, torch.float16, torch.float32, torch.float64 or one of the strings "
    + ", ".join(repr(alias) for alias in _DTYPE_BY_ALIAS)
)
_EXAMPLE = "param_policy={'defaults': {'param_dtype': torch.bfloat16}}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamDefaults:
    """Dtypes for every dedicated parameter (strings such as ``"bf16"`` are accepted)."""

    param_dtype: torch.dtype | None = None  # forward compute dtype; None inherits the param's
    reduce_dtype: torch.dtype | None = None  # dtype of the gradient reduce; None = the grad's

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            object.__setattr__(self, name, _parse_dtype(value, f"ParamDefaults.{name}"))

    def dtypes_of(self, param: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
        """(compute dtype, gradient reduce dtype) of a dedicated parameter: the policy's, else
        the parameter's own; its gradient has its compute dtype, so that is the default reduce
        dtype. The one place these are resolved."""
        param_dtype = self.param_dtype or param.dtype
        return param_dtype, self.reduce_dtype or param_dtype


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamPolicy:
    """How dedicated parameters are computed and reduced; today only ``defaults``."""

    defaults: ParamDefaults = field(default_factory=ParamDefaults)

    def __post_init__(self) -> None:
        if not isinstance(self.defaults, ParamDefaults):
            raise TypeError(
                f"ParamPolicy.defaults must be a ParamDefaults, got "
                f"{type(self.defaults).__name__} {self.defaults!r}; use "
                "ParamPolicy(defaults=ParamDefaults(param_dtype=torch.bfloat16))"
            )


def resolve_param_policy(
    param_policy: ParamPolicy | Mapping[str, object] | None,
    compute_dtype: torch.dtype | str | None = None,
) -> ParamPolicy:
    """One validated ParamPolicy from ``param_policy=`` or the legacy ``compute_dtype=``.

    ``compute_dtype=X`` means ``ParamPolicy(defaults=ParamDefaults(param_dtype=X))``; giving both
    is an error. Dict form: ``{"defaults": {"param_dtype": ..., "reduce_dtype": ...}}``.
    """
    if compute_dtype is not None:
        if param_policy is not None:
            raise ValueError(
                f"got both compute_dtype={compute_dtype!r} and param_policy={param_policy!r}; "
                "compute_dtype is the legacy spelling of param_policy.defaults.param_dtype. "
                "Pass only param_policy and set its defaults.param_dtype, e.g. " + _EXAMPLE
            )
        dtype = _parse_dtype(compute_dtype, "compute_dtype")
        return ParamPolicy(defaults=ParamDefaults(param_dtype=dtype))
    if param_policy is None:
        return ParamPolicy()
    if isinstance(param_policy, ParamPolicy):
        return param_policy
    if isinstance(param_policy, Mapping):
        return _policy_from_mapping(param_policy)
    raise TypeError(
        f"param_policy must be None, a dmuon.ParamPolicy or a dict, got "
        f"{type(param_policy).__name__} {param_policy!r}; use e.g. " + _EXAMPLE
    )


def _policy_from_mapping(mapping: Mapping[str, object]) -> ParamPolicy:
    _reject_unknown_keys(mapping, ("defaults",), "param_policy")
    defaults = mapping.get("defaults")
    if defaults is None:
        return ParamPolicy()
    if isinstance(defaults, ParamDefaults):
        return ParamPolicy(defaults=defaults)
    if not isinstance(defaults, Mapping):
        raise TypeError(
            f"param_policy['defaults'] must be a dict or a dmuon.ParamDefaults, got "
            f"{type(defaults).__name__} {defaults!r}; use e.g. " + _EXAMPLE
        )
    accepted = tuple(f.name for f in fields(ParamDefaults))
    _reject_unknown_keys(defaults, accepted, "param_policy['defaults']")
    parsed = {
        key: _parse_dtype(value, f"param_policy['defaults'][{key!r}]")
        for key, value in defaults.items()
    }
    return ParamPolicy(defaults=ParamDefaults(**parsed))


def _reject_unknown_keys(mapping: Mapping[str, object], accepted: tuple[str, ...], where: str):
    for key in mapping:
        if key not in accepted:
            raise ValueError(
                f"{where}: unknown key {key!r} in {dict(mapping)!r}; accepted keys: "
                + ", ".join(repr(name) for name in accepted)
                + ". Example: "
                + _EXAMPLE
            )


def _parse_dtype(value: object, where: str) -> torch.dtype | None:
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if value in _ACCEPTED_DTYPES:
            return value
        raise ValueError(
            f"{where}={value!r} is not a floating-point compute dtype; use {_ACCEPTED_TEXT} "
            "(or None to keep the parameter's own dtype)"
        )
    if isinstance(value, str):
        dtype = _DTYPE_BY_ALIAS.get(value)
        if dtype is None:
            raise ValueError(
                f"{where}={value!r} is not a known dtype name; use {_ACCEPTED_TEXT} "
                "(or None to keep the parameter's own dtype)"
            )
        return dtype
    raise TypeError(
        f"{where} must be a torch.dtype, a dtype name or None, got {type(value).__name__} "
        f"{value!r}; use {_ACCEPTED_TEXT}"
    )
