"""The ``DMUON_*`` environment variables that switch kernel behaviour, and the one parser of
their on/off values.

Owns the variable names read by the kernels package (``DMUON_CACHE_DIR`` excepted: the
autotune cache module stays plain standard library and names it itself) and ``env_flag``, which
dmuon-core uses for its own switches too. A leaf: it imports only the standard library and
must not import anything from this package.
"""

from __future__ import annotations

import os
from collections.abc import Callable

NS_KERNEL_ENV = "DMUON_NS_KERNEL"  # a kernel name: the Newton-Schulz "auto" override
NS_CUDA_GRAPH_ENV = "DMUON_NS_CUDA_GRAPH"  # flag, default on: CUDA-graph replay of NS
# flag, default on: the first-use progress lines (autotune, library imports, kernel builds, CUDA-graph
# captures)
SYRK_AUTOTUNE_LOG_ENV = "DMUON_SYRK_AUTOTUNE_LOG"
KERNEL_CACHE_ENV = "DMUON_KERNEL_CACHE"  # flag, default on: compiled kernels kept on disk
FUSED_TRITON_ENV = "DMUON_FUSED_TRITON"  # flag, default on: Triton kernels of the fused Muon step
# flag, default on: on GPUs with a measured prior, tune the expected winner first (autotune)
SYRK_AUTOTUNE_PRIOR_ENV = "DMUON_SYRK_AUTOTUNE_PRIOR"

TRUE_SPELLINGS = ("1", "true", "yes", "on")
FALSE_SPELLINGS = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """The on/off value of environment variable ``name``: 1/true/yes/on or 0/false/no/off in any
    case (surrounding spaces ignored); ``default`` when it is unset or empty.

    Raises ValueError naming the variable, its value and the accepted spellings otherwise, so a
    typo such as ``disabled`` never silently means the default.
    """
    raw = os.environ.get(name)
    value = "" if raw is None else raw.strip().lower()
    if not value:
        return default
    if value in TRUE_SPELLINGS:
        return True
    if value in FALSE_SPELLINGS:
        return False
    raise ValueError(
        f"environment variable {name}={raw!r} is not an on/off value: use one of "
        f"{', '.join(TRUE_SPELLINGS)} (on) or {', '.join(FALSE_SPELLINGS)} (off), any case, "
        f"or unset it for the default ({'on' if default else 'off'})"
    )


def progress_lines_enabled() -> bool:
    """False when ``DMUON_SYRK_AUTOTUNE_LOG`` is 0/false/no/off: the switch of every first-use
    progress line (autotune candidates and verdicts, library imports, kernel builds, CUDA-graph
    captures); read at every line. Compiles of dmuon's own CuTe kernels are announced regardless,
    so a long compile never looks like a hang."""
    return env_flag(SYRK_AUTOTUNE_LOG_ENV, default=True)


def quietly(flag: Callable[[], bool]) -> bool:
    """``flag()``, or False where its variable is not an on/off value: for a progress line in
    an availability probe, which must not fail (the value raises at the next line elsewhere)."""
    try:
        return flag()
    except ValueError:
        return False
