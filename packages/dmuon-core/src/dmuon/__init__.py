"""dmuon: distributed Muon for PyTorch FSDP2.

Each Muon matrix gets one owner rank. The owner broadcasts the weight in forward, receives the
averaged gradient in backward, and alone runs momentum + Newton-Schulz + update; under HSDP it
publishes the new weight across replicas asynchronously, behind the next forward::

    import dmuon
    dmuon.dedicate_params(model, dp_mesh, predicate=lambda name, p: "proj" in name and p.ndim == 2)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

``dmuon.inspect`` holds read-only views of what ``dedicate_params`` decided (owners, boundaries,
segments, the partition plan) and the partition's pure functions for what-ifs; ``dmuon.checkpoint``
saves and loads. Every other module is internal.
"""

from dmuon_kernels._torch_support import require_torch

require_torch("dmuon-core")

from dmuon import inspect  # noqa: E402
from dmuon.clip import clip_grad_norm_  # noqa: E402
from dmuon.dedicate import (  # noqa: E402
    dedicate_params,
    dedicate_params_ddp,
    dedicated_parameters,
    no_sync,
    set_gradient_divide_factor,
    wait_all_replicate_broadcasts,
)
from dmuon.deferred import dedicate_before_fully_shard  # noqa: E402
from dmuon.muon_options import (  # noqa: E402
    AdjustLr,
    MomentumDtype,
    MuonOptions,
    NonfinitePolicy,
    NSBackend,
)
from dmuon.optim import Muon  # noqa: E402
from dmuon.partition import OwnerCoord  # noqa: E402
from dmuon.policy import ParamDefaults, ParamPolicy  # noqa: E402
from dmuon.qk_clip import (  # noqa: E402
    AttentionHeads,
    GQAClip,
    MLAHeads,
    QKClip,
    attention_max_logits,
    mla_max_logits,
)
from dmuon.step_group import StepGroup  # noqa: E402
from dmuon_kernels import (  # noqa: E402
    KELLER_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    YOU_COEFFICIENTS,
    NewtonSchulz,
    get_backend_status,
    get_ns_backend,
)

__version__ = "0.1.0"

# Diagnostics live in the dmuon-tools distribution; resolved by name so that dmuon-core never
# imports it (and works without it).
_TOOLS_NAMES = ("summarize_param_groups", "summarize_comm_plan", "collect_forward_unshard_profile")


def __getattr__(name: str):
    if name in _TOOLS_NAMES:
        import importlib

        try:
            tools = importlib.import_module("dmuon_tools")
        except ImportError as error:
            raise ImportError(
                f"dmuon.{name} is provided by the dmuon-tools package: pip install dmuon-tools "
                "(not on PyPI yet: from a checkout of the repository, pip install "
                "./packages/dmuon-tools)"
            ) from error
        if not hasattr(tools, name):
            raise ImportError(
                f"dmuon.{name} needs a dmuon-tools release that provides it "
                f"(installed: {getattr(tools, '__version__', 'unknown')}): "
                "pip install -U dmuon-tools (from a checkout of the repository: pip install -U "
                "./packages/dmuon-tools)"
            )
        return getattr(tools, name)
    raise AttributeError(f"module 'dmuon' has no attribute {name!r}")


__all__ = [
    "KELLER_COEFFICIENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "YOU_COEFFICIENTS",
    "AdjustLr",
    "AttentionHeads",
    "GQAClip",
    "MLAHeads",
    "MomentumDtype",
    "Muon",
    "MuonOptions",
    "NSBackend",
    "NewtonSchulz",
    "NonfinitePolicy",
    "OwnerCoord",
    "ParamDefaults",
    "ParamPolicy",
    "QKClip",
    "StepGroup",
    "__version__",
    "attention_max_logits",
    "clip_grad_norm_",
    "dedicate_before_fully_shard",
    "dedicate_params",
    "dedicate_params_ddp",
    "dedicated_parameters",
    "get_backend_status",
    "get_ns_backend",
    "inspect",
    "mla_max_logits",
    "no_sync",
    "set_gradient_divide_factor",
    "wait_all_replicate_broadcasts",
]
