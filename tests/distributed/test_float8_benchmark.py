"""The float8 benchmark's CPU smoke run (``benchmarks/e2e/bench_float8.py --quick``): every arm
trains on gloo at world size 1 with torchao's CPU float8 path, and its JSON holds what the GPU run
reports.

Two steps per arm (torchao's float8 matmuls are slow on the CPU). The float8 arms must compute
in float8 (their first loss is not the fp32 model's) and dmuon's float8 forward must be FSDP2's
for the same recipe: the same model, the same first batch, the same casts, so the same first
loss bit for bit ([Note: float8 training on dedicated weights] in ``dmuon.float8``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchao.float8", reason="torchao is not installed")

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "benchmarks" / "e2e" / "bench_float8.py"
ARMS = [
    "fsdp2-adamw",
    "fsdp2-adamw-float8-tensorwise",
    "fsdp2-adamw-float8-rowwise",
    "dmuon",
    "dmuon-float8-tensorwise",
    "dmuon-float8-rowwise",
]
STEPS = 2


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("float8") / "float8.json"


@pytest.fixture(scope="module")
def record(out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick"]
    command += ["--steps", str(STEPS), "--warmup", "1", "--out", str(out)]
    completed = subprocess.run(
        command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900
    )
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-4000:]
    assert "x fsdp2" in completed.stdout.splitlines()[-8], completed.stdout[-2000:]
    return json.loads(out.read_text())


def test_the_quick_run_trains_every_arm_and_records_its_curve_step_times_and_versions(record):
    assert record["benchmark"] == "float8"
    assert record["device"] == "cpu"
    assert record["torchao"] and record["torch"] and record["git_sha"]
    assert list(record["arms"]) == ARMS
    for arm, result in record["arms"].items():
        assert "error" not in result, (arm, result.get("traceback"))
        assert len(result["losses"]) == STEPS and result["losses_finite"], arm
        assert len(result["step_ms"]) == STEPS - 1 and result["step_ms_median"] > 0, arm
        assert math.isfinite(result["eval_loss"]), arm
    assert record["data"]["kind"] == "markov-chain-then-copy"
    assert 0 < record["data"]["loss_floor"] < math.log(record["model"]["vocab"])


def test_the_float8_arms_convert_every_projection_and_dmuon_dedicates_the_float8_linears(record):
    arms = record["arms"]
    projections = 7 * record["model"]["layers"]
    for arm in ARMS:
        expected = projections if "float8" in arm else None
        assert arms[arm].get("float8_linears") == expected, arm
    assert arms["fsdp2-adamw-float8-tensorwise"]["float8_all_gather"] is True
    assert arms["dmuon-float8-tensorwise"]["float8_all_gather"] is False
    assert arms["dmuon"]["dedicated_modules"] == ["Linear"]
    for recipe in ("tensorwise", "rowwise"):
        assert arms[f"dmuon-float8-{recipe}"]["dedicated_modules"] == ["Float8Linear"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_dmuons_float8_forward_is_fsdp2s_and_differs_from_the_unconverted_model(record, recipe):
    arms = record["arms"]
    first = arms[f"dmuon-float8-{recipe}"]["losses"][0]
    assert first == arms[f"fsdp2-adamw-float8-{recipe}"]["losses"][0]
    assert arms["dmuon"]["losses"][0] == arms["fsdp2-adamw"]["losses"][0]
    assert first != arms["dmuon"]["losses"][0]


def test_the_plot_mode_draws_the_runs_json_next_to_it(record, out):
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--plot", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
