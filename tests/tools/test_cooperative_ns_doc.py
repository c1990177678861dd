"""``docs/cooperative-newton-schulz.md``: its cost table is what ``cooperative_ns_ms`` gives on
the H200 machine, so the design page cannot drift from the model."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmuon_tools.costs import cooperative_ns_ms, ns_batch_ms
from dmuon_tools.machine import H200, Link
from dmuon_tools.model_shapes import PRESETS
from dmuon_tools.simulator import Layout, Workload, simulate

DOC = Path(__file__).resolve().parents[2] / "docs" / "cooperative-newton-schulz.md"
MATRICES = (
    ("Llama-3-8B MLP", (4096, 14336)),
    ("Llama-3-70B MLP", (8192, 28672)),
    ("Llama-3.1-405B MLP", (16384, 53248)),
    ("Llama-3.1-405B q/o", (16384, 16384)),
)


def expected_table() -> str:
    lines = ["| matrix | k = 1 | k = 2 | k = 4 | k = 8 |", "|---|---:|---:|---:|---:|"]
    for name, shape in MATRICES:
        cells = []
        for ranks in (1, 2, 4, 8):
            replicated, split = (
                cooperative_ns_ms(H200.ns_ms, shape, ranks, H200.nvlink, split_square_work=split)
                for split in (False, True)
            )
            cells.append(f"{replicated:.1f} / {split:.1f}")
        lines.append(f"| {name}, {shape[0]} x {shape[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_the_design_pages_cost_table_is_what_the_cost_model_gives():
    text = DOC.read_text()
    start = text.index("<!-- cooperative table:")
    block = text[text.index("\n", start) + 1 : text.index("<!-- end of cooperative table -->")]
    assert block.strip() == expected_table()


def test_one_rank_is_the_plain_newton_schulz_call():
    assert cooperative_ns_ms(
        H200.ns_ms, (8192, 28672), 1, H200.nvlink, split_square_work=True
    ) == pytest.approx(ns_batch_ms(H200.ns_ms, (8192, 28672), 1))


def test_cooperation_adds_the_gram_all_reduces_and_the_split_all_gathers_by_hand():
    # A table of one point at 1 TFLOP/ms: time is FLOPs / 1e12 ms at any size.
    table = {(1000, 1000): 20 * 1000**3 / 1e12}
    link = Link(bandwidth_gbps=100.0, latency_us=0.0)
    n, m, k = 1000, 4000, 4
    gram_bytes = 2 * n * n
    all_reduce = 2 * (k - 1) / k * gram_bytes / 100e9 * 1e3
    all_gather = (k - 1) / k * gram_bytes / 100e9 * 1e3
    replicated = (6 * n * n * m / k + 14 * n**3) / 1e12 + 2 * all_reduce
    split = (6 * n * n * m + 14 * n**3) / k / 1e12 + 2 * all_reduce + 20 * all_gather
    assert cooperative_ns_ms(table, (m, n), k, link, split_square_work=False) == pytest.approx(
        replicated
    )
    assert cooperative_ns_ms(table, (n, m), k, link, split_square_work=True) == pytest.approx(split)


def test_the_design_pages_405b_table_is_what_the_simulator_predicts():
    text = DOC.read_text()
    for label, layout, digits in (
        ("512 GPUs, G 64 x R 8", Layout(num_shards=64, num_replicas=8), 1),
        ("2,048 GPUs, G 16 x R 16 x TP 8", Layout(num_shards=16, num_replicas=16, tp=8), 2),
        ("4,096 GPUs, G 8 x R 64 x TP 8", Layout(num_shards=8, num_replicas=64, tp=8), 2),
    ):
        predictions = simulate(
            PRESETS["llama3.1-405b"], layout, Workload(), H200, ["fsdp2-adamw", "dmuon-z3"]
        ).predictions
        fsdp2, dmuon = predictions["fsdp2-adamw"], predictions["dmuon-z3"]
        fits = "" if fsdp2.fits else " (does not fit)"
        row = (
            f"| {label} | {fsdp2.step_ms / 1e3:.{digits}f} s{fits} | "
            f"{dmuon.step_ms / 1e3:.{digits}f} s | "
            f"{dmuon.optimizer_ms:.0f} ms ({dmuon.optimizer_share:.1%}) |"
        )
        assert row in text, row
