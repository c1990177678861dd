"""A list scheduler for one rank's step: operations on streams, each stream on a resource.

Owns placing operations in time. An operation runs on a resource (the GPU's compute, the links
of one of its process groups), in the order it was issued on that resource, once every operation
it depends on has started or ended as asked (a prefetch is issued when the layer before starts;
a compute waits for the weights it needs). That is how CUDA streams behave when one rank issues
work in program order and the kernels of one resource run one at a time. It must not know what
the operations mean (``steps`` builds them) nor what they cost (``costs``).

[Note: one resource, one queue]
Two streams that use the same resource share one queue: FSDP2's all-gather and reduce-scatter
streams both use the shard group's links and run one after the other in issue order, and so do
dmuon's broadcasts and reduces. Operations on different resources overlap freely: the shard
group's collectives and the replicate group's (an HSDP all-reduce, reduce or publish) run at once
(inside a node they use different links; across nodes the replicate ring takes one NIC of the
several a shard group's rings use), and communication does not slow compute down (NCCL's kernels
take a few SMs in reality).

[Note: who is to blame for a wait]
Where the compute resource sits idle before an operation, the wait is charged along the chain
that held the operation back: the operation it started after (its latest dependency, or the one
before it on its resource) is charged for the part of the wait it was running, and what held
that one back for the part before. A forward that waited for a broadcast which itself waited for
the previous step's HSDP publish charges the publish for its share and the broadcast for the
rest. The tail of a window after the last compute operation is charged the same way from the
operation that ends the window.

[Note: work that only fills idle time]
``fill_idle`` places an operation of low priority (the overlapped owner step on its side stream)
into the idle intervals its resource has left between a time and the end of what the resource
already holds, cut into pieces where the intervals are; nothing placed before moves, so the
compute that ran at full speed keeps its time and the filler takes only what was idle (the GPU
shares its SMs between streams; here it gives the filler none while a kernel of the compute
stream runs, which neither slows backward down nor lets the filler use what a kernel leaves
unoccupied). What does not fit is returned for the caller to place with ``add``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class After:
    """A dependency: ``op`` must have ended (``at_start=False``) or started."""

    op: int
    at_start: bool = False


@dataclass(slots=True, kw_only=True)
class Op:
    name: str
    stream: str  # the CUDA stream it would be issued on: "compute", "dmuon shard", ...
    resource: str  # what it occupies: "compute", "shard group: nvlink", ...
    kind: str  # what it is, for the breakdown: "forward", "shard broadcast", "optimizer", ...
    duration_ms: float
    deps: tuple[After, ...] = ()
    step: int = 0
    phase: str = ""  # "forward", "backward", "step"
    layer: int | None = None
    payload_bytes: float = 0.0  # the collective's buffer
    wire_bytes: float = 0.0  # what this rank sends
    start_ms: float = field(default=0.0)
    end_ms: float = field(default=0.0)


class Timeline:
    """Operations issued in program order, placed as they are added."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._free_at: dict[str, float] = {}
        self._last_on: dict[str, int] = {}
        self._previous_on_resource: list[int | None] = []

    def add(self, op: Op) -> int:
        """Place ``op`` after its dependencies and after what its resource already holds;
        returns its index (for ``After``)."""
        ready = 0.0
        for dep in op.deps:
            placed = self.ops[dep.op]
            ready = max(ready, placed.start_ms if dep.at_start else placed.end_ms)
        op.start_ms = max(ready, self._free_at.get(op.resource, 0.0))
        op.end_ms = op.start_ms + op.duration_ms
        self._free_at[op.resource] = op.end_ms
        self._previous_on_resource.append(self._last_on.get(op.resource))
        self.ops.append(op)
        self._last_on[op.resource] = len(self.ops) - 1
        return len(self.ops) - 1

    def fill_idle(self, op: Op, not_before: float) -> tuple[list[int], float]:
        """Place ``op`` (its ``duration_ms``) into the idle time of its resource from
        ``not_before`` to the end of what the resource holds ([Note: work that only fills idle
        time]); returns the pieces placed and the milliseconds that did not fit."""
        end = self._free_at.get(op.resource, 0.0)
        busy = sorted(
            (placed.start_ms, placed.end_ms)
            for placed in self.ops
            if placed.resource == op.resource and placed.end_ms > not_before
        )
        left, cursor, pieces = op.duration_ms, not_before, []
        for start, stop in [*busy, (end, end)]:
            if left <= _EPSILON_MS or cursor >= end:
                break
            if start - cursor > _EPSILON_MS:
                length = min(start - cursor, left)
                piece = Op(
                    name=f"{op.name} (part {len(pieces) + 1})",
                    stream=op.stream,
                    resource=op.resource,
                    kind=op.kind,
                    duration_ms=length,
                    deps=op.deps,
                    step=op.step,
                    phase=op.phase,
                    layer=op.layer,
                    start_ms=cursor,
                    end_ms=cursor + length,
                )
                self._previous_on_resource.append(None)
                self.ops.append(piece)
                pieces.append(len(self.ops) - 1)
                left -= length
            cursor = max(cursor, stop)
        return pieces, max(left, 0.0)

    def end_of(self, indices) -> float:
        return max((self.ops[i].end_ms for i in indices), default=0.0)

    def exposed_by_kind(self, begin_ms: float, end_ms: float) -> dict[str, float]:
        """Time the compute resource waits inside ``[begin_ms, end_ms)``, by the kind of the
        operation that held it back (see [Note: who is to blame for a wait])."""
        exposed: dict[str, float] = {}
        cursor = begin_ms
        # In time order: pieces placed by ``fill_idle`` come later in the list than they run.
        compute = sorted(
            (i for i, op in enumerate(self.ops) if op.resource == "compute"),
            key=lambda i: self.ops[i].start_ms,
        )
        for index in compute:
            op = self.ops[index]
            if not begin_ms <= op.start_ms < end_ms:
                continue
            if op.start_ms - cursor > _EPSILON_MS:
                self._blame(self._blocker(index), cursor, op.start_ms, exposed)
            cursor = max(cursor, op.end_ms)
        if end_ms - cursor > _EPSILON_MS:
            last = max(
                (i for i, op in enumerate(self.ops) if cursor < op.end_ms <= end_ms + _EPSILON_MS),
                key=lambda i: self.ops[i].end_ms,
                default=None,
            )
            self._blame(last, cursor, end_ms, exposed)
        return exposed

    def _blocker(self, index: int) -> int | None:
        """What ``ops[index]`` started after: its latest dependency, or the operation before it
        on its resource when that ended later."""
        op = self.ops[index]
        best, best_at = None, -1.0
        for dep in op.deps:
            placed = self.ops[dep.op]
            at = placed.start_ms if dep.at_start else placed.end_ms
            if at > best_at:
                best, best_at = dep.op, at
        previous = self._previous_on_resource[index]
        if previous is not None and self.ops[previous].end_ms > best_at:
            best = previous
        return best

    def _blame(self, index: int | None, begin: float, end: float, into: dict[str, float]) -> None:
        while index is not None and end - begin > _EPSILON_MS:
            op = self.ops[index]
            own_begin = max(op.start_ms, begin)
            if end - own_begin > _EPSILON_MS:
                into[op.kind] = into.get(op.kind, 0.0) + (end - own_begin)
            end = min(end, op.start_ms)
            index = self._blocker(index)
        if end - begin > _EPSILON_MS:
            into["idle"] = into.get("idle", 0.0) + (end - begin)


_EPSILON_MS = 1e-9
