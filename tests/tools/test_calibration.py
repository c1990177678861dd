"""``dmuon_tools.calibration`` on the committed benchmark results: the H200 preset is what its
sources give, the committed report is what the command prints, and the loader names the file
and the key it cannot read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dmuon.inspect import SPECULATION_CHUNKS
from dmuon_tools.calibration import (
    E2E_FILE,
    GLOO_FILE,
    UNRECORDED_SPECULATION_CHUNKS,
    bench_e2e_shape,
    calibrate,
    derive_h200,
    format_markdown,
)
from dmuon_tools.machine import H200
from dmuon_tools.simulator import Layout, Workload, simulate

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
RESULTS = REPOSITORY_ROOT / "benchmarks" / "results"
DOCS = REPOSITORY_ROOT / "docs"


@pytest.fixture(scope="module")
def calibration():
    return calibrate(RESULTS)


def test_the_h200_preset_is_what_the_files_it_names_give():
    assert derive_h200(RESULTS) == H200


def test_the_committed_report_is_what_the_command_prints(calibration):
    assert (DOCS / "simulator-calibration.md").read_text() == format_markdown(calibration)
    committed = json.loads((DOCS / "simulator-calibration.json").read_text())
    assert committed == json.loads(json.dumps(calibration.to_json()))


def speculation_settings(path: Path) -> tuple[int, int]:
    """An overlap_ab run's speculation chunks and side-stream priority (older runs recorded
    neither: the defaults of then)."""
    data = json.loads(path.read_text())
    return (
        data.get("speculation_chunks", UNRECORDED_SPECULATION_CHUNKS),
        data.get("speculation_stream_priority", 0),
    )


def test_every_committed_step_benchmark_is_compared_and_the_protocol_and_other_gpu_runs_are_excluded(
    calibration,
):
    sources = {row.source for row in calibration.rows}
    on_cpu = {path.name for path in RESULTS.glob("*-cpu-*.json")}
    on_other_gpus = {path.name for path in RESULTS.glob("*-h100-*.json")}
    what_ifs = {
        path.name
        for path in RESULTS.glob("overlap-ab-*.json")
        if speculation_settings(path) != (SPECULATION_CHUNKS, 0)
    }
    assert what_ifs  # the committed what-if runs of the overlapped step
    for pattern in ("step-*.json", "e2e-*.json", "host-*.json", "overlap-ab-*.json"):
        found = {path.name for path in RESULTS.glob(pattern)}
        assert found - on_cpu - on_other_gpus - what_ifs <= sources
    excluded = dict(calibration.excluded)
    protocol = {path.name for path in RESULTS.glob("protocol-*.json")}
    assert protocol | on_cpu | on_other_gpus | what_ifs == set(excluded)
    assert all("no step time is recorded" in excluded[name] for name in protocol)
    assert all("the simulator models the NVIDIA H200" in excluded[name] for name in on_other_gpus)
    assert all("run with speculation chunks" in excluded[name] for name in what_ifs)
    assert not sources & (on_cpu | on_other_gpus | what_ifs)


def test_a_fit_row_is_matched_and_held_out_rows_are_the_rest(calibration):
    fits = [row for row in calibration.rows if row.role == "fit"]
    assert {(row.source, row.case, row.quantity) for row in fits} >= {
        (E2E_FILE, "fsdp2-adamw", "forward+backward"),
        (E2E_FILE, "naive-muon", "optimizer step"),
        (GLOO_FILE, "fsdp2-adamw", "step"),
    }
    for row in fits:
        if row.quantity in ("forward+backward", "step") and row.source in (E2E_FILE, GLOO_FILE):
            continue  # a step whose forward+backward was fitted: its optimizer is predicted
        assert abs(row.error) < 1e-3, row
    assert sum(row.role == "held out" for row in calibration.rows) > 10 * len(fits)


def test_the_gloo_link_is_fitted_so_fsdp2_s_gloo_step_is_matched(calibration):
    data = json.loads((RESULTS / GLOO_FILE).read_text())
    measured = data["results"]["fsdp2-adamw"]["step_ms_median"]
    row = next(
        r for r in calibration.rows
        if r.source == GLOO_FILE and r.case == "fsdp2-adamw" and r.quantity == "step"
    )  # fmt: skip
    assert row.measured == measured
    assert row.predicted == pytest.approx(measured, rel=1e-3)


def test_the_world_size_1_step_of_the_1b_llama_is_predicted_from_the_simulator(calibration):
    data = json.loads((RESULTS / E2E_FILE).read_text())
    shape = bench_e2e_shape(data["inputs"]["model"], E2E_FILE)
    workload = Workload(seq_len=2048, micro_batch=4)
    expected = simulate(shape, Layout(num_shards=1), workload, H200, ["dmuon-z3"])
    row = next(
        r for r in calibration.rows
        if r.source == E2E_FILE and r.case == "dmuon-z3" and r.quantity == "step"
    )  # fmt: skip
    assert row.predicted == pytest.approx(expected.predictions["dmuon-z3"].step_ms)


def test_a_paired_overlap_run_is_compared_step_by_step_and_by_its_ratio(calibration, tmp_path):
    """overlap_ab.py's two medians against the simulator's two systems on bench_e2e's model, and
    its ratio against theirs; a multi-GPU run of it (the world size it records) on NCCL."""
    source = next(
        p
        for p in sorted(RESULTS.glob("overlap-ab-*.json"))
        if speculation_settings(p) == (SPECULATION_CHUNKS, 0)
    )
    data = json.loads(source.read_text())
    shape = bench_e2e_shape(data["model"], source.name)
    workload = Workload(seq_len=2048, micro_batch=4)
    systems = ["dmuon-z3", "dmuon-z3-overlap"]
    expected = simulate(shape, Layout(num_shards=1), workload, H200, systems).predictions
    rows = {(r.case, r.quantity): r for r in calibration.rows if r.source == source.name}
    assert rows[("dmuon-z3", "step")].measured == data["summary"]["plain_median_ms"]
    assert rows[("dmuon-z3-overlap", "step")].measured == data["summary"]["overlapped_median_ms"]
    ratio = rows[("dmuon-z3-overlap / dmuon-z3, paired", "step ratio")]
    assert ratio.measured == data["summary"]["ratio"] and ratio.unit == "x"
    assert ratio.predicted == pytest.approx(
        expected["dmuon-z3-overlap"].step_ms / expected["dmuon-z3"].step_ms
    )
    assert rows[("dmuon-z3", "step")].predicted == pytest.approx(expected["dmuon-z3"].step_ms)
    shutil.copytree(RESULTS, tmp_path / "results")
    data.update(world_size=8, backend="nccl")
    (tmp_path / "results" / "overlap-ab-h200-w8-2027-01-01.json").write_text(json.dumps(data))
    multi = [
        r for r in calibrate(tmp_path / "results").rows
        if r.source == "overlap-ab-h200-w8-2027-01-01.json"
    ]  # fmt: skip
    assert len(multi) == 3 and {r.setting for r in multi} == {"NCCL, 8 GPUs"}


def test_an_overlap_what_if_run_is_excluded_with_its_settings(tmp_path):
    """A run with the speculation's chunks or stream priority off the defaults measures
    something the simulator does not model: listed as excluded, never compared."""
    (source,) = [p for p in RESULTS.glob("overlap-ab-*.json") if "fcd3f46" in p.name]
    data = json.loads(source.read_text())
    shutil.copytree(RESULTS, tmp_path / "results")
    for name, settings in {
        "overlap-ab-h200-w1-2027-01-01-chunks.json": {"speculation_chunks": 2 * SPECULATION_CHUNKS},
        "overlap-ab-h200-w1-2027-01-01-priority.json": {"speculation_stream_priority": -5},
        "overlap-ab-h200-w1-2027-01-01-defaults.json": {
            "speculation_chunks": SPECULATION_CHUNKS,
            "speculation_stream_priority": 0,
        },
    }.items():
        (tmp_path / "results" / name).write_text(json.dumps({**data, **settings}))
    result = calibrate(tmp_path / "results")
    excluded = dict(result.excluded)
    assert (
        f"speculation chunks {2 * SPECULATION_CHUNKS}, side-stream priority 0"
        in excluded["overlap-ab-h200-w1-2027-01-01-chunks.json"]
    )
    assert "priority -5" in excluded["overlap-ab-h200-w1-2027-01-01-priority.json"]
    compared = {r.source for r in result.rows}
    assert "overlap-ab-h200-w1-2027-01-01-defaults.json" in compared
    assert not compared & {
        "overlap-ab-h200-w1-2027-01-01-chunks.json",
        "overlap-ab-h200-w1-2027-01-01-priority.json",
    }


def test_a_results_folder_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(
        ValueError, match="is not a folder; pass the repository's benchmarks/results"
    ):
        calibrate(tmp_path / "missing")


def test_a_result_missing_a_key_names_the_file_and_the_key(tmp_path):
    for path in RESULTS.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    broken = json.loads((tmp_path / E2E_FILE).read_text())
    del broken["inputs"]
    (tmp_path / E2E_FILE).write_text(json.dumps(broken))
    with pytest.raises(ValueError, match=f"{E2E_FILE}: no 'inputs' in the file"):
        calibrate(tmp_path)


def test_multi_gpu_and_collective_results_are_compared_once_committed(tmp_path):
    for path in RESULTS.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    # What multi_gpu_session.sh will bring back, in the shape its scripts write.
    e2e = json.loads((RESULTS / E2E_FILE).read_text())
    e2e["world_size"] = 8
    (tmp_path / "e2e-h200-w8-2027-01-01.json").write_text(json.dumps(e2e))
    collectives = {
        "benchmark": "bench_collectives",
        "backend": "nccl",
        "world_size": 8,
        "nodes": 1,
        "results": [
            {"kind": "all_gather", "bytes": 2**26, "median_ms": 0.2},
            {"kind": "broadcast", "bytes": 2**26, "error": "RuntimeError: not here"},
        ],
    }
    (tmp_path / "collectives-h200-nccl-w8-2027-01-01.json").write_text(json.dumps(collectives))
    rows = calibrate(tmp_path).rows
    multi = [r for r in rows if r.source == "e2e-h200-w8-2027-01-01.json"]
    assert {r.setting for r in multi} == {"NCCL, 8 GPUs"}
    (gather,) = [r for r in rows if r.source.startswith("collectives-")]
    # ring all-gather of 64 MiB over 8 ranks on the assumed NVLink
    expected = 7 * H200.nvlink.latency_ms + 7 / 8 * 2**26 / (H200.nvlink.bandwidth_gbps * 1e6)
    assert (gather.quantity, gather.setting) == ("all_gather 64 MiB", "nccl, 8 ranks")
    assert gather.predicted == pytest.approx(expected)


def test_a_cpu_run_is_excluded_not_compared_with_the_h200_model(tmp_path, calibration):
    shutil.copytree(RESULTS, tmp_path / "results")
    data = json.loads((RESULTS / E2E_FILE).read_text())
    data["device"] = "cpu"
    (tmp_path / "results" / "e2e-cpu-w1-copy.json").write_text(json.dumps(data))
    with_cpu_run = calibrate(tmp_path / "results")
    assert "e2e-cpu-w1-copy.json" in dict(with_cpu_run.excluded)
    assert with_cpu_run.rows == calibration.rows
