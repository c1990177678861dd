"""``dmuon-tools simulate`` and ``dmuon-tools calibrate``: what they print, and one line with
status 2 for every bad input."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from dmuon_tools.cli import main
from dmuon_tools.machine import H200, Machine
from dmuon_tools.model_shapes import PRESETS
from dmuon_tools.simulate_report import PREDICTION_LABEL, format_markdown_table
from dmuon_tools.simulator import Layout, Workload, simulate

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
RESULTS = REPOSITORY_ROOT / "benchmarks" / "results"


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_simulate_prints_each_system_as_a_prediction(capsys):
    code, out, _ = run_cli(capsys, "simulate", "--config", "llama3-8b", "--gpus", "64")
    assert code == 0
    assert "llama3-8b on 64 GPUs = G 8 x R 8, 8 GPUs a node" in out
    assert "shard group on nvlink, replicate group on network" in out
    for system in ("fsdp2-adamw", "dmuon-z3", "dmuon-z3-sync", "dmuon-z2", "naive-muon"):
        assert f"\n  {system} " in out
    assert PREDICTION_LABEL in out


def test_simulate_json_holds_the_numbers_the_table_shows(capsys):
    code, out, _ = run_cli(
        capsys, "simulate", "--config", "llama3-8b", "--mesh", "8x2", "--json", "--timeline"
    )
    assert code == 0
    (run,) = json.loads(out)
    expected = simulate(
        PRESETS["llama3-8b"], Layout(num_shards=8, num_replicas=2), Workload(), H200
    )
    dmuon = run["predictions"]["dmuon-z3"]
    assert dmuon["step_ms"] == pytest.approx(expected.predictions["dmuon-z3"].step_ms)
    assert run["layout"]["world_size"] == 16
    assert {span["stream"] for span in dmuon["timeline"]} >= {"compute", "dmuon shard"}


def test_simulate_markdown_is_the_readme_table_format(capsys):
    args = ("--config", "llama3-8b", "--gpus", "8", "--gpus", "16", "--markdown")
    code, out, _ = run_cli(capsys, "simulate", *args)
    assert code == 0
    runs = [
        simulate(PRESETS["llama3-8b"], Layout(num_shards=8, num_replicas=replicas), Workload(),
                 H200, ["fsdp2-adamw", "dmuon-z3", "naive-muon"])
        for replicas in (1, 2)
    ]  # fmt: skip
    assert out.strip() == format_markdown_table(runs)


def test_a_written_machine_file_simulates_like_the_preset(capsys, tmp_path):
    path = tmp_path / "machine.json"
    code, out, _ = run_cli(capsys, "simulate", "--write-machine", str(path))
    assert code == 0 and f"wrote {path}" in out
    assert Machine.load(path) == H200
    args = ("simulate", "--config", "llama3.2-1b", "--gpus", "8", "--json")
    _, from_preset, _ = run_cli(capsys, *args)
    _, from_file, _ = run_cli(capsys, *args, "--machine", str(path))
    assert json.loads(from_preset)[0]["predictions"] == json.loads(from_file)[0]["predictions"]


def test_simulate_plots_one_timeline_per_layout(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "step.png"
    code, _, err = run_cli(
        capsys, "simulate", "--config", "llama3.2-1b", "--gpus", "8", "--gpus", "16",
        "--plot", str(path),
    )  # fmt: skip
    assert code == 0
    for index in (0, 1):
        written = tmp_path / f"step-{index}.png"
        assert f"wrote {written}" in err
        assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tokens_per_step_adds_a_run_of_each_layout_at_that_many_tokens_by_accumulation(capsys):
    args = ("--config", "llama3.2-1b", "--gpus", "8", "--seq", "1024", "--json")
    code, out, _ = run_cli(capsys, "simulate", *args, "--tokens-per-step", "64K")
    assert code == 0
    main_run, accumulated = json.loads(out)
    # One micro-batch of 1024 tokens on each of 8 ranks is 8K tokens a step; 64K is 8 of them.
    assert main_run["workload"]["accumulation"] == 1
    assert main_run["workload"]["tokens_per_step"] == 8 * 1024
    assert accumulated["workload"]["accumulation"] == 8
    assert accumulated["workload"]["tokens_per_step"] == 65_536
    assert accumulated["workload"]["no_sync"] is False
    expected = simulate(
        PRESETS["llama3.2-1b"], Layout(num_shards=8), Workload(seq_len=1024, accumulation=8), H200
    )
    assert accumulated["predictions"]["dmuon-z3"]["step_ms"] == pytest.approx(
        expected.predictions["dmuon-z3"].step_ms
    )


def test_accumulation_and_no_sync_describe_the_workload_they_simulate(capsys):
    args = ("--config", "llama3.2-1b", "--mesh", "8", "--seq", "1024", "--accumulation", "4")
    code, out, _ = run_cli(capsys, "simulate", *args, "--no-sync")
    assert code == 0
    assert (
        "seq 1024 x micro-batch 1 per data-parallel rank x 4 micro-batches a step, gradients "
        "reduced on the last only (no_sync)" in out
    )
    assert "32,768 tokens a step; forward+backward at 416.7 TFLOP/s" in out


def test_tokens_per_step_below_one_micro_batch_a_rank_is_skipped_with_a_note(capsys):
    args = ("--config", "llama3.2-1b", "--gpus", "8", "--json", "--tokens-per-step", "32K")
    code, out, err = run_cli(capsys, "simulate", *args)
    assert code == 0
    assert len(json.loads(out)) == 1  # the main run alone
    assert (
        "skipped at 32K tokens a step: 32K tokens a step is less than one micro-batch on each of "
        "the 8 data-parallel ranks (64K)" in err
    )


def test_training_tflops_adds_a_run_at_that_compute_rate(capsys):
    args = ("--config", "llama3.2-1b", "--mesh", "8", "--seq", "1024", "--json")
    code, out, _ = run_cli(capsys, "simulate", *args, "--training-tflops", "208.35")
    assert code == 0
    full, half = json.loads(out)
    assert (
        half["predictions"]["fsdp2-adamw"]["step_ms"]
        > full["predictions"]["fsdp2-adamw"]["step_ms"]
    )
    expected = simulate(
        PRESETS["llama3.2-1b"],
        Layout(num_shards=8),
        Workload(seq_len=1024),
        dataclasses.replace(H200, training_tflops=208.35),
    )
    assert half["predictions"]["dmuon-z3"]["step_ms"] == pytest.approx(
        expected.predictions["dmuon-z3"].step_ms
    )


def test_markdown_gives_a_column_per_variant_with_dmuon_against_fsdp2_there(capsys):
    args = ("--config", "llama3.2-1b", "--gpus", "8", "--gpus", "16", "--seq", "1024")
    variants = ("--tokens-per-step", "128K", "--training-tflops", "300")
    code, out, _ = run_cli(capsys, "simulate", *args, *variants, "--markdown")
    assert code == 0
    header, _, eight, sixteen = out.splitlines()[:4]
    assert header.endswith(
        "| dmuon vs FSDP2 at 128K tokens a step | dmuon vs FSDP2 at 300 TFLOP/s (-28% compute "
        "rate) |"
    )
    systems = ["fsdp2-adamw", "dmuon-z3", "naive-muon"]
    for line, replicas, accumulation in ((eight, 1, 16), (sixteen, 2, 8)):
        layout = Layout(num_shards=8, num_replicas=replicas)
        accumulated = simulate(
            PRESETS["llama3.2-1b"], layout, Workload(seq_len=1024, accumulation=accumulation),
            H200, systems,
        ).predictions  # fmt: skip
        slower = simulate(
            PRESETS["llama3.2-1b"], layout, Workload(seq_len=1024),
            dataclasses.replace(H200, training_tflops=300.0), systems,
        ).predictions  # fmt: skip
        ratio = accumulated["dmuon-z3"].step_ms / accumulated["fsdp2-adamw"].step_ms - 1
        other = slower["dmuon-z3"].step_ms / slower["fsdp2-adamw"].step_ms - 1
        assert line.endswith(f"| {ratio:+.1%} ({accumulation} micro-batches) | {other:+.1%} |")
        assert f"| {8 * replicas}K |" in line  # one micro-batch of 1024 tokens a rank
    assert "forward+backward at 416.7 TFLOP/s of model FLOPs" in out


def hide_matplotlib(monkeypatch) -> None:
    """Make ``import matplotlib`` fail as it does where it is not installed (a None entry in
    ``sys.modules`` raises ModuleNotFoundError), whether or not it is installed here."""
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)


def test_simulate_plot_without_matplotlib_prints_the_json_then_exits_2_with_the_install_hint(
    capsys, monkeypatch, tmp_path
):
    hide_matplotlib(monkeypatch)
    path = tmp_path / "step.png"
    args = ("simulate", "--config", "llama3.2-1b", "--gpus", "8", "--json", "--plot", str(path))
    code, out, err = run_cli(capsys, *args)
    assert code == 2
    (run,) = json.loads(out)  # the whole --json output, before the plot fails
    assert run["layout"]["world_size"] == 8
    assert set(run["predictions"]) == {"fsdp2-adamw", "dmuon-z3", "dmuon-z2", "naive-muon"}
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"dmuon-tools simulate: error: --plot {path}: the predictions are ")
    assert "pip install dmuon-tools[plots]" in err
    assert "pip install ./packages/dmuon-tools[plots]" in err
    assert not path.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "8"], "simulate needs --config (a config.json or a preset) and --mesh GxR"),
        (["--config", "llama3-8b"], "simulate needs --config (a config.json or a preset) and"),
        (["--config", "llama3-8b", "--mesh", "8y2"], "--mesh '8y2' is not GxR or G"),
        (["--config", "llama3-8b", "--gpus", "0"], "--gpus must be a positive integer, got 0"),
        (["--config", "llama3-8b", "--gpus", "8", "--tp", "2"], "--tp goes with --mesh"),
        (
            ["--config", "llama3-8b", "--mesh", "8", "--tp", "16"],
            "TP 16 spans more than one node of 8 GPUs",
        ),
        (
            ["--config", "llama3-8b", "--mesh", "8", "--systems", "fsdp2-adamw,dmuon-z4"],
            "unknown systems ['dmuon-z4']",
        ),
        (["--config", "mixtral-8x7b", "--mesh", "8"], "mixture-of-experts decoder"),
        (["--config", "gpt-5", "--mesh", "8"], "--config 'gpt-5' is neither a file nor a preset"),
        (
            ["--config", "llama3-8b", "--mesh", "8", "--machine", "b200"],
            "--machine 'b200' is neither a file nor a preset",
        ),
        (["--config", "llama3-8b", "--mesh", "8", "--seq", "0"], "seq_len must be a positive"),
        (
            ["--config", "llama3-8b", "--mesh", "8", "--accumulation", "0"],
            "workload: accumulation must be a positive integer, got 0",
        ),
        (
            ["--config", "llama3-8b", "--mesh", "8", "--tokens-per-step", "1.5M"],
            "--tokens-per-step '1.5M' is not a positive number of tokens",
        ),
        (
            ["--config", "llama3-8b", "--mesh", "8", "--tokens-per-step", "100000"],
            "--tokens-per-step 100,000 is not a whole number of micro-batches",
        ),
        (
            ["--config", "llama3-8b", "--mesh", "8", "--training-tflops", "0"],
            "--training-tflops must be positive (TFLOP/s), got 0.0",
        ),
    ],
)
def test_bad_simulate_arguments_exit_2_with_the_fix(capsys, args, message):
    code, out, err = run_cli(capsys, "simulate", *args)
    assert code == 2
    assert out == ""
    assert err.startswith("dmuon-tools simulate: error: ")
    assert len(err.strip().splitlines()) == 1
    assert message in err


def test_a_config_without_vocab_size_is_refused_with_the_key_to_add(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
        "num_attention_heads": 8,
    }))  # fmt: skip
    code, _, err = run_cli(capsys, "simulate", "--config", str(config), "--mesh", "2")
    assert code == 2
    assert 'add "vocab_size" to the config' in err


def test_a_bad_machine_file_exits_2_naming_the_key(capsys, tmp_path):
    data = H200.to_json()
    del data["network"]
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(data))
    code, _, err = run_cli(
        capsys, "simulate", "--config", "llama3-8b", "--mesh", "8", "--machine", str(path)
    )
    assert code == 2
    assert "missing network" in err and "--write-machine machine.json" in err


def test_calibrate_summarises_the_committed_results(capsys):
    code, out, _ = run_cli(capsys, "calibrate", "--results", str(RESULTS), "--json")
    assert code == 0
    report = json.loads(out)
    components = {entry["component"] for entry in report["summary"]}
    assert "whole step (world size 1)" in components
    assert report["machine"]["name"] == "h200"


def test_calibrate_without_a_results_folder_exits_2(capsys, tmp_path):
    code, out, err = run_cli(capsys, "calibrate", "--results", str(tmp_path / "nowhere"))
    assert (code, out) == (2, "")
    assert "is not a folder; pass the repository's benchmarks/results" in err
