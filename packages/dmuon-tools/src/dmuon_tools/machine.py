"""The machine a step is simulated on: measured kernel rates, link bandwidths, host floors.

Owns the ``Machine`` description (a typed dataclass, read from and written to JSON) and the
presets built from the repository's committed measurements. Every figure says where it comes
from in ``sources``: a file under ``benchmarks/results/`` and the quantity read from it, a fit
(``dmuon_tools.calibration`` derives the fitted ones from those files and a test keeps the preset
equal to that derivation), or ``assumed:`` with the reason when nothing measured exists yet (the
NVLink and network links: no multi-GPU machine has been lent to the project). It must not
simulate anything (``simulator`` does) nor read benchmark files (``calibration`` does).

Units: milliseconds, GB/s (1e9 bytes per second), TFLOP/s (1e12), microseconds for latencies,
GiB (2**30 bytes) for memory.

[Note: what a link's numbers mean]
``Link.bandwidth_gbps`` is what one GPU moves through that link class in one direction while a
ring collective runs (NCCL's "bus bandwidth"), not the datasheet figure; ``latency_us`` is the
per-step cost alpha of a ring (one hop plus the kernel's synchronisation). A group whose ranks
sit in one node uses ``nvlink``. ``network`` is one GPU's NIC (rail-optimised clusters have one
per GPU: 8 x 400 Gb/s a node). A group spanning nodes runs one ring per NIC of its ranks in a
node, so its bandwidth is that many NICs' (``group_link``), at most NVLink's: an HSDP replicate
group (one rank a node) gets one NIC, a shard group of 16 ranks over two nodes gets eight. A
cluster with fewer NICs than GPUs should give ``network`` the bandwidth each GPU's share of them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dmuon_tools.ns_table import format_shape, shape_key

# Systems whose host time per layer the machine may floor (see ``Machine.layer_host_ms``).
HOST_FLOOR_SYSTEMS = ("fsdp2", "dmuon")


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """One link class (NVLink inside a node, the network between nodes); see [Note: what a
    link's numbers mean]."""

    bandwidth_gbps: float  # GB/s one GPU achieves in a ring over this link, one direction
    latency_us: float  # alpha: cost of one ring step

    def transfer_ms(self, num_bytes: float) -> float:
        """Milliseconds to move ``num_bytes`` at this link's bandwidth (no latency)."""
        return num_bytes / (self.bandwidth_gbps * 1e9) * 1e3

    @property
    def latency_ms(self) -> float:
        return self.latency_us * 1e-3


@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    """What the simulator knows about a GPU, its host software floors and its links."""

    name: str
    gpu: str
    memory_gib: float  # what one GPU can allocate
    gemm_tflops: float  # dense bf16 GEMM rate, measured on a large product
    training_tflops: float  # model FLOP rate forward+backward achieve (matmuls + elementwise)
    copy_gbps: float  # effective HBM bandwidth of the optimizer's element-wise passes
    # Newton-Schulz of one call, per (short, long) shape, ms: dmuon's, and torch.optim.Muon's
    # (the naive baseline).
    ns_ms: Mapping[tuple[int, int], float]
    reference_ns_ms: Mapping[tuple[int, int], float]
    # Host floor of one decoder layer's forward+backward per system, ms: a small model is bound
    # by launching kernels and running hooks, not by the GPU (GPT-2-small: ~5 ms a layer).
    layer_host_ms: Mapping[str, float]
    # Naive Muon on DTensors: host time DTensor dispatch adds per matrix per step.
    dtensor_host_ms_per_matrix: float
    nvlink: Link
    network: Link
    sources: Mapping[str, str] = field(default_factory=dict)  # field -> where it comes from

    def __post_init__(self) -> None:
        for name in ("memory_gib", "gemm_tflops", "training_tflops", "copy_gbps"):
            _check_positive(self.name, name, getattr(self, name))
        _check_positive(
            self.name, "dtensor_host_ms_per_matrix", self.dtensor_host_ms_per_matrix, zero=True
        )
        for table_name in ("ns_ms", "reference_ns_ms"):
            table = getattr(self, table_name)
            if not table:
                raise ValueError(
                    f"machine {self.name!r}: {table_name} is empty; give at least one measured "
                    'Newton-Schulz time, e.g. {"4096x14336": 5.0}.'
                )
            for shape, ms in table.items():
                _check_positive(self.name, f"{table_name}[{format_shape(shape)}]", ms)
        unknown = sorted(set(self.layer_host_ms) - set(HOST_FLOOR_SYSTEMS))
        if unknown:
            raise ValueError(
                f"machine {self.name!r}: layer_host_ms has {unknown}; its keys are "
                f"{', '.join(HOST_FLOOR_SYSTEMS)}."
            )
        for system, ms in self.layer_host_ms.items():
            _check_positive(self.name, f"layer_host_ms[{system}]", ms, zero=True)
        for link_name in ("nvlink", "network"):
            link = getattr(self, link_name)
            _check_positive(self.name, f"{link_name}.bandwidth_gbps", link.bandwidth_gbps)
            _check_positive(self.name, f"{link_name}.latency_us", link.latency_us, zero=True)

    def group_link(self, link_class: str, ranks_in_node: int) -> Link:
        """The link a group's collectives run at: NVLink inside a node; across nodes, the NICs
        of the group's ranks in one node together, at most NVLink (see [Note: what a link's
        numbers mean])."""
        if link_class == "nvlink":
            return self.nvlink
        bandwidth = min(self.nvlink.bandwidth_gbps, ranks_in_node * self.network.bandwidth_gbps)
        return Link(bandwidth_gbps=bandwidth, latency_us=self.network.latency_us)

    # ---- JSON ------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for table_name in ("ns_ms", "reference_ns_ms"):
            data[table_name] = {
                format_shape(shape): ms for shape, ms in getattr(self, table_name).items()
            }
        data["layer_host_ms"] = dict(self.layer_host_ms)
        data["sources"] = dict(self.sources)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "machine") -> Machine:
        """From ``to_json()``'s layout; every missing or unknown key is named."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a JSON object, got a {type(data).__name__}.")
        expected = set(cls.__dataclass_fields__)
        required = expected - {"sources"}
        missing, unknown = sorted(required - set(data)), sorted(set(data) - expected)
        if missing or unknown:
            raise ValueError(
                f"{where}: "
                + "; ".join(
                    part
                    for part in (
                        f"missing {', '.join(missing)}" if missing else "",
                        f"unknown keys {', '.join(unknown)}" if unknown else "",
                    )
                    if part
                )
                + ". Write a machine file with dmuon-tools simulate --machine h200 "
                "--write-machine machine.json and edit its values."
            )
        values = dict(data)
        for table_name in ("ns_ms", "reference_ns_ms"):
            values[table_name] = _shape_table(values[table_name], f"{where}: {table_name}")
        for link_name in ("nvlink", "network"):
            link = values[link_name]
            if not isinstance(link, Mapping) or set(link) != {"bandwidth_gbps", "latency_us"}:
                raise ValueError(
                    f"{where}: {link_name} must be an object with bandwidth_gbps and latency_us, "
                    f"got {link!r}."
                )
            values[link_name] = Link(**{key: _number(link[key], f"{where}: {link_name}.{key}")
                                        for key in link})  # fmt: skip
        for key in ("memory_gib", "gemm_tflops", "training_tflops", "copy_gbps",
                    "dtensor_host_ms_per_matrix"):  # fmt: skip
            values[key] = _number(values[key], f"{where}: {key}")
        floors = values["layer_host_ms"]
        if not isinstance(floors, Mapping):
            raise ValueError(f"{where}: layer_host_ms must be an object, got {floors!r}.")
        values["layer_host_ms"] = {
            str(k): _number(v, f"{where}: layer_host_ms.{k}") for k, v in floors.items()
        }
        values["sources"] = dict(values.get("sources") or {})
        return cls(**values)

    @classmethod
    def load(cls, path: str | Path) -> Machine:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read the machine file {path}: {error}") from error
        return cls.from_json(data, str(path))


def _check_positive(machine: str, name: str, value: float, *, zero: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(
            f"machine {machine!r}: {name} must be a finite number {bound}, got {value!r}."
        )


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number, got {value!r}.")
    return float(value)


def _shape_table(table: Any, where: str) -> dict[tuple[int, int], float]:
    if not isinstance(table, Mapping):
        raise ValueError(f'{where}: expected an object {{"MxN": ms}}, got {table!r}.')
    result = {}
    for text, ms in table.items():
        try:
            dims = tuple(int(d) for d in str(text).lower().split("x"))
        except ValueError:
            dims = ()
        if len(dims) != 2 or min(dims) < 1:
            raise ValueError(f"{where}: {text!r} is not a shape 'MxN' of positive integers.")
        result[shape_key(dims)] = _number(ms, f"{where}[{text}]")
    return result


# ---- presets ---------------------------------------------------------------------------------

_RESULTS = "benchmarks/results/"
# Sources of the H200 preset; ``dmuon_tools.calibration.derive_h200`` reads exactly these.
H200_SOURCES = {
    "gemm_tflops": _RESULTS + "syrk-h200-2026-11-29-final.json: matmul 8192x8192x8192 bfloat16, "
    "cublas median",
    "training_tflops": _RESULTS + "e2e-h200-w1-2026-12-01-48aeddf.json: fsdp2-adamw, model FLOPs "
    "/ (step_ms_median - optimizer_ms_median) (fit)",
    "copy_gbps": _RESULTS + "step-h200-2026-12-01-48aeddf.json: fused AdamW median_ms, 28 bytes "
    "per parameter (fit)",
    "ns_ms": _RESULTS + "ns-h200-2026-11-29-autotune-graphs.json: candidate 'dmuon gram'",
    "reference_ns_ms": _RESULTS
    + "ns-h200-2026-11-29-autotune-graphs.json: candidate 'torch.optim.Muon'",
    "layer_host_ms": _RESULTS + "host-gpt2-h200-2026-12-01-576a0bf.json: "
    "device_forward_backward_ms / 12 layers, per variant (fit)",
    "dtensor_host_ms_per_matrix": _RESULTS + "e2e-h200-w1-2026-12-01-48aeddf.json: naive-muon "
    "optimizer_ms_median minus the modelled NS and element-wise time, per matrix (fit)",
    "memory_gib": "the H200's 141 GB less what the CUDA context and allocator keep (139 GiB "
    "allocatable, as the GPU machine reports)",
    "nvlink": "assumed: H200 NVLink 4 (450 GB/s a direction), NCCL ring bus bandwidth about "
    "80% of it; not measured (no multi-GPU machine yet: benchmarks/overlap/bench_collectives.py)",
    "network": "assumed: one 400 Gb/s NIC per GPU (50 GB/s), 90% achieved by a ring, 10 us a "
    "step; not measured (benchmarks/overlap/bench_collectives.py on two nodes)",
}

H200 = Machine(
    name="h200",
    gpu="NVIDIA H200",
    memory_gib=139.0,
    gemm_tflops=679.7,
    training_tflops=416.7,
    copy_gbps=3449.0,
    ns_ms={
        (1024, 4096): 0.2833,
        (4096, 4096): 2.6795,
        (4096, 14336): 4.8355,
        (8192, 8192): 17.5744,
        (8192, 28672): 31.4435,
    },
    reference_ns_ms={
        (1024, 4096): 0.5861,
        (4096, 4096): 2.9679,
        (4096, 14336): 8.677,
        (8192, 8192): 25.9276,
        (8192, 28672): 68.0191,
    },
    layer_host_ms={"fsdp2": 4.914, "dmuon": 4.119},
    dtensor_host_ms_per_matrix=1.481,
    nvlink=Link(bandwidth_gbps=360.0, latency_us=5.0),
    network=Link(bandwidth_gbps=45.0, latency_us=10.0),
    sources=H200_SOURCES,
)
"""One H200 per GPU, 8 per node on NVLink, 400 Gb/s a GPU between nodes: kernel figures measured
on the project's H200 (``sources``), links assumed."""

MACHINES: dict[str, Machine] = {H200.name: H200}


def with_training_tflops(machine: Machine, tflops: float) -> Machine:
    """``machine`` with another model FLOP rate for forward and backward (a what-if of the
    compute rate: the sensitivity of a prediction to it); its source says so."""
    sources = dict(machine.sources)
    sources["training_tflops"] = (
        f"what-if: {tflops:g} TFLOP/s instead of the machine's {machine.training_tflops:g}"
    )
    return replace(machine, training_tflops=tflops, sources=sources)


def load_machine(text: str) -> Machine:
    """A preset name (``h200``) or the path of a machine JSON file."""
    path = Path(text)
    if path.is_file():
        return Machine.load(path)
    preset = MACHINES.get(text.lower())
    if preset is None:
        raise ValueError(
            f"--machine {text!r} is neither a file nor a preset. Presets: "
            f"{', '.join(MACHINES)}; or pass a machine JSON file (write one with --write-machine)."
        )
    return preset
