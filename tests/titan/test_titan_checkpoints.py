"""dmuon-titan through torchtitan's own CheckpointManager (DCP): a resumed run continues exactly
like the uninterrupted one on the same layout and to fp32 rounding on another, and the weights
move both ways between a stock torchtitan run (FSDP2 + AdamW) and a dmuon one."""

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.titan.scenarios_titan import model_wrapper_entries, train, train_error

# fp32 Newton-Schulz; the runs differ by the order of float additions after the load (2 ranks
# against HSDP 2 x 2): within 1e-5 relative, the bound a resume on another layout must meet.
FP32_TOLERANCE = 1e-5


def assert_equal_weights(weights: dict, expected: dict) -> None:
    assert weights.keys() == expected.keys()
    different = [name for name, value in weights.items() if not torch.equal(value, expected[name])]
    assert not different, different


# The uninterrupted run both resume tests compare against, with checkpoints at steps 2 and 4.
SAVING = {"steps": 4, "ns": "fp32", "checkpoint_folder": "ckpt", "checkpoint_interval": 2}


@pytest.fixture(scope="module")
def uninterrupted(pool2, tmp_path_factory) -> tuple[dict, str]:
    """One 4-step run on 2 ranks and its checkpoint root, shared by the resume tests (each
    resumes from step 2; their own step-4 checkpoints overwrite nothing a later test loads)."""
    root = str(tmp_path_factory.mktemp("uninterrupted"))
    return pool2.run(train, job_options=SAVING, checkpoint_root=root)[0], root


def test_a_run_resumed_from_its_checkpoint_continues_bit_for_bit(pool2, uninterrupted):
    run, root = uninterrupted
    resumed = pool2.run(train, job_options={**SAVING, "load_step": 2}, checkpoint_root=root)[0]
    assert resumed["first_step"] == 3
    assert resumed["logged"] == run["logged"][2:]
    assert_equal_weights(resumed["final"], run["final"])


def test_a_run_resumed_on_another_layout_continues_like_the_uninterrupted_one(pool4, uninterrupted):
    # The same global batch of 4 sequences: 2 ranks x 2, then HSDP (2 replicas x 2 shards) x 1.
    run, root = uninterrupted
    resumed = pool4.run(
        train,
        job_options={**SAVING, "load_step": 2, "dp_replicate": 2, "dp_shard": 2, "local_batch": 1},
        checkpoint_root=root,
    )[0]
    assert resumed["first_step"] == 3
    for name, value in resumed["final"].items():
        expected = run["final"][name]
        assert ((value - expected).norm() / expected.norm()).item() < FP32_TOLERANCE, name


def test_weights_move_both_ways_between_stock_torchtitan_and_dmuon(pool2, tmp_path):
    stock = {"steps": 2, "dmuon": False, "checkpoint_folder": "stock"}
    stock_run = pool2.run(train, job_options=stock, checkpoint_root=str(tmp_path))[0]
    # dmuon starts from the stock run's weights (the model alone: AdamW's state is not Muon's)...
    dmuon_job = {"steps": 3, "checkpoint_folder": "stock", "load_step": 2, "load_model_only": True}
    dmuon_run = pool2.run(train, job_options=dmuon_job, checkpoint_root=str(tmp_path))[0]
    assert_equal_weights(dmuon_run["initial"], stock_run["final"])
    assert dmuon_run["dedicated"]
    # ... and its checkpoint (written at its last step, 3, into the same folder) gives a stock
    # run its weights back.
    back = {"steps": 1, "dmuon": False, "checkpoint_folder": "stock", "load_step": 3}
    back_run = pool2.run(
        train, job_options={**back, "load_model_only": True}, checkpoint_root=str(tmp_path)
    )[0]
    assert_equal_weights(back_run["initial"], dmuon_run["final"])


def test_resuming_a_stock_checkpoint_with_dmuon_names_the_flag_that_loads_it(pool2, tmp_path):
    stock = {"steps": 2, "dmuon": False, "checkpoint_folder": "stock", "ns": "fp32"}
    stock_run = pool2.run(train, job_options=stock, checkpoint_root=str(tmp_path))[0]
    resume = {"steps": 3, "checkpoint_folder": "stock", "load_step": 2, "ns": "fp32"}
    messages = pool2.run(train_error, job_options=resume, checkpoint_root=str(tmp_path))
    for message in messages:
        assert "has no dmuon optimizer state: DCP finds no momentum_buffer for layers." in message
        assert "--checkpoint.exclude_from_loading optimizer" in message
    # The flag the message names resumes it: the weights, the schedule and the data position.
    flagged = {**resume, "exclude_from_loading": ["optimizer"]}
    run = pool2.run(train, job_options=flagged, checkpoint_root=str(tmp_path))[0]
    assert run["first_step"] == 3
    assert_equal_weights(run["initial"], stock_run["final"])


# ---- a MoE model (qwen3's debug MoE, a few small experts), its expert stacks as dmuon pieces ----

MOE = {"model": "qwen3_moe", "ns": "fp32"}


def test_torchtitans_model_wrapper_takes_the_expert_stacks_entries_of_a_moe_model(pool2):
    # The wrapper caches the state dict and compares each entry's storage with the cached
    # one's at every save; the entries are dmuon's sharded stacks (each rank's expert pieces).
    per_rank = pool2.run(model_wrapper_entries, job_options=MOE)
    for rank, entries in enumerate(per_rank):
        assert len(entries) == 2 * 3, (rank, sorted(entries))  # w1, w2, w3 of both blocks
        for key, entry in entries.items():
            assert entry["same_cached_entry"], (rank, key)
            assert entry["storage"] == entry["chunk_storages"][0], (rank, key)
            assert entry["full_tensor_equal"] is not False, (rank, key)
    assert all(entry["full_tensor_equal"] for entry in per_rank[0].values())


def test_a_moe_run_saves_at_its_interval_exports_and_resumes_bit_for_bit(pool2, tmp_path):
    saving = {**MOE, "steps": 4, "checkpoint_folder": "ckpt", "checkpoint_interval": 2}
    run = pool2.run(
        train, job_options={**saving, "export_dtype": "float16"}, checkpoint_root=str(tmp_path)
    )[0]
    # torchtitan's final export (the model alone, in float16) holds the full expert stacks.
    exported = tmp_path / "exported.pt"
    dcp_to_torch_save(str(tmp_path / "ckpt" / "step-4"), str(exported))
    export = torch.load(exported, weights_only=True)
    stack = "layers.1.moe.routed_experts.inner_experts.w2_EDF"
    assert export[stack].dtype == torch.float16
    assert torch.equal(export[stack], run["final"][stack].half())
    # The interval checkpoint of step 2 resumes the run.
    resumed = pool2.run(
        train, job_options={**saving, "load_step": 2}, checkpoint_root=str(tmp_path)
    )
    resumed = resumed[0]
    assert resumed["first_step"] == 3
    assert resumed["logged"] == run["logged"][2:]
    assert_equal_weights(resumed["final"], run["final"])


@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3"])
def test_a_distmuon_recipe_job_resumed_at_step_3_repeats_steps_4_to_6(pool2, tmp_path, model):
    recipe = {"model": model, "distmuon_recipe": True, "ns": "fp32", "steps": 6}
    saving = {**recipe, "checkpoint_folder": "ckpt", "checkpoint_interval": 3}
    run = pool2.run(train, job_options=saving, checkpoint_root=str(tmp_path))[0]
    resumed = pool2.run(
        train, job_options={**saving, "load_step": 3}, checkpoint_root=str(tmp_path)
    )
    resumed = resumed[0]
    assert resumed["first_step"] == 4
    assert resumed["logged"] == run["logged"][3:]
    assert_equal_weights(resumed["final"], run["final"])
