"""GPU-only timing of short kernels: the measurement behind autotune verdicts and benchmarks.

Owns how a callable is timed: warm-up, CUDA events, repetitions interleaved between the
contenders, the median. It must not decide anything from the numbers (autotune does).

"GPU-only" means launch overhead on the host is kept out of the figure: before each timed
region the stream is given a spin kernel long enough for the host to enqueue every timed call
behind it, so the events measure back-to-back device work. That is the cost that matters when
Newton-Schulz replays as a CUDA graph (the default). On CPU tensors the host clock is used.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

# Each timed region aims at this much device time, so event resolution (~0.5 us) is negligible.
TARGET_REGION_MS = 1.0
MAX_CALLS_PER_REGION = 200
# The spin kernel never runs longer than this, whatever the host estimate says.
MAX_SPIN_MS = 50.0


def median_ms(
    contenders: Mapping[str, Callable[[], object]],
    device: torch.device,
    *,
    repeats: int = 15,
    warmup: int = 3,
) -> dict[str, float]:
    """Median milliseconds per call of each contender, timed interleaved on ``device``."""
    if device.type != "cuda":
        return _median_host_ms(contenders, repeats=repeats, warmup=warmup)
    with torch.cuda.device(device):
        return _median_gpu_ms(contenders, repeats=repeats, warmup=warmup)


def _median_host_ms(
    contenders: Mapping[str, Callable[[], object]], *, repeats: int, warmup: int
) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    for _ in range(repeats):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def _spin_cycles_per_ms() -> float | None:
    """Calibrate ``torch.cuda._sleep`` (a private spin kernel) once; None when it is absent."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 2_000_000
    sleep(cycles // 10)  # first launch loads the kernel
    start.record()
    sleep(cycles)
    end.record()
    end.synchronize()
    elapsed = start.elapsed_time(end)
    return cycles / elapsed if elapsed > 0 else None


def _median_gpu_ms(
    contenders: Mapping[str, Callable[[], object]], *, repeats: int, warmup: int
) -> dict[str, float]:
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    torch.cuda.synchronize()
    cycles_per_ms = _spin_cycles_per_ms()

    # A first rough pass gives, per contender, device time and host enqueue time per call.
    calls: dict[str, int] = {}
    host_ms: dict[str, float] = {}
    for name, fn in contenders.items():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        host_start = time.perf_counter()
        start.record()
        for _ in range(3):
            fn()
        end.record()
        host_ms[name] = (time.perf_counter() - host_start) * 1e3 / 3
        end.synchronize()
        device_ms = max(start.elapsed_time(end) / 3, 1e-3)
        calls[name] = max(1, min(MAX_CALLS_PER_REGION, round(TARGET_REGION_MS / device_ms)))

    regions: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event, int]]] = {
        name: [] for name in contenders
    }
    names = list(contenders)
    for repeat in range(repeats):
        # Rotate the order so no contender always runs right after the same neighbour.
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            fn, count = contenders[name], calls[name]
            if cycles_per_ms is not None:
                spin_ms = min(MAX_SPIN_MS, 1.5 * host_ms[name] * count + 0.05)
                torch.cuda._sleep(int(spin_ms * cycles_per_ms))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(count):
                fn()
            end.record()
            regions[name].append((start, end, count))
    torch.cuda.synchronize()
    return {
        name: statistics.median(start.elapsed_time(end) / count for start, end, count in timed)
        for name, timed in regions.items()
    }
