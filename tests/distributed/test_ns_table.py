"""The Newton-Schulz counts where the routing table is printed: ``optimizer.routing()`` is the
same on every rank and the counts are not (each owner counts its own matrices), so
``dmuon.inspect.owners_newton_schulz_counts`` gathers each matrix's count from its owner and
``dmuon.inspect.newton_schulz_table`` prints them beside the routing table, the same on every
rank, on gloo and in one process."""

from __future__ import annotations

import pytest

import dmuon.inspect
from tests.distributed import scenarios_checkpoint
from tests.distributed import scenarios_ns_table as scenarios

STEPS = 3


def summed_over_ranks(results: list[dict]) -> dict:
    """The reference: every rank's own counts, added up per matrix (per expert, per block)."""
    total: dict = {}
    for result in results:
        for fqn, count in result["own"].items():
            values = count if isinstance(count, tuple) else (count,)
            previous = total.get(fqn, (0,) * len(values))
            total[fqn] = tuple(a + b for a, b in zip(previous, values, strict=True))
    return {fqn: values if len(values) > 1 else values[0] for fqn, values in total.items()}


@pytest.mark.parametrize(
    ("world_size", "replicas", "row_blocks"),
    [(2, 1, False), (2, 1, True), (4, 2, False)],
    ids=["1d-2", "1d-2-row-blocks", "hsdp-2x2"],
)
def test_every_rank_gets_each_owners_count_and_the_same_table(
    gloo_pool, world_size, replicas, row_blocks
):
    results = gloo_pool(world_size).run(
        scenarios.gathered, steps=STEPS, replicas=replicas, row_blocks=row_blocks
    )
    expected = summed_over_ranks(results)
    for result in results:
        assert result["gathered"] == expected
        assert result["table"] == results[0]["table"]
    # Each matrix (each row block) got one Newton-Schulz a step from its owner.
    assert all(
        set(count if isinstance(count, tuple) else (count,)) == {STEPS}
        for count in expected.values()
    )
    lines = results[0]["table"].splitlines()
    assert lines[0].split() == ["parameter", "shape", "owner", "newton-schulz", "outputs"]
    assert [line.split()[0] for line in lines[2:]] == results[0]["muon"]
    assert all(line.split()[3] == str(STEPS) for line in lines[2:])
    if row_blocks:  # 5 heads of 6 rows
        q_proj = next(line for line in lines if line.startswith("layers.0.q_proj.weight "))
        assert q_proj.endswith(f"{STEPS} each of 5")


def test_in_one_process_the_gathered_counts_are_the_processs_own_and_the_table_shows_them():
    model, optimizer = scenarios_checkpoint.build(replicas=0)
    scenarios_checkpoint.train(model, optimizer, range(STEPS))
    own = dmuon.inspect.newton_schulz_counts(optimizer)
    assert dmuon.inspect.owners_newton_schulz_counts(optimizer) == own
    lines = dmuon.inspect.newton_schulz_table(optimizer).splitlines()
    assert len(lines) == 2 + len(own)
    for line, (fqn, count) in zip(lines[2:], own.items(), strict=True):
        assert line.split()[0] == fqn and line.split()[-1] == str(count) == str(STEPS)
