"""The simulator against the measurements: fitted constants, and predicted vs measured.

``dmuon-tools calibrate`` in three modules, each depending only on the ones before it:

- ``results``: reading the committed benchmark results (``benchmarks/results/`` of the dmuon
  repository): which files the H200 preset's figures come from, and what each file gives;
- ``fit``: the H200 machine's measured and fitted figures from the files its ``sources`` name
  (``derive_h200``), and the gloo loopback's bandwidth (``gloo_machine``);
- ``report``: every measured component the simulator predicts, the prediction, the error, and
  whether the measurement fixed a constant (``fit``) or was left out of every fit (``held
  out``), as text or Markdown.

A constant is fitted once, on the one measurement ``machine.H200_SOURCES`` names, and every other
measurement is a test of it. This module holds no code: it names what the CLI and the tests use.
"""

from __future__ import annotations

from dmuon_tools.calibration.fit import GLOO_LATENCY_US, derive_h200, gloo_machine
from dmuon_tools.calibration.report import (
    BENCH_E2E_DEFAULT_MODEL,
    BENCH_STEP_ROWS,
    DEFAULT_COMMAND,
    E2E_SYSTEMS,
    OVERLAP_AB_SYSTEMS,
    Calibration,
    Row,
    calibrate,
    format_markdown,
    format_text,
)
from dmuon_tools.calibration.results import (
    CUBLAS_NS_CANDIDATE,
    DMUON_NS_CANDIDATE,
    E2E_FILE,
    GEMM_FILE,
    GLOO_FILE,
    HOST_FILE,
    NS_FILE,
    REFERENCE_NS_CANDIDATE,
    STEP_FILE,
    UNRECORDED_SPECULATION_CHUNKS,
    bench_e2e_shape,
)

__all__ = [
    "BENCH_E2E_DEFAULT_MODEL",
    "BENCH_STEP_ROWS",
    "CUBLAS_NS_CANDIDATE",
    "DEFAULT_COMMAND",
    "DMUON_NS_CANDIDATE",
    "E2E_FILE",
    "E2E_SYSTEMS",
    "GEMM_FILE",
    "GLOO_FILE",
    "GLOO_LATENCY_US",
    "HOST_FILE",
    "NS_FILE",
    "OVERLAP_AB_SYSTEMS",
    "REFERENCE_NS_CANDIDATE",
    "STEP_FILE",
    "UNRECORDED_SPECULATION_CHUNKS",
    "Calibration",
    "Row",
    "bench_e2e_shape",
    "calibrate",
    "derive_h200",
    "format_markdown",
    "format_text",
    "gloo_machine",
]
