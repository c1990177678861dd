"""torchtitan's job configs with dmuon switched on: ``--module dmuon_titan``.

``torchtitan.train --module dmuon_titan --config llama3_8b`` runs torchtitan's own ``llama3_8b``
job (from ``torchtitan.models.llama3.config_registry``) with ``dmuon_titan.enable``: any config
function of torchtitan's models is found by its name, and ``--dmuon.*`` flags set dmuon's
options. It owns that lookup and nothing else.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from dmuon_titan.trainer import DMuonTrainer, enable

# torchtitan's model packages whose config_registry this module looks through, in order.
MODEL_PACKAGES = ("llama3", "qwen3", "deepseek_v3", "gpt_oss", "qwen3_5", "kimi_k2_7")


def __getattr__(name: str) -> Callable[[], DMuonTrainer.Config]:
    if name.startswith("_"):
        raise AttributeError(name)
    for package in MODEL_PACKAGES:
        try:
            registry = importlib.import_module(f"torchtitan.models.{package}.config_registry")
        except ImportError:
            continue
        job = getattr(registry, name, None)
        if callable(job):
            return lambda: enable(job())
    raise AttributeError(
        f"dmuon_titan has no config {name!r}: it runs torchtitan's own job configs with dmuon "
        f"on, and none of torchtitan.models.{{{', '.join(MODEL_PACKAGES)}}}.config_registry "
        "defines it. Use a config name of those modules (e.g. llama3_8b), or call "
        "dmuon_titan.enable(config) in your own config_registry."
    )
