"""The rank-tagged logger: ``[DMuon][rank=R/W] <message>`` on the ``dmuon_kernels`` logger.

Owns the tag and making the lines visible without any logging set-up. A leaf: rank and world
size come from the RANK / WORLD_SIZE environment variables (set by torchrun and the test
harness), so it imports neither torch.distributed nor anything from this package.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("dmuon_kernels")


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (it may be redirected after import)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def rank_tag() -> str:
    """``[DMuon][rank=R/W] `` from the RANK / WORLD_SIZE environment variables (default 0/1)."""
    rank = os.environ.get("RANK", "0")
    world_size = os.environ.get("WORLD_SIZE", "1")
    return f"[DMuon][rank={rank}/{world_size}] "


def is_rank_zero() -> bool:
    """Whether this process is rank 0 (RANK unset counts as 0): the one that prints progress
    lines meant once per job."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def _make_visible_by_default() -> None:
    # Progress lines must show up without any logging set-up, but an application that configured
    # logging (a handler on the root logger) gets them through its own handlers instead.
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        logger.addHandler(_CurrentStderrHandler())


def log_rank_tagged(message: str, *, level: int = logging.INFO) -> None:
    """Log ``message`` prefixed with ``[DMuon][rank=R/W] `` on the ``dmuon_kernels`` logger."""
    _make_visible_by_default()
    logger.log(level, "%s%s", rank_tag(), message)
