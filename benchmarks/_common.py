"""What every benchmark script records about its run, and where it writes it.

Owns the run metadata the benchmark JSON carries (git sha, device name, torch/CUDA/package
versions, the UTC date, the ``DMUON_*`` environment), the default result path
(``benchmarks/results/<benchmark>-<device>[-<qualifier>...]-<date>.json``), writing the JSON,
and the start-up the distributed scripts share (the package sources on ``sys.path`` where the
packages are not installed; the process group for ``--device``/``--backend``), and waiting for a
device to finish (``synchronize``, a no-op on the CPU).

Must not: measure anything, decide what a script's JSON contains (each script lays out its own
record, these functions give its values), or import dmuon (the distributed scripts call
``add_package_sources_if_missing()`` before they import it).

The scripts run as ``python benchmarks/<kind>/<name>.py`` (or under ``torch.distributed.run``)
from the repository root; each puts the repository root on ``sys.path`` first and then
``from benchmarks import _common`` (``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
GIT_SHA_ENV = "DMUON_GIT_SHA"  # the sha where the run has no git checkout (the GPU machine)


def git_sha(explicit: str | None = None) -> str:
    """The commit measured: ``explicit`` (``--git-sha``), else ``$DMUON_GIT_SHA``, else
    ``git rev-parse HEAD`` with ``-dirty`` when tracked files differ from it, else "unknown"."""
    if explicit:
        return explicit
    if os.environ.get(GIT_SHA_ENV):
        return os.environ[GIT_SHA_ENV]
    try:
        sha = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def _git(*arguments: str) -> str:
    completed = subprocess.run(
        ["git", *arguments], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    return completed.stdout.strip()


def device_name(device: torch.device) -> str:
    """The GPU's name ("NVIDIA H200"), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def versions(**packages: str | None) -> dict[str, str | None]:
    """torch's and CUDA's versions, then ``packages`` (JSON key -> version) in the given order."""
    return {"torch": torch.__version__, "cuda": torch.version.cuda, **packages}


def installed(*distributions: str) -> dict[str, str | None]:
    """The installed version of each distribution (e.g. "quack-kernels"), None where absent."""
    found: dict[str, str | None] = {}
    for name in distributions:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def dmuon_environment() -> dict[str, str]:
    """The ``DMUON_*`` variables of this process (they switch kernels, graphs, autotune)."""
    return {key: os.environ[key] for key in sorted(os.environ) if key.startswith("DMUON_")}


def compile_kernels_first() -> None:
    """Time the tuned kernels from the first step: ``DMUON_KERNEL_COMPILE=wait`` unless the caller
    set it. By default a run's Newton-Schulz runs cuBLAS until its background compile lands and
    the ranks switch (``dmuon_kernels.background_compile``), which a benchmark's few timed steps
    may never reach: ``bench_step`` on an H100 at 9a417a3 timed cuBLAS as "auto". The JSON
    records the setting with the other ``DMUON_*`` variables (``dmuon_environment``).
    ``bench_cold_start`` measures the background compile itself and does not call this."""
    os.environ.setdefault("DMUON_KERNEL_COMPILE", "wait")


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def iso_seconds(date: datetime.datetime) -> str:
    """The JSON's "date": ``2026-11-29T10:32:24+00:00``."""
    return date.isoformat(timespec="seconds")


def slug(text: str) -> str:
    """Lower-case words joined by "-": "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def result_path(
    benchmark: str, device_label: str, date: datetime.datetime, *qualifiers: str
) -> Path:
    """``benchmarks/results/<benchmark>-<device slug>[-<qualifier>...]-<YYYY-MM-DD>.json``."""
    stem = "-".join([benchmark, slug(device_label), *qualifiers, f"{date:%Y-%m-%d}"])
    return RESULTS_DIR / f"{stem}.json"


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work; the CPU has none."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_record_options(parser: argparse.ArgumentParser, out_help: str | None = None) -> None:
    """``--out`` (where the JSON goes; ``out_help`` says the script's default) and ``--git-sha``
    (what ``git_sha()`` records instead of asking git)."""
    parser.add_argument("--out", type=Path, default=None, help=out_help)
    parser.add_argument("--git-sha", default=None, help="recorded in the JSON (default: git)")


def write_json(path: Path, record: dict) -> None:
    """Writes ``record`` (indented; values JSON cannot hold as their ``str``) and says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {path}")


# ---- start-up of the distributed scripts --------------------------------------------------------


def add_package_sources_if_missing() -> None:
    """Where dmuon or dmuon_kernels is not installed (the GPU machine has no hatch), import the
    sources of both from ``packages/``."""
    if any(importlib.util.find_spec(name) is None for name in ("dmuon", "dmuon_kernels")):
        for package in ("dmuon-kernels", "dmuon-core"):
            sys.path.insert(0, str(REPO_ROOT / "packages" / package / "src"))


def single_process_environment() -> None:
    """Lets a distributed script run as ``python <script>`` without torchrun: a world of one on a
    free local port (nothing when torchrun set the environment)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )


def start_process_group(script: str, device: str, backend: str, cpu_run: str) -> torch.device:
    """Joins the torchrun job on ``backend`` ("nccl" or "gloo") and returns this rank's device:
    the GPU ``LOCAL_RANK % device_count`` for ``device == "cuda"``, else the CPU. ``cpu_run`` is
    the command-line flags for a CPU run, named when there is no GPU."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"{script}: no CUDA device; pass {cpu_run} for a CPU run.")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        rank_device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(rank_device)
    else:
        if backend == "nccl":
            raise SystemExit(f"{script}: the nccl backend needs --device cuda.")
        rank_device = torch.device("cpu")
    if backend == "nccl":
        dist.init_process_group("nccl", device_id=rank_device)
    else:
        dist.init_process_group("gloo")
    return rank_device
