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
