"""dmuon on slices of larger named meshes.

dmuon is given one dim of a 2-D ("dp", "tp") or ("pp", "dp") mesh on 4 gloo processes; every rank
must create the same groups in the same order (else the ranks block in mismatched ``new_group``
calls) and each data-parallel slice must train like its own single-process reference. The
timeouts of the groups dmuon creates (also on a slice of a 3-D mesh) and a stalled peer:
``tests/reliability/test_timeouts.py``.

HSDP is recognised by structure, not by name: any two dims work, their roles given by the
argument they are passed as, including torchtitan's (dp_replicate, dp_shard, cp, tp) mesh with
``fsdp`` = dp_shard x cp flattened. Giving dmuon fewer data-parallel dims than FSDP2 shards over
(the replicate dim forgotten, dp_shard where FSDP2 has fsdp) must raise on every rank, naming
both meshes and the fix: each replica would otherwise own and step its own copy.
"""

import pytest

from tests.distributed.scenarios_meshes import (
    context_parallel_flattened,
    forgotten_replicate_dim,
    torchtitan_3d,
    train_hsdp_on_named_dims,
    train_on_the_dp_dim_of_a_2d_mesh,
)
from tests.distributed.scenarios_protocol import train_against_reference
from tests.distributed.test_protocol import (
    FP32_TOLERANCE,
    assert_bit_identical,
    assert_matches_reference,
    owned_masters_and_losses,
)

POLICIES = ["isolated", "shared"]


@pytest.mark.parametrize("process_group_policy", POLICIES)
def test_the_dp_dim_of_a_dp_tp_mesh_trains_like_the_single_process_reference(
    pool4, process_group_policy
):
    results = pool4.run(
        train_on_the_dp_dim_of_a_2d_mesh,
        dims=("tp", "dp"),
        process_group_policy=process_group_policy,
    )
    assert_matches_reference(results, FP32_TOLERANCE)
    # mesh[[tp][dp]] = [[0, 1], [2, 3]]: the dp slices are {0, 1} and {2, 3}.
    for rank, result in enumerate(results):
        dp_slice = [0, 1] if rank < 2 else [2, 3]
        assert result["rank_grid"] == [dp_slice]
        assert result["world_group_ranks"] == dp_slice


@pytest.mark.parametrize("process_group_policy", POLICIES)
def test_each_pipeline_stage_trains_its_own_model_on_its_own_dp_slice(pool4, process_group_policy):
    # The stages' models differ (2 and 3 layers): one rank-agreement check or gradient norm over
    # the whole world would mix them. Clipping every step makes a norm from the wrong ranks show.
    results = pool4.run(
        train_on_the_dp_dim_of_a_2d_mesh,
        dims=("pp", "dp"),
        process_group_policy=process_group_policy,
        layers_per_stage=(2, 3),
        clip_max_norm=0.05,
    )
    assert_matches_reference(results, FP32_TOLERANCE)
    assert [result["stage"] for result in results] == [0, 0, 1, 1]
    for rank, result in enumerate(results):
        stage_ranks = [0, 1] if rank < 2 else [2, 3]
        assert result["world_group_ranks"] == stage_ranks


def test_the_dp_dim_that_is_not_the_last_dim_gets_the_ranks_of_its_column(pool4):
    # ("dp", "tp"): mesh[dp][tp] = [[0, 1], [2, 3]], so rank 0's dp slice is {0, 2}.
    results = pool4.run(
        train_on_the_dp_dim_of_a_2d_mesh,
        dims=("dp", "tp"),
        process_group_policy="isolated",
        steps=2,
    )
    assert_matches_reference(results, FP32_TOLERANCE)
    for rank, result in enumerate(results):
        assert result["world_group_ranks"] == [rank % 2, rank % 2 + 2]


# ---- HSDP by structure ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicate_shard_run(pool4):
    """The ("replicate", "shard") HSDP run every other naming must reproduce bit for bit."""
    return pool4.run(train_against_reference, replicas=2, steps=4)


def test_hsdp_on_dims_named_dp_replicate_and_dp_shard_trains_like_replicate_and_shard(
    pool4, replicate_shard_run
):
    results = pool4.run(
        train_hsdp_on_named_dims,
        dims=("dp_replicate", "dp_shard"),
        shard_dim="dp_shard",
        replicate_dim="dp_replicate",
    )
    assert_matches_reference(results, FP32_TOLERANCE)
    assert_bit_identical(
        owned_masters_and_losses(replicate_shard_run), owned_masters_and_losses(results)
    )
    for rank, result in enumerate(results):
        assert result["owners"] == replicate_shard_run[rank]["owners"]
        assert result["rank_grid"] == [[0, 1], [2, 3]]


def test_the_roles_follow_the_arguments_not_the_names_when_the_names_are_swapped(
    pool4, replicate_shard_run
):
    # dim 0 (FSDP2's replicate dim) is named "shard" and passed as replicate_mesh.
    results = pool4.run(
        train_hsdp_on_named_dims,
        dims=("shard", "replicate"),
        shard_dim="replicate",
        replicate_dim="shard",
    )
    assert_matches_reference(results, FP32_TOLERANCE)
    assert_bit_identical(
        owned_masters_and_losses(replicate_shard_run), owned_masters_and_losses(results)
    )
    assert all(result["rank_grid"] == [[0, 1], [2, 3]] for result in results)


def test_a_forgotten_replicate_dim_raises_on_every_rank_naming_both_meshes_and_the_fix(pool4):
    messages = pool4.run(forgotten_replicate_dim)
    for rank, message in enumerate(messages):
        replica = [0, 1] if rank < 2 else [2, 3]
        other = [2, 3] if rank < 2 else [0, 1]
        assert message.startswith("dmuon.Muon: FSDP2 shards "), (rank, message)
        assert (
            "over the data-parallel mesh dims ('dp_replicate', 'dp_shard') spanning ranks "
            "[0, 1, 2, 3], but dedicate_params was given mesh ('dp_shard',) and no "
            f"replicate_mesh: its ownership grid spans ranks {replica}. Ranks {other} would be "
            "replicas that own and update their own copies of the dedicated weights"
        ) in message, (rank, message)
        assert message.endswith(
            "Give dedicate_params the data-parallel dims fully_shard got: "
            'dmuon.dedicate_params(model, mesh["dp_shard"], predicate, '
            'replicate_mesh=mesh["dp_replicate"]).'
        ), (rank, message)


def test_a_ddp_over_more_ranks_than_dmuons_mesh_raises_on_every_rank_with_the_fix(pool4):
    messages = pool4.run(forgotten_replicate_dim, wrapper="ddp")
    for rank, message in enumerate(messages):
        replica = [0, 1] if rank < 2 else [2, 3]
        assert message.startswith(
            "dmuon.Muon: the DistributedDataParallel around this model averages over its "
            "process group spanning ranks [0, 1, 2, 3], but dedicate_params was given mesh "
            f"('dp_shard',) and no replicate_mesh: its ownership grid spans ranks {replica}."
        ), (rank, message)
        assert message.endswith(
            "the whole data-parallel mesh (a 1-D mesh over ranks [0, 1, 2, 3]) as mesh, e.g. "
            "dmuon.dedicate_params_ddp(model, mesh, predicate), which also wraps the model in "
            "DDP over that mesh's group."
        ), (rank, message)


def test_context_parallel_refuses_the_unflattened_shard_dim_and_trains_on_the_flattened_one(
    pool4,
):
    refused = pool4.run(context_parallel_flattened, dedicated_dim="dp_shard")
    for rank, result in enumerate(refused):
        # mesh (dp_replicate 1, dp_shard 2, cp 2, tp 1): dp_shard pairs ranks {0, 2}, {1, 3}.
        mine = [0, 2] if rank % 2 == 0 else [1, 3]
        assert (
            "over the data-parallel mesh dims ('fsdp',) spanning ranks [0, 1, 2, 3], but "
            f"dedicate_params was given mesh ('dp_shard',) and no replicate_mesh: its "
            f"ownership grid spans ranks {mine}"
        ) in result["error"], (rank, result["error"])
        assert result["error"].endswith('dmuon.dedicate_params(model, mesh["fsdp"], predicate).')
    trained = pool4.run(context_parallel_flattened, dedicated_dim="fsdp")
    assert all(result["error"] is None for result in trained)
    assert_matches_reference(trained, FP32_TOLERANCE)


def test_torchtitans_3d_mesh_trains_like_the_reference_with_fsdp_and_dp_replicate(pool8):
    results = pool8.run(torchtitan_3d, dedicated_dims=("fsdp", "dp_replicate"))
    assert all(result["error"] is None for result in results)
    assert_matches_reference(results, FP32_TOLERANCE)
    # mesh (dp_replicate 2, dp_shard 1, cp 2, tp 2): rank = 4 r + 2 c + t.
    for rank, result in enumerate(results):
        tp = rank % 2
        assert result["rank_grid"] == [[tp, tp + 2], [tp + 4, tp + 6]]
        assert result["tp_ranks"] == [rank - tp, rank - tp + 1]


@pytest.mark.parametrize(
    "dedicated_dims",
    [("dp_shard", "dp_replicate"), ("fsdp", None)],
    ids=["dp_shard", "no_replicate"],
)
def test_torchtitans_3d_mesh_refuses_fewer_data_parallel_dims_than_fsdp2_has(pool8, dedicated_dims):
    results = pool8.run(torchtitan_3d, dedicated_dims=dedicated_dims)
    for rank, result in enumerate(results):
        tp = rank % 2
        # The TP dim is left out: FSDP2's data-parallel ranks are this TP coordinate's.
        assert (
            "over the data-parallel mesh dims ('dp_replicate', 'fsdp') spanning ranks "
            f"{[tp, tp + 2, tp + 4, tp + 6]}"
        ) in result["error"], (rank, result["error"])
        assert result["error"].endswith(
            'dmuon.dedicate_params(model, mesh["fsdp"], predicate, '
            'replicate_mesh=mesh["dp_replicate"]).'
        ), (rank, result["error"])
