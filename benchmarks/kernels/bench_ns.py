"""Newton-Schulz speed: dmuon's gram and direct NS against torch.optim.Muon's orthogonalisation.

Every candidate orthogonalises the same fp32 matrix per shape. torch.optim.Muon's NS
(``torch.optim._muon._zeropower_via_newtonschulz`` with its defaults: Keller's coefficients,
5 steps, eps 1e-7, bf16 iteration) is the baseline measured in the same run; dmuon's candidates
use their defaults (Polar Express, 5 steps, fp16 iteration, kernel "auto") and return fp32.
Times are the median over CUDA-event-timed repetitions after warm-up calls (the warm-up absorbs
any per-shape SYRK autotune); ratios are baseline_ms / candidate_ms, so > 1 means faster.

Usage (from the repository root, packages installed or on PYTHONPATH)::

    python benchmarks/kernels/bench_ns.py                      # CUDA; JSON: benchmarks/results/ns-<gpu>-<date>.json
    python benchmarks/kernels/bench_ns.py --repeats 50 --warmup 10 --out ns.json --git-sha <sha>
    python benchmarks/kernels/bench_ns.py --quick              # small shapes on CPU, a smoke test (no JSON
                                                       # unless --out is given; CPU fp16 matmuls
                                                       # are slow, so its ratios mean nothing)
    hatch run bench-ns --quick

Columns: torch.optim.Muon's NS (baseline); dmuon gram with kernel="auto" and CUDA graphs (the
default), the same without graphs, the same on cuBLAS only; dmuon direct; the gram-newton-schulz
package (quack kernels, torch.compile "reduce-overhead"; a baseline, never a dependency: it is
imported only here and its column says why when it is missing). A batched case follows: a stack
of 8 same-shape 1024x4096 matrices, one batched call against 8 separate calls.

Adding columns: a candidate is a name and a zero-argument factory returning ``f(G) -> Tensor``;
a factory that raises (e.g. a kernel not installed) gives a column marked unavailable with the
reason. Another script can extend the default list::

    from bench_ns import Candidate, default_candidates, main
    main(candidates=[*default_candidates(),
                     Candidate("quack", lambda: NewtonSchulz(kernel="quack"))])
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch
from torch import Tensor
from torch.optim import _muon as torch_muon

from benchmarks import _common
from dmuon_kernels import NewtonSchulz, __version__, get_backend_status

# (rows, cols) of the matrices Muon meets in 1B-70B models.
SHAPES: list[tuple[int, int]] = [
    (1024, 4096),
    (4096, 4096),
    (4096, 14336),
    (8192, 8192),
    (8192, 28672),
]
QUICK_SHAPES: list[tuple[int, int]] = [(128, 512), (256, 256), (64, 1024)]
BASELINE = "torch.optim.Muon"


@dataclass(frozen=True)
class Candidate:
    """A table column: ``build()`` returns the callable that is timed on each input."""

    name: str
    build: Callable[[], Callable[[Tensor], Tensor]]


def torch_muon_orthogonalise() -> Callable[[Tensor], Tensor]:
    coefficients = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
    steps, eps = torch_muon.DEFAULT_NS_STEPS, torch_muon.EPS
    return lambda G: torch_muon._zeropower_via_newtonschulz(G, coefficients, steps, eps)


def newton_schulz_without_graphs(backend: str, **kwargs) -> NewtonSchulz:
    """A NewtonSchulz built with DMUON_NS_CUDA_GRAPH=0 (read at construction)."""
    previous = os.environ.get("DMUON_NS_CUDA_GRAPH")
    os.environ["DMUON_NS_CUDA_GRAPH"] = "0"
    try:
        return NewtonSchulz(backend, **kwargs)
    finally:
        if previous is None:
            del os.environ["DMUON_NS_CUDA_GRAPH"]
        else:
            os.environ["DMUON_NS_CUDA_GRAPH"] = previous


def gram_newton_schulz_package() -> Callable[[Tensor], Tensor]:
    """The gram-newton-schulz package (quack kernels, torch.compile reduce-overhead), with the
    same Polar Express table and restart as dmuon. A benchmark baseline only: imported here."""
    from gram_newton_schulz import GramNewtonSchulz

    from dmuon_kernels import POLAR_EXPRESS_COEFFICIENTS

    return GramNewtonSchulz(
        ns_coefficients=[list(row) for row in POLAR_EXPRESS_COEFFICIENTS],
        gram_newton_schulz_reset_iterations=[2],
    )


def default_candidates() -> list[Candidate]:
    return [
        Candidate(BASELINE, torch_muon_orthogonalise),
        # gram + kernel="auto" + CUDA graphs: the default configuration
        Candidate("dmuon gram", lambda: NewtonSchulz("gram")),
        Candidate("dmuon gram no-graphs", lambda: newton_schulz_without_graphs("gram")),
        Candidate("dmuon gram cublas", lambda: NewtonSchulz("gram", kernel="cublas")),
        Candidate("dmuon direct", lambda: NewtonSchulz("direct")),
        Candidate("gram-newton-schulz pkg", gram_newton_schulz_package),
    ]


# Batched case: same-shape matrices owned by one rank, one batched call against one call each.
BATCHED_CASE = (8, 1024, 4096)
QUICK_BATCHED_CASE = (4, 64, 256)


def batched_candidates() -> list[Candidate]:
    def separate_calls() -> Callable[[Tensor], Tensor]:
        ns = NewtonSchulz("gram")
        return lambda stack: torch.stack([ns(matrix) for matrix in stack])

    return [
        Candidate("dmuon gram, one call per matrix", separate_calls),
        Candidate("dmuon gram, one batched call", lambda: NewtonSchulz("gram")),
        Candidate("gram-newton-schulz pkg, batched", gram_newton_schulz_package),
    ]


def run_batched(
    case: tuple[int, int, int], device: torch.device, *, warmup: int, repeats: int
) -> list[dict]:
    """Median ms of each batched candidate on one (B, m, n) stack; ratios vs separate calls."""
    generator = torch.Generator(device=device).manual_seed(1)
    stack = torch.randn(case, device=device, dtype=torch.float32, generator=generator)
    results = []
    for candidate in batched_candidates():
        entry: dict = {"stack": list(case), "candidate": candidate.name}
        try:
            times = time_calls(candidate.build(), stack, warmup=warmup, repeats=repeats)
            entry.update(median_ms=statistics.median(times), times_ms=times, error=None)
        except Exception as error:  # the row says why instead of the run stopping
            entry.update(median_ms=None, times_ms=[], error=f"{type(error).__name__}: {error}")
        results.append(entry)
    separate = results[0]["median_ms"]
    for entry in results:
        both = separate and entry["median_ms"]
        entry["speedup_vs_separate_calls"] = separate / entry["median_ms"] if both else None
    return results


def time_calls(
    function: Callable[[Tensor], Tensor], G: Tensor, *, warmup: int, repeats: int
) -> list[float]:
    """Milliseconds per call: CUDA events on CUDA (one pair per call), wall clock on CPU."""
    for _ in range(warmup):
        function(G)
    times = []
    if G.is_cuda:
        torch.cuda.synchronize(G.device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function(G)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            begin = time.perf_counter()
            function(G)
            times.append(1e3 * (time.perf_counter() - begin))
    return times


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes on CPU (smoke test)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls (default 5; 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default 20; 3)")
    _common.add_record_options(
        parser, "JSON path (default benchmarks/results/ns-<gpu>-<date>.json; none with --quick)"
    )
    return parser.parse_args(argv)


def run(
    candidates: Sequence[Candidate],
    shapes: Sequence[tuple[int, int]],
    device: torch.device,
    *,
    warmup: int,
    repeats: int,
) -> list[dict]:
    """One result per (shape, candidate): median and all times, or why it did not run."""
    built: dict[str, Callable[[Tensor], Tensor] | str] = {}
    for candidate in candidates:
        try:
            built[candidate.name] = candidate.build()
        except Exception as error:  # the column says why instead of the run stopping
            built[candidate.name] = f"{type(error).__name__}: {error}"
    results = []
    generator = torch.Generator(device=device).manual_seed(0)
    for rows, cols in shapes:
        G = torch.randn(rows, cols, device=device, dtype=torch.float32, generator=generator)
        for candidate in candidates:
            function = built[candidate.name]
            entry: dict = {"shape": [rows, cols], "candidate": candidate.name}
            if isinstance(function, str):
                entry.update(median_ms=None, times_ms=[], error=function)
            else:
                try:
                    times = time_calls(function, G, warmup=warmup, repeats=repeats)
                    entry.update(median_ms=statistics.median(times), times_ms=times, error=None)
                except Exception as error:
                    entry.update(
                        median_ms=None, times_ms=[], error=f"{type(error).__name__}: {error}"
                    )
            results.append(entry)
        del G
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for entry in results:
        baseline = next(
            r for r in results if r["shape"] == entry["shape"] and r["candidate"] == BASELINE
        )
        both = entry["median_ms"] and baseline["median_ms"]
        entry["speedup_vs_torch"] = baseline["median_ms"] / entry["median_ms"] if both else None
    return results


def format_table(results: list[dict], candidates: Sequence[Candidate]) -> str:
    names = [candidate.name for candidate in candidates]
    width = max(22, *(len(name) + 2 for name in names))
    lines = ["shape".rjust(12) + "".join(name.rjust(width) for name in names)]
    shapes = list(dict.fromkeys(tuple(entry["shape"]) for entry in results))
    for shape in shapes:
        cells = []
        for name in names:
            entry = next(
                r for r in results if tuple(r["shape"]) == shape and r["candidate"] == name
            )
            if entry["median_ms"] is None:
                cell = "unavailable"
            elif name == BASELINE:
                cell = f"{entry['median_ms']:.2f} ms"
            else:
                cell = f"{entry['median_ms']:.2f} ms ({entry['speedup_vs_torch']:.2f}x)"
            cells.append(cell.rjust(width))
        lines.append(f"{shape[0]:>5}x{shape[1]:<6}" + "".join(cells))
    errors = {r["candidate"]: r["error"] for r in results if r["error"]}
    lines += [f"{name}: {error}" for name, error in errors.items()]
    return "\n".join(lines)


def _or_default(value: int | None, default: int) -> int:
    return default if value is None else value


def main(argv: Sequence[str] | None = None, candidates: Sequence[Candidate] | None = None) -> int:
    args = parse_args(argv)
    candidates = list(candidates) if candidates is not None else default_candidates()
    if args.quick:
        device, shapes = torch.device("cpu"), QUICK_SHAPES
        warmup, repeats = _or_default(args.warmup, 1), _or_default(args.repeats, 3)
    else:
        if not torch.cuda.is_available():
            print(
                "bench_ns: no CUDA device; run with --quick for a CPU smoke test", file=sys.stderr
            )
            return 2
        device, shapes = torch.device("cuda", torch.cuda.current_device()), SHAPES
        warmup, repeats = _or_default(args.warmup, 5), _or_default(args.repeats, 20)
    date = _common.utc_now()
    label = _common.device_name(device)

    results = run(candidates, shapes, device, warmup=warmup, repeats=repeats)
    print(
        f"Newton-Schulz on {label}, fp32 input, median of {repeats} after {warmup} "
        f"warm-up; (x) = speedup vs {BASELINE}"
    )
    print(format_table(results, candidates))
    batched_case = QUICK_BATCHED_CASE if args.quick else BATCHED_CASE
    batched = run_batched(batched_case, device, warmup=warmup, repeats=repeats)
    print(f"batched stack {batched_case}:")
    for entry in batched:
        if entry["median_ms"] is None:
            print(f"  {entry['candidate']:<34} unavailable: {entry['error']}")
        else:
            speedup = entry["speedup_vs_separate_calls"]
            print(f"  {entry['candidate']:<34} {entry['median_ms']:8.3f} ms ({speedup:.2f}x)")

    out = (
        args.out
        if args.out is not None
        else (None if args.quick else _common.result_path("ns", label, date))
    )
    if out is not None:
        record = {
            "benchmark": "newton_schulz",
            "date": _common.iso_seconds(date),
            "git_sha": _common.git_sha(args.git_sha),
            "device": label,
            **_common.versions(dmuon_kernels=__version__),
            "inputs": {
                "shapes": [list(shape) for shape in shapes],
                "input_dtype": "float32",
                "warmup": warmup,
                "repeats": repeats,
                "quick": args.quick,
                "candidates": [candidate.name for candidate in candidates],
                "baseline": BASELINE,
            },
            "backend_status": get_backend_status(),
            "results": results,
            "batched": batched,
        }
        _common.write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
