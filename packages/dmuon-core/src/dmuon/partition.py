"""Who owns each dedicated parameter: a pure function of names, shapes and mesh sizes.

Owns: the layer id of a parameter name, the Newton-Schulz cost model, the packing of a layer's
small parameters into one unit, and the global Longest-Processing-Time placement of units on the
(shard, replicate) owner grid.

Must not: touch tensors, devices, ``torch.distributed`` or process groups (it does not even
import torch). It runs anywhere for any world size (the planner in dmuon-tools uses it for
10,000-slot what-ifs) and gives the same answer on every rank because it depends only on its
arguments, never on hash or set iteration order.

[Note: slot order]
The owner grid has ``num_shards * num_replicas * num_tp`` slots. Slot ``i`` is the owner
``OwnerCoord(shard=i % num_shards, replicate=i // num_shards % num_replicas, tp=i // (num_shards
* num_replicas))``: shard index fastest, so that ties (which go to the lowest slot) spread
consecutive units over different shard indices first. ``OwnershipPlan.loads[i]`` is the load of
slot ``i``. Under tensor parallelism (``num_tp`` > 1) a slot's ``tp`` is the TP rank that runs the
Newton-Schulz of a TP-sharded matrix (see ``dmuon.tp``).

[Note: spreading a layer versus balance]
Two passes keep the two goals apart. First, plain LPT decides balance: units, heaviest first
(ties: smallest parameter name), each go to the least-loaded slot (ties: lowest slot). That gives
the classic bound: the heaviest owner carries at most ``total/S + c`` where ``c`` is the cost of
the unit that made it heaviest (and exactly the largest unit when it sits alone).

Second, same-layer collisions are removed only by changes that never make the heaviest owner
heavier than the first pass left it, so the balance bound still holds:
- move: the colliding unit goes to the least-loaded slot without its layer, if that slot's load
  plus the unit's cost stays at or below the heaviest load;
- rotate: otherwise, a cycle of moves among units of exactly equal cost (loads unchanged) that
  takes the unit off its slot, each unit landing on a slot without its layer (breadth-first over
  slots).
Lightest colliding units are repaired first. Layers with more units than slots are left as LPT
placed them. When balance and spreading conflict, balance wins; ``crowded_layers`` and
``describe()`` report the layers left sharing an owner.

[Note: expert stacks]
A mixture-of-experts layer keeps its experts as one (E, m, n) tensor; Muon treats it as E
matrices (m, n). One owner for the whole stack would put E matrices' Newton-Schulz on one rank,
so a spec with ``expert_stack=True`` is cut into ``min(E, S)`` contiguous expert slices
``[start, stop)`` (sizes differing by at most one, the larger first), each a unit of its own
costing ``(stop - start) * ns_cost((m, n))``. They are never packed with the layer's small
parameters, and since they share the layer id, the spreading pass puts them on distinct owners
when the balance allows: an (8, m, n) stack on 4 owners gets 2 experts on each. A slice is named
``<name>[start:stop]`` (``expert_piece_name``) in ``owners`` and in its unit.

[Note: expert parallelism]
Under expert parallelism (EP) a stack's E experts are split over the ``ep`` ranks: EP slot ``e``
holds experts ``[e * E / ep, (e + 1) * E / ep)``, and only the ranks of that slot (its
expert-FSDP ranks, times the HSDP replicas) ever hold them. ``plan_ownership(expert_groups=...)``
names those ranks by their owner slots on the full grid: ``expert_groups[e]`` is the slots of EP
slot ``e``, in its expert grid's order (``expert_parallel_groups`` gives torchtitan's layout).
Each EP slot's experts are cut like a stack of ``E / ep`` experts on ``len(expert_groups[e])``
slots (``expert_slices``, offset to the slot's first expert), and each slice is a unit *pinned*
to its EP slot: LPT places it on the least-loaded slot of its group, so broadcasts and reduces of
its experts never leave the group, and the owners inside each EP slot are balanced together
with the other units on the same slots (the placement is one LPT over every unit, heaviest
first). The spreading pass never moves a pinned unit, nor swaps one in a rotation. Owners stay
coordinates of the full (shard, replicate) grid; ``expert_slices[name]`` lists every EP slot's
slices, in expert order.

A matrix whose Newton-Schulz runs per row block (``ParamSpec.row_blocks``, [Note: row blocks] in
``dmuon.row_blocks``) costs the sum of its blocks' ``ns_cost``: q_proj split into 32 heads of
(128, 4096) costs 32 * ns_cost((128, 4096)), about 99x less than ns_cost((4096, 4096)).
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_SMALL_PARAM_NUMEL = 5_000_000
"""Parameters with fewer elements than this are packed per layer into one unit (one owner)."""

LAYER_CONTAINER_NAMES = frozenset({"layers", "blocks", "layer", "h", "block"})
"""Module-list names whose ``<name>.<index>`` children are transformer blocks."""

_INDEX = re.compile(r"[0-9]+")
_FLOP_PER_GFLOP = 1e9
_LIST_LOADS_UP_TO_SLOTS = 8  # describe() lists every owner's load up to this many slots


@dataclass(frozen=True, slots=True)
class OwnerCoord:
    """Owner coordinate in the (shard, replicate) grid, and the TP rank that runs the
    Newton-Schulz of a tensor-parallel matrix (0 without TP)."""

    shard: int
    replicate: int = 0
    tp: int = 0

    def __repr__(self) -> str:
        tp = f", tp={self.tp}" if self.tp else ""
        return f"OwnerCoord(shard={self.shard}, replicate={self.replicate}{tp})"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    """What the partition knows about one parameter."""

    name: str  # fully-qualified name, as in model.named_parameters()
    shape: tuple[int, ...]
    layer_id: str | None  # e.g. "model.layers.3"; None = no layer found
    # (E, m, n): E expert matrices, placed in slices (see [Note: expert stacks]).
    expert_stack: bool = False
    # Row-block sizes when Newton-Schulz runs per block (``dedicate_params(row_blocks=...)``,
    # [Note: row blocks] in ``dmuon.row_blocks``): the cost is the blocks' sum.
    row_blocks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(
                f"ParamSpec.name must be a non-empty str, got {self.name!r}; "
                "pass the parameter's fully-qualified name from model.named_parameters()"
            )
        shape = self.shape
        if not isinstance(shape, Sequence) or isinstance(shape, str):
            raise TypeError(
                f"ParamSpec {self.name!r}: shape must be a tuple of ints, got {shape!r}; "
                "pass tuple(param.shape)"
            )
        if any(isinstance(d, bool) or not isinstance(d, int) for d in shape):
            raise TypeError(
                f"ParamSpec {self.name!r}: shape must contain only ints, got {tuple(shape)!r}; "
                "pass tuple(param.shape)"
            )
        if len(shape) == 0:
            raise ValueError(
                f"ParamSpec {self.name!r}: empty shape (); a scalar parameter cannot be "
                "dedicated. Exclude it with the predicate (or give it shape (1,))"
            )
        if any(d < 0 for d in shape):
            raise ValueError(
                f"ParamSpec {self.name!r}: negative dimension in shape {tuple(shape)!r}; "
                "pass tuple(param.shape)"
            )
        if type(shape) is not tuple:
            object.__setattr__(self, "shape", tuple(shape))
        if self.layer_id is not None and not isinstance(self.layer_id, str):
            raise TypeError(
                f"ParamSpec {self.name!r}: layer_id must be a str or None, got "
                f"{self.layer_id!r}; use layer_id_of(name) or your layer_id_fn's result"
            )
        if self.expert_stack and len(self.shape) != 3:
            raise ValueError(
                f"ParamSpec {self.name!r}: expert_stack=True needs a 3-D shape (num_experts, m, "
                f"n), got {self.shape!r}; set expert_stack=False for other shapes"
            )
        if self.row_blocks is not None and (
            self.expert_stack
            or len(self.shape) < 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.row_blocks)
            or sum(self.row_blocks) != self.shape[0]
        ):
            raise ValueError(
                f"ParamSpec {self.name!r}: row_blocks must be sizes >= 1 summing to the rows of "
                f"a matrix that is not an expert stack, got {self.row_blocks!r} for shape "
                f"{self.shape!r}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnershipUnit:
    """Parameters that always share one owner: a large matrix alone, or a layer's small ones."""

    names: tuple[str, ...]  # in input order
    layer_id: str | None
    cost: float  # FLOPs, see param_cost
    owner: OwnerCoord


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnershipPlan:
    """The owner of every parameter plus the load it puts on each slot (see [Note: slot order])."""

    # parameter name -> owner, in input order; an expert stack is replaced by its slices'
    # names (``<name>[start:stop]``, in expert order). Do not mutate.
    owners: dict[str, OwnerCoord]
    units: tuple[OwnershipUnit, ...]  # in placement order: heaviest first
    loads: tuple[float, ...]  # FLOPs per slot; slot i -> owner_of_slot(i)
    num_shards: int
    num_replicas: int
    unlayered: tuple[str, ...]  # names whose layer_id is None (callers warn about them)
    # expert stack name -> its slices [start, stop), in expert order (see [Note: expert stacks])
    expert_slices: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    num_tp: int = 1
    # Under expert parallelism, the owner slots of each EP slot (see [Note: expert
    # parallelism]); () without it.
    expert_groups: tuple[tuple[int, ...], ...] = ()

    @property
    def num_ep(self) -> int:
        """The expert-parallel degree: 1 without ``expert_groups``."""
        return max(len(self.expert_groups), 1)

    def ep_experts(self, name: str, ep_slot: int) -> tuple[int, int]:
        """Experts ``[start, stop)`` of the stack ``name`` that EP slot ``ep_slot`` holds."""
        num_experts = self.expert_slices[name][-1][1]
        per_slot = num_experts // self.num_ep
        return ep_slot * per_slot, (ep_slot + 1) * per_slot

    @property
    def num_slots(self) -> int:
        return self.num_shards * self.num_replicas * self.num_tp

    @property
    def imbalance(self) -> float:
        """Heaviest owner's load over the mean load; 1.0 when nothing costs anything."""
        total = math.fsum(self.loads)
        if total == 0.0:
            return 1.0
        return max(self.loads) / (total / len(self.loads))

    @property
    def crowded_layers(self) -> tuple[str, ...]:
        """Layers with two or more units on one owner (their broadcasts serialise there)."""
        seen: dict[str, set[OwnerCoord]] = {}
        crowded: dict[str, None] = {}
        for unit in self.units:
            if unit.layer_id is None:
                continue
            owners = seen.setdefault(unit.layer_id, set())
            if unit.owner in owners:
                crowded[unit.layer_id] = None
            owners.add(unit.owner)
        return tuple(crowded)

    def owner_of_slot(self, slot: int) -> OwnerCoord:
        return _owner_of_slot(slot, self.num_shards, self.num_replicas)

    def slot_of(self, owner: OwnerCoord) -> int:
        return (owner.tp * self.num_replicas + owner.replicate) * self.num_shards + owner.shard

    def describe(self) -> str:
        """One log line: counts, per-owner load summary, imbalance, spreading, unlayered."""
        num_slots = self.num_slots
        loads_gflop = [load / _FLOP_PER_GFLOP for load in self.loads]
        mean = math.fsum(loads_gflop) / num_slots
        heaviest_slot = max(range(num_slots), key=lambda slot: (self.loads[slot], -slot))
        heaviest = self.owner_of_slot(heaviest_slot)
        layers = {unit.layer_id for unit in self.units if unit.layer_id is not None}
        parts = [
            f"dmuon partition: {len(self.owners)} params in {len(self.units)} units over "
            f"{num_slots} owners (G={self.num_shards} x R={self.num_replicas}"
            + (f" x TP={self.num_tp})" if self.num_tp > 1 else ")")
            + (f", experts over EP={self.num_ep}" if self.expert_groups else ""),
            f"load min/mean/max = {min(loads_gflop):,.1f}/{mean:,.1f}/{max(loads_gflop):,.1f} "
            f"GFLOP",
            f"imbalance {self.imbalance:.3f}",
            f"heaviest owner (shard={heaviest.shard}, replicate={heaviest.replicate}"
            + (f", tp={heaviest.tp})" if self.num_tp > 1 else ")"),
        ]
        if num_slots <= _LIST_LOADS_UP_TO_SLOTS:
            parts.append("per owner GFLOP " + " ".join(f"{x:,.1f}" for x in loads_gflop))
        parts.append(f"{sum(1 for load in self.loads if load == 0.0)} owners own nothing")
        parts.append(
            f"{len(layers) - len(self.crowded_layers)}/{len(layers)} layers on distinct owners"
        )
        if self.expert_slices:
            slices = sum(len(ranges) for ranges in self.expert_slices.values())
            parts.append(f"{len(self.expert_slices)} expert stacks in {slices} slices")
        if self.unlayered:
            shown = ", ".join(self.unlayered[:3]) + (", ..." if len(self.unlayered) > 3 else "")
            parts.append(f"{len(self.unlayered)} params without a layer id ({shown})")
        return "; ".join(parts)


def layer_id_of(name: str, layer_id_fn: Callable[[str], str | None] | None = None) -> str | None:
    """The transformer block a parameter belongs to, as a module path prefix of its name.

    With ``layer_id_fn``, its result is returned (a str or None). Otherwise the innermost ancestor
    ``<c>.<N>`` with ``c`` in ``layers, blocks, layer, h, block`` (whole name components, the
    parameter's own last component excluded) is used:
    ``model.layers.3.self_attn.q_proj.weight -> model.layers.3``,
    ``visual.blocks.5.attn.qkv.weight -> visual.blocks.5``,
    ``encoder.layer.2.attention.self.query.weight -> encoder.layer.2``,
    ``transformer.h.7.mlp.c_fc.weight -> transformer.h.7``,
    ``swin.encoder.layers.0.blocks.1.attention.self.query.weight -> swin.encoder.layers.0.blocks.1``
    (a Swin stage holds many blocks: innermost gives the block).

    One exception gives T5 its block: a ``layer.M`` directly after another match
    (``block.1.layer.0``) is a sub-layer of that block (T5 keeps a block's attention and
    feed-forward in ``block.N.layer.0/1/2``), so ``block.1.layer.0.SelfAttention.q.weight ->
    block.1``. Names with no match (``lm_head.weight``) give None.
    """
    if layer_id_fn is not None:
        layer_id = layer_id_fn(name)
        if layer_id is not None and not isinstance(layer_id, str):
            raise TypeError(
                f"layer_id_fn({name!r}) returned {layer_id!r} ({type(layer_id).__name__}); "
                "it must return the layer's module path as a str (e.g. 'model.layers.3') or None"
            )
        return layer_id
    parts = name.split(".")
    chosen_end = 0  # number of components in the chosen layer id; 0 = none
    last_match_end = -1
    # i + 2 < len(parts): the match must be an ancestor, not the parameter itself.
    for i in range(len(parts) - 2):
        if parts[i] not in LAYER_CONTAINER_NAMES or not _INDEX.fullmatch(parts[i + 1]):
            continue
        is_sublayer = parts[i] == "layer" and last_match_end == i
        if not is_sublayer:
            chosen_end = i + 2
        last_match_end = i + 2
    return ".".join(parts[:chosen_end]) if chosen_end else None


def make_param_specs(
    named_shapes: Iterable[tuple[str, Sequence[int]]],
    layer_id_fn: Callable[[str], str | None] | None = None,
) -> tuple[ParamSpec, ...]:
    """ParamSpecs for ``(name, shape)`` pairs, with layer ids from :func:`layer_id_of`."""
    return tuple(
        ParamSpec(name=name, shape=tuple(shape), layer_id=layer_id_of(name, layer_id_fn))
        for name, shape in named_shapes
    )


def ns_cost(shape: Sequence[int]) -> float:
    """Newton-Schulz FLOPs of a matrix: ``6 n'^2 m' + 14 n'^3``.

    The first dim is m, the trailing dims are flattened into n (a conv weight ``(out, in, kh, kw)``
    is ``out x in*kh*kw``); ``n' = min(m, n)``, ``m' = max(m, n)``.
    """
    return float(_ns_cost_int(shape))


def param_cost(shape: Sequence[int]) -> float:
    """Owner-side cost used for placement: :func:`ns_cost` for >= 2-D, numel for 1-D.

    1-D parameters (norms, biases) take the element-wise AdamW route, whose work is linear in
    numel, so their numel stands for their cost.
    """
    return float(_param_cost_int(tuple(shape)))


def expert_slices(num_experts: int, num_slots: int) -> tuple[tuple[int, int], ...]:
    """The contiguous expert ranges ``[start, stop)`` a stack of ``num_experts`` is cut into on
    ``num_slots`` owner slots: ``min(num_experts, num_slots)`` of them (at least one), sizes
    differing by at most one, the larger first. ``expert_slices(8, 4) == ((0, 2), (2, 4), (4, 6),
    (6, 8))``."""
    count = max(1, min(num_experts, num_slots))
    size, larger = divmod(num_experts, count)
    ranges, start = [], 0
    for index in range(count):
        stop = start + size + (1 if index < larger else 0)
        ranges.append((start, stop))
        start = stop
    return tuple(ranges)


def expert_parallel_groups(
    num_shards: int, num_replicas: int, num_ep: int
) -> tuple[tuple[int, ...], ...]:
    """The owner slots of each EP slot in torchtitan's layout, for ``plan_ownership(expert_groups=
    ...)``: the shard index is ``efsdp_index * num_ep + ep_index`` (the ``ep`` dim varies fastest,
    as torchtitan unflattens ("dp_replicate", "efsdp", "ep") from the same ranks as
    ("dp_replicate", "fsdp")), so EP slot ``e`` holds the shard indices ``e, e + num_ep, ...`` of
    every replica. ``expert_parallel_groups(4, 1, 2) == ((0, 2), (1, 3))``."""
    _check_grid_size("num_shards", num_shards, "the size of the shard mesh dim")
    _check_grid_size("num_replicas", num_replicas, "the size of the replicate mesh dim")
    _check_grid_size("num_ep", num_ep, "the size of the expert-parallel mesh dim")
    if num_shards % num_ep:
        raise ValueError(
            f"expert_parallel_groups: num_ep={num_ep} does not divide num_shards={num_shards}; "
            "the ep dim splits the shard dim, so pass an ep degree that divides it"
        )
    return tuple(
        tuple(
            replica * num_shards + index * num_ep + ep
            for replica in range(num_replicas)
            for index in range(num_shards // num_ep)
        )
        for ep in range(num_ep)
    )


def expert_piece_name(name: str, start: int, stop: int) -> str:
    """The name of experts ``[start, stop)`` of the stack ``name`` in a plan: ``name[start:stop]``."""
    return f"{name}[{start}:{stop}]"


def plan_ownership(
    specs: Sequence[ParamSpec],
    num_shards: int,
    num_replicas: int = 1,
    *,
    small_param_numel: int = DEFAULT_SMALL_PARAM_NUMEL,
    num_tp: int = 1,
    expert_groups: Sequence[Sequence[int]] | None = None,
) -> OwnershipPlan:
    """Give every parameter one owner among the ``num_shards * num_replicas * num_tp`` slots.

    Units: a parameter with ``numel >= small_param_numel`` is a unit alone; a layer's smaller
    parameters form one unit (one owner); a small parameter without a layer id is a unit alone (so
    unlayered parameters never pile onto one owner). Unit cost = sum of :func:`param_cost`. An
    expert stack (``expert_stack=True``) is cut into expert slices, each a unit alone (see [Note:
    expert stacks] in this module's docstring). With ``expert_groups`` (expert parallelism: the
    owner slots of each EP slot), each EP slot's experts are cut over its own slots and owned
    there only (see [Note: expert parallelism]).

    Placement: one global LPT greedy over all units, then a repair pass that moves a layer's
    units onto distinct owners without making the heaviest owner heavier (see [Note: spreading a
    layer versus balance] in this module's docstring). The result depends only on the set of specs, not on
    their order (owners are invariant under permutation of ``specs``); ``owners`` and each unit's
    ``names`` follow input order.
    """
    _check_grid_size("num_shards", num_shards, "the size of the shard mesh dim")
    _check_grid_size(
        "num_replicas", num_replicas, "the size of the replicate mesh dim (1 = no HSDP)"
    )
    _check_grid_size("num_tp", num_tp, "the size of the tensor-parallel mesh dim (1 = no TP)")
    if isinstance(small_param_numel, bool) or not isinstance(small_param_numel, int):
        raise TypeError(
            f"plan_ownership: small_param_numel must be an int, got {small_param_numel!r}; "
            f"use an element count such as {DEFAULT_SMALL_PARAM_NUMEL:_}"
        )
    if small_param_numel < 0:
        raise ValueError(
            f"plan_ownership: small_param_numel must be >= 0, got {small_param_numel}; "
            "use 0 to give every parameter its own unit"
        )
    specs = tuple(specs)
    _check_specs(specs)

    num_slots = num_shards * num_replicas * num_tp
    groups = _check_expert_groups(expert_groups, num_slots, num_tp, specs)
    pinned: dict[tuple[int, int], tuple[int, ...]] = {}  # (stack, start) -> its EP slot's slots
    slices_of = {}
    for spec in specs:
        if not spec.expert_stack:
            continue
        if not groups:
            slices_of[spec.name] = expert_slices(spec.shape[0], num_slots)
            continue
        per_slot = spec.shape[0] // len(groups)
        ranges = []
        for ep, slots in enumerate(groups):
            first = ep * per_slot
            for start, stop in expert_slices(per_slot, len(slots)):
                ranges.append((first + start, first + stop))
                pinned[(id(spec), first + start)] = slots
        slices_of[spec.name] = tuple(ranges)
    units = sorted(
        _build_units(specs, small_param_numel, slices_of, pinned),
        key=lambda u: (-u.cost, u.order_key),
    )
    loads = _place_greedy(units, num_slots)
    _spread_layers(units, loads, num_slots)

    def owner(slot: int) -> OwnerCoord:
        return _owner_of_slot(slot, num_shards, num_replicas)

    owner_by_name: dict[str, OwnerCoord] = {}
    for unit in units:
        for name in unit.names:
            owner_by_name[name] = owner(unit.slot)
    planned_names = [
        expert_piece_name(spec.name, start, stop) if spec.expert_stack else spec.name
        for spec in specs
        for start, stop in slices_of.get(spec.name, ((0, 0),))
    ]
    return OwnershipPlan(
        owners={name: owner_by_name[name] for name in planned_names},
        units=tuple(
            OwnershipUnit(
                names=unit.names,
                layer_id=unit.layer_id,
                cost=float(unit.cost),
                owner=owner(unit.slot),
            )
            for unit in units
        ),
        loads=tuple(float(load) for load in loads),
        num_shards=num_shards,
        num_replicas=num_replicas,
        unlayered=tuple(spec.name for spec in specs if spec.layer_id is None),
        expert_slices=slices_of,
        num_tp=num_tp,
        expert_groups=groups,
    )


# --- internals ------------------------------------------------------------------------------


def _owner_of_slot(slot: int, num_shards: int, num_replicas: int) -> OwnerCoord:
    """See [Note: slot order]."""
    return OwnerCoord(
        shard=slot % num_shards,
        replicate=slot // num_shards % num_replicas,
        tp=slot // (num_shards * num_replicas),
    )


@dataclass(slots=True)
class _Unit:
    names: tuple[str, ...]
    layer_id: str | None
    cost: int  # exact integer FLOPs: equal-cost ties and swaps compare exactly
    order_key: str  # smallest member name: order-independent tie-break
    slot: int = -1
    # The only slots it may take (an EP slot's expert slice, [Note: expert parallelism]); None:
    # any slot. A pinned unit is never moved by the spreading pass.
    slots: tuple[int, ...] | None = None


def _ns_cost_int(shape: Sequence[int]) -> int:
    if len(shape) < 2:
        raise ValueError(
            f"ns_cost needs a matrix shape (2 or more dims), got {tuple(shape)!r}; "
            "1-D parameters are costed by numel (use param_cost)"
        )
    m = shape[0]
    n = math.prod(shape[1:])
    short, long = min(m, n), max(m, n)
    return 6 * short * short * long + 14 * short**3


def _param_cost_int(shape: tuple[int, ...]) -> int:
    return _ns_cost_int(shape) if len(shape) >= 2 else math.prod(shape)


def _spec_cost_int(spec: ParamSpec) -> int:
    """A matrix split in row blocks costs its blocks' Newton-Schulz, each (b, n)."""
    if spec.row_blocks is None:
        return _param_cost_int(spec.shape)
    return sum(_ns_cost_int((rows, *spec.shape[1:])) for rows in spec.row_blocks)


def _check_grid_size(arg: str, value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"plan_ownership: {arg} must be an int >= 1, got {value!r}; pass {what}")
    if value < 1:
        raise ValueError(f"plan_ownership: {arg} must be >= 1, got {value}; pass {what}")


def _check_specs(specs: tuple[ParamSpec, ...]) -> None:
    first_index: dict[str, int] = {}
    for index, spec in enumerate(specs):
        if not isinstance(spec, ParamSpec):
            raise TypeError(
                f"plan_ownership: specs[{index}] is {type(spec).__name__} {spec!r}, not a "
                "ParamSpec; build specs with make_param_specs(model.named_parameters() shapes)"
            )
        if spec.name in first_index:
            raise ValueError(
                f"plan_ownership: duplicate parameter name {spec.name!r} at specs"
                f"[{first_index[spec.name]}] and specs[{index}]; each spec needs the "
                "parameter's unique fully-qualified name (model.named_parameters())"
            )
        first_index[spec.name] = index


def _check_expert_groups(
    expert_groups: Sequence[Sequence[int]] | None,
    num_slots: int,
    num_tp: int,
    specs: tuple[ParamSpec, ...],
) -> tuple[tuple[int, ...], ...]:
    """``expert_groups`` as tuples, checked: disjoint groups of one size, slots on the grid,
    and every expert stack's experts divisible by the EP degree."""
    if expert_groups is None:
        return ()
    if isinstance(expert_groups, (str, bytes)) or not isinstance(expert_groups, Sequence):
        raise TypeError(
            f"plan_ownership: expert_groups must be a sequence of owner-slot sequences, one per "
            f"EP slot, got {expert_groups!r}; see expert_parallel_groups"
        )
    groups = []
    for group in expert_groups:
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence):
            raise TypeError(
                f"plan_ownership: expert_groups must hold one sequence of owner slots per EP "
                f"slot, got {group!r} in {expert_groups!r}; see expert_parallel_groups"
            )
        groups.append(tuple(group))
    flat = [slot for group in groups for slot in group]
    problem = None
    if not groups or not groups[0]:
        problem = "it is empty or holds an empty group"
    elif num_tp > 1:
        problem = f"tensor parallelism (num_tp={num_tp}) with expert parallelism is not supported"
    elif any(len(group) != len(groups[0]) for group in groups):
        problem = f"its groups differ in size ({[len(group) for group in groups]})"
    elif any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_slots for s in flat):
        problem = f"it names slots outside the grid's 0..{num_slots - 1}"
    elif len(set(flat)) != len(flat):
        problem = "a slot is in two groups (or twice in one)"
    if problem is not None:
        raise ValueError(
            f"plan_ownership: expert_groups={[list(group) for group in groups]} is not a split of "
            f"the {num_slots} owner slots into EP slots: {problem}; pass one group of owner "
            "slots per EP slot, all of one size (expert_parallel_groups gives torchtitan's)"
        )
    for spec in specs:
        if spec.expert_stack and spec.shape[0] % len(groups):
            raise ValueError(
                f"plan_ownership: expert stack {spec.name!r} has {spec.shape[0]} experts, not a "
                f"multiple of the expert-parallel degree {len(groups)}; each EP slot must hold "
                "as many experts as the others (the model's experts are split evenly over ep)"
            )
    return tuple(groups)


def _build_units(
    specs: tuple[ParamSpec, ...],
    small_param_numel: int,
    slices_of: dict[str, tuple[tuple[int, int], ...]],
    pinned: dict[tuple[int, int], tuple[int, ...]],
) -> list[_Unit]:
    units: list[_Unit] = []
    small_by_layer: dict[str, list[ParamSpec]] = {}
    for spec in specs:
        if spec.expert_stack:
            units.extend(_expert_units(spec, slices_of[spec.name], pinned))
        elif spec.layer_id is not None and math.prod(spec.shape) < small_param_numel:
            small_by_layer.setdefault(spec.layer_id, []).append(spec)
        else:
            units.append(_unit_of([spec], spec.layer_id))
    units.extend(_unit_of(group, layer_id) for layer_id, group in small_by_layer.items())
    return units


def _expert_units(
    spec: ParamSpec,
    ranges: tuple[tuple[int, int], ...],
    pinned: dict[tuple[int, int], tuple[int, ...]],
) -> list[_Unit]:
    """One unit per expert slice of a stack: its experts' Newton-Schulz cost (pinned to its EP
    slot's owner slots under expert parallelism)."""
    per_expert = _ns_cost_int(spec.shape[1:])
    units = []
    for start, stop in ranges:
        name = expert_piece_name(spec.name, start, stop)
        units.append(
            _Unit(
                names=(name,),
                layer_id=spec.layer_id,
                cost=(stop - start) * per_expert,
                order_key=name,
                slots=pinned.get((id(spec), start)),
            )
        )
    return units


def _unit_of(specs: list[ParamSpec], layer_id: str | None) -> _Unit:
    names = tuple(spec.name for spec in specs)
    return _Unit(
        names=names,
        layer_id=layer_id,
        cost=sum(_spec_cost_int(spec) for spec in specs),
        order_key=min(names),
    )


def _place_greedy(units: list[_Unit], num_slots: int) -> list[int]:
    """Plain LPT: each unit (heaviest first) on the least-loaded slot it may take (a pinned unit:
    among its ``slots``); sets unit.slot."""
    loads = [0] * num_slots
    # (load, slot): ties go to the lowest slot; an entry is stale once a pinned unit raised the
    # slot's load past it.
    heap = [(0, slot) for slot in range(num_slots)]
    for unit in units:
        if unit.slots is not None:
            slot = min(unit.slots, key=lambda s: (loads[s], s))
        else:
            while heap[0][0] != loads[heap[0][1]]:
                heapq.heappop(heap)
            slot = heapq.heappop(heap)[1]
        loads[slot] += unit.cost
        heapq.heappush(heap, (loads[slot], slot))
        unit.slot = slot
    return loads


def _spread_layers(units: list[_Unit], loads: list[int], num_slots: int) -> None:
    """Resolve same-layer collisions by moves and equal-cost rotations that keep loads in bound."""
    units_per_layer: dict[str, int] = {}
    count: dict[str, dict[int, int]] = {}  # layer -> slot -> number of its units there
    for unit in units:
        if unit.layer_id is not None:
            units_per_layer[unit.layer_id] = units_per_layer.get(unit.layer_id, 0) + 1
            per_slot = count.setdefault(unit.layer_id, {})
            per_slot[unit.slot] = per_slot.get(unit.slot, 0) + 1

    def is_crowded(unit: _Unit) -> bool:
        layer = unit.layer_id
        return (
            layer is not None
            and unit.slots is None
            and units_per_layer[layer] <= num_slots
            and count[layer][unit.slot] > 1
        )

    crowded = [unit for unit in units if is_crowded(unit)]
    if not crowded:
        return
    heaviest = max(loads)
    # cost -> slot -> units of that cost on that slot (the candidates for rotations).
    same_cost_at: dict[int, dict[int, list[_Unit]]] = {}
    for unit in units:
        if unit.slots is None:  # a pinned unit never moves (see [Note: expert parallelism])
            same_cost_at.setdefault(unit.cost, {}).setdefault(unit.slot, []).append(unit)
    # (load, slot) entries; an entry is stale when its load differs from loads[slot].
    by_load = [(load, slot) for slot, load in enumerate(loads)]
    heapq.heapify(by_load)

    def relocate(unit: _Unit, slot: int) -> None:
        if unit.layer_id is not None:
            per_slot = count[unit.layer_id]
            per_slot[unit.slot] -= 1
            per_slot[slot] = per_slot.get(slot, 0) + 1
        at_slot = same_cost_at[unit.cost]
        at_slot[unit.slot].remove(unit)
        at_slot.setdefault(slot, []).append(unit)
        loads[unit.slot] -= unit.cost
        loads[slot] += unit.cost
        unit.slot = slot

    def holds(layer: str | None, slot: int) -> bool:
        return layer is not None and count[layer].get(slot, 0) > 0

    def least_loaded_without(layer: str) -> int | None:
        passed_over = []
        passed_slots = set()
        found = None
        while by_load:
            load, slot = by_load[0]
            if load != loads[slot] or slot in passed_slots:
                heapq.heappop(by_load)  # stale or duplicate
            elif holds(layer, slot):
                passed_slots.add(slot)
                passed_over.append(heapq.heappop(by_load))
            else:
                found = slot
                break
        for entry in passed_over:
            heapq.heappush(by_load, entry)
        return found

    # Lightest colliding units first: they are the easiest to fit elsewhere.
    for unit in reversed(crowded):
        if not is_crowded(unit):
            continue  # an earlier repair already resolved this collision
        target = least_loaded_without(unit.layer_id)
        if target is not None and loads[target] + unit.cost <= heaviest:
            source = unit.slot
            relocate(unit, target)
            heapq.heappush(by_load, (loads[source], source))
            heapq.heappush(by_load, (loads[target], target))
            continue
        rotation = _find_rotation(unit, same_cost_at[unit.cost], num_slots, holds)
        for moved, slot in rotation or ():
            relocate(moved, slot)


def _find_rotation(
    unit: _Unit,
    same_cost_at: dict[int, list[_Unit]],
    num_slots: int,
    holds: Callable[[str | None, int], bool],
) -> list[tuple[_Unit, int]] | None:
    """A cycle of equal-cost moves (loads unchanged) that takes ``unit`` off its crowded slot.

    Breadth-first over slots: ``unit`` moves to a slot without its layer, a unit there moves on
    to a slot without *its* layer, ... until one can move into ``unit``'s old slot. Returns the
    moves ``[(unit, slot), ...]`` or None. Each slot receives at most one unit, whose layer was
    absent there, so applying the cycle creates no collision and removes ``unit``'s.
    """
    home = unit.slot
    # Fast path, the usual case: a direct swap (the first cycle breadth-first search would find).
    for slot in range(num_slots):
        if slot == home or holds(unit.layer_id, slot):
            continue
        for other in same_cost_at.get(slot, ()):
            if not holds(other.layer_id, home):
                return [(unit, slot), (other, home)]
    arrived_by: dict[int, tuple[int, _Unit]] = {}  # slot -> (previous slot, unit that moved in)
    queue: list[int] = []
    unvisited = [slot for slot in range(num_slots) if slot != home]

    def visit_from(source: int, mover: _Unit) -> None:
        nonlocal unvisited
        blocked = []
        for slot in unvisited:
            if holds(mover.layer_id, slot):
                blocked.append(slot)
            else:
                arrived_by[slot] = (source, mover)
                queue.append(slot)
        unvisited = blocked

    visit_from(home, unit)
    head = 0
    while head < len(queue):
        slot = queue[head]
        head += 1
        for evicted in same_cost_at.get(slot, ()):
            if not holds(evicted.layer_id, home):
                moves = [(evicted, home)]
                while slot != home:
                    previous, mover = arrived_by[slot]
                    moves.append((mover, slot))
                    slot = previous
                return moves[::-1]
            if unvisited:
                visit_from(slot, evicted)
    return None
