"""One-time checks that every rank made the same choices, so a mismatch fails loudly, never hangs.

Owns the comparison and its message; one ``all_gather_object`` of digests per check (a second,
of the facts themselves, only when the digests differ). It must not be called on a hot path.

Two kinds of check: ``check_ranks_agree`` compares facts every rank holds (which parameters are
dedicated, the Newton-Schulz request); ``ranks_fail_together`` makes an error raised on some
ranks during setup raise on all of them, before the ranks that did not fail go on into a
collective the failed ones will never join.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

_FIX = (
    "Every rank must build the same model, call dedicate_params with the same predicate and "
    "options, and construct dmuon.Muon with the same arguments."
)


def check_ranks_agree(group: dist.ProcessGroup | None, facts: dict[str, tuple[str, Any]]) -> None:
    """Raise ValueError on every rank if any fact differs between ranks of ``group``.

    ``facts`` maps a key to (what it is, for the message; this rank's value).
    """
    if group is None:
        return
    # Digests first: the facts (every parameter's name, say) are gathered only to describe a
    # mismatch, so a large model on many ranks sends a few bytes per check.
    digests = {
        key: hashlib.sha256(repr(value).encode()).hexdigest() for key, (_, value) in facts.items()
    }
    if len(set(map(str, _gathered(group, digests)))) == 1:
        return
    everyone = _gathered(group, {key: value for key, (_, value) in facts.items()})
    ranks = dist.get_process_group_ranks(group)
    for key, (what, _) in facts.items():
        reference = everyone[0][key]
        differing = [rank for rank, seen in zip(ranks, everyone) if seen[key] != reference]
        if differing:
            mismatch = everyone[ranks.index(differing[0])][key]
            reference, mismatch = _first_difference(reference, mismatch)
            raise ValueError(
                f"dmuon: ranks {differing} use different {what} from rank {ranks[0]}: "
                f"rank {ranks[0]} has {_short(reference)}, rank {differing[0]} has "
                f"{_short(mismatch)}. {_FIX}"
            )


def _gathered(group: dist.ProcessGroup, mine: dict) -> list[dict]:
    everyone: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def _first_difference(a: Any, b: Any) -> tuple[Any, Any]:
    """The first differing items of two lists of one length (what a message should show of two
    long lists), else the values themselves."""
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for x, y in zip(a, b):
            if x != y:
                return x, y
    return a, b


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# What a rank reports to the others in ``ranks_fail_together``: None (no error) or the kind of
# exception to raise everywhere and its "TypeName: message" text.
_FailureReport = tuple[str, str] | None


@contextlib.contextmanager
def ranks_fail_together(what: str) -> Iterator[None]:
    """Run the body; if it raised on any rank of the default group, raise on every rank.

    Ends with one ``all_gather_object`` on the default group (under its timeout), so every rank
    of it must enter the block. Where every rank failed, each re-raises its own error unchanged;
    where only some did, every rank raises the same error naming the failed ranks and their
    messages (a ValueError or TypeError when the first failure was one, else a RuntimeError),
    chained on the failed ranks to the original. Without torch.distributed, or with one rank,
    errors pass through untouched.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    error: Exception | None = None
    try:
        yield
    except Exception as caught:
        error = caught
    report: _FailureReport = None if error is None else (_kind_of(error), _describe(error))
    reports: list[_FailureReport] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(reports, report)
    except Exception:
        if error is not None:
            # The peers did not answer; this rank's own error says the most (the failed gather
            # stays visible as its context).
            raise error  # noqa: B904
        raise
    failed = {rank: failure for rank, failure in enumerate(reports) if failure is not None}
    if not failed:
        return
    if error is not None and len(failed) == len(reports):
        raise error
    kind, _ = failed[min(failed)]
    raise _EXCEPTION_KINDS[kind](_failure_message(what, failed, len(reports))) from error


_EXCEPTION_KINDS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "RuntimeError": RuntimeError,
}


def _kind_of(error: Exception) -> str:
    if isinstance(error, ValueError):
        return "ValueError"
    if isinstance(error, TypeError):
        return "TypeError"
    return "RuntimeError"


def _describe(error: Exception, limit: int = 2000) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= limit else text[:limit] + "..."


def _failure_message(what: str, failed: dict[int, tuple[str, str]], world_size: int) -> str:
    by_text: dict[str, list[int]] = {}
    for rank, (_, text) in failed.items():
        by_text.setdefault(text, []).append(rank)
    ok = [rank for rank in range(world_size) if rank not in failed]
    where = _ranks_label(sorted(failed))
    if len(by_text) == 1:
        errors = f": {next(iter(by_text))}"
    else:
        errors = ":" + "".join(
            f"\n  {_ranks_label(same)}: {text}" for text, same in by_text.items()
        )
    return (
        f"{what} failed on {where} of {world_size} (ranks {ok} did not fail){errors}\n"
        f"Every rank raises this error, so none waits in a collective for the failed ones. "
        f"Fix the error on {where} (the traceback is in that rank's output); a rank-dependent "
        f"argument, predicate or model is the usual cause."
    )


def _ranks_label(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
