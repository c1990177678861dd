"""Checkpoint folders: ``torch.distributed.checkpoint`` save and load, committed atomically and
checked against what is loaded.

Owns the folder protocol and the load-time checks; the state dicts come from ``_model`` and
``_optim`` (or anywhere: any DCP state dict works), the checksums and the reading of the files
from ``_integrity`` ([Note: checkpoint checksums]).

[Note: atomic commit]
``save`` writes into ``.<name>.incomplete`` beside the target and, once every rank's data and
the metadata are written, the first rank renames it into place (an earlier checkpoint of that
name is moved aside first and removed after). A rank killed during a save leaves only the
``.incomplete`` folder, which ``load`` never reads; the target is either the previous complete
checkpoint or absent. ``load`` refuses a folder without DCP's ``.metadata`` (written last) and
says "no such checkpoint" for a path that does not exist.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dmuon._torch_internals import flatten_state_dict
from dmuon.checkpoint._integrity import (
    METADATA_FILE,
    CheckpointIntegrityError,
    ChecksummingWriter,
    VerifyingReader,
    missing_checkpoint,
    raise_on_every_rank,
    read_checksums,
    read_metadata,
    warn_unverifiable,
)

INCOMPLETE_PREFIX = "."
INCOMPLETE_SUFFIX = ".incomplete"


def save(
    state_dict: dict[str, object],
    checkpoint_id: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """``torch.distributed.checkpoint.save`` into ``checkpoint_id``, committed atomically, with
    a checksum of every item written.

    Collective over ``process_group`` (default: every rank). See [Note: atomic commit] and
    [Note: checkpoint checksums].
    """
    target = Path(checkpoint_id)
    staging = target.with_name(f"{INCOMPLETE_PREFIX}{target.name}{INCOMPLETE_SUFFIX}")
    first = _is_first(process_group)
    if first:
        shutil.rmtree(staging, ignore_errors=True)
        staging.parent.mkdir(parents=True, exist_ok=True)
    _barrier(process_group)
    with _single_process_is_intended():
        dcp.save(
            state_dict, storage_writer=ChecksummingWriter(staging), process_group=process_group
        )
    _barrier(process_group)
    if first:
        previous = target.with_name(f"{INCOMPLETE_PREFIX}{target.name}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        if target.exists():
            target.rename(previous)
        staging.rename(target)
        shutil.rmtree(previous, ignore_errors=True)
    _barrier(process_group)


def load(
    state_dict: dict[str, object],
    checkpoint_id: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """``torch.distributed.checkpoint.load`` of ``checkpoint_id`` into ``state_dict``, in place.

    Before reading any tensor, every rank checks its ``state_dict`` against the checkpoint:
    missing, unexpected and mis-shaped keys raise a ``ValueError`` on every rank naming them.
    Unexpected keys count under the top-level keys ``state_dict`` has: ``{"model": ...}`` alone
    loads the model part of a checkpoint saved as ``{"model": ..., "optim": ...}``.
    Optimizer entries (under a dict with ``"state"`` and ``"param_groups"``) that the checkpoint
    does not have are dropped from ``state_dict`` instead: that parameter's state starts fresh
    (``dmuon.checkpoint.set_optimizer_state_dict`` warns naming it); the checkpoint's extra
    entries are not read. Param groups are read as the checkpoint has them (its number of
    groups, its keys), and ``set_optimizer_state_dict`` matches them to the current groups.

    Every file read is checked against the checksums ``save`` wrote, on every rank, before any
    value is written into ``state_dict``: a changed, truncated or missing file, or a junk
    ``.metadata``, raises ``CheckpointIntegrityError`` on every rank naming the file, and a path
    that does not exist raises ``FileNotFoundError`` ("no such checkpoint"). A checkpoint
    without checksums (``torch.distributed.checkpoint.save``, an older dmuon) loads with a
    warning that it cannot be verified.
    """
    path = Path(checkpoint_id)
    reader = verifying_reader(path, process_group=process_group)
    saved = reader.saved_entries
    optimizer_prefixes = _optimizer_state_prefixes(state_dict)
    _take_saved_group_layout(state_dict, optimizer_prefixes, saved)
    flat, paths = flatten_state_dict(state_dict)
    errors, dropped = [], []
    for key, value in flat.items():
        if key not in saved:
            if _is_optimizer_entry(paths[key], optimizer_prefixes):
                dropped.append(paths[key])
            else:
                errors.append(f"missing in the checkpoint: {key}")
            continue
        entry = saved[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(entry, TensorStorageMetadata):
                errors.append(f"{key} is a tensor here but not in the checkpoint")
            elif tuple(entry.size) != tuple(value.shape):
                errors.append(
                    f"size mismatch for {key}: the checkpoint has {tuple(entry.size)}, this "
                    f"state dict {tuple(value.shape)}"
                )
    requested = _union_over_ranks(set(flat), process_group)
    # Only the parts asked for count: {"model": ...} alone loads the model of a model +
    # optimizer checkpoint.
    parts = {key.split(".", 1)[0] for key in requested} | set(state_dict)
    unexpected = sorted(
        key
        for key in saved
        if key not in requested
        and key.split(".", 1)[0] in parts
        and not _looks_like_optimizer_entry(key, optimizer_prefixes)
    )
    errors += [f"in the checkpoint but not in the state dict: {key}" for key in unexpected]
    _raise_if_any_rank_failed(errors, path, process_group)
    for key_path in dropped:
        _drop(state_dict, key_path)
    try:
        with _single_process_is_intended():
            dcp.load(state_dict, storage_reader=reader, process_group=process_group)
    except CheckpointException as failure:
        error = _readable(failure, path)
        raise error from (None if isinstance(error, CheckpointIntegrityError) else failure)


def checksumming_writer(checkpoint_id: str | os.PathLike) -> ChecksummingWriter:
    """The storage writer ``save`` uses, for a ``torch.distributed.checkpoint.save`` (or
    ``async_save``) that is called elsewhere (a framework's own checkpointing): a
    ``FileSystemWriter`` into ``checkpoint_id`` that also writes the checksum file beside
    ``.metadata`` (see [Note: checkpoint checksums]). No atomic commit: the folder is written in
    place, as DCP's own writer does."""
    return ChecksummingWriter(checkpoint_id)


def verifying_reader(
    checkpoint_id: str | os.PathLike, *, process_group: dist.ProcessGroup | None = None
) -> VerifyingReader:
    """The storage reader ``load`` uses, for a ``torch.distributed.checkpoint.load`` called
    elsewhere: every file read is checked against the checksums on every rank of
    ``process_group`` (the group of that ``load``; default: every rank) before any value loads.

    Collective: reads and checks ``.metadata`` here, so a missing checkpoint or a damaged
    ``.metadata`` raises on every rank before ``load`` starts. A damaged data file raises
    ``CheckpointIntegrityError`` inside DCP's ``load``, which wraps it in its
    ``CheckpointException`` (its ``failures`` hold it per rank). Without checksums it warns that
    the checkpoint cannot be verified, as ``load`` does. None of ``load``'s key checks run.
    """
    path = Path(checkpoint_id)
    metadata, checksums, problem = None, None, None
    try:
        checksums, metadata = _read_checkpoint(path)
    except (OSError, CheckpointIntegrityError) as error:  # raised on every rank below
        problem = error
    raise_on_every_rank(problem, process_group)
    if checksums is None:
        warn_unverifiable(path)
    return VerifyingReader(path, metadata=metadata, checksums=checksums, group=process_group)


def _read_checkpoint(path: Path):
    """``(checksums or None, DCP metadata)`` of the checkpoint at ``path``, checked."""
    if not (path / METADATA_FILE).is_file():
        staging = path.with_name(f"{INCOMPLETE_PREFIX}{path.name}{INCOMPLETE_SUFFIX}")
        if not path.exists() and not staging.exists():
            raise missing_checkpoint(path)
        hint = f" ({staging} exists: a save into it did not finish)" if staging.exists() else ""
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint: it has no {METADATA_FILE}{hint}. Load the "
            "folder dmuon.checkpoint.save (or torch.distributed.checkpoint.save) completed."
        )
    checksums = read_checksums(path)
    return checksums, read_metadata(path, checksums)


def _readable(failure: CheckpointException, path: Path) -> BaseException:
    """DCP's ``CheckpointException`` (a ``BaseException`` listing each rank's error) as the
    error it carries: dmuon's own where a rank raised one, else one naming every rank's."""
    for _, (error, _trace) in sorted(failure.failures.items()):
        if isinstance(error, CheckpointIntegrityError):
            return error
    lines = "\n  ".join(
        f"rank {rank}: {type(error).__name__}: {error}"
        for rank, (error, _trace) in sorted(failure.failures.items())
    )
    return RuntimeError(f"dmuon.checkpoint.load: reading {path} failed:\n  {lines}")


# ---- optimizer entries --------------------------------------------------------------------


def _optimizer_state_prefixes(state_dict: Mapping, prefix: tuple = ()) -> list[tuple]:
    """Paths of the optimizer state dicts inside: ``{"state": ..., "param_groups": ...}``, or
    their flattened form (every key ``state.<fqn>.<name>`` or ``param_groups.<fqn>.<key>``)."""
    found = []
    nested = "state" in state_dict and "param_groups" in state_dict
    flattened = bool(state_dict) and all(
        isinstance(key, str) and key.startswith(("state.", "param_groups.")) for key in state_dict
    )
    if nested or flattened:
        found.append(prefix)
    for key, value in state_dict.items():
        if isinstance(value, Mapping):
            found += _optimizer_state_prefixes(value, (*prefix, key))
    return found


def _take_saved_group_layout(state_dict: dict, prefixes: list[tuple], saved: Mapping) -> None:
    """Give each optimizer state dict the checkpoint's param groups: as many, with its keys.

    Groups are a list, matched by position when read; a checkpoint written with other groups
    (another ``param_groups=``, another optimizer) would otherwise fill this optimizer's groups
    by index. ``set_optimizer_state_dict`` then matches each saved group to the current ones by
    the FQNs they hold, as it does for a dict kept in memory.
    """
    for prefix in prefixes:
        node = state_dict
        for key in prefix:
            node = node[key]
        if not isinstance(node.get("param_groups"), list):
            continue  # the flattened form: keyed by FQN, not by position
        start = ".".join(map(str, (*prefix, "param_groups"))) + "."
        groups: dict[int, dict[str, None]] = {}
        for key in saved:
            if not key.startswith(start):
                continue
            index, dot, name = key[len(start) :].partition(".")
            if dot and index.isdigit():
                groups.setdefault(int(index), {})[name] = None  # dcp.load fills the value
        if groups:
            node["param_groups"] = [groups.get(i, {}) for i in range(max(groups) + 1)]


# An optimizer entry may be missing from either side: per-parameter state under another route
# (starts fresh), or a group option the other version of dmuon did not have (keeps its value).
_LENIENT_PARTS = ("state", "param_groups")


def _is_optimizer_entry(path: tuple, prefixes: list[tuple]) -> bool:
    return any(
        path[: len(p)] == p and len(path) > len(p) and _is_lenient_part(str(path[len(p)]))
        for p in prefixes
    )


def _is_lenient_part(key: str) -> bool:
    """``state`` / ``param_groups`` (nested form) or ``state.<...>`` (flattened form)."""
    return any(key == part or key.startswith(part + ".") for part in _LENIENT_PARTS)


def _looks_like_optimizer_entry(flat_key: str, prefixes: list[tuple]) -> bool:
    return any(
        flat_key.startswith(".".join(map(str, (*p, part))) + ".")
        for p in prefixes
        for part in _LENIENT_PARTS
    )


def _drop(state_dict: dict, path: tuple) -> None:
    """Delete the entry at ``path``; a per-parameter state dict left empty goes too."""
    *parents, last = path
    node = state_dict
    for key in parents:
        parent, node = node, node[key]
    del node[last]
    if parents and not node and isinstance(parent, dict):
        del parent[parents[-1]]


# ---- agreement over ranks -------------------------------------------------------------------


def _union_over_ranks(keys: set[str], group: dist.ProcessGroup | None) -> set[str]:
    if not dist.is_initialized():
        return keys
    everyone: list[set[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, keys, group=group)
    return set().union(*everyone)


def _raise_if_any_rank_failed(errors: list[str], path: Path, group) -> None:
    everyone = [errors]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, errors, group=group)
    lines = sorted({error for found in everyone for error in found})
    if lines:
        shown = "\n  ".join(lines[:20])
        more = f"\n  ... {len(lines) - 20} more" if len(lines) > 20 else ""
        raise ValueError(
            f"dmuon.checkpoint.load: the checkpoint {path} does not fit the state dict (was it "
            f"written for another model?):\n  {shown}{more}"
        )


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    # Without torch.distributed, DCP warns that it assumes one process: here that is the point.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _is_first(group: dist.ProcessGroup | None) -> bool:
    if not dist.is_initialized():
        return True
    return dist.get_rank() == min(dist.get_process_group_ranks(group or dist.group.WORLD))


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)
