"""The READMEs' tables: the dmuon-tools README's ``--ns-table`` example (a hand-written
``{"MxN": ms}`` table), and the root README's prediction table and its calibration error."""

import json
import shlex
from pathlib import Path

from dmuon_tools.cli import main

# The README's table: H200 medians of the "dmuon gram" candidate for Llama-3-8B's three shapes.
README_TABLE = {"1024x4096": 0.260, "4096x4096": 2.730, "4096x14336": 5.019}


def test_the_readme_plain_table_predicts_every_rank_from_measured_shapes_only(tmp_path, capsys):
    table = tmp_path / "ns.json"
    table.write_text(json.dumps(README_TABLE))
    code = main(["plan", "--config", "llama3-8b", "--mesh", "8", "--ns-table", str(table)])
    out = capsys.readouterr().out
    assert code == 0
    # A plain table names no candidate or device: the heading shows the file alone.
    assert f"predicted Newton-Schulz time per rank ({table}):" in out
    assert "SCALED" not in out
    assert "96 x 4096x14336: 5.019 ms each (measured)" in out


# ---- the root README's prediction table -----------------------------------------------------

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
README = REPOSITORY_ROOT / "README.md"
TABLE_MARKER = "<!-- prediction table: dmuon-tools "
TABLE_END = "<!-- end of prediction table -->"


def test_the_readme_prediction_table_is_what_its_command_prints(capsys):
    text = README.read_text()
    start = text.index(TABLE_MARKER)
    command_line = text[start + len(TABLE_MARKER) : text.index(" -->", start)]
    block = text[text.index("\n", start) + 1 : text.index(TABLE_END)]
    code = main(shlex.split(command_line))
    assert code == 0
    assert capsys.readouterr().out.strip() == block.strip()
    assert "PREDICTED by dmuon-tools simulate" in block


def test_the_readme_quotes_the_committed_calibration_error():
    summary = {
        entry["component"]: entry
        for entry in json.loads(
            (REPOSITORY_ROOT / "docs" / "simulator-calibration.json").read_text()
        )["summary"]
    }
    readme = " ".join(README.read_text().split())  # line breaks as spaces
    for component, words in (
        ("whole step (world size 1)", "on the whole step"),
        ("optimizer step (world size 1)", "on the optimizer step"),
        ("memory per GPU, peak", "on peak memory"),
    ):
        entry = summary[component]
        quoted = f"{entry['median_abs_error']:.1%} / {entry['max_abs_error']:.1%} {words}"
        assert quoted in readme, quoted
