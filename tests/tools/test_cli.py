"""The ``dmuon-tools`` command: ``backend`` and the ``plan`` what-ifs on presets and config files."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from dmuon_tools.cli import main

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
NS_TABLE = REPOSITORY_ROOT / "benchmarks" / "results" / "ns-h200-2026-11-29.json"

# Llama-3-8B's published config.json (the keys a real file has, most of them unused here).
LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "torch_dtype": "bfloat16",
}


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def plan_json(capsys, *args: str) -> dict:
    code, out, err = run_cli(capsys, "plan", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def ns_table_ms(candidate: str = "dmuon gram") -> dict[tuple[int, int], float]:
    rows = json.loads(NS_TABLE.read_text())["results"]
    return {tuple(sorted(r["shape"])): r["median_ms"] for r in rows if r["candidate"] == candidate}


def ns_flops(short: int, long: int) -> float:
    return 6 * short * short * long + 14 * short**3


def test_plan_of_a_preset_on_an_8x16_mesh_prints_the_partition_and_the_heaviest_owners(capsys):
    code, out, _ = run_cli(capsys, "plan", "--config", "llama3-8b", "--mesh", "8x16")
    assert code == 0
    # 32 layers x 7 projections; k_proj and v_proj (1024 x 4096 < 5M elements) share a unit.
    assert "dmuon partition: 224 params in 192 units over 128 owners (G=8 x R=16)" in out
    assert "imbalance" in out and "heaviest owners:" in out
    assert out.count("  rank ") == 5


def test_a_config_json_gives_the_same_plan_as_the_preset_of_the_same_model(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B_CONFIG))
    from_file = plan_json(capsys, "--config", str(config), "--mesh", "8x16")
    from_preset = plan_json(capsys, "--config", "llama3-8b", "--mesh", "8x16")
    assert from_file["model"]["name"] == str(config)
    assert from_file["partition"] == from_preset["partition"]
    assert from_file["load"] == from_preset["load"]
    assert from_file["model"]["shapes"] == [
        {"shape": "4096x4096", "count": 64},
        {"shape": "1024x4096", "count": 64},
        {"shape": "14336x4096", "count": 64},
        {"shape": "4096x14336", "count": 32},
    ]


def test_a_vlm_config_is_read_from_its_text_config(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llava", "text_config": LLAMA3_8B_CONFIG}))
    report = plan_json(capsys, "--config", str(tmp_path), "--mesh", "8")
    assert report["model"]["num_matrices"] == 224


def test_a_10000_rank_what_if_leaves_the_ranks_beyond_the_matrices_empty(capsys):
    report = plan_json(capsys, "--config", "llama3-70b", "--mesh", "10000")
    load = report["load"]
    # 80 layers x 7 projections, every one >= 5M elements: 560 units on 560 distinct owners.
    assert (load["num_slots"], load["num_params"], load["num_units"]) == (10000, 560, 560)
    assert load["owners_without_params"] == 10000 - 560
    assert "per_owner" not in load  # only with --all-owners
    assert report["mesh"]["num_slots"] == 10000


def test_all_owners_lists_every_owner_with_its_rank(capsys):
    load = plan_json(capsys, "--config", "qwen2.5-0.5b", "--mesh", "4x2", "--all-owners")["load"]
    assert [o["rank"] for o in load["per_owner"]] == list(range(8))
    assert [(o["shard"], o["replicate"]) for o in load["per_owner"][3:5]] == [(3, 0), (0, 1)]
    assert math.fsum(o["gflop"] for o in load["per_owner"]) == pytest.approx(load["total_gflop"])


def test_ns_table_prediction_on_one_rank_is_the_sum_of_the_measured_times(capsys):
    times = ns_table_ms()
    per_layer = 2 * times[(4096, 4096)] + 2 * times[(1024, 4096)] + 3 * times[(4096, 14336)]
    report = plan_json(capsys, "--config", "llama3-8b", "--mesh", "1", "--ns-table", str(NS_TABLE))
    predicted = report["predicted_ns"]
    assert predicted["candidate"] == "dmuon gram" and predicted["device"] == "NVIDIA H200"
    assert predicted["max_ms"] == pytest.approx(32 * per_layer, rel=1e-12)
    assert predicted["every_matrix_on_one_rank_ms"] == pytest.approx(32 * per_layer, rel=1e-12)
    assert predicted["scaled_shapes"] == []


def test_ns_table_prediction_on_8x16_spreads_the_same_total_over_the_ranks(capsys):
    report = plan_json(
        capsys, "--config", "llama3-8b", "--mesh", "8x16", "--ns-table", str(NS_TABLE)
    )
    predicted = report["predicted_ns"]
    total = predicted["every_matrix_on_one_rank_ms"]
    assert predicted["mean_ms"] * 128 == pytest.approx(total, rel=1e-12)
    assert predicted["min_ms"] <= predicted["mean_ms"] <= predicted["max_ms"]
    assert predicted["speedup_over_redundant"] == pytest.approx(total / predicted["max_ms"])
    assert predicted["heaviest"][0]["ms"] == predicted["max_ms"]


def test_shapes_missing_from_the_ns_table_are_scaled_from_the_nearest_by_flops_and_flagged(capsys):
    times = ns_table_ms()
    report = plan_json(capsys, "--config", "qwen2.5-7b", "--mesh", "8", "--ns-table", str(NS_TABLE))
    predicted = report["predicted_ns"]
    assert predicted["scaled_shapes"] == ["512x3584", "3584x3584", "3584x18944"]
    for entry in predicted["shapes"]:
        short, long = map(int, entry["shape"].split("x"))
        flops = ns_flops(short, long)
        nearest = min(times, key=lambda known: abs(math.log(ns_flops(*known) / flops)))
        expected = times[nearest] * flops / ns_flops(*nearest)
        assert entry["table_shape"] == f"{nearest[0]}x{nearest[1]}"
        assert entry["ms_each"] == pytest.approx(expected, rel=1e-12)
    code, out, _ = run_cli(
        capsys, "plan", "--config", "qwen2.5-7b", "--mesh", "8", "--ns-table", str(NS_TABLE)
    )
    assert code == 0
    assert "56 x 3584x3584: " in out and "SCALED from 4096x4096 by FLOPs" in out


def test_candidate_chooses_the_rows_of_the_ns_table(capsys):
    times = ns_table_ms("dmuon direct")
    report = plan_json(
        capsys, "--config", "llama3-8b", "--mesh", "1", "--ns-table", str(NS_TABLE),
        "--candidate", "dmuon direct",
    )  # fmt: skip
    per_layer = 2 * times[(4096, 4096)] + 2 * times[(1024, 4096)] + 3 * times[(4096, 14336)]
    assert report["predicted_ns"]["max_ms"] == pytest.approx(32 * per_layer, rel=1e-12)


def test_a_plain_shape_to_ms_table_is_accepted(capsys, tmp_path):
    table = tmp_path / "times.json"
    table.write_text(json.dumps({"4096x4096": 1.0, "1024x4096": 0.25, "14336x4096": 3.0}))
    report = plan_json(capsys, "--config", "llama3-8b", "--mesh", "1", "--ns-table", str(table))
    assert report["predicted_ns"]["max_ms"] == pytest.approx(32 * (2 + 0.5 + 9.0))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "llama3-8b", "--mesh", "8x"], "--mesh '8x' is not GxR or G"),
        (["--config", "llama3-8b", "--mesh", "0x4"], "use e.g. --mesh 8x16"),
        (["--config", "gpt-7", "--mesh", "8"], "neither a file nor a preset. Presets: llama2-7b"),
        (["--config", "llama3-8b"], "plan needs --config"),
        (
            [
                "--config",
                "llama3-8b",
                "--mesh",
                "8",
                "--ns-table",
                str(NS_TABLE),
                "--candidate",
                "x",
            ],
            "no successful measurements for candidate 'x'; its candidates are ['dmuon direct'",
        ),
    ],
    ids=["mesh-syntax", "mesh-zero", "unknown-preset", "missing-mesh", "unknown-candidate"],
)
def test_bad_plan_arguments_exit_2_with_the_fix(capsys, args, message):
    code, out, err = run_cli(capsys, "plan", *args)
    assert code == 2 and out == ""
    assert err.startswith("dmuon-tools plan: error: ") and message in err


def test_a_config_without_decoder_sizes_names_the_missing_keys(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    code, _, err = run_cli(capsys, "plan", "--config", str(config), "--mesh", "2")
    assert code == 2
    assert "the config has no intermediate_size, num_attention_heads" in err


def test_list_presets_shows_every_preset(capsys):
    code, out, _ = run_cli(capsys, "plan", "--list-presets")
    assert code == 0
    for name in ("llama3-8b", "llama3-70b", "qwen2.5-7b", "mistral-7b"):
        assert f"{name}: " in out


def test_python_m_dmuon_tools_backend_prints_the_backend_as_json():
    completed = subprocess.run(
        [sys.executable, "-m", "dmuon_tools", "backend"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(completed.stdout)
    assert report["ns_backend"].startswith("Gram NS")
    assert "cublas" in report["status"]["backends"]


def test_a_moe_preset_plans_every_expert_and_predicts_each_slice_as_its_experts_times(
    capsys, tmp_path
):
    table = tmp_path / "ns.json"
    table.write_text(
        json.dumps({"1024x4096": 0.25, "4096x4096": 1.0, "4096x28672": 8.0, "4096x14336": 5.0})
    )
    report = plan_json(capsys, "--config", "mixtral-8x7b", "--mesh", "16", "--ns-table", str(table))
    model = report["model"]
    # 32 layers x (4 attention projections + 8 experts x (gate_up, down)).
    assert model["num_matrices"] == 32 * (4 + 8 * 2)
    assert model["num_expert_stacks"] == 64
    assert {"shape": "28672x4096", "count": 256} in model["shapes"]
    assert model["numel"] == 32 * (
        2 * 4096 * 4096 + 2 * 1024 * 4096 + 8 * (28672 * 4096 + 4096 * 14336)
    )
    predicted = report["predicted_ns"]
    per_layer = 2 * 1.0 + 2 * 0.25 + 8 * (8.0 + 5.0)
    assert predicted["every_matrix_on_one_rank_ms"] == pytest.approx(32 * per_layer, rel=1e-12)
    assert predicted["mean_ms"] * 16 == pytest.approx(32 * per_layer, rel=1e-12)
    assert predicted["scaled_shapes"] == []


def test_moe_and_encoder_configs_it_cannot_model_exit_2_naming_the_model_type(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA3_8B_CONFIG, "model_type": "deepseek_v3"}))
    code, out, err = run_cli(capsys, "plan", "--config", str(config), "--mesh", "8")
    assert code == 2 and out == ""
    assert err.startswith("dmuon-tools plan: error: ")
    assert "model_type 'deepseek_v3' is not a layout dmuon-tools plan models" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            {"results": [{"shape": "4096x4096", "candidate": "dmuon gram", "median_ms": 2.7}]},
            "results[0]: shape '4096x4096' is not a list of positive integers; write it as "
            "[rows, cols]",
        ),
        (
            {"results": [{"candidate": "dmuon gram", "median_ms": 2.7}]},
            "results[0]: shape None is not a list of positive integers",
        ),
        (
            {"results": [{"shape": [4096, 4096], "candidate": "dmuon gram", "median_ms": -2}]},
            "results[0]: time -2 is not a positive number of milliseconds",
        ),
        ({"results": "none"}, "'results' must be a list of rows"),
        ({"4096x4096": -1}, "entry '4096x4096': time -1 is not a positive number of milliseconds"),
        ({"4096x4096": float("nan")}, "time nan is not a positive number of milliseconds"),
        ({"4096x4096": True}, "time True is not a positive number of milliseconds"),
        ({"4096x4096": "2.7"}, "time '2.7' is not a positive number of milliseconds"),
        ({"4096x4096": 0}, "time 0 is not a positive number of milliseconds"),
        ({"4096xabc": 1.0}, "'4096xabc' is not a shape 'MxN' of positive integers"),
    ],
    ids=[
        "string-shape", "missing-shape", "negative-bench-time", "results-not-a-list",
        "negative", "nan", "bool", "string-time", "zero", "bad-shape-key",
    ],
)  # fmt: skip
def test_a_bad_ns_table_entry_exits_2_showing_the_value(capsys, tmp_path, table, message):
    path = tmp_path / "ns.json"
    path.write_text(json.dumps(table))  # json writes nan as NaN, which json.loads reads back
    code, out, err = run_cli(
        capsys, "plan", "--config", "llama3-8b", "--mesh", "8", "--ns-table", str(path)
    )
    assert code == 2 and out == ""
    assert err.startswith("dmuon-tools plan: error: ") and message in err


@pytest.mark.parametrize("mesh", ["9999999999", "100000x1000", "1000001"])
def test_a_mesh_above_a_million_owners_exits_2_before_planning(capsys, mesh):
    code, out, err = run_cli(capsys, "plan", "--config", "llama3-8b", "--mesh", mesh)
    assert code == 2 and out == ""
    assert "more than the 1,000,000 a what-if plans" in err
    assert "use a mesh of at most that many GPUs" in err


def test_a_mesh_of_exactly_a_million_owners_is_planned(capsys):
    report = plan_json(capsys, "--config", "llama3.2-1b", "--mesh", "1000x1000")
    assert report["mesh"]["num_slots"] == 1_000_000


def test_backend_with_a_kernel_this_machine_cannot_run_still_reports_and_exits_2(
    capsys, monkeypatch
):
    import dmuon

    status = dmuon.get_backend_status()
    missing = [name for name, entry in status["backends"].items() if not entry["available"]]
    if not missing:
        pytest.skip("every NS kernel can run on this machine")
    monkeypatch.setenv("DMUON_NS_KERNEL", missing[0])
    code, out, err = run_cli(capsys, "backend")
    report = json.loads(out)
    assert code == 2
    assert report["ns_backend"] is None
    assert report["ns_backend_error"].startswith(f"DMUON_NS_KERNEL={missing[0]!r} cannot run here")
    assert report["status"]["backends"][missing[0]]["available"] is False
    assert err == f"dmuon-tools backend: error: {report['ns_backend_error']}\n"


def test_backend_with_an_unknown_kernel_name_reports_and_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("DMUON_NS_KERNEL", "bogus")
    code, out, err = run_cli(capsys, "backend")
    assert code == 2
    assert json.loads(out)["ns_backend"] is None
    assert err.startswith("dmuon-tools backend: error: environment variable DMUON_NS_KERNEL")
    assert "got 'bogus'" in err


def test_a_reader_that_leaves_early_gets_no_traceback():
    # About 160 KB of JSON: more than a pipe holds (64 KiB on Linux), so the writer is still
    # writing when the reader closes its end (as `dmuon-tools plan ... | head -1` does).
    command = [sys.executable, "-m", "dmuon_tools", "plan", "--config", "llama3-70b"]
    command += ["--mesh", "1000", "--all-owners", "--json"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        assert process.stdout.readline() == "{\n"
        process.stdout.close()
        stderr = process.stderr.read()
        code = process.wait(timeout=120)
    assert "Traceback" not in stderr and stderr == ""
    assert code == 141
