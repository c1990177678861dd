"""Every package declares what its source imports: in its dependencies, or in an extra.

A missing declaration passes the workspace tests (the dev environment holds everything) and
breaks the wheel a user installs; ``.ci/wheels`` catches it at run time, this test at a glance.
"""

import ast
import sys
from pathlib import Path

import pytest
import tomllib

PACKAGES = Path(__file__).resolve().parents[1] / "packages"

# package folder -> its import name
SOURCES = {
    "dmuon-kernels": "dmuon_kernels",
    "dmuon-core": "dmuon",
    "dmuon-hf": "dmuon_hf",
    "dmuon-tools": "dmuon_tools",
    "dmuon-titan": "dmuon_titan",
}

# top-level import name -> the distribution that provides it
DISTRIBUTION_OF = {
    "torch": "torch",
    "numpy": "numpy",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "safetensors": "safetensors",
    "matplotlib": "matplotlib",
    "triton": "triton",
    "quack": "quack-kernels",
    "cutlass": "nvidia-cutlass-dsl",
    "cuda": "cuda-python",
    "tvm_ffi": "apache-tvm-ffi",
    "dmuon": "dmuon-core",
    "dmuon_kernels": "dmuon-kernels",
    "torchtitan": "torchtitan",
}

# Needed at run time without an import of ours: distribution -> why.
UNIMPORTED_REQUIREMENTS = {
    "dmuon-core": {"numpy": "torch.distributed.all_gather_object fails without numpy"},
}


def _requirement_name(requirement: str) -> str:
    name = requirement
    for separator in "<>=!~;[ ":
        name = name.split(separator)[0]
    return name.lower()


def declared(package: str) -> set[str]:
    project = tomllib.loads((PACKAGES / package / "pyproject.toml").read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements.extend(extra)
    return {_requirement_name(requirement) for requirement in requirements}


def third_party_imports(package: str) -> set[str]:
    names = set()
    for path in (PACKAGES / package / "src" / SOURCES[package]).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__", SOURCES[package]}


@pytest.mark.parametrize("package", sorted(SOURCES))
def test_every_import_of_a_package_is_a_declared_dependency_or_extra(package):
    imports = third_party_imports(package)
    unknown = sorted(imports - set(DISTRIBUTION_OF))
    assert unknown == [], f"{package} imports {unknown}: add them to DISTRIBUTION_OF here"
    missing = sorted({DISTRIBUTION_OF[name] for name in imports} - declared(package))
    assert missing == [], f"{package} imports {missing} without declaring them in pyproject.toml"


@pytest.mark.parametrize("package", sorted(UNIMPORTED_REQUIREMENTS))
def test_run_time_requirements_without_an_import_are_declared(package):
    missing = sorted(set(UNIMPORTED_REQUIREMENTS[package]) - declared(package))
    assert missing == [], (
        f"{package} does not declare {missing}: {UNIMPORTED_REQUIREMENTS[package]}"
    )
