"""Newton-Schulz schedules: distance to the polar factor against time, per coefficient table.

A schedule is a coefficient table (one row per iteration). For each one:

- error, on each matrix of the test suite (``dmuon_kernels.reference.SPECTRUM_CASES``: singular
  values log-spaced over three to four decades, a rank-deficient one, a single row): the relative
  Frobenius distance ``||O - U·Vᵀ|| / ||U·Vᵀ||`` to the polar factor from a float64 SVD on the
  CPU, for O = the table's polynomial applied to the singular values in float64
  (``polynomial``: the schedule's own error, no rounding) and O = ``NewtonSchulz("gram",
  coefficients=table)`` on the benchmark's device in its default iteration dtype (``ns``: fp16 on
  CUDA, fp32 on the CPU);
- time: the median of ``NewtonSchulz("gram", coefficients=table)`` (kernel "auto", CUDA graphs)
  on fp32 Llama-shaped matrices, GPU-only (``dmuon_kernels.syrk.timing.median_ms``), the tables
  interleaved; with the FLOP model's ratio to the default next to it (gram form
  ``6·n²·m + (4·T − 6)·n³``, direct form ``T·(3·n²·m + n³)``, T rows, n <= m).

A schedule may replace the default only if its error is no worse on every row (the verdict
column, for both errors). Rows: the default (Polar Express, 5 steps), ``POLAR_EXPRESS_4`` (4
steps, see [Note: cheaper schedules] in ``dmuon_kernels.coefficients``), the default's first
four rows, You's and Keller's tables.

Usage (repository root; on the GPU machine put the package sources on PYTHONPATH)::

    python benchmarks/kernels/bench_ns_schedules.py          # CUDA; JSON: benchmarks/results/ns-schedules-<gpu>-<date>.json
    python benchmarks/kernels/bench_ns_schedules.py --quick  # small shapes on CPU: a smoke test (no JSON unless --out)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch

from benchmarks import _common
from dmuon_kernels import NewtonSchulz, __version__, get_backend_status, reference
from dmuon_kernels.coefficients import (
    KELLER_COEFFICIENTS,
    POLAR_EXPRESS_4_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    YOU_COEFFICIENTS,
)
from dmuon_kernels.newton_schulz import uses_gram_form

DEFAULT = "polar_express"
SCHEDULES = {
    DEFAULT: POLAR_EXPRESS_COEFFICIENTS,
    "polar_express_4": POLAR_EXPRESS_4_COEFFICIENTS,
    "polar_express[:4]": POLAR_EXPRESS_COEFFICIENTS[:4],
    "you": YOU_COEFFICIENTS,
    "keller": KELLER_COEFFICIENTS,
}
# (rows, cols): the 0.89 B Llama of bench_e2e (q/o, k/v, gate/up) and Llama-3-8B's projections.
SHAPES = [(2048, 2048), (1024, 2048), (2048, 5632), (4096, 4096), (1024, 4096), (4096, 14336)]
QUICK_SHAPES = [(64, 256), (128, 128)]


def relative_distance(output: torch.Tensor, polar: torch.Tensor) -> float:
    output = output.to(device="cpu", dtype=torch.float64)
    return ((output - polar).norm() / polar.norm()).item()


def errors(table, device: torch.device) -> dict[str, dict[str, float]]:
    """{"polynomial": {case: error}, "ns": {case: error}} against float64 SVD polar factors."""
    ns = NewtonSchulz("gram", coefficients=table)
    result: dict[str, dict[str, float]] = {"polynomial": {}, "ns": {}}
    for name in reference.SPECTRUM_CASES:
        G = reference.spectrum_case(name)
        polar = reference.polar_factor(G)
        result["polynomial"][name] = relative_distance(
            reference.newton_schulz_by_svd(G, table), polar
        )
        result["ns"][name] = relative_distance(ns(G.to(device)), polar)
    return result


def model_flops(rows: int, cols: int, steps: int) -> float:
    """The NS FLOP model of the gram backend (symmetric products counted at half)."""
    n, m = min(rows, cols), max(rows, cols)
    if uses_gram_form(rows, cols):
        return 6 * n * n * m + (4 * steps - 6) * n**3
    return steps * (3 * n * n * m + n**3)


def times(shapes, device: torch.device, *, warmup: int, repeats: int) -> dict[str, dict]:
    """{schedule: {"RxC": median ms}}, the schedules interleaved per shape."""
    from dmuon_kernels.syrk.timing import median_ms

    instances = {name: NewtonSchulz("gram", coefficients=t) for name, t in SCHEDULES.items()}
    result: dict[str, dict] = {name: {} for name in SCHEDULES}
    generator = torch.Generator(device=device).manual_seed(0)
    for rows, cols in shapes:
        G = torch.randn(rows, cols, device=device, generator=generator)
        contenders = {name: (lambda ns=ns, G=G: ns(G)) for name, ns in instances.items()}
        for name, ms in median_ms(contenders, device, repeats=repeats, warmup=warmup).items():
            result[name][f"{rows}x{cols}"] = ms
    return result


def verdicts(measured: dict[str, dict]) -> dict[str, dict[str, bool]]:
    """Per schedule and kind of error: no worse than the default on every suite matrix."""
    default = measured[DEFAULT]
    return {
        name: {
            kind: all(errs[kind][case] <= default[kind][case] for case in errs[kind])
            for kind in ("polynomial", "ns")
        }
        for name, errs in measured.items()
    }


def format_tables(measured, verdict, timed, shapes) -> str:
    cases = list(reference.SPECTRUM_CASES)
    width = max(len(name) for name in SCHEDULES) + 2
    lines = ["distance to the polar factor (polynomial / ns), per suite matrix:"]
    lines.append(
        "schedule".ljust(width) + "rows" + "".join(c.rjust(18) for c in cases) + "  no worse"
    )
    for name, table in SCHEDULES.items():
        cells = "".join(
            f"{measured[name]['polynomial'][c]:.4f}/{measured[name]['ns'][c]:.4f}".rjust(18)
            for c in cases
        )
        ok = "/".join("yes" if verdict[name][k] else "no" for k in ("polynomial", "ns"))
        lines.append(name.ljust(width) + f"{len(table):>4}" + cells + f"  {ok}")
    lines.append("")
    lines.append("median ms (x = default / schedule, measured; model = FLOP ratio):")
    keys = [f"{r}x{c}" for r, c in shapes]
    lines.append("schedule".ljust(width) + "".join(k.rjust(24) for k in keys))
    for name, table in SCHEDULES.items():
        cells = []
        for (rows, cols), key in zip(shapes, keys):
            ms, base = timed[name][key], timed[DEFAULT][key]
            model = model_flops(rows, cols, len(POLAR_EXPRESS_COEFFICIENTS)) / model_flops(
                rows, cols, len(table)
            )
            cells.append(f"{ms:.3f} ({base / ms:.2f}x, {model:.2f}x)".rjust(24))
        lines.append(name.ljust(width) + "".join(cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes on CPU (smoke test)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls (default 5; 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default 20; 3)")
    _common.add_record_options(
        parser, "JSON path (default benchmarks/results/ns-schedules-<gpu>-<date>.json)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        device, shapes, warmup, repeats = torch.device("cpu"), QUICK_SHAPES, 1, 3
    elif torch.cuda.is_available():
        device, shapes, warmup, repeats = (
            torch.device("cuda", torch.cuda.current_device()),
            SHAPES,
            5,
            20,
        )
    else:
        print("bench_ns_schedules: no CUDA device; run with --quick on the CPU", file=sys.stderr)
        return 2
    warmup = warmup if args.warmup is None else args.warmup
    repeats = repeats if args.repeats is None else args.repeats
    date, label = _common.utc_now(), _common.device_name(device)

    measured = {name: errors(table, device) for name, table in SCHEDULES.items()}
    verdict = verdicts(measured)
    timed = times(shapes, device, warmup=warmup, repeats=repeats)
    print(f"Newton-Schulz schedules on {label} (gram backend, kernel auto, fp32 input)")
    print(format_tables(measured, verdict, timed, shapes))

    out = (
        args.out
        if args.out is not None
        else (None if args.quick else _common.result_path("ns-schedules", label, date))
    )
    if out is not None:
        record = {
            "benchmark": "ns_schedules",
            "date": _common.iso_seconds(date),
            "git_sha": _common.git_sha(args.git_sha),
            "device": label,
            **_common.versions(dmuon_kernels=__version__),
            "environment": _common.dmuon_environment(),
            "inputs": {
                "schedules": {name: [list(row) for row in t] for name, t in SCHEDULES.items()},
                "default": DEFAULT,
                "suite": list(reference.SPECTRUM_CASES),
                "shapes": [list(shape) for shape in shapes],
                "warmup": warmup,
                "repeats": repeats,
                "quick": args.quick,
            },
            "backend_status": get_backend_status(),
            "errors": measured,
            "no_worse_than_default": verdict,
            "median_ms": timed,
        }
        _common.write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
