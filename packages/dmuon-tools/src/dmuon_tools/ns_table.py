"""A measured Newton-Schulz time table: milliseconds per matrix shape, and lookups for any shape.

Owns reading the table (the JSON ``benchmarks/kernels/bench_ns.py`` writes, or a plain ``{"MxN": ms}``
object) and the estimate for a shape the table lacks: the time of the table shape nearest in
Newton-Schulz FLOPs (``6 n'^2 m' + 14 n'^3``, ``n' = min``, ``m' = max``), scaled by the FLOP
ratio, and flagged as scaled. A shape and its transpose cost the same (Newton-Schulz works on the
wide orientation), so they share an entry. Pure: no tensors, no device.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dmuon.inspect import ns_cost

DEFAULT_CANDIDATE = "dmuon gram"


def shape_key(shape: Sequence[int]) -> tuple[int, int]:
    """``(short side, long side)`` of a matrix; trailing dims are flattened into columns."""
    rows = shape[0]
    cols = math.prod(shape[1:])
    return min(rows, cols), max(rows, cols)


def format_shape(key: Sequence[int]) -> str:
    return "x".join(str(d) for d in key)


@dataclass(frozen=True, slots=True)
class NSTime:
    ms: float
    table_shape: tuple[int, int]  # the measured shape the time comes from
    scaled: bool  # True when ``shape`` is not in the table and the time is FLOP-scaled


@dataclass(frozen=True, slots=True, kw_only=True)
class NSTimeTable:
    times_ms: dict[tuple[int, int], float]  # shape_key -> median milliseconds
    candidate: str | None
    source: str
    device: str | None = None

    def lookup(self, shape: Sequence[int]) -> NSTime:
        """The measured time of ``shape`` (or its transpose), else the FLOP-scaled nearest."""
        key = shape_key(shape)
        if key in self.times_ms:
            return NSTime(self.times_ms[key], key, scaled=False)
        flops = ns_cost(key)
        nearest = min(
            self.times_ms, key=lambda known: (abs(math.log(ns_cost(known) / flops)), known)
        )
        return NSTime(self.times_ms[nearest] * flops / ns_cost(nearest), nearest, scaled=True)

    @classmethod
    def load(cls, path: str | Path, candidate: str = DEFAULT_CANDIDATE) -> NSTimeTable:
        """Read a ``bench_ns.py`` result (rows of ``shape``, ``candidate``, ``median_ms``; the rows
        of ``candidate`` are used) or a ``{"MxN": ms}`` object (``candidate`` is ignored)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read the NS time table {path}: {error}") from error
        if isinstance(data, Mapping) and "results" in data:
            return cls._from_benchmark(data, candidate, str(path))
        if isinstance(data, Mapping):
            return cls._from_mapping(data, str(path))
        raise ValueError(
            f"{path}: expected a bench_ns.py result (an object with 'results') or an object "
            f'mapping "MxN" to milliseconds, got a JSON {type(data).__name__}.'
        )

    @classmethod
    def _from_benchmark(cls, data: Mapping, candidate: str, source: str) -> NSTimeTable:
        results = data["results"]
        if not isinstance(results, list):
            raise ValueError(
                f"{source}: 'results' must be a list of rows (shape, candidate, median_ms), got a "
                f"JSON {type(results).__name__}; pass a benchmarks/kernels/bench_ns.py result."
            )
        rows = [row for row in results if isinstance(row, Mapping)]
        candidates = sorted({str(row.get("candidate")) for row in rows})
        times = {}
        for index, row in enumerate(rows):
            if row.get("candidate") != candidate or row.get("median_ms") is None:
                continue
            if row.get("error"):
                continue
            where = f"{source}: results[{index}]"
            times[_shape_of(row.get("shape"), where)] = _milliseconds(row["median_ms"], where)
        if not times:
            raise ValueError(
                f"{source} has no successful measurements for candidate {candidate!r}; its "
                f"candidates are {candidates}. Choose one with --candidate."
            )
        device = data.get("device")
        return cls(times_ms=times, candidate=candidate, source=source, device=device)

    @classmethod
    def _from_mapping(cls, data: Mapping, source: str) -> NSTimeTable:
        times = {}
        for text, ms in data.items():
            where = f"{source}: entry {text!r}"
            try:
                dims = tuple(int(d) for d in str(text).lower().split("x"))
            except ValueError:
                dims = ()
            if len(dims) < 2 or min(dims) < 1:
                raise ValueError(
                    f"{where}: {text!r} is not a shape 'MxN' of positive integers; write "
                    'entries like {"4096x14336": 4.8}.'
                )
            times[shape_key(dims)] = _milliseconds(ms, where)
        if not times:
            raise ValueError(f"{source} holds no shapes; write entries like {{'4096x4096': 2.7}}.")
        return cls(times_ms=times, candidate=None, source=source)


def _shape_of(value: object, where: str) -> tuple[int, int]:
    """The ``shape_key`` of a benchmark row's ``shape``: a list of two or more positive ints."""
    if (
        not isinstance(value, list | tuple)
        or len(value) < 2
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in value)
    ):
        raise ValueError(
            f"{where}: shape {value!r} is not a list of positive integers; write it as "
            "[rows, cols], e.g. [4096, 14336]."
        )
    return shape_key(value)


def _milliseconds(value: object, where: str) -> float:
    """A measured time: a finite number of milliseconds above zero."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"{where}: time {value!r} is not a positive number of milliseconds; write the "
            "measured median, e.g. 4.8."
        )
    return float(value)
