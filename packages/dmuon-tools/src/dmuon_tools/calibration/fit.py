"""Fitting the machine to the measurements: the H200 preset's figures, and the gloo loopback.

Owns computing the H200's measured and fitted figures from the files its ``sources`` name
(``derive_h200``; a test keeps ``machine.H200`` equal to it) and fitting the one bandwidth of gloo
ranks sharing a GPU (``gloo_machine``). It must not change the model to fit a number: a constant
is fitted once, on the one measurement ``machine.H200_SOURCES`` names, and every other
measurement is a test of it (``report``).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from dmuon_tools.calibration.results import (
    DMUON_NS_CANDIDATE,
    E2E_FILE,
    GEMM_FILE,
    GLOO_FILE,
    HOST_FILE,
    NS_FILE,
    REFERENCE_NS_CANDIDATE,
    STEP_FILE,
    bench_e2e_shape,
    e2e_workload,
    measured_ns_ms,
    model_config_text,
    read_result,
    value_at,
)
from dmuon_tools.costs import (
    ADAMW_BYTES_PER_ELEMENT,
    REFERENCE_MUON_BYTES_PER_ELEMENT,
    elementwise_ms,
    ns_batch_ms,
)
from dmuon_tools.machine import H200, H200_SOURCES, Link, Machine
from dmuon_tools.ns_table import shape_key
from dmuon_tools.simulator import (
    Layout,
    ModelSizes,
    Workload,
    forward_backward_flops,
    head_flops,
    simulate,
)

# gloo on CUDA tensors of one GPU: a TCP loopback; its latency is assumed, its bandwidth fitted.
GLOO_LATENCY_US = 50.0


def derive_h200(results: str | Path) -> Machine:
    """The H200 preset's measured and fitted figures, computed from the files its sources name
    (a test keeps ``machine.H200`` equal to this)."""
    results = Path(results)
    syrk = read_result(results / GEMM_FILE)
    matmul = next(
        (
            row
            for row in value_at(syrk, "matmul", results / GEMM_FILE)
            if row["shape"] == [8192, 8192, 8192] and row["dtype"] == "bfloat16"
        ),
        None,
    )
    if matmul is None:
        raise ValueError(f"{GEMM_FILE}: no bfloat16 8192x8192x8192 matmul row.")
    gemm_tflops = 2 * 8192**3 / (matmul["median_ms"]["cublas"] * 1e-3) / 1e12
    ns_path = results / NS_FILE
    ns_ms = measured_ns_ms(ns_path, DMUON_NS_CANDIDATE)
    reference_ns_ms = measured_ns_ms(ns_path, REFERENCE_NS_CANDIDATE)

    step_path = results / STEP_FILE
    step = read_result(step_path)
    adamw_ms = float(value_at(step, "results.fused AdamW.median_ms", step_path))
    num_params = int(value_at(step, "num_params", step_path))
    copy_gbps = ADAMW_BYTES_PER_ELEMENT * num_params / (adamw_ms * 1e-3) / 1e9

    e2e_path = results / E2E_FILE
    e2e = read_result(e2e_path)
    inputs = value_at(e2e, "inputs", e2e_path)
    model = ModelSizes.of(bench_e2e_shape(inputs["model"], E2E_FILE))
    workload = e2e_workload(inputs)
    baseline = value_at(e2e, "results.fsdp2-adamw", e2e_path)
    forward_backward_ms = baseline["step_ms_median"] - baseline["optimizer_ms_median"]
    training_tflops = forward_backward_flops(model, workload) / (forward_backward_ms * 1e-3) / 1e12

    naive = value_at(e2e, "results.naive-muon", e2e_path)
    matrices = [dims for layer in model.layers for _, dims in layer]
    modelled_ms = (
        math.fsum(ns_batch_ms(reference_ns_ms, shape_key(dims), 1) for dims in matrices)
        + elementwise_ms(model.dedicated_numel, REFERENCE_MUON_BYTES_PER_ELEMENT, copy_gbps)
        + elementwise_ms(model.other_numel, ADAMW_BYTES_PER_ELEMENT, copy_gbps)
    )
    dtensor_ms = max(0.0, (naive["optimizer_ms_median"] - modelled_ms) / len(matrices))

    host_path = results / HOST_FILE
    host = read_result(host_path)
    host_inputs = value_at(host, "inputs", host_path)
    gpt2 = model_config_text(host_inputs["model"])
    gpt2_model = ModelSizes.of(bench_e2e_shape({k: int(v) for k, v in gpt2.items()}, HOST_FILE))
    gpt2_workload = Workload(
        seq_len=int(host_inputs["seq"]),
        micro_batch=int(host_inputs["micro_batch"]),
        activation_checkpointing=False,
    )
    head_ms = head_flops(gpt2_model, gpt2_workload) / (training_tflops * 1e12) * 1e3
    floors = {}
    for variant, family in (("fsdp2-adamw", "fsdp2"), ("dmuon-z3", "dmuon")):
        measured = value_at(host, f"results.{variant}.device_forward_backward_ms", host_path)
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
    data = read_result(path)
    inputs = value_at(data, "inputs", path)
    shape = bench_e2e_shape(inputs["model"], GLOO_FILE)
    workload = e2e_workload(inputs)
    world = int(value_at(data, "world_size", path))
    measured = float(value_at(data, "results.fsdp2-adamw.step_ms_median", path))
    layout = gloo_layout(world)

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


def gloo_layout(world: int) -> Layout:
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
