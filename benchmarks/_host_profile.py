"""Where the host time of a warmed call goes: cProfile over a few calls, as JSON rows and a table.

Owns running calls under ``cProfile`` (the device idle before each, nothing synchronised while
the profiler runs), turning the statistics into per-call rows, and printing them compactly.
Must not decide what a script profiles or where its rows go in the JSON.

A row: ``{"function": "file:line(name)", "calls_per_call", "own_us_per_call",
"cum_us_per_call"}``, the file shortened to its last two path parts (``syrk/dispatch.py``),
built-ins as cProfile names them (``<built-in method torch.mm>``); every figure divided by the
number of profiled calls. cProfile adds a fraction of a microsecond to each Python call it
sees, so its times are larger than the unprofiled ones: read them as shares of the call, and
take absolute host times from the scripts' unprofiled medians.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable, Sequence
from pathlib import PurePath

import torch

from benchmarks import _common

OWN_TIME, CUMULATIVE_TIME = "own", "cumulative"
_SORT_KEYS = {OWN_TIME: "own_us_per_call", CUMULATIVE_TIME: "cum_us_per_call"}
# pstats' key of a function: (file, first line, name); built-ins are ("~", 0, name).
_BUILTIN_FILE = "~"


def profile_calls(
    fn: Callable[[], object], device: torch.device, calls: int
) -> tuple[pstats.Stats, list[float]]:
    """``calls`` calls of ``fn`` under one profiler, and each call's host time in ms (entry to
    return, profiled). The profiler is off while the device is synchronised between calls, so
    each call starts on an idle device, as the unprofiled host times do, and no launch queue
    fills up over the calls."""
    profiler = cProfile.Profile()
    host_ms = []
    for _ in range(calls):
        _common.synchronize(device)
        started = time.perf_counter()
        profiler.enable()
        fn()
        profiler.disable()
        host_ms.append((time.perf_counter() - started) * 1e3)
    _common.synchronize(device)
    return pstats.Stats(profiler), host_ms


def top_functions(
    stats: pstats.Stats, calls: int, order: str = OWN_TIME, top: int = 12
) -> list[dict]:
    """The ``top`` functions by own (``"own"``) or cumulative time, per profiled call."""
    rows = [
        {
            "function": function_label(key),
            "calls_per_call": total_calls / calls,
            "own_us_per_call": own_s / calls * 1e6,
            "cum_us_per_call": cumulative_s / calls * 1e6,
        }
        for key, (_, total_calls, own_s, cumulative_s, _) in stats.stats.items()
        if not _is_profiler(key)
    ]
    rows.sort(key=lambda row: -row[_SORT_KEYS[order]])
    return rows[:top]


def function_label(key: tuple[str, int, str]) -> str:
    """``syrk/dispatch.py:120(syrk)``; a built-in's own name."""
    file, line, name = key
    if file == _BUILTIN_FILE and line == 0:
        return name
    return f"{'/'.join(PurePath(file).parts[-2:])}:{line}({name})"


def _is_profiler(key: tuple[str, int, str]) -> bool:
    """The profiler's own ``disable()``, which it records once per profiled call."""
    return key[0] == _BUILTIN_FILE and "_lsprof.Profiler" in key[2]


def format_rows(rows: Sequence[dict], title: str, width: int = 90) -> str:
    """``title``, then one line per row: own us, cumulative us and calls per call, function."""
    lines = [title, f"  {'own us':>9} {'cum us':>9} {'calls':>7}  function"]
    lines += [
        f"  {row['own_us_per_call']:>9.1f} {row['cum_us_per_call']:>9.1f} "
        f"{row['calls_per_call']:>7.1f}  {row['function'][:width]}"
        for row in rows
    ]
    return "\n".join(lines)
