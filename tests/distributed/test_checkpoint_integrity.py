"""A checkpoint that changed on disk after it was written never loads silently (on gloo, 2 ranks).

``dmuon.checkpoint.save`` keeps a crc32 of every item it writes beside DCP's ``.metadata``;
``load`` checks each file and item it reads on every rank, and agrees over the ranks, before any
value reaches a parameter: a flipped byte, a truncated shard or a junk ``.metadata`` raises on
every rank naming the file, with nothing changed. A checkpoint without checksums (stock torch)
loads, with a warning that it cannot be verified.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from dmuon.checkpoint import CheckpointIntegrityError, _integrity
from dmuon.checkpoint._integrity import CHECKSUMS_FILE
from tests.distributed import scenarios_checkpoint
from tests.distributed import scenarios_checkpoint_integrity as scenarios


@pytest.fixture(scope="module")
def pristine(pool2, tmp_path_factory):
    """The checkpoint ``dmuon.checkpoint.save`` wrote on 2 ranks after ``SAVE_AT`` steps, and the
    uninterrupted run's final weights."""
    path = tmp_path_factory.mktemp("integrity") / "checkpoint"
    result = pool2.run(scenarios_checkpoint.save_midway_and_finish, path=str(path))[0]
    return path, result["weights"]


@pytest.fixture
def copy(pristine, tmp_path) -> Path:
    """A copy of the pristine checkpoint, for a test to damage."""
    path = tmp_path / "checkpoint"
    shutil.copytree(pristine[0], path)
    return path


def largest_tensor_item(path: Path, file: str) -> tuple[str, int, int]:
    """``(fqn, offset, length)`` of the largest item ``file`` holds, from DCP's metadata."""
    metadata = pickle.loads((path / ".metadata").read_bytes())
    items = [
        (index.fqn, info.offset, info.length)
        for index, info in metadata.storage_data.items()
        if info.relative_path == file
    ]
    return max(items, key=lambda item: item[2])


def test_an_untouched_checkpoint_resumes_bit_identically_and_without_a_warning(pool2, pristine):
    # resume_and_finish turns any warning into an error: a verified load warns of nothing.
    path, uninterrupted = pristine
    assert (path / CHECKSUMS_FILE).is_file()
    resumed = pool2.run(scenarios_checkpoint.resume_and_finish, path=str(path))[0]
    for key, value in uninterrupted.items():
        assert torch.equal(resumed["weights"][key], value), key


def test_a_flipped_byte_in_one_ranks_shard_raises_on_every_rank_naming_the_file_and_changes_nothing(
    pool2, copy
):
    # __1_0.distcp holds what rank 1 wrote; on the same layout only rank 1 reads it, so rank 0
    # learns of the damage from the agreement alone.
    fqn, offset, length = largest_tensor_item(copy, "__1_0.distcp")
    shard = copy / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[offset + length // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    results = pool2.run(scenarios.load_into_a_trained_model, path=str(copy))
    for rank, result in enumerate(results):
        assert result["type"] == "CheckpointIntegrityError", (rank, result["error"])
        assert f"{shard}: changed after it was written: {fqn}" in result["error"]
        assert "nothing was loaded" in result["error"]
        assert result["changed"] == [], rank
    assert "(found on rank 1 of the group)" in results[0]["error"]


@pytest.mark.parametrize("checksums", [True, False], ids=["dmuon", "without-checksums"])
def test_a_truncated_shard_raises_dmuons_message_naming_it_on_every_rank(pool2, copy, checksums):
    if not checksums:
        (copy / CHECKSUMS_FILE).unlink()
    shard = copy / "__0_0.distcp"
    size = shard.stat().st_size
    with shard.open("r+b") as stream:
        stream.truncate(size // 2)
    results = pool2.run(scenarios.load_into_a_trained_model, path=str(copy))
    for rank, result in enumerate(results):
        assert result["type"] == "CheckpointIntegrityError", (rank, result["error"])
        assert f"{shard}: truncated: {size // 2} bytes" in result["error"]
        assert result["changed"] == [], rank


@pytest.mark.parametrize(
    ("checksums", "says"),
    [
        (True, ".metadata changed after it was written (16 bytes"),
        (False, ".metadata is not a torch.distributed.checkpoint metadata file (unpickling it"),
    ],
    ids=["dmuon", "without-checksums"],
)
def test_a_junk_metadata_file_raises_dmuons_message_naming_it_on_every_rank(
    pool2, copy, checksums, says
):
    if not checksums:
        (copy / CHECKSUMS_FILE).unlink()
    (copy / ".metadata").write_bytes(b"not a checkpoint")
    for rank, result in enumerate(pool2.run(scenarios.load_into_a_trained_model, path=str(copy))):
        assert result["type"] == "CheckpointIntegrityError", (rank, result["error"])
        assert f"{copy / '.metadata'}" in result["error"] and says in result["error"]
        assert result["changed"] == [], rank


def test_a_mistyped_path_says_no_such_checkpoint_with_the_path_and_what_is_beside_it(pool2, copy):
    mistyped = copy.with_name("checkpont")
    for result in pool2.run(scenarios.load_into_a_trained_model, path=str(mistyped)):
        assert result["type"] == "FileNotFoundError"
        assert f"no such checkpoint: {mistyped} does not exist" in result["error"]
        assert f"{copy.parent} holds the checkpoints: checkpoint" in result["error"]
        assert result["changed"] == []


def test_a_flipped_byte_raises_on_another_layout_too(copy):
    # One process reads every item of both ranks' files, resharding them.
    fqn, offset, length = largest_tensor_item(copy, "__0_0.distcp")
    shard = copy / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[offset + length // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=f"changed after it was written: {fqn} "):
        scenarios_checkpoint.load_in_one_process(str(copy))


def test_items_past_the_held_bytes_limit_are_read_again_and_load_the_same_values(
    pristine, monkeypatch
):
    path, _ = pristine
    held = scenarios_checkpoint.load_in_one_process(str(path))
    monkeypatch.setattr(_integrity, "HELD_BYTES_LIMIT", 0)  # every item checked, then read again
    read_twice = scenarios_checkpoint.load_in_one_process(str(path))
    for key, value in held.items():
        assert torch.equal(read_twice[key], value), key


def edit_one_checksum(text: str) -> str:
    document = json.loads(text)
    items = next(iter(document["files"].values()))["items"]
    items[0][2] ^= 1
    return json.dumps(document)


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda text: "[]", "is not a dmuon checksum file (AttributeError"),
        (edit_one_checksum, "its own crc32 does not match: it changed after it was written"),
    ],
    ids=["junk", "one-checksum-edited"],
)
def test_a_damaged_checksum_file_raises_naming_it_and_blames_no_data_file(copy, damage, says):
    # One process is enough: the file is read before any other.
    checksums = copy / CHECKSUMS_FILE
    checksums.write_text(damage(checksums.read_text()))
    with pytest.raises(CheckpointIntegrityError) as raised:
        scenarios_checkpoint.load_in_one_process(str(copy))
    assert f"{checksums} is not a dmuon checksum file" in str(raised.value)
    assert says in str(raised.value) and ".distcp" not in str(raised.value)


def test_a_checkpoint_without_checksums_loads_like_the_uninterrupted_run_and_warns_once(
    pool2, tmp_path
):
    path = tmp_path / "stock"
    uninterrupted = pool2.run(scenarios.save_with_torch_midway_and_finish, path=str(path))[0]
    assert not (path / CHECKSUMS_FILE).exists()
    results = pool2.run(scenarios.resume_recording_warnings, path=str(path))
    for result in results:
        assert len(result["warnings"]) == 1
        assert f"{path} has no {CHECKSUMS_FILE}" in result["warnings"][0]
        assert "cannot be verified" in result["warnings"][0]
    for key, value in uninterrupted["weights"].items():
        assert torch.equal(results[0]["weights"][key], value), key
