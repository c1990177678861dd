"""The simulator against the measurements: fitted constants, and predicted vs measured.

Owns reading the committed benchmark results (``benchmarks/results/`` of the dmuon repository:
``bench_e2e.py``, ``overlap_ab.py``, ``bench_step.py``, ``profile_host.py``, ``bench_ns.py``,
``bench_syrk.py`` and ``run_protocol_cuda.py`` JSON), deriving the H200 machine's measured and
fitted figures from the files its ``sources`` name (``derive_h200``), and the calibration report:
every measured component the simulator predicts, the prediction, the error, and whether the
measurement fixed a constant (``fit``) or was left out of every fit (``held out``). It must not
change the model to fit a number: a constant is fitted once, on the one measurement
``machine.H200_SOURCES`` names, and every other measurement is a test of it.

[Note: reading a benchmark file]
Each family of files has a loader that takes what the simulator needs and says, naming the file
and the key, when something is missing; files of a family the report does not use are ignored,
and the protocol runs are listed as excluded with the reason (their ``seconds`` time the whole
check, reference model included, not a training step).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmuon.inspect import SPECULATION_CHUNKS
from dmuon_tools.costs import (
    ADAMW_BYTES_PER_ELEMENT,
    COLLECTIVES,
    MUON_BYTES_PER_ELEMENT,
    REFERENCE_MUON_BYTES_PER_ELEMENT,
    collective_ms,
    elementwise_ms,
    ns_batch_ms,
    owner_ns_ms,
)
from dmuon_tools.machine import H200, H200_SOURCES, Link, Machine
from dmuon_tools.model_shapes import DecoderShape
from dmuon_tools.ns_table import shape_key
from dmuon_tools.simulator import (
    Layout,
    ModelSizes,
    Workload,
    forward_backward_flops,
    head_flops,
    simulate,
)

# The files the H200 preset's figures come from (see machine.H200_SOURCES).
GEMM_FILE = "syrk-h200-2026-11-29-final.json"
NS_FILE = "ns-h200-2026-11-29-autotune-graphs.json"
STEP_FILE = "step-h200-2026-12-01-48aeddf.json"
E2E_FILE = "e2e-h200-w1-2026-12-01-48aeddf.json"
HOST_FILE = "host-gpt2-h200-2026-12-01-576a0bf.json"
GLOO_FILE = "e2e-h200-gloo-w4-2026-12-01-f6373d6.json"
DMUON_NS_CANDIDATE = "dmuon gram"
CUBLAS_NS_CANDIDATE = "dmuon gram cublas"
REFERENCE_NS_CANDIDATE = "torch.optim.Muon"
# gloo on CUDA tensors of one GPU: a TCP loopback; its latency is assumed, its bandwidth fitted.
GLOO_LATENCY_US = 50.0
BENCH_E2E_DEFAULT_MODEL = {"vocab": 32000, "dim": 2048, "layers": 16, "heads": 16,
                           "kv_heads": 8, "ffn": 5632}  # fmt: skip
# Variants of bench_e2e / profile_host and the simulator's system for each.
E2E_SYSTEMS = {
    "fsdp2-adamw": "fsdp2-adamw",
    "dmuon-z3": "dmuon-z3",
    "dmuon-z2": "dmuon-z2",
    "dmuon-z3-overlap": "dmuon-z3-overlap",
    "dmuon-z2-overlap": "dmuon-z2-overlap",
    "naive-muon": "naive-muon",
}
BENCH_STEP_ROWS = {
    "fused AdamW": "adamw",
    "torch.optim.Muon": "reference",
    "dmuon.Muon (gram, kernel auto)": "dmuon",
    "dmuon.Muon (gram, kernel cublas)": "dmuon cublas",
}
# The error of the memory components the host profile lists after a step is not a test of the
# model when it is exact by construction (sizes of tensors); they are still reported.
DEFAULT_COMMAND = "dmuon-tools calibrate --results benchmarks/results"


# ---- reading files (see [Note: reading a benchmark file]) ------------------------------------


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read the benchmark result {path}: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got a {type(data).__name__}.")
    return data


def _get(data: Mapping[str, Any], keys: str, path: Path) -> Any:
    value: Any = data
    for key in keys.split("."):
        if not isinstance(value, Mapping) or key not in value:
            raise ValueError(
                f"{path.name}: no {keys!r} in the file; it is not a result of the benchmark its "
                "name says, or was written by an older version of it."
            )
        value = value[key]
    return value


def bench_e2e_shape(model: Mapping[str, Any], where: str) -> DecoderShape:
    """bench_e2e's Llama of ``ModelConfig`` (vocab, dim, layers, heads, kv_heads, ffn)."""
    try:
        dim, heads = int(model["dim"]), int(model["heads"])
        return DecoderShape(
            name=f"bench_e2e Llama d{dim} L{model['layers']}",
            hidden_size=dim,
            intermediate_size=int(model["ffn"]),
            num_hidden_layers=int(model["layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(model["kv_heads"]),
            head_dim=dim // heads,
            vocab_size=int(model["vocab"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where}: model {model!r} is not bench_e2e's ModelConfig.") from error


def _model_config_text(text: str) -> dict[str, float]:
    """``"ModelConfig(vocab=50257, dim=768, ...)"`` (profile_host's record) as a dict."""
    return {key: float(value) for key, value in re.findall(r"(\w+)=([0-9.]+)", str(text))}


def _ns_table(path: Path, candidate: str) -> dict[tuple[int, int], float]:
    data = _read(path)
    table = {
        shape_key(row["shape"]): float(row["median_ms"])
        for row in _get(data, "results", path)
        if row.get("candidate") == candidate and not row.get("error") and row.get("median_ms")
    }
    if not table:
        raise ValueError(f"{path.name}: no measurements of candidate {candidate!r}.")
    return table


def _bench_step_counts(data: Mapping[str, Any], path: Path) -> dict[tuple[int, int], int]:
    """NS shape -> how many matrices, of bench_step's layer stack."""
    layers = int(_get(data, "num_layers", path))
    counts: dict[tuple[int, int], int] = {}
    for dims in _get(data, "layer_shapes", path).values():
        key = shape_key(dims)
        counts[key] = counts.get(key, 0) + layers
    return counts


def _e2e_workload(inputs: Mapping[str, Any]) -> Workload:
    return Workload(
        seq_len=int(inputs["seq"]),
        micro_batch=int(inputs["micro_batch"]),
        activation_checkpointing=bool(inputs.get("checkpoint", True)),
        param_bytes=4 if "float32" in str(inputs.get("param_dtype")) else 2,
    )


# ---- the H200's figures ------------------------------------------------------------------------


def derive_h200(results: str | Path) -> Machine:
    """The H200 preset's measured and fitted figures, computed from the files its sources name
    (a test keeps ``machine.H200`` equal to this)."""
    results = Path(results)
    syrk = _read(results / GEMM_FILE)
    matmul = next(
        (
            row
            for row in _get(syrk, "matmul", results / GEMM_FILE)
            if row["shape"] == [8192, 8192, 8192] and row["dtype"] == "bfloat16"
        ),
        None,
    )
    if matmul is None:
        raise ValueError(f"{GEMM_FILE}: no bfloat16 8192x8192x8192 matmul row.")
    gemm_tflops = 2 * 8192**3 / (matmul["median_ms"]["cublas"] * 1e-3) / 1e12
    ns_path = results / NS_FILE
    ns_ms = _ns_table(ns_path, DMUON_NS_CANDIDATE)
    reference_ns_ms = _ns_table(ns_path, REFERENCE_NS_CANDIDATE)

    step_path = results / STEP_FILE
    step = _read(step_path)
    adamw_ms = float(_get(step, "results.fused AdamW.median_ms", step_path))
    num_params = int(_get(step, "num_params", step_path))
    copy_gbps = ADAMW_BYTES_PER_ELEMENT * num_params / (adamw_ms * 1e-3) / 1e9

    e2e_path = results / E2E_FILE
    e2e = _read(e2e_path)
    inputs = _get(e2e, "inputs", e2e_path)
    model = ModelSizes.of(bench_e2e_shape(inputs["model"], E2E_FILE))
    workload = _e2e_workload(inputs)
    baseline = _get(e2e, "results.fsdp2-adamw", e2e_path)
    forward_backward_ms = baseline["step_ms_median"] - baseline["optimizer_ms_median"]
    training_tflops = forward_backward_flops(model, workload) / (forward_backward_ms * 1e-3) / 1e12

    naive = _get(e2e, "results.naive-muon", e2e_path)
    matrices = [dims for layer in model.layers for _, dims in layer]
    modelled_ms = (
        math.fsum(ns_batch_ms(reference_ns_ms, shape_key(dims), 1) for dims in matrices)
        + elementwise_ms(model.dedicated_numel, REFERENCE_MUON_BYTES_PER_ELEMENT, copy_gbps)
        + elementwise_ms(model.other_numel, ADAMW_BYTES_PER_ELEMENT, copy_gbps)
    )
    dtensor_ms = max(0.0, (naive["optimizer_ms_median"] - modelled_ms) / len(matrices))

    host_path = results / HOST_FILE
    host = _read(host_path)
    host_inputs = _get(host, "inputs", host_path)
    gpt2 = _model_config_text(host_inputs["model"])
    gpt2_model = ModelSizes.of(bench_e2e_shape({k: int(v) for k, v in gpt2.items()}, HOST_FILE))
    gpt2_workload = Workload(
        seq_len=int(host_inputs["seq"]),
        micro_batch=int(host_inputs["micro_batch"]),
        activation_checkpointing=False,
    )
    head_ms = head_flops(gpt2_model, gpt2_workload) / (training_tflops * 1e12) * 1e3
    floors = {}
    for variant, family in (("fsdp2-adamw", "fsdp2"), ("dmuon-z3", "dmuon")):
        measured = _get(host, f"results.{variant}.device_forward_backward_ms", host_path)
        floors[family] = round((measured - head_ms) / gpt2_model.num_layers, 3)
    return dataclasses.replace(
        H200,
        gemm_tflops=round(gemm_tflops, 1),
        training_tflops=round(training_tflops, 1),
        copy_gbps=round(copy_gbps, 0),
        ns_ms={shape: round(ms, 4) for shape, ms in ns_ms.items()},
        reference_ns_ms={shape: round(ms, 4) for shape, ms in reference_ns_ms.items()},
        layer_host_ms=floors,
        dtensor_host_ms_per_matrix=round(dtensor_ms, 3),
        sources=H200_SOURCES,
    )


def gloo_machine(results: str | Path, machine: Machine) -> Machine:
    """``machine`` with its in-node link replaced by gloo on one GPU (a TCP loopback): latency
    assumed (``GLOO_LATENCY_US``), bandwidth fitted so that FSDP2 + AdamW's step on 4 ranks
    matches ``GLOO_FILE``."""
    path = Path(results) / GLOO_FILE
    data = _read(path)
    inputs = _get(data, "inputs", path)
    shape = bench_e2e_shape(inputs["model"], GLOO_FILE)
    workload = _e2e_workload(inputs)
    world = int(_get(data, "world_size", path))
    measured = float(_get(data, "results.fsdp2-adamw.step_ms_median", path))
    layout = _gloo_layout(world)

    def predicted(bandwidth: float) -> float:
        trial = _with_loopback(machine, bandwidth)
        return (
            simulate(shape, layout, workload, trial, ("fsdp2-adamw",))
            .predictions["fsdp2-adamw"]
            .step_ms
        )

    low, high = 1e-3, 1e4  # GB/s; the step falls as bandwidth grows
    for _ in range(60):
        middle = math.sqrt(low * high)
        if predicted(middle) > measured:
            low = middle
        else:
            high = middle
    return _with_loopback(machine, round(math.sqrt(low * high), 4))


def _gloo_layout(world: int) -> Layout:
    return Layout(num_shards=world, gpus_per_node=1, ranks_per_gpu=world)


def _with_loopback(machine: Machine, bandwidth_gbps: float) -> Machine:
    sources = dict(machine.sources)
    sources["nvlink"] = (
        f"gloo on one GPU: latency assumed {GLOO_LATENCY_US:g} us, bandwidth fitted on "
        f"{GLOO_FILE} fsdp2-adamw step_ms_median (fit)"
    )
    return dataclasses.replace(
        machine,
        name=f"{machine.name}-gloo-loopback",
        nvlink=Link(bandwidth_gbps=bandwidth_gbps, latency_us=GLOO_LATENCY_US),
        sources=sources,
    )


# ---- the report ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    source: str  # file name
    case: str  # variant or configuration
    quantity: str
    measured: float
    predicted: float
    role: str  # "fit" or "held out"
    unit: str = "ms"
    setting: str = "world size 1"  # where it ran: "NCCL, 8 GPUs", "gloo, 4 ranks on one GPU"

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured if self.measured else math.nan


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    machine: Machine
    gloo: Machine
    rows: tuple[Row, ...]
    excluded: tuple[tuple[str, str], ...]  # (file, reason)

    def summary(self) -> list[dict[str, Any]]:
        """Held-out rows of the latest file of each benchmark, grouped by what they measure:
        how many, median and largest absolute error."""
        groups: dict[str, list[Row]] = {}
        for row in self.rows:
            if row.role == "held out" and _is_latest(row.source):
                groups.setdefault(_group_of(row), []).append(row)
        return [
            {
                "component": name,
                "rows": len(rows),
                "median_abs_error": statistics.median(abs(r.error) for r in rows),
                "max_abs_error": max(abs(r.error) for r in rows),
            }
            for name, rows in sorted(groups.items(), key=lambda item: _summary_order(item[0]))
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "command": DEFAULT_COMMAND,
            "machine": self.machine.to_json(),
            "gloo_link": dataclasses.asdict(self.gloo.nvlink),
            "summary": self.summary(),
            "rows": [{**dataclasses.asdict(row), "error": _finite(row.error)} for row in self.rows],
            "excluded": [{"file": f, "reason": r} for f, r in self.excluded],
        }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


# The newest file of each family (the ones the fits use, and their gloo and host siblings).
_LATEST = {
    STEP_FILE,
    E2E_FILE,
    GLOO_FILE,
    HOST_FILE,
    "host-llama1b-h200-2026-12-01-576a0bf.json",
}


def _is_latest(source: str) -> bool:
    return source in _LATEST or source.startswith("collectives-")


_SUMMARY_ORDER = ("whole step", "forward+backward", "optimizer step", "memory", "collectives")


def _summary_order(group: str) -> tuple[bool, int, str]:
    """World size 1 first, then the other settings; within each, the step before its parts."""
    rank = next((i for i, prefix in enumerate(_SUMMARY_ORDER) if group.startswith(prefix)), 9)
    return "world size 1" not in group and not group.startswith("memory"), rank, group


def _group_of(row: Row) -> str:
    if row.source.startswith("collectives-"):
        return f"collectives ({row.setting})"
    if row.unit == "GiB":
        if row.quantity == "peak":
            return "memory per GPU, peak"
        return "memory per GPU, persistent state by component (tensor sizes)"
    world = row.setting
    if row.quantity.startswith("optimizer") or row.source.startswith("step-"):
        return f"optimizer step ({world})"
    if row.quantity == "forward+backward":
        return f"forward+backward ({world})"
    return f"whole step ({world})"


def calibrate(results: str | Path, machine: Machine | None = None) -> Calibration:
    """Every prediction the committed results can check, on ``machine`` (default: the figures
    ``derive_h200`` computes from ``results``)."""
    results = Path(results)
    if not results.is_dir():
        raise ValueError(
            f"--results {str(results)!r} is not a folder; pass the repository's benchmarks/results."
        )
    machine = machine or derive_h200(results)
    gloo = gloo_machine(results, machine)
    cublas_ns = _ns_table(results / NS_FILE, CUBLAS_NS_CANDIDATE)
    rows: list[Row] = []
    excluded: list[tuple[str, str]] = []
    for path in sorted(results.glob("*.json")):
        name = path.name
        if _ran_on_cpu(path):  # the simulator models the GPU: a CPU run checks nothing of it
            excluded.append((name, "a CPU run (the simulator models the H200)"))
        elif name.startswith("step-"):
            rows += _step_rows(path, machine, cublas_ns)
        elif name.startswith("e2e-"):
            rows += _e2e_rows(path, machine, gloo)
        elif name.startswith("overlap-ab-"):
            what_if = _overlap_what_if(path)
            if what_if is None:
                rows += _overlap_ab_rows(path, machine, gloo)
            else:
                excluded.append((name, what_if))
        elif name.startswith("host-"):
            rows += _host_rows(path, machine)
        elif name.startswith("collectives-"):
            rows += _collective_rows(path, machine, gloo)
        elif name.startswith("protocol-"):
            excluded.append(
                (
                    name,
                    "correctness run: its 'seconds' time the whole check (the reference model, "
                    "per-step comparisons and all-reduces) and no step time is recorded",
                )
            )
    return Calibration(machine=machine, gloo=gloo, rows=tuple(rows), excluded=tuple(excluded))


def _ran_on_cpu(path: Path) -> bool:
    data = json.loads(path.read_text())
    return isinstance(data, dict) and data.get("device") == "cpu"


def _step_rows(
    path: Path, machine: Machine, cublas_ns: Mapping[tuple[int, int], float]
) -> list[Row]:
    data = _read(path)
    counts = _bench_step_counts(data, path)
    numel = sum(count * a * b for (a, b), count in counts.items())
    predicted = {
        "adamw": elementwise_ms(numel, ADAMW_BYTES_PER_ELEMENT, machine.copy_gbps),
        "reference": math.fsum(
            count * ns_batch_ms(machine.reference_ns_ms, shape, 1)
            for shape, count in counts.items()
        )
        + elementwise_ms(numel, REFERENCE_MUON_BYTES_PER_ELEMENT, machine.copy_gbps),
        "dmuon": owner_ns_ms(machine.ns_ms, counts)
        + elementwise_ms(numel, MUON_BYTES_PER_ELEMENT, machine.copy_gbps),
        "dmuon cublas": owner_ns_ms(cublas_ns, counts)
        + elementwise_ms(numel, MUON_BYTES_PER_ELEMENT, machine.copy_gbps),
    }
    rows = []
    for case, what in BENCH_STEP_ROWS.items():
        result = _get(data, "results", path).get(case)
        if result is None or result.get("median_ms") is None:
            continue
        fit = path.name == STEP_FILE and what == "adamw"
        rows.append(
            Row(
                source=path.name,
                case=case,
                quantity="optimizer step",
                measured=float(result["median_ms"]),
                predicted=predicted[what],
                role="fit" if fit else "held out",
            )
        )
    return rows


def _e2e_setting(
    data: Mapping[str, Any], path: Path, machine: Machine, gloo: Machine
) -> tuple[Machine, Layout, str]:
    """The machine, layout and setting label of a run of bench_e2e's model: NCCL runs on one
    node (one GPU a rank), gloo runs of several ranks sharing the one GPU (how the project's GPU
    machine runs them)."""
    world = int(_get(data, "world_size", path))
    if _get(data, "backend", path) == "gloo" and world > 1:
        return gloo, _gloo_layout(world), f"gloo, {world} ranks on one GPU"
    layout = Layout(num_shards=world, gpus_per_node=max(8, world))
    return machine, layout, "world size 1" if world == 1 else f"NCCL, {world} GPUs"


def _e2e_rows(path: Path, machine: Machine, gloo: Machine) -> list[Row]:
    """``bench_e2e.py``: each variant's step, its parts and its peak."""
    data = _read(path)
    inputs = _get(data, "inputs", path)
    machine, layout, setting = _e2e_setting(data, path, machine, gloo)
    shape = bench_e2e_shape(inputs["model"], path.name)
    workload = _e2e_workload(inputs)
    variants = [
        v for v, result in _get(data, "results", path).items()
        if v in E2E_SYSTEMS and "error" not in result
    ]  # fmt: skip
    simulation = simulate(shape, layout, workload, machine, [E2E_SYSTEMS[v] for v in variants])
    rows = []
    for variant in variants:
        result = data["results"][variant]
        prediction = simulation.predictions[E2E_SYSTEMS[variant]]
        measured = {
            "step": result["step_ms_median"],
            "optimizer step": result["optimizer_ms_median"],
            "forward+backward": result["step_ms_median"] - result["optimizer_ms_median"],
        }
        predicted = {
            "step": prediction.step_ms,
            "optimizer step": prediction.optimizer_ms,
            "forward+backward": prediction.step_ms - prediction.optimizer_ms,
        }
        # The overlapped step's owner work runs during backward on the GPU (sharing it with
        # backward's kernels) and only in backward's idle compute in the simulator: where the
        # time falls between backward and step() differs by construction, the step compares.
        quantities = ["step"] if E2E_SYSTEMS[variant].endswith("-overlap") else list(measured)
        for quantity in quantities:
            rows.append(
                Row(
                    source=path.name,
                    case=variant,
                    quantity=quantity,
                    measured=float(measured[quantity]),
                    predicted=predicted[quantity],
                    role=_e2e_role(path.name, variant, quantity),
                    setting=setting,
                )
            )
        peaks = [p for p in result.get("peak_gib_per_rank") or [] if p is not None]
        if peaks:
            rows.append(
                Row(
                    source=path.name,
                    case=variant,
                    quantity="peak",
                    measured=max(peaks),
                    predicted=prediction.memory_gib["peak"],
                    role="held out",
                    unit="GiB",
                    setting=setting,
                )
            )
    return rows


# The two systems ``overlap_ab.py`` alternates, and its summary's key for each.
OVERLAP_AB_SYSTEMS = {"dmuon-z3": "plain_median_ms", "dmuon-z3-overlap": "overlapped_median_ms"}


# The speculation chunks of the ``overlap_ab.py`` runs that predate recording them: the default
# was four until it became two.
UNRECORDED_SPECULATION_CHUNKS = 4


def _overlap_what_if(path: Path) -> str | None:
    """Why an ``overlap_ab.py`` run measured settings the simulator does not model, or None."""
    data = _read(path)
    chunks = data.get("speculation_chunks", UNRECORDED_SPECULATION_CHUNKS)
    priority = data.get("speculation_stream_priority", 0)
    if (chunks, priority) == (SPECULATION_CHUNKS, 0):
        return None
    return (
        f"run with speculation chunks {chunks}, side-stream priority {priority}; the "
        f"simulator models the defaults ({SPECULATION_CHUNKS} chunks, priority 0)"
    )


def _overlap_ab_rows(path: Path, machine: Machine, gloo: Machine) -> list[Row]:
    """``overlap_ab.py``: the plain and the overlapped step measured paired (their iterations
    alternated on one machine), each step and the ratio of the two."""
    # Its first version ran NCCL at world size 1 only and recorded neither.
    data = {"world_size": 1, "backend": "nccl", **_read(path)}
    machine, layout, setting = _e2e_setting(data, path, machine, gloo)
    shape = bench_e2e_shape(_get(data, "model", path), path.name)
    # bench_e2e's defaults (activation checkpointing, bf16) where the file predates recording them
    workload = _e2e_workload(data)
    predictions = simulate(shape, layout, workload, machine, list(OVERLAP_AB_SYSTEMS))
    predicted = {s: predictions.predictions[s].step_ms for s in OVERLAP_AB_SYSTEMS}
    rows = [
        Row(
            source=path.name,
            case=system,
            quantity="step",
            measured=float(_get(data, f"summary.{key}", path)),
            predicted=predicted[system],
            role="held out",
            setting=setting,
        )
        for system, key in OVERLAP_AB_SYSTEMS.items()
    ]
    plain, overlapped = OVERLAP_AB_SYSTEMS
    rows.append(
        Row(
            source=path.name,
            case=f"{overlapped} / {plain}, paired",
            quantity="step ratio",
            measured=float(_get(data, "summary.ratio", path)),
            predicted=predicted[overlapped] / predicted[plain],
            role="held out",
            unit="x",
            setting=setting,
        )
    )
    return rows


def _e2e_role(name: str, variant: str, quantity: str) -> str:
    # The rows a constant was fitted on, and the ones that fit fixes almost whole (a step whose
    # forward+backward was the fit, and the reverse).
    fits = {
        (E2E_FILE, "fsdp2-adamw", "forward+backward"),
        (E2E_FILE, "fsdp2-adamw", "step"),
        (E2E_FILE, "naive-muon", "optimizer step"),
        (GLOO_FILE, "fsdp2-adamw", "step"),
        (GLOO_FILE, "fsdp2-adamw", "forward+backward"),
    }
    return "fit" if (name, variant, quantity) in fits else "held out"


def _host_rows(path: Path, machine: Machine) -> list[Row]:
    data = _read(path)
    inputs = _get(data, "inputs", path)
    config = {k: int(v) for k, v in _model_config_text(inputs["model"]).items()}
    shape = bench_e2e_shape(config, path.name)
    # profile_host checkpoints activations exactly for bench_e2e's default model (--llama-1b);
    # the file does not record it.
    checkpointing = all(config.get(k) == v for k, v in BENCH_E2E_DEFAULT_MODEL.items())
    workload = Workload(
        seq_len=int(inputs["seq"]),
        micro_batch=int(inputs["micro_batch"]),
        activation_checkpointing=checkpointing,
    )
    results = _get(data, "results", path)
    variants = [v for v in results if v in E2E_SYSTEMS]
    simulation = simulate(shape, Layout(num_shards=1), workload, machine, variants)
    rows = []
    for variant in variants:
        result, prediction = results[variant], simulation.predictions[variant]
        pairs = (
            ("forward+backward", "device_forward_backward_ms",
             prediction.step_ms - prediction.optimizer_ms, "ms"),
            ("optimizer step", "device_step_ms", prediction.optimizer_ms, "ms"),
            ("peak", "peak_gib", prediction.memory_gib["peak"], "GiB"),
        )  # fmt: skip
        for quantity, key, predicted, unit in pairs:
            if result.get(key) is None:
                continue
            fit = path.name == HOST_FILE and quantity == "forward+backward"
            rows.append(
                Row(
                    source=path.name,
                    case=variant,
                    quantity=quantity,
                    measured=float(result[key]),
                    predicted=predicted,
                    role="fit" if fit else "held out",
                    unit=unit,
                )
            )
        for component, measured in (result.get("memory_after_step_gib") or {}).items():
            if component in prediction.memory_gib:
                rows.append(
                    Row(
                        source=path.name,
                        case=variant,
                        quantity=component,
                        measured=float(measured),
                        predicted=prediction.memory_gib[component],
                        role="held out",
                        unit="GiB",
                    )
                )
    return rows


def _collective_rows(path: Path, machine: Machine, gloo: Machine) -> list[Row]:
    """``bench_collectives.py``: each measured collective against the ring model on the link
    its ranks use (gloo ranks sharing a GPU: the fitted loopback; NCCL in one node: NVLink;
    across nodes: the network)."""
    data = _read(path)
    world = int(_get(data, "world_size", path))
    backend = _get(data, "backend", path)
    if backend == "gloo":
        link = gloo.nvlink
    else:
        link = machine.nvlink if int(data.get("nodes", 1)) <= 1 else machine.network
    rows = []
    for result in _get(data, "results", path):
        if "error" in result or result.get("kind") not in COLLECTIVES:
            continue
        rows.append(
            Row(
                source=path.name,
                case=f"{backend} x {world}",
                quantity=f"{result['kind']} {result['bytes'] / 2**20:g} MiB",
                measured=float(result["median_ms"]),
                predicted=collective_ms(result["kind"], result["bytes"], world, link),
                role="held out",
                setting=f"{backend}, {world} ranks",
            )
        )
    return rows


# ---- printing ---------------------------------------------------------------------------------


def format_markdown(calibration: Calibration) -> str:
    """The report as the Markdown page ``docs/simulator-calibration.md`` holds."""
    machine = calibration.machine
    lines = [
        "# Simulator calibration",
        "",
        "Generated by `" + DEFAULT_COMMAND + " --markdown` (do not edit: "
        "`tests/tools/test_calibration.py` keeps this page equal to the command's output). "
        "What the simulator assumes is in [simulator.md](simulator.md).",
        "",
        "Every number below is measured on one H200 (NVIDIA, torch 2.11) and committed under "
        "`benchmarks/results/`. A row marked **fit** fixed one of the machine's constants; every "
        "other row is **held out**: predicted from constants fitted elsewhere. No multi-GPU "
        "NCCL measurement exists yet, so the NVLink and network links are assumed and nothing "
        "here tests them; the communication model is tested only on 4 gloo ranks sharing the "
        "GPU (a TCP loopback, not NCCL).",
        "",
        "## Summary (held-out rows of the newest run of each benchmark)",
        "",
        "| component | rows | median abs. error | max abs. error |",
        "|---|---:|---:|---:|",
    ]
    for entry in calibration.summary():
        lines.append(
            f"| {entry['component']} | {entry['rows']} | {entry['median_abs_error']:.1%} | "
            f"{entry['max_abs_error']:.1%} |"
        )
    lines += [
        "",
        "Reading the summary:",
        "",
        "- At world size 1 the model is tested on the optimizer step of two shapes (the 8B-shaped "
        "4-layer stack of `bench_step.py`, the 1 B Llama of `bench_e2e.py`) and on the whole "
        "iteration of the 1 B Llama. Its largest errors there are the launch-bound optimizer "
        "steps of the GPT-2-small shape (the simulator has no host model for the step) and the "
        "run-to-run spread of the measurements themselves: " + _largest_spread(calibration.rows)
        + ".",
        "- On 4 gloo ranks sharing the GPU the ring model mispredicts dmuon by about 2x while "
        "FSDP2's step is the fit: the ring model prices gloo's broadcast and reduce (dmuon's "
        "collectives) like its all-gather and reduce-scatter (FSDP2's), and the measurements say "
        "gloo does not (one explanation, unverified: a reduce-scatter run as an all-reduce, "
        "twice the bytes). `benchmarks/overlap/bench_collectives.py --backend gloo` on 4 ranks measures "
        "each kind; a per-kind link would replace the one fitted bandwidth.",
        "- Nothing here tests NVLink or the network: those predictions rest on the assumed links "
        "until `benchmarks/multi_gpu_session.sh` runs.",
        "",
        "## The machine's constants",
        "",
        "| constant | value | from |",
        "|---|---:|---|",
        f"| GEMM rate (bf16) | {machine.gemm_tflops:g} TFLOP/s | {machine.sources['gemm_tflops']} |",
        f"| forward+backward model FLOP rate | {machine.training_tflops:g} TFLOP/s | "
        f"{machine.sources['training_tflops']} |",
        f"| element-wise (HBM) bandwidth | {machine.copy_gbps:g} GB/s | "
        f"{machine.sources['copy_gbps']} |",
        f"| host floor per layer, FSDP2 / dmuon | {machine.layer_host_ms['fsdp2']:g} / "
        f"{machine.layer_host_ms['dmuon']:g} ms | {machine.sources['layer_host_ms']} |",
        f"| DTensor host time per matrix (naive Muon) | {machine.dtensor_host_ms_per_matrix:g} "
        f"ms | {machine.sources['dtensor_host_ms_per_matrix']} |",
        f"| gloo loopback link (4 ranks, one GPU) | {calibration.gloo.nvlink.bandwidth_gbps:g} "
        f"GB/s, {calibration.gloo.nvlink.latency_us:g} us | {calibration.gloo.sources['nvlink']} |",
        f"| NVLink | {machine.nvlink.bandwidth_gbps:g} GB/s, {machine.nvlink.latency_us:g} us | "
        f"{machine.sources['nvlink']} |",
        f"| network | {machine.network.bandwidth_gbps:g} GB/s, {machine.network.latency_us:g} us |"
        f" {machine.sources['network']} |",
        "",
        "Newton-Schulz per call (ms), " + machine.sources["ns_ms"] + " and "
        + machine.sources["reference_ns_ms"] + ":",
        "",
        "| shape | dmuon | torch.optim.Muon |",
        "|---|---:|---:|",
    ]  # fmt: skip
    for shape in sorted(machine.ns_ms):
        reference = machine.reference_ns_ms.get(shape)
        lines.append(
            f"| {shape[0]}x{shape[1]} | {machine.ns_ms[shape]:g} | "
            + (f"{reference:g}" if reference is not None else "-")
            + " |"
        )
    lines += ["", "## Every row", ""]
    current = None
    for row in calibration.rows:
        if row.source != current:
            current = row.source
            lines += [
                "",
                f"### {row.source}",
                "",
                "| case | quantity | measured | predicted | error | role |",
                "|---|---|---:|---:|---:|---|",
            ]
        lines.append(
            f"| {row.case} | {row.quantity} | {_value(row.measured, row.unit)} | "
            f"{_value(row.predicted, row.unit)} | {row.error:+.1%} | {row.role} |"
        )
    lines += ["", "## Not used", ""]
    for name, reason in calibration.excluded:
        lines.append(f"- `{name}`: {reason}.")
    return "\n".join(lines) + "\n"


def _value(value: float, unit: str) -> str:
    """A measured or predicted figure with its unit; a ratio ("x") to four decimals."""
    return f"{value:.4f} x" if unit == "x" else f"{value:.2f} {unit}"


def _largest_spread(rows: Sequence[Row]) -> str:
    """The widest run-to-run spread of one quantity measured in several committed runs of the
    same benchmark configuration at world size 1 (same case and predicted value)."""
    runs: dict[tuple[str, str, str, float], list[float]] = {}
    for row in rows:
        if row.setting == "world size 1" and row.unit == "ms" and row.quantity == "step":
            key = (row.source.split("-")[0], row.case, row.quantity, round(row.predicted, 6))
            runs.setdefault(key, []).append(row.measured)
    repeated = [(max(v) / min(v), key, v) for key, v in runs.items() if len(v) > 1]
    if not repeated:
        return "no configuration was measured twice"
    spread, (_, case, quantity, _), values = max(repeated)
    return (
        f"the {case} {quantity} measured {min(values):.1f} to {max(values):.1f} ms across "
        f"{len(values)} committed runs of one configuration ({spread - 1:.0%} apart)"
    )


def format_text(calibration: Calibration, rows: Sequence[Row] | None = None) -> str:
    """The summary and the constants, for a terminal."""
    lines = ["calibration: held-out rows of the newest run of each benchmark"]
    for entry in calibration.summary():
        lines.append(
            f"  {entry['component']}: {entry['rows']} rows, median |error| "
            f"{entry['median_abs_error']:.1%}, max {entry['max_abs_error']:.1%}"
        )
    lines.append("every row:")
    for row in rows if rows is not None else calibration.rows:
        lines.append(
            f"  {row.source} {row.case} {row.quantity}: measured {_value(row.measured, row.unit)}"
            f", predicted {_value(row.predicted, row.unit)} ({row.error:+.1%}, {row.role})"
        )
    return "\n".join(lines)
