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
# flag, default on: on CUDA the Muon update is written by Newton-Schulz's last product
# (``dmuon_kernels.update_epilogue``)
UPDATE_EPILOGUE_ENV = "DMUON_UPDATE_EPILOGUE"
# "cublas" (default) or "triton": the GEMM of that update where it also writes the forward weight
# (``dmuon_kernels.update_epilogue``)
UPDATE_GEMM_ENV = "DMUON_UPDATE_GEMM"
# flag, default on: on GPUs with a measured prior, tune the expected winner first (autotune)
SYRK_AUTOTUNE_PRIOR_ENV = "DMUON_SYRK_AUTOTUNE_PRIOR"
# "background" (default) or "wait": where a dmuon.Muon's Newton-Schulz kernels compile
# (``dmuon_kernels.background_compile``)
KERNEL_COMPILE_ENV = "DMUON_KERNEL_COMPILE"
COMPILE_IN_BACKGROUND = "background"
COMPILE_FIRST = "wait"
KERNEL_COMPILE_MODES = (COMPILE_IN_BACKGROUND, COMPILE_FIRST)

TRUE_SPELLINGS = ("1", "true", "yes", "on")
FALSE_SPELLINGS = ("0", "false", "no", "off")


def _read(name: str) -> tuple[str | None, str]:
    """Environment variable ``name`` as set, and as compared: stripped, lower case ("" unset)."""
    raw = os.environ.get(name)
    return raw, "" if raw is None else raw.strip().lower()


def env_flag(name: str, default: bool) -> bool:
    """The on/off value of environment variable ``name``: 1/true/yes/on or 0/false/no/off in any
    case (surrounding spaces ignored); ``default`` when it is unset or empty.

    Raises ValueError naming the variable, its value and the accepted spellings otherwise, so a
    typo such as ``disabled`` never silently means the default.
    """
    raw, value = _read(name)
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


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The value of environment variable ``name``, one of ``choices`` (any case, surrounding
    spaces ignored); ``default`` when it is unset or empty. Raises ValueError naming the
    variable, its value and the choices otherwise."""
    raw, value = _read(name)
    if not value:
        return default
    if value in choices:
        return value
    raise ValueError(
        f"environment variable {name}={raw!r} is not one of {', '.join(choices)} (any case); "
        f"unset it for the default ({default})"
    )


def kernel_compile_mode(requested: object = None) -> str:
    """``"background"`` or ``"wait"``: ``requested`` when given (a ``NewtonSchulz(kernel_compile=
    ...)`` argument), else ``DMUON_KERNEL_COMPILE`` (any case, spaces ignored), else
    ``"background"``. Raises ValueError naming the argument or variable, its value and the two
    choices otherwise."""
    if requested is None:
        raw, value = _read(KERNEL_COMPILE_ENV)
        if not value:
            return COMPILE_IN_BACKGROUND
        source = f"environment variable {KERNEL_COMPILE_ENV}={raw!r}"
    else:
        value = requested.strip().lower() if isinstance(requested, str) else requested
        source = f"kernel_compile={requested!r}"
    if value in KERNEL_COMPILE_MODES:
        return str(value)
    raise ValueError(
        f"{source} is not a kernel compile mode: use 'background' (the default: steps run on "
        "cuBLAS while the tuned kernels compile in a separate process, then switch to them at "
        "a step every rank agrees on) or 'wait' (compile and tune inside the first step, so "
        "every step runs the tuned kernels: bit-reproducible from step 1)"
        + ("" if requested is None else f", or None to read {KERNEL_COMPILE_ENV}")
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
