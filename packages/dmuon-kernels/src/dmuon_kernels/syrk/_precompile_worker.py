"""A background process of ``syrk.precompile``: compile one quack kernel variant, leave its
marker, say so (or why not) in one rank-tagged line. See [Note: compiling ahead] there.

Usage (``syrk.precompile`` starts it)::

    python -m dmuon_kernels.syrk._precompile_worker --device 0 --dtype float16 \\
        --variant '{"op": "syrk", "with_c": false, "alpha": 1.0, "beta": 1.0}' \\
        --marker <quack cache>/dmuon-ahead-<key> --started-at <time.time() at the start>
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dmuon_kernels._log import log_rank_tagged
from dmuon_kernels.syrk import quack
from dmuon_kernels.syrk.cache import atomic_write_bytes
from dmuon_kernels.syrk.precompile import Variant


def main(argv: list[str] | None = None) -> int:
    """A background process: compile one variant, leave its marker, say so in one line."""
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("--device", type=int, required=True)
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), required=True)
    parser.add_argument("--variant", type=json.loads, required=True)
    parser.add_argument("--marker", type=Path, required=True)
    parser.add_argument("--started-at", type=float, required=True)  # time.time() at the launch
    args = parser.parse_args(argv)
    variant, dtype = Variant(**args.variant), getattr(torch, args.dtype)
    try:
        quack.compile_only(
            variant.op,
            dtype,
            torch.device("cuda", args.device),
            with_c=variant.with_c,
            alpha=variant.alpha,
            beta=variant.beta,
        )
    except Exception as exc:  # the step compiles it instead: say why, never hide it
        log_rank_tagged(
            f"background compile of the {variant.describe(dtype)} failed "
            f"({type(exc).__name__}: {exc}); the first step compiles it instead"
        )
        return 1
    atomic_write_bytes(args.marker, b"")
    log_rank_tagged(
        f"{variant.describe(dtype)} compiled ahead in the background, ready "
        f"{time.time() - args.started_at:.1f} s after its process started"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
