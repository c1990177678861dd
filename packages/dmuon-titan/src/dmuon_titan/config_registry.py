"""torchtitan's job configs with dmuon switched on: ``--module dmuon_titan``.

``torchtitan.train --module dmuon_titan --config llama3_8b`` runs torchtitan's own ``llama3_8b``
job (from ``torchtitan.models.llama3.config_registry``) with ``dmuon_titan.enable``: any config
function of torchtitan's model registries is found by its name (and listed by ``dir()``, which
torchtitan shows when a name is unknown), and ``--dmuon.*`` flags set dmuon's options. It owns
that lookup and nothing else.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torchtitan.models

from dmuon_titan import trainer as _trainer

# torchtitan's model packages whose config_registry this module looks through, in order.
_MODEL_PACKAGES = ("llama3", "qwen3", "deepseek_v3", "gpt_oss", "qwen3_5", "kimi_k2_7")


def __getattr__(name: str) -> Callable[[], _trainer.DMuonTrainer.Config]:
    job = _jobs().get(name) if not name.startswith("_") else None
    if job is None and not name.startswith("_"):
        _raise_if_defined_where_it_does_not_import(name)
    if job is None:
        raise AttributeError(
            f"dmuon_titan has no config {name!r}: it runs torchtitan's own job configs with "
            f"dmuon on, and none of torchtitan.models.{{{', '.join(_MODEL_PACKAGES)}}}."
            "config_registry defines it; or call dmuon_titan.enable(config) in a config_registry "
            "of your own."
        )
    return lambda: _trainer.enable(job())


def __dir__() -> list[str]:
    return sorted(_jobs())


def _jobs() -> dict[str, Callable]:
    """Every job config function of torchtitan's model registries that import here."""
    jobs: dict[str, Callable] = {}
    for package in _MODEL_PACKAGES:
        registry = _registry(package)
        if registry is None:
            continue
        for name, function in inspect.getmembers(registry, inspect.isfunction):
            if function.__module__ == registry.__name__ and not name.startswith("_"):
                jobs.setdefault(name, function)
    return jobs


def _registry(package: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"torchtitan.models.{package}.config_registry")
    except ImportError:
        return None


def _raise_if_defined_where_it_does_not_import(name: str) -> None:
    """An ImportError naming what is missing, when a model registry that does not import here
    defines ``name`` (its source has ``def name(``): torchtitan's own lookup reads a missing
    attribute as an unknown config and would list the others instead. ``kimi_k2_7``'s imports
    torchvision, for its image data."""
    for package in _MODEL_PACKAGES:
        module = f"torchtitan.models.{package}.config_registry"
        try:
            importlib.import_module(module)
            continue
        except ImportError as error:
            failure = error
        # The file itself: finding its spec would import the package, which may fail too.
        path = Path(torchtitan.models.__file__).parent / package / "config_registry.py"
        source = path.read_text() if path.exists() else ""
        if re.search(rf"^def {re.escape(name)}\(", source, flags=re.MULTILINE):
            raise ImportError(
                f"dmuon_titan: torchtitan's config {name!r} is in {module}, which does not import "
                f"here ({type(failure).__name__}: {failure}). Install the package that provides "
                f"{failure.name or 'the missing module'}, then run it again."
            ) from failure
