"""When data moves: the forward and backward hooks on hook-boundary modules.

Owns the per-model protocol state (the boundaries, their forward order, the end-of-backward
callback, gradient-sync on/off) and the hook functions. What moves is ``group``'s concern; this
module only decides when.

The state answers for itself: the modules around it change it through its methods, never by
writing its fields (``tests/core/test_model_state.py``). The optimizer attaches its overlapped
step (``attach_overlap``) and its offloaded masters (``attach_offload``, which tells each
``DedicatedParam`` where its master lives); ``dmuon.no_sync`` runs under
``without_gradient_sync``; ``dmuon.checkpoint`` reads and loads under ``reading_checkpoint`` and
``loading_checkpoint_elsewhere``, a plain ``load_state_dict`` calls ``note_masters_loaded``;
``dmuon.data_parallel`` hands it the FSDP modules it found (``remember_fsdp_reducers``).

One training step, as the hooks see it (each boundary ``b`` advances itself: ``group``)::

    pre-forward(b)   b.pre_forward: unshard b (wait for its broadcast), register its unsharded
                     params; prefetch the next boundary, wrap b's inputs to detect b's
                     post-backward
    post-forward(b)  b.post_forward: placeholders back; Z3: free; hook b's outputs for
                     pre-backward
    pre-backward(b)  b.pre_backward: unshard b again (Z3), register params; prefetch the
                     previous boundary
    post-backward(b) b.finish_backward after its last use: placeholders back, free, reduce b's
                     gradients to their owners; the sent messages of boundaries
                     REDUCES_IN_FLIGHT back are waited for and freed
    end of backward  finish boundaries whose inputs needed no grad; b.finalize_backward: wait;
                     gradients to masters
    step             the optimizer asks the state: before_step (drain publishes, free),
                     after_step (refresh from the masters and publish)

A boundary used k times in one forward expects k post-backwards: see [Note: backward passes of
one forward] in ``group``.

[Note: a boundary skipped on some ranks only]
Each boundary's broadcasts and gradient reduces pair up across ranks by the order they are
issued in. Data-dependent control flow that skips a boundary on some ranks only (a vision tower
on text-only batches, a layer dropped by a per-rank random draw) breaks that pairing: the ranks
that ran it wait for collectives the others never issue (or issue later, for another boundary),
as under FSDP2, until the process-group timeout; each rank's error names the collective and the
boundary it was for. Telling every rank at once would need a collective in every forward, which
dmuon does not pay. What one rank can see alone it says at once: a boundary that comes before
the current one in the forward order the first forward recorded and has not run in this forward
(``_warn_on_skipped_boundaries``, once per boundary; harmless where every rank skips it alike).
The fix is the user's: run the boundary on every rank (on a dummy input where there is no data),
or keep the branch inside one boundary.

[Note: activation checkpointing]
With non-reentrant checkpointing a boundary's forward re-runs inside backward. Its outputs'
pre-backward hook fires before the recompute, so the boundary is already unsharded; the
pre-forward hook then only re-registers the unsharded parameters, and the post-forward hook
leaves everything in place. Inside backward the hooks never issue a collective of their own.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from dmuon import _profiler_labels as labels
from dmuon._torch_internals import (
    fsdp_input_cast_dtype,
    in_backward,
    profiler_range,
    queue_end_of_backward,
    tree_flatten,
    tree_unflatten,
)
from dmuon.experts import mark_expert_piece, piece_original, stacks_of
from dmuon.group import (
    AveragedGradients,
    BoundaryGroup,
    GradientMessage,
    assign_to_masters,
    average_messages,
)
from dmuon.mesh import OwnershipMesh
from dmuon.offload import MasterOffload
from dmuon.param import DedicatedParam, is_dedicated
from dmuon.partition import OwnershipPlan
from dmuon.profile import ForwardUnshardProfile

# Boundaries whose gradient reduces may be in flight at once, this rank's messages of segments it
# does not own kept alive for them; older ones are waited for and freed (as FSDP2 bounds its
# reduce-scatters), so backward holds O(1) boundaries of sent gradients, not all of them.
REDUCES_IN_FLIGHT = 2


class GradientListener(Protocol):
    """What takes each boundary's gradients as they land during backward: the overlapped step
    (``dmuon.Muon(..., overlap_step=True)``, ``dmuon.overlap``)."""

    def landing(self) -> contextlib.AbstractContextManager:
        """Where a landing runs: the side stream on CUDA, inline elsewhere."""

    def landed(
        self, group: BoundaryGroup, received: list[GradientMessage], averaged: AveragedGradients
    ) -> None:
        """The owned gradients of ``group`` are final for this backward (``averaged``)."""

    def before_masters_take_gradients(self) -> None:
        """End of backward: the landings' averaging must be ordered before what reads the
        masters' gradients next (work the listener started on them may go on)."""

    def gradients_cleared(self) -> None:
        """``zero_grad``: the gradients the landings read are gone."""


class DedicatedState:
    """Everything ``dedicate_params`` set up on one model."""

    def __init__(
        self,
        *,
        model: nn.Module,
        mesh: OwnershipMesh,
        plan: OwnershipPlan,
        params: dict[str, DedicatedParam],
        boundaries: list[BoundaryGroup],
        route_overrides: dict[str, str],
        gradient_divisor: Callable[[DedicatedState], float],
        profile: ForwardUnshardProfile | None = None,
    ) -> None:
        self.model = model
        self.mesh = mesh
        self.plan = plan
        self.params = params
        self.boundaries = boundaries
        # FQN -> route for every parameter ``dedicate_params(..., routes=...)`` routed.
        self.route_overrides = route_overrides
        # What the owners divide the gradients summed over the grid by, read at each end of
        # backward (``dmuon.data_parallel.gradient_divisor``: the mean, or the model's factor).
        self._gradient_divisor = gradient_divisor
        # (FQN, module) of the FSDP modules that reduce the rest of the model, found once
        # dmuon.Muon looked (``dmuon.data_parallel``). Kept here, not in a table keyed by the
        # state: the modules reference the state, and such a table would keep the model alive.
        self._fsdp_reducers: list[tuple[str, nn.Module]] | None = None
        self.stacks = stacks_of(params.values())  # FQN -> expert stack (see ``dmuon.experts``)
        self.profile = profile  # forward-unshard wait counters (DMUON_RECORD_FORWARD_PROFILE=1)
        self._requires_gradient_sync = True  # off inside dmuon.no_sync
        self.is_adopted = False
        # Counts the changes of the gradients as a whole (completed backwards, zero_grad calls):
        # a decision on them (see ``dmuon.step_group``) holds while it is unchanged.
        self.gradient_generation = 0
        # Set by dmuon.checkpoint while it reads (its entry maker) or loads the model, and by a
        # plain load_state_dict, whose masters the next forward publishes (see
        # [Note: loading into a dedicated parameter] in ``module_state``).
        self._checkpoint_reading: Callable[[Any], torch.Tensor | None] | None = None
        self._checkpoint_loading = False
        self._masters_loaded = False
        # Forward order of the boundaries, recorded during the first forward; prefetch uses it.
        self._forward_order: list[BoundaryGroup] = []
        # Position of each boundary in the forward order, once the first forward has closed it.
        self._forward_position: dict[BoundaryGroup, int] | None = None
        # Boundaries that ran a grad-enabled forward in the current forward pass, in order (see
        # [Note: backward passes of one forward]).
        self._forwarded: list[BoundaryGroup] = []
        # A backward finished since the last grad-enabled forward: the next one starts a pass.
        self._backward_since_forward = False
        # Boundaries that reduced in this backward, in order (see REDUCES_IN_FLIGHT).
        self._reduced: list[BoundaryGroup] = []
        # Set by dmuon.Muon(overlap_step=True) (``attach_overlap``): each boundary's owned gradients land (are
        # waited for, averaged and handed to it) as soon as the boundary has reduced, during
        # backward, instead of at its end (see [Note: the overlapped step] in dmuon.overlap).
        self._gradient_listener: GradientListener | None = None
        # Set by dmuon.Muon(offload_masters=True) (``attach_offload``): the CPU homes that hold
        # the owned Muon masters between steps (every rank sets it, owner of some or not).
        self._master_offload: MasterOffload | None = None
        self._landed: list[AveragedGradients] = []  # this backward's landings, in order
        self._end_of_backward_queued = False
        # The forward now running: the boundaries run, and the furthest position reached in the
        # forward order (see [Note: a boundary skipped on some ranks only]); those warned of.
        self._ran_this_forward: set[BoundaryGroup] = set()
        self._last_position = 0
        self._warned_skipped: set[BoundaryGroup] = set()
        # Boundaries whose dtypes the first forward looked at (_warn_on_mixed_compute_dtypes).
        self._dtypes_checked: set[BoundaryGroup] = set()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # Run by after_step between the update and the publish (register_master_update_hook).
        self._master_update_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()

    @property
    def device(self) -> torch.device:
        """Where the dedicated weights live (the CPU when nothing is dedicated)."""
        return self.boundaries[0].device if self.boundaries else torch.device("cpu")

    @property
    def gradient_listener(self) -> GradientListener | None:
        """What takes each boundary's gradients as they land (``attach_overlap``), if any."""
        return self._gradient_listener

    @property
    def requires_gradient_sync(self) -> bool:
        """False inside ``dmuon.no_sync`` (``without_gradient_sync``): backward keeps the
        gradients local."""
        return self._requires_gradient_sync

    @property
    def fsdp_reducers(self) -> list[tuple[str, nn.Module]] | None:
        """The FSDP modules that reduce the rest of the model, once ``remember_fsdp_reducers``
        was told them (None before)."""
        return self._fsdp_reducers

    @property
    def checkpoint_reading(self) -> Callable[[Any], torch.Tensor | None] | None:
        """The entry maker of the checkpoint read now running (``reading_checkpoint``), if any."""
        return self._checkpoint_reading

    @property
    def checkpoint_loading(self) -> bool:
        """A checkpoint load that takes the dedicated keys itself is running
        (``loading_checkpoint_elsewhere``)."""
        return self._checkpoint_loading

    # ---- setup --------------------------------------------------------------------------------

    def register_hooks(self) -> None:
        self._follow_model_zero_grad()
        for group in self.boundaries:
            self._handles.append(
                group.module.register_forward_pre_hook(
                    functools.partial(_pre_forward, self, group), with_kwargs=True
                )
            )
            self._handles.append(
                group.module.register_forward_hook(functools.partial(_post_forward, self, group))
            )

    def _follow_model_zero_grad(self) -> None:
        """``model.zero_grad()`` clears the owners' master gradients too.

        The masters are not parameters of the model, so ``Module.zero_grad`` cannot see them; yet
        their gradients must follow torch's rules (accumulate over backwards until zeroed) for
        the usual loop, a skipped step, and accumulation alike. The model's own ``zero_grad``
        is wrapped on this instance, and still runs.
        """
        module_zero_grad = self.model.zero_grad

        @functools.wraps(module_zero_grad)
        def zero_grad(set_to_none: bool = True) -> None:
            module_zero_grad(set_to_none)
            self.zero_master_grads(set_to_none)

        object.__setattr__(self.model, "zero_grad", zero_grad)

    def zero_master_grads(self, set_to_none: bool = True) -> None:
        self.gradient_generation += 1
        if self._gradient_listener is not None:
            self._gradient_listener.gradients_cleared()
        for p in self.params.values():
            if p.master is not None and p.master.grad is not None:
                if set_to_none:
                    p.master.grad = None
                else:
                    p.master.grad.zero_()
            if p.unsharded is not None:  # gradients kept locally under no_sync
                p.unsharded.grad = None
        for stack in self.stacks.values():
            if stack.unsharded is not None:
                stack.unsharded.grad = None

    def ensure_adopted(self) -> None:
        """Move the weights into the owners' segments (deferred for meta-device models)."""
        if self.is_adopted:
            return
        for p in self.params.values():
            current = p.module._parameters[p.attr]
            if current is not p.placeholder:
                p.original = current if p.experts is None else piece_original(p, current)
            if p.original is None or p.original.is_meta:
                raise RuntimeError(
                    f"dedicated parameter {p.fqn!r} is still on the meta device. Materialise the "
                    "model (model.to_empty(device=...) and initialise the weights) before the "
                    "first forward and before constructing dmuon.Muon."
                )
        for group in self.boundaries:
            group.build_segments(next(iter(group.params)).original.device)
        for stack in self.stacks.values():
            stack.bind(stack.pieces[0].original.device)
        for group in self.boundaries:
            group.adopt()
            group.register_placeholders()
        for p in self.params.values():
            if p.experts is not None and p.master is not None:
                mark_expert_piece(p.master)  # the optimizer sees k expert matrices
        self.is_adopted = True

    # ---- what the optimizer attaches ------------------------------------------------------------

    def check_can_take_optimizer(self, *, overlap_step: bool) -> None:
        """Refuse a new ``dmuon.Muon`` before anything takes it (the step group, this state):
        one whose ``overlap_step`` would be this model's second listener, or any other while
        an ``offload_masters=True`` optimizer's CPU homes hold the masters. The same facts on
        every rank, so every rank raises alike."""
        if overlap_step and self._gradient_listener is not None:
            raise ValueError(OVERLAP_ALREADY_ATTACHED)
        if self._master_offload is not None:
            raise ValueError(OFFLOAD_ALREADY_ATTACHED)

    def attach_overlap(self, listener: GradientListener) -> None:
        """``dmuon.Muon(..., overlap_step=True)``: from now on each boundary's owned gradients land
        in ``listener`` as soon as the boundary has reduced (``_land``). One per model."""
        if self._gradient_listener is not None:
            raise ValueError(OVERLAP_ALREADY_ATTACHED)
        self._gradient_listener = listener

    def attach_offload(self, masters: Iterable[torch.Tensor]) -> MasterOffload:
        """``dmuon.Muon(..., offload_masters=True)``: the masters this rank owns among ``masters``
        move to CPU homes between steps; each one's ``DedicatedParam`` is told where its value
        lives (``master_value()``, a publish: [Note: offloaded masters] in ``dmuon.offload``).
        One per model: a second would take the first's NaN stand-ins for the masters."""
        if self._master_offload is not None:
            raise ValueError(OFFLOAD_ALREADY_ATTACHED)
        chosen = {id(master) for master in masters}
        owned = [
            (p, self.boundary_of(p)) for p in self.iter_owned_masters() if id(p.master) in chosen
        ]
        offload = MasterOffload(owned, self.device)
        for p, _ in owned:
            p.offload = offload
        self._master_offload = offload
        return offload

    def remember_fsdp_reducers(self, reducers: list[tuple[str, nn.Module]]) -> None:
        """(FQN, module) of the FSDP modules that reduce the rest of the model, as
        ``dmuon.data_parallel`` found them when ``dmuon.Muon`` looked."""
        self._fsdp_reducers = reducers

    # ---- gradient sync and checkpoints ------------------------------------------------------------

    @contextlib.contextmanager
    def without_gradient_sync(self) -> Iterator[None]:
        """Inside, backward reduces no gradient to the owners: they accumulate locally
        (``dmuon.no_sync``)."""
        previous = self._requires_gradient_sync
        self._requires_gradient_sync = False
        try:
            yield
        finally:
            self._requires_gradient_sync = previous

    @contextlib.contextmanager
    def reading_checkpoint(
        self, make_entry: Callable[[Any], torch.Tensor | None]
    ) -> Iterator[None]:
        """Inside, ``state_dict()`` holds ``make_entry(p)`` for each dedicated parameter or stack
        (no key where it returns None): ``dmuon.checkpoint``'s reads."""
        previous = self._checkpoint_reading
        self._checkpoint_reading = make_entry
        try:
            yield
        finally:
            self._checkpoint_reading = previous

    @contextlib.contextmanager
    def loading_checkpoint_elsewhere(self) -> Iterator[None]:
        """Inside, ``load_state_dict()`` leaves the dedicated keys alone: the caller
        (``dmuon.checkpoint``) takes them."""
        previous = self._checkpoint_loading
        self._checkpoint_loading = True
        try:
            yield
        finally:
            self._checkpoint_loading = previous

    def note_masters_loaded(self) -> None:
        """A plain ``load_state_dict`` wrote the masters: the next forward (or
        ``dmuon.checkpoint`` call) publishes them (``publish_loaded_masters``)."""
        self._masters_loaded = True

    # ---- prefetch order -------------------------------------------------------------------------

    def _record_forward(self, group: BoundaryGroup) -> None:
        if self._forward_position is not None:
            return
        if group in self._forward_order:  # the second forward has begun: the order is known
            self._forward_position = {g: i for i, g in enumerate(self._forward_order)}
        else:
            self._forward_order.append(group)

    def _warn_on_skipped_boundaries(self, group: BoundaryGroup) -> None:
        """See [Note: a boundary skipped on some ranks only]. O(1) but where a boundary was
        skipped: the boundaries between the last one run in this forward and ``group``."""
        position = None if self._forward_position is None else self._forward_position.get(group)
        if position is None:
            return
        if position == 0:  # a forward begins
            self._ran_this_forward.clear()
            self._last_position = 0
        elif position > self._last_position + 1:
            skipped = [
                g
                for g in self._forward_order[self._last_position + 1 : position]
                if g not in self._ran_this_forward and g not in self._warned_skipped
            ]
            if skipped:
                self._warned_skipped.update(skipped)
                warnings.warn(
                    SKIPPED_BOUNDARY.format(
                        skipped=", ".join(g.label for g in skipped),
                        rank=f"rank {dist.get_rank()}" if dist.is_initialized() else "this rank",
                        current=group.label,
                    ),
                    UserWarning,
                    stacklevel=3,
                )
        self._ran_this_forward.add(group)
        self._last_position = max(self._last_position, position)

    def _neighbour(self, group: BoundaryGroup, step: int) -> BoundaryGroup | None:
        position = None if self._forward_position is None else self._forward_position.get(group)
        if position is None:
            return None
        index = position + step
        return self._forward_order[index] if 0 <= index < len(self._forward_order) else None

    # ---- backward bookkeeping -------------------------------------------------------------------

    def _queue_end_of_backward(self) -> None:
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            queue_end_of_backward(self._end_of_backward)

    def _start_forward_pass(self) -> None:
        """Forget the previous pass's boundaries once a backward has consumed it."""
        if self._backward_since_forward:
            self._backward_since_forward = False
            for group in self._forwarded:
                group.forget_forward_pass()
            self._forwarded.clear()

    def _finish_backward(self, group: BoundaryGroup) -> None:
        group.finish_backward(reduce=self._requires_gradient_sync)
        if self._requires_gradient_sync:
            self._reduced.append(group)
            if len(self._reduced) > REDUCES_IN_FLIGHT:
                self._reduced[-1 - REDUCES_IN_FLIGHT].retire_sent_reduces()
            if self._gradient_listener is not None:
                self._land(group)

    def _land(self, group: BoundaryGroup) -> None:
        """The overlapped step: this boundary's owned gradients, final for this backward, are
        averaged now and handed to the listener (which starts the owner step on them)."""
        listener = self._gradient_listener
        with listener.landing():
            received = group.land_local_reduces()
            averaged = average_messages(received, self._gradient_divisor(self))
            listener.landed(group, received, averaged)
        self._landed.append(averaged)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        self._backward_since_forward = True
        self.gradient_generation += 1
        forwarded = list(dict.fromkeys(self._forwarded))  # unique, in forward order
        with profiler_range(labels.FINALIZE_BACKWARD):
            # Boundaries whose inputs needed no grad never saw their post-backward: finish them
            # in reverse forward order, the same on every rank.
            for group in reversed(forwarded):
                if not group.finished_backward:
                    self._finish_backward(group)
            received = []
            for group in reversed(forwarded):
                received += group.finalize_backward(reduce=self._requires_gradient_sync)
            self._reduced.clear()
            landed, self._landed = self._landed, []
            if landed:
                self._gradient_listener.before_masters_take_gradients()
            # One division for the whole backward, or one per landed boundary: the same numbers
            # (element-wise), and one read of the produced flags either way.
            divisor = self._gradient_divisor(self)
            assign_to_masters([*landed, average_messages(received, divisor)])

    # ---- the optimizer step ---------------------------------------------------------------------

    def before_step(self) -> None:
        """The masters are about to change: a publish still in flight from the previous step
        reads the weights (two steps without a forward in between stay correct), and a copy
        left unsharded would serve the next forward the weights of before (``reshard_all``).
        No segment counts as written by this step yet: a mark left by a step that failed
        before its publish is forgotten ([Note: the step writes the segments] in
        ``dmuon.muon_route``)."""
        self.wait_all_replicate_broadcasts()
        self.reshard_all()
        for p in self.iter_owned_masters():
            p.segment_fresh = False

    def after_step(self, *, asynchronous: bool) -> None:
        """The masters changed: every copy of the weights follows (collective). Asynchronous:
        the HSDP publish is waited for by the next forward (or ``before_step``)."""
        for hook in self._master_update_hooks.values():
            hook()
        self.publish_masters(wait=not asynchronous)

    def register_master_update_hook(
        self, hook: Callable[[], None]
    ) -> torch.utils.hooks.RemovableHandle:
        """``hook()`` runs in every ``after_step``: after the optimizer updated the weights (the
        owners' masters, FSDP2's shards) and before the masters are published, so what it
        writes into them reaches every copy with the step's own publish (``dmuon.QKClip``)."""
        handle = torch.utils.hooks.RemovableHandle(self._master_update_hooks)
        self._master_update_hooks[handle.id] = hook
        return handle

    # ---- loading weights ------------------------------------------------------------------------

    def boundary_of(self, p: DedicatedParam) -> BoundaryGroup:
        return next(group for group in self.boundaries if p in group.params)

    def load_full_value(self, p: DedicatedParam, value: torch.Tensor) -> None:
        """Write a full value this rank was given into every copy of ``p`` it holds."""
        self.wait_all_replicate_broadcasts()
        self.boundary_of(p).load_full_value(p, value)

    def publish_masters(self, *, wait: bool = True) -> None:
        """After the masters changed: every copy of the weights follows (collective)."""
        with profiler_range(labels.PUBLISH):
            for group in self.boundaries:
                group.refresh_from_masters()
                group.publish()
                if wait:
                    group.wait_for_publish()

    def publish_loaded_masters(self) -> None:
        """Publish the masters a plain ``load_state_dict`` changed, if it did (collective: every
        rank calls it at the same point, the next forward or ``dmuon.checkpoint`` call)."""
        if self._masters_loaded:
            self._masters_loaded = False
            self.reshard_all()  # a boundary left unsharded holds the weights of before
            self.publish_masters()

    # ---- user-facing drains ---------------------------------------------------------------------

    def reshard_all(self) -> None:
        """Free every boundary still unsharded before the weights change.

        Only a grad-enabled forward whose backward never ran leaves one so under Z2 (a
        validation loss computed with grad on); its copy would serve the next forward the
        weights of before the step. Freed, the next forward broadcasts the new ones. No
        collective is issued, so the protocol's order is unchanged.
        """
        for group in self.boundaries:
            if group.is_unsharded or group.is_unsharding:
                group.reshard()

    def wait_all_replicate_broadcasts(self) -> None:
        for group in self.boundaries:
            group.wait_for_publish()

    def owned_segment_values(self) -> dict[int, torch.Tensor]:
        """id(p) -> the value of each parameter this rank owns in its local segment
        (``BoundaryGroup.local_values``: views that stay valid), which the step may write."""
        return {
            id(p): value
            for group in self.boundaries
            for p, value in group.local_values()
            if p.master is not None
        }

    def iter_owned_masters(self) -> Iterator[DedicatedParam]:
        for p in self.params.values():
            if p.master is not None:
                yield p


# ---- the hooks ------------------------------------------------------------------------------


def _pre_forward(
    state: DedicatedState, group: BoundaryGroup, module: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict] | None:
    if in_backward():  # activation-checkpoint recompute: see [Note: activation checkpointing]
        group.recompute_forward()
        return None
    state.ensure_adopted()
    state.publish_loaded_masters()
    if state._forward_position is None:  # the first forward: look once, cheaply
        _warn_on_mixed_compute_dtypes(state, group, module, args, kwargs)
    state._record_forward(group)
    state._warn_on_skipped_boundaries(group)
    if state.profile is not None:
        state.profile.record(group.name, group.is_unsharding, group.device, group.wait_for_unshard)
    backward_follows = torch.is_grad_enabled()
    if backward_follows:
        state._start_forward_pass()
    group.pre_forward(backward_follows=backward_follows)
    following = state._neighbour(group, +1)
    if following is not None:
        following.unshard()
    if not backward_follows:
        return None
    return _attach_post_backward(state, group, args, kwargs)


OVERLAP_ALREADY_ATTACHED = (
    "dmuon.Muon(overlap_step=True): this model already has an optimizer with "
    "overlap_step=True; each model (each pipeline stage) takes one dmuon.Muon."
)

OFFLOAD_ALREADY_ATTACHED = (
    "dmuon.Muon: this model already has an optimizer with offload_masters=True, whose CPU homes "
    "hold the Muon masters between steps (the parameters hold NaN stand-ins); another optimizer "
    "would step or offload those stand-ins. Each model (each pipeline stage) takes one "
    "dmuon.Muon: keep stepping the first."
)

SKIPPED_BOUNDARY = (
    "dmuon: boundary {skipped} did not run in this forward on {rank}, though it comes before "
    "{current} in the forward order the first forward recorded. Every rank must run the same "
    "hook boundaries in every forward: dmuon's broadcasts and gradient reduces pair up across "
    "ranks by order, so if another rank ran it, the ranks wait for each other until the "
    "process-group timeout. Run the boundary on every rank (on a dummy input where a rank has no "
    "data for it), or keep the data-dependent branch inside one boundary "
    "(dedicate_params(..., hook_boundary_predicate=...)). If every rank skipped it alike, this "
    "is harmless."
)

MIXED_COMPUTE_DTYPES = (
    "dmuon: the inputs of {boundary} are {inputs}{cast} but its dedicated weights compute in "
    "{weights} (param_policy.defaults.param_dtype of dedicate_params; None keeps the parameter's "
    "dtype), so the first matmul that mixes them will fail with torch's dtype error (\"expected "
    'm1 and m2 to have the same dtype"). Make the two agree: compute the dedicated weights in '
    "the dtype of the rest of the model (dmuon.dedicate_params(..., param_policy={{'defaults': "
    "{{'param_dtype': {inputs}}}}})), or give the rest of the model the dedicated weights' "
    "(fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype={weights})) on every module), "
    "or run forward under torch.autocast."
)


def _warn_on_mixed_compute_dtypes(
    state: DedicatedState, group: BoundaryGroup, module: nn.Module, args: tuple, kwargs: dict
) -> None:
    """A boundary's input activations (its first floating input, as FSDP2's mixed precision
    will cast it: dmuon's hooks run before FSDP2's) in another dtype than its dedicated weights,
    with autocast off, make the first matmul fail with torch's bare dtype error: say which
    dtypes and how to make them agree, just before. Looked at once per boundary, in the first
    forward."""
    if group in state._dtypes_checked or torch.is_autocast_enabled(group.device.type):
        return
    state._dtypes_checked.add(group)
    floating = next(
        (
            t
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ),
        None,
    )
    if floating is None:
        return
    cast = fsdp_input_cast_dtype(module)
    inputs = cast or floating.dtype
    weights = {p.param_dtype for p in group.params}
    if weights == {inputs}:
        return
    warnings.warn(
        MIXED_COMPUTE_DTYPES.format(
            boundary=group.name or "the root module",
            inputs=inputs,
            cast=" (as FSDP2's MixedPrecisionPolicy casts them)" if cast is not None else "",
            weights=", ".join(sorted(str(w) for w in weights)),
        ),
        UserWarning,
        stacklevel=2,
    )


def _post_forward(
    state: DedicatedState, group: BoundaryGroup, module: nn.Module, args: tuple, output: Any
) -> None:
    if in_backward():
        return None
    grad_tensors = [
        t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    group.post_forward(backward_follows=bool(grad_tensors))
    if grad_tensors:
        state._forwarded.append(group)
        hook = functools.partial(_pre_backward, state, group)
        for tensor in grad_tensors:
            tensor.register_hook(hook)
    return None  # the output object is returned untouched (ModelOutput, dataclasses, ...)


def _pre_backward(state: DedicatedState, group: BoundaryGroup, grad: torch.Tensor) -> None:
    state._queue_end_of_backward()
    if group.pre_backward():
        previous = state._neighbour(group, -1)
        if previous is not None and previous in state._forwarded:
            previous.unshard()
    return None


def _on_post_backward(state: DedicatedState, group: BoundaryGroup) -> None:
    # A boundary used k times in one forward sees k post-backwards; it finishes after the last.
    if group.post_backward():
        state._finish_backward(group)


class _PostBackward(torch.autograd.Function):
    """Identity on a boundary's inputs; its backward runs once the boundary's backward is done."""

    @staticmethod
    def forward(ctx, callback, *inputs: torch.Tensor):  # type: ignore[override]
        ctx.callback = callback
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.callback()
        return (None, *grads)


def _attach_post_backward(
    state: DedicatedState, group: BoundaryGroup, args: tuple, kwargs: dict
) -> tuple[tuple, dict] | None:
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return None
    callback = functools.partial(_on_post_backward, state, group)
    wrapped = _PostBackward.apply(callback, *(leaves[i] for i in positions))
    for i, tensor in zip(positions, wrapped):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


# ---- the state on its model ------------------------------------------------------------------

_STATE_ATTR = "_dmuon_state"


def attach_state(model: nn.Module, state: DedicatedState) -> None:
    object.__setattr__(model, _STATE_ATTR, state)


def find_dedicated_state(model: nn.Module) -> DedicatedState | None:
    return getattr(model, _STATE_ATTR, None)


def get_dedicated_state(model: nn.Module) -> DedicatedState:
    state = getattr(model, _STATE_ATTR, None)
    inner = getattr(model, "module", None)
    if state is None and isinstance(inner, nn.Module) and hasattr(inner, _STATE_ATTR):
        raise ValueError(
            f"{type(model).__name__} wraps the model dedicate_params prepared; dmuon takes that "
            "model itself: pass model.module (dmuon.Muon(ddp_model.module, ...), "
            "dmuon.no_sync(ddp_model.module), dmuon.checkpoint.get_state_dict(ddp_model.module, "
            "optimizer))."
        )
    if state is None and any(is_dedicated(p) for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} is a part of the model dmuon.dedicate_params prepared: pass "
            "that whole model (the one given to dedicate_params) to dmuon.Muon, dmuon.checkpoint "
            "and dmuon.no_sync."
        )
    if state is None:
        raise ValueError(
            f"{type(model).__name__} has no dedicated parameters: call "
            "dmuon.dedicate_params(model, mesh, predicate) before fully_shard and before "
            "constructing dmuon.Muon(model, ...)."
        )
    return state
