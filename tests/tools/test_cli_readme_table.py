"""The dmuon-tools README's ``--ns-table`` example: a hand-written ``{"MxN": ms}`` table."""

import json

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
