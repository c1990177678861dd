"""torch's private APIs reach dmuon-core through one module, ``dmuon._torch_internals``, and a
torch without one of them fails at import with the internal, the version and the fix.

A use is private when it imports from a private torch module or imports a private name, follows
a private attribute of a torch module (``torch._foreach_norm``, ``dist.distributed_c10d.
_get_default_group``), or reads or writes a private attribute that torch's classes have or that
torch sets on objects (``mesh._get_root_mesh()``, ``param._st_info``), directly or by name
through ``getattr``. ``nn.Module``'s slot dictionaries are exempt by decision (see the module).

The packages around core cannot import ``dmuon._torch_internals`` (a private module of core):
what they need of torch's internals core answers publicly (``dmuon.inspect``), and the few uses
no dmuon function should serve are listed here with their reason, so a new one fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon import _torch_internals

SOURCE = Path(dmuon.__file__).resolve().parent
THE_ONE_PLACE = SOURCE / "_torch_internals.py"
PACKAGES = SOURCE.parents[2]
OTHER_PACKAGES = (
    "dmuon-hf/src/dmuon_hf",
    "dmuon-kernels/src/dmuon_kernels",
    "dmuon-titan/src/dmuon_titan",
    "dmuon-tools/src/dmuon_tools",
)
# File -> the private torch uses it keeps, and why no dmuon function serves them.
KNOWN_OUTSIDE_CORE = {
    # torch's activation-checkpoint wrapper, applied as Accelerate's FSDP2 plugin applies it;
    # torch has it under no public path.
    "dmuon-hf/src/dmuon_hf/sharding.py": {
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ...",
    },
    # torchtitan's own setting for its per-block compile of MoE dispatch.
    "dmuon-titan/src/dmuon_titan/parallelize.py": {"torch._dynamo"},
    # dmuon-kernels stands below core (it cannot import it): foreach ops with no public
    # spelling, the matmul backend in force, the CUDA driver's sleep for timings.
    "dmuon-kernels/src/dmuon_kernels/fused.py": {
        "torch._foreach_add_",
        "torch._foreach_copy_",
        "torch._foreach_mul_",
    },
    "dmuon-kernels/src/dmuon_kernels/syrk/autotune.py": {"._get_backend"},
    "dmuon-kernels/src/dmuon_kernels/syrk/cute.py": {"torch._C"},
    "dmuon-kernels/src/dmuon_kernels/syrk/timing.py": {"torch.cuda._sleep"},
}
MODULE_SLOTS = {"_parameters", "_modules", "_buffers", "_non_persistent_buffers_set"}
# Private attributes torch sets on objects at run time (dir() of a class cannot list them).
SET_BY_TORCH = {
    "_ddp_ignored",
    "_ddp_params_and_buffers_to_ignore",
    "_st_info",
    "_module_parameters",
    "_timeout",
    "_local_tensor",
}
TORCH_CLASSES = (
    torch.Tensor,
    nn.Parameter,
    nn.Module,
    DTensor,
    DeviceMesh,
    dist.ProcessGroup,
    DistributedDataParallel,
    FSDPModule,
    torch.autograd.Variable,
    torch.autograd.Function,
)
TORCH_PRIVATE_ATTRIBUTES = (
    {
        name
        for cls in TORCH_CLASSES
        for name in dir(cls)
        if name.startswith("_") and not name.startswith("__")
    }
    | SET_BY_TORCH
) - MODULE_SLOTS
TORCH_ROOTS = {"torch", "dist", "nn", "F", "dcp"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_torch_uses(source: str) -> list[str]:
    """Every use of a private torch API in ``source``, as ``line: what``."""
    found: set[tuple[int, str]] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" and any(
                    _private(part) for part in alias.name.split(".")
                ):
                    found.add((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "torch":
                continue
            if any(_private(part) for part in node.module.split(".")):
                found.add((node.lineno, f"from {node.module} import ..."))
            for alias in node.names:
                if _private(alias.name):
                    found.add((node.lineno, f"from {node.module} import {alias.name}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            chain, root = [node.attr], node.value
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in TORCH_ROOTS:
                found.add((node.lineno, ".".join([root.id, *reversed(chain)])))
            elif node.attr in TORCH_PRIVATE_ATTRIBUTES:
                found.add((node.lineno, f".{node.attr}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in TORCH_PRIVATE_ATTRIBUTES
        ):
            found.add((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_torchs_private_apis_are_used_in_one_module_of_core():
    offenders = {
        str(path.relative_to(SOURCE)): private_torch_uses(path.read_text())
        for path in sorted(SOURCE.rglob("*.py"))
        if path != THE_ONE_PLACE
    }
    assert {name: uses for name, uses in offenders.items() if uses} == {}


@pytest.mark.parametrize("package", OTHER_PACKAGES)
def test_the_other_packages_use_no_private_torch_api_but_the_known_ones(package):
    paths = sorted((PACKAGES / package).rglob("*.py"))
    assert paths, f"no sources under {package}"
    new_uses = {}
    for path in paths:
        name = str(path.relative_to(PACKAGES))
        known = KNOWN_OUTSIDE_CORE.get(name, set())
        uses = [
            use
            for use in private_torch_uses(path.read_text())
            if use.split(": ", 1)[1] not in known
        ]
        if uses:
            new_uses[name] = uses
    assert new_uses == {}, (
        "a private torch API outside dmuon-core: give the package a public dmuon function that "
        "reaches it through dmuon._torch_internals (dmuon.inspect), or list it in "
        "KNOWN_OUTSIDE_CORE with the reason"
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "from torch.utils._pytree import tree_flatten",
            ["1: from torch.utils._pytree import ..."],
        ),
        (
            "from torch.nn.modules.module import _IncompatibleKeys",
            ["1: from torch.nn.modules.module import _IncompatibleKeys"],
        ),
        ("import torch\ntorch._foreach_norm(xs, 2)", ["2: torch._foreach_norm"]),
        (
            "import torch\ntorch._C._current_graph_task_id()",
            ["2: torch._C", "2: torch._C._current_graph_task_id"],
        ),
        (
            "dist.distributed_c10d._get_default_group()",
            ["1: dist.distributed_c10d._get_default_group"],
        ),
        ("root = mesh._get_root_mesh()", ["1: ._get_root_mesh"]),
        ("spec = getattr(param, '_st_info', None)", ["1: getattr(..., '_st_info')"]),
        ("value._local_tensor", ["1: ._local_tensor"]),
        ("module._parameters[name] = p\nself._pending = []\ngroup._root_rank(s)", []),
        ("from torch.distributed.tensor import DTensor\nimport torch.nn.functional as F", []),
    ],
)
def test_the_private_use_check_finds_each_kind_of_use(source, expected):
    assert private_torch_uses(source) == expected


def test_a_torch_without_an_internal_fails_naming_it_the_version_and_the_fix():
    with pytest.raises(ImportError) as caught:
        _torch_internals._load("torch.utils._pytree", "a_function_torch_never_had")
    message = str(caught.value)
    assert "torch.utils._pytree.a_function_torch_never_had" in message
    assert f"torch {torch.__version__} does not have" in message
    assert f"tested with torch {_torch_internals.TESTED_TORCH}" in message
    assert "pip install 'torch>=2.11,<2.14'" in message


def test_fully_shard_skips_dedicated_parameters_on_this_torch():
    from dmuon import fsdp2

    assert fsdp2.install_error is None
