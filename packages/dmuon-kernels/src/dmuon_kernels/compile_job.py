"""The background compile job: a separate process that builds the kernels Newton-Schulz will
need for a list of shapes, then exits.

Run as ``python -m dmuon_kernels.compile_job <spec.json>`` by ``dmuon_kernels.background_compile``
(never by hand). The spec names the training process (``parent_pid``), the CUDA device, the
Newton-Schulz settings (backend, coefficients, restarts, iteration dtype, eps), the shapes
(B, n, m) the optimizer's step will pass to ``iterate_normalized``, and a progress file. For each
shape the job runs the iteration once, eagerly, on zeros, with "auto" in compile-only mode
(``syrk.autotune.compile_for``): each product "auto" would tune has its contenders' kernels built
(what the autotuner would compile, through the same backends, so the objects land in the
owner-only kernel cache and the libraries' own caches under ``DMUON_CACHE_DIR``), and the
iteration's own calls then go through them (compiling the variants of its alpha and beta).
Nothing is timed and no verdict is recorded: timings taken beside a training step would be
wrong, so the training process times each shape itself after the switch, loading these kernels
from disk. One JSON line per shape goes to the progress file as it is done.

It must never outlive the training process: a watchdog thread exits as soon as the parent is
gone (its parent pid changes), whatever the job is doing. It prints its rank-tagged lines to
its stderr, which the parent sends to a log file; exit status 0 means every shape is done.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from dmuon_kernels._env import NS_CUDA_GRAPH_ENV

# How often the watchdog looks for the parent, in seconds.
WATCHDOG_PERIOD = 0.5
# The exit status of a job whose parent is gone.
ORPHANED_STATUS = 70


def _exit_with_parent(parent_pid: int) -> None:
    """Exit this process (no clean-up: it only builds kernels) once ``parent_pid`` is no longer
    its parent: the parent died and the job was handed to init or a subreaper."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_PERIOD)
        os._exit(ORPHANED_STATUS)

    if os.getppid() != parent_pid:
        os._exit(ORPHANED_STATUS)
    threading.Thread(target=watch, name="dmuon-compile-job-watchdog", daemon=True).start()


def run(spec: dict) -> None:
    """Build the kernels of every shape in ``spec`` (see the module docstring)."""
    os.environ[NS_CUDA_GRAPH_ENV] = "0"  # eager only: a capture here would be thrown away
    import torch

    from dmuon_kernels._log import log_rank_tagged
    from dmuon_kernels.newton_schulz import NewtonSchulz, NSRequest
    from dmuon_kernels.syrk.autotune import compile_only_in_this_process

    device = torch.device(spec["device"])
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(
            f"the compile job was given device {spec['device']!r} but this process sees no CUDA "
            f"device (torch.cuda.is_available() is {torch.cuda.is_available()}; "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    torch.cuda.set_device(device)
    compile_only_in_this_process()
    settings = spec["newton_schulz"]
    dtype = getattr(torch, settings["dtype"])
    ns = NewtonSchulz._for_request(
        NSRequest.of(
            backend=settings["backend"],
            coefficients=settings["coefficients"],
            restart_iterations=settings["restart_iterations"],
            dtype=dtype,
            eps=settings["eps"],
        )
    )
    progress = Path(spec["progress"])
    shapes = [tuple(shape) for shape in spec["shapes"]]
    for index, shape in enumerate(shapes, 1):
        start = time.perf_counter()
        ns.iterate_normalized(torch.zeros(shape, dtype=dtype, device=device))
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        log_rank_tagged(
            f"compile job: Newton-Schulz shape={shape} done ({index}/{len(shapes)}) in "
            f"{seconds:.1f} s"
        )
        with progress.open("a") as file:
            file.write(json.dumps({"shape": list(shape), "seconds": seconds}) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: python -m dmuon_kernels.compile_job <spec.json> (started by "
            "dmuon_kernels.background_compile, not by hand)",
            file=sys.stderr,
        )
        return 2
    spec = json.loads(Path(args[0]).read_text())
    _exit_with_parent(int(spec["parent_pid"]))
    run(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
