"""The oldest torch this project is tested on, and the import-time check that enforces it.

Owns only the version comparison; it must not import anything from torch beyond ``__version__``.
"""

from __future__ import annotations

import re

MIN_TORCH_VERSION = (2, 11)


def _parse(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ImportError(f"cannot parse the installed torch version {version!r}")
    return int(match.group(1)), int(match.group(2))


def require_torch(package: str, version: str | None = None) -> None:
    """Raise ImportError naming the required torch when the installed one is older."""
    if version is None:
        import torch

        version = torch.__version__
    if _parse(version) < MIN_TORCH_VERSION:
        need = ".".join(map(str, MIN_TORCH_VERSION))
        raise ImportError(
            f"{package} requires torch>={need} (FSDP2's fully_shard and the APIs dmuon uses), "
            f"but torch {version} is installed. Upgrade with: pip install 'torch>={need}'"
        )
