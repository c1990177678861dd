"""dmuon-titan through torchtitan's own CheckpointManager (DCP): a resumed run continues exactly
like the uninterrupted one on the same layout and to fp32 rounding on another, and the weights
move both ways between a stock torchtitan run (FSDP2 + AdamW) and a dmuon one."""

import pytest
import torch

from tests.titan.scenarios_titan import train

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
