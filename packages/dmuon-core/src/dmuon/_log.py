"""The ``dmuon`` logger and how its lines become visible without any logging set-up.

Owns the logger every core module logs on and ``log_once``: the one-per-job lines (the partition
``dedicate_params`` chose, the route summary of ``dmuon.Muon``), on rank 0. The log is the
application's: a level it set on ``dmuon`` stays, and once it configured logging (a handler on
``dmuon`` or on the root logger) its handlers get the lines, dmuon's none. Only when nothing is
configured does dmuon add one stderr handler and, if the logger has no level, INFO, as torch's
own warnings show without set-up. A leaf: it imports nothing of the package.
"""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

logger = logging.getLogger("dmuon")


class _StderrUnlessConfigured(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at emit time (it may be redirected after import),
    and stays silent once the application gave the root logger a handler: the line then reaches
    the application's handlers through propagation, once."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)  # logging's rule: a failing handler never raises


_handler: _StderrUnlessConfigured | None = None


def make_visible() -> None:
    """Give ``dmuon`` a stderr handler (once) and INFO if the application configured neither a
    handler nor a level; otherwise leave its configuration as it is."""
    global _handler
    if _handler is not None or logger.handlers or logging.getLogger().handlers:
        return
    _handler = _StderrUnlessConfigured()
    logger.addHandler(_handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def log_once(message: str, *args: object) -> None:
    """An INFO line meant once per job: logged on rank 0 only (every rank decided alike)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    make_visible()
    logger.info(message, *args)
