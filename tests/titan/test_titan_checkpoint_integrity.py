"""dmuon-titan's checkpoints carry dmuon's checksums (issue 43 item 5, the torchtitan path):
torchtitan's own ``CheckpointManager`` saves them (interval saves, async saves, the last step's
export) with ``dmuon.checkpoint``'s writer and resumes with its reader, so a byte changed on disk
raises ``CheckpointIntegrityError`` naming the file on every rank instead of loading."""

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import dmuon.checkpoint
from tests.titan.scenarios_titan import train
from tests.titan.scenarios_titan_async import train_with_async_checkpoints
from tests.titan.scenarios_titan_integrity import resume_integrity_error
from tests.titan.test_titan_checkpoints import assert_equal_weights

# Checkpoints at step 2 (the full training state) and 4 (the last step: the model alone, in
# float16, torchtitan's export).
SAVING = {
    "steps": 4,
    "ns": "fp32",
    "checkpoint_folder": "ckpt",
    "checkpoint_interval": 2,
    "export_dtype": "float16",
}
RESUME = {**SAVING, "load_step": 2}


@pytest.fixture(scope="module")
def uninterrupted(pool2, tmp_path_factory) -> tuple[dict, Path]:
    """One 4-step run on 2 ranks and its checkpoint root; each test resumes from a copy."""
    root = tmp_path_factory.mktemp("uninterrupted")
    return pool2.run(train, job_options=SAVING, checkpoint_root=str(root))[0], root


def copy_of(root: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "root"
    shutil.copytree(root, copy)
    return copy


def flip_a_byte_of_a_shard(checkpoint: Path) -> Path:
    """One bit of the byte in the middle of the second rank's shard, inverted; the shard."""
    shard = checkpoint / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    return shard


def test_every_checkpoint_of_a_run_has_checksums_and_the_export_matches_them(
    uninterrupted, tmp_path
):
    run, root = uninterrupted
    for step in (2, 4):
        assert (root / "ckpt" / f"step-{step}" / ".checksums.json").is_file(), step
    # The float16 export loads through dmuon's checked load without a warning (its checksums
    # hold), as stock DCP reads it...
    export = root / "ckpt" / "step-4"
    dcp_to_torch_save(str(export), str(tmp_path / "export.pt"))
    stock = torch.load(tmp_path / "export.pt", weights_only=True)
    checked = {key: torch.empty_like(value) for key, value in stock.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dmuon.checkpoint.load(checked, export)
    assert_equal_weights(checked, stock)
    # ... and holds the run's final weights in float16.
    for name, value in run["final"].items():
        assert torch.equal(checked[name], value.half()), name


def test_a_run_resumed_from_its_checked_checkpoint_continues_bit_for_bit(
    pool2, uninterrupted, tmp_path
):
    run, root = uninterrupted
    resumed = pool2.run(train, job_options=RESUME, checkpoint_root=str(copy_of(root, tmp_path)))
    resumed = resumed[0]
    assert resumed["first_step"] == 3
    assert resumed["logged"] == run["logged"][2:]
    assert_equal_weights(resumed["final"], run["final"])


def test_resuming_from_a_shard_with_one_flipped_byte_raises_naming_the_file_on_every_rank(
    pool2, uninterrupted, tmp_path
):
    _, root = uninterrupted
    copy = copy_of(root, tmp_path)
    shard = flip_a_byte_of_a_shard(copy / "ckpt" / "step-2")
    messages = pool2.run(resume_integrity_error, job_options=RESUME, checkpoint_root=str(copy))
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} resumed from the damaged checkpoint"
        assert "is damaged (nothing was loaded from it)" in message, (rank, message)
        assert f"{shard}: changed after it was written" in message, (rank, message)


def test_an_async_checkpoint_carries_checksums_and_a_flipped_byte_raises_at_resume(pool2, tmp_path):
    saving = {key: value for key, value in SAVING.items() if key != "export_dtype"}
    pool2.run(train_with_async_checkpoints, job_options=saving, checkpoint_root=str(tmp_path))
    checkpoint = tmp_path / "ckpt" / "step-2"
    assert (checkpoint / ".checksums.json").is_file()
    shard = flip_a_byte_of_a_shard(checkpoint)
    messages = pool2.run(
        resume_integrity_error,
        job_options={**saving, "load_step": 2},
        checkpoint_root=str(tmp_path),
        asynchronous=True,
    )
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} resumed from the damaged checkpoint"
        assert f"{shard}: changed after it was written" in message, (rank, message)
