"""``optimizer.routing()`` and the Newton-Schulz table under expert parallelism on gloo
(issue 42, item 1): a rank holds only its EP slot's experts, yet every rank lists every piece of
every expert stack with its owner, the same rows on every rank."""

from __future__ import annotations

from dmuon.routing import ExpertSliceOwner
from tests.distributed import scenarios_expert_parallel_inspect as scenarios

STACKS = ("layers.0.w_in", "layers.0.w_out", "layers.1.w_in", "layers.1.w_out")
STEPS = 2


def test_routing_lists_every_piece_of_every_ep_slot_with_its_owner_the_same_on_every_rank(pool4):
    results = pool4.run(scenarios.routing_and_table, steps=STEPS)
    rows = results[0]["rows"]
    assert all(result["rows"] == rows for result in results)
    # What dedicate_params decided for each rank's own pieces, merged over the ranks.
    decided = {}
    for result in results:
        decided.update(result["local_owners"])
    by_fqn = {row[0]: row for row in rows}
    for stack in STACKS:
        owner = by_fqn[stack][3]
        assert [(piece.start, piece.stop) for piece in owner] == [(0, 2), (2, 4), (4, 6), (6, 8)]
        assert all(isinstance(piece, ExpertSliceOwner) for piece in owner)
        for piece in owner:
            assert piece.rank == decided[f"{stack}[{piece.start}:{piece.stop}]"]
            assert piece.rank % 2 == piece.start // 4  # EP slot e: ranks e, e + 2


def test_the_newton_schulz_table_shows_every_expert_counted_by_its_owner_on_every_rank(pool4):
    results = pool4.run(scenarios.routing_and_table, steps=STEPS)
    table = results[0]["table"]
    assert all(result["table"] == table for result in results)
    lines = {line.split()[0]: line for line in table.splitlines()[2:]}
    for stack in STACKS:
        assert lines[stack].endswith(f"{STEPS} each of 8"), lines[stack]
