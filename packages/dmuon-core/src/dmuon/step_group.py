"""``dmuon.StepGroup``: the ``dmuon.Muon`` optimizers that take one training step together.

Owns which optimizers form one step (the parts of a model this rank holds, and through the
pipeline group the stages other ranks hold) and the decisions they must share: whether this
step's gradients are finite, and (``agreed_minimum``) the step the Newton-Schulz kernels switch
on. It must not touch gradients or weights, nor compute norms
(``clip`` does; it reduces its norm over ``pp_group``).

[Note: one step, several optimizers]
Under pipeline parallelism a model is cut into stages, one or more per rank (interleaved
schedules give a rank several chunks), each a module of its own with its own ``dedicate_params``
and its own ``dmuon.Muon``, as torchtitan does. The stages' weights only stay in step if every
optimizer of every stage takes the same decision: a NaN gradient on stage 0 must make stage 1
skip too, and the other chunks of the same rank. Each rank's first optimizer to step decides for
all of the group's optimizers on it: one fused check over all their gradients, one flag
all-reduced over each distinct ownership grid, over the TP ranks and over the pipeline group;
the others reuse that verdict. When ``dmuon.clip_grad_norm_`` ran over the group since the
gradients last changed, its total norm (already reduced over every stage) decides: a finite norm
means finite gradients, so the check then costs nothing; only a non-finite one runs the check,
to name the parameters. A verdict holds while the gradients are unchanged: every optimizer's
model counts its completed backwards and ``zero_grad`` calls (``DedicatedState``'s
``gradient_generation``), and a verdict or a clip's norm taken at other counts is not reused.

The pipeline group is the trainer's own (``pp_mesh.get_group()``): dmuon's collectives on it are
synchronous and run between the schedule's last backward and the optimizer step, when the
schedule has no send or receive in flight, so nothing interleaves with them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dmuon import collectives
from dmuon.consistency import check_ranks_agree
from dmuon.nonfinite import PendingFlag, nonfinite_gradients

if TYPE_CHECKING:
    from dmuon.hooks import DedicatedState


@dataclass(frozen=True, slots=True, eq=False)
class StepMember:
    """What the step group knows of one optimizer (one part of the model)."""

    optimizer: object  # the ``dmuon.Muon``: its identity only
    state: DedicatedState  # the part's model: gradient generations, grids, device
    nonfinite: str  # its ``nonfinite=`` policy
    # (canonical FQN, this rank's gradient) of everything it steps that has a gradient.
    named_gradients: Callable[[], list[tuple[str, torch.Tensor]]]
    # Whether it starts a background kernel compile: the stages' switch agreement is a collective
    # over the pipeline group, so the stages must agree on it (``dmuon.kernel_switch``).
    background_compile: bool = False


class StepGroup:
    """The optimizers of one training step: the parts of a model on this rank, and the pipeline
    stages on other ranks.

    Build one on every rank, with the pipeline dim of the mesh when there is one, and give it to
    every part's optimizer; clip over all the parts at once::

        step_group = dmuon.StepGroup(pp_mesh=mesh["pp"])
        optimizers = [dmuon.Muon(part, ..., step_group=step_group) for part in model_parts]
        ...
        schedule.step(inputs, target=targets, losses=losses)
        dmuon.clip_grad_norm_(model_parts, optimizers, max_norm)  # one norm over all stages
        for optimizer in optimizers:
            optimizer.step()  # nonfinite="skip": every stage skips, or none does

    Every rank gives it the same number of optimizers (one per stage it holds), in stage order.
    Without a pipeline, a ``StepGroup()`` still ties several models of one rank trained together
    into one step. An optimizer given none has a group of its own.

    Args:
        pp_mesh: the 1-D pipeline dim of the device mesh (``mesh["pp"]``), or its process group;
            None when no pipeline spans ranks.
    """

    def __init__(self, pp_mesh: DeviceMesh | dist.ProcessGroup | None = None) -> None:
        self.pp_group = _pipeline_group(pp_mesh)
        self.members: list[StepMember] = []
        # (gradient generations, names of non-finite gradients) of the last verdict, and the
        # optimizers that have used it.
        self._verdict: tuple[tuple[int, ...], list[str]] | None = None
        self._verdict_users: set[int] = set()
        # (gradient generations, the clipped norm is finite) of the last clip over the group.
        self._clip_norm: tuple[tuple[int, ...], PendingFlag] | None = None

    def join(self, member: StepMember) -> None:
        """Add an optimizer (``dmuon.Muon`` does it at construction); collective over the
        pipeline group, whose ranks must add their optimizers in the same order."""
        if any(joined.state is member.state for joined in self.members):
            raise ValueError(
                "dmuon.StepGroup: this model already has an optimizer in the step group; give "
                "each part of the model (each pipeline stage on this rank) one dmuon.Muon."
            )
        policies = {joined.nonfinite for joined in self.members} | {member.nonfinite}
        if len(policies) > 1:
            raise ValueError(
                f"dmuon.StepGroup: its optimizers use different nonfinite policies "
                f"{sorted(policies)}; they take one decision per step, so give every part's "
                "dmuon.Muon the same nonfinite=."
            )
        check_ranks_agree(
            self.pp_group,
            {
                "nonfinite": (
                    "nonfinite policies across pipeline stages (dmuon.Muon(nonfinite=...))",
                    member.nonfinite,
                ),
                "part": (
                    "numbers of optimizers in the step group (one per stage a rank holds)",
                    len(self.members),
                ),
                "background_compile": (
                    "decisions to compile the Newton-Schulz kernels in a background job across "
                    "pipeline stages (DMUON_KERNEL_COMPILE, DMUON_KERNEL_CACHE, and whether each "
                    "host trusts its DMUON_CACHE_DIR: see the kernels README)",
                    member.background_compile,
                ),
            },
        )
        self.members.append(member)

    # ---- the verdict on this step's gradients ----------------------------------------------

    def nonfinite_gradients(self, optimizer: object) -> tuple[list[str], bool]:
        """The names of the gradients holding NaN or inf anywhere in the step (sorted; [] if
        none), and whether this call decided it (False: another optimizer of the group did, for
        these same gradients). Collective over the group's ranks when it decides."""
        generations = self._generations()
        if (
            self._verdict is not None
            and self._verdict[0] == generations
            and id(optimizer) not in self._verdict_users
        ):
            self._verdict_users.add(id(optimizer))
            return self._verdict[1], False
        clip_norm, self._clip_norm = self._clip_norm, None
        if clip_norm is not None and clip_norm[0] == generations and clip_norm[1].value():
            names: list[str] = []  # the clipped norm, over every stage, was finite
        else:
            names = nonfinite_gradients(
                [pair for member in self.members for pair in member.named_gradients()],
                self._check_groups(),
                self._device(),
            )
        self._verdict, self._verdict_users = (generations, names), {id(optimizer)}
        return names, True

    def record_clip_norm(self, total_norm: torch.Tensor) -> None:
        """``dmuon.clip_grad_norm_`` over the whole group found ``total_norm`` (every stage's):
        the verdict of this step can read it instead of checking again. No host sync here: the
        flag starts for the host now, so the verdict waits for the norm, not for what the clip
        queues after it."""
        self._clip_norm = (self._generations(), PendingFlag(torch.isfinite(total_norm)))

    def agreed_minimum(self, value: int) -> int:
        """The minimum of ``value`` over every rank of the step: one int32 all-reduced over the
        groups the non-finite check uses (``value`` itself, with no collective, on a step of
        one rank). Every rank of the step must call it together: ``dmuon.kernel_switch``'s
        agreement on when the Newton-Schulz kernels switch."""
        groups = [group for group in self._check_groups() if group is not None]
        if not groups:
            return value
        flag = torch.tensor(value, dtype=torch.int32, device=self._device())
        for group in groups:
            collectives.all_reduce(
                flag, group, op=dist.ReduceOp.MIN, purpose="the kernel switch agreement"
            ).wait()
        return int(flag.item())

    def all_reduce_over_pipeline(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        """Reduce ``tensor`` over the pipeline stages in place (nothing without a pipeline)."""
        if self.pp_group is not None:
            collectives.all_reduce(
                tensor, self.pp_group, op=op, purpose="across the pipeline stages"
            ).wait()

    # ---- internals --------------------------------------------------------------------------

    def _generations(self) -> tuple[int, ...]:
        return tuple(member.state.gradient_generation for member in self.members)

    def _check_groups(self) -> list[dist.ProcessGroup | None]:
        """Groups that together span every rank of the step: each distinct ownership grid and
        TP group of the members (once each, in one order on every rank), then the pipeline."""
        grids: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for member in self.members:
            mesh = member.state.mesh
            for group in (mesh.world_group, mesh.tp_group):
                if group is not None:
                    grids.setdefault(tuple(dist.get_process_group_ranks(group)), group)
        return [grids[ranks] for ranks in sorted(grids)] + [self.pp_group]

    def _device(self) -> torch.device:
        devices = [member.state.device for member in self.members]
        return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def _pipeline_group(
    pp_mesh: DeviceMesh | dist.ProcessGroup | None,
) -> dist.ProcessGroup | None:
    if pp_mesh is None:
        return None
    if isinstance(pp_mesh, DeviceMesh):
        if pp_mesh.ndim != 1:
            raise ValueError(
                f"dmuon.StepGroup: pp_mesh must be the 1-D pipeline dim of the mesh, got a "
                f"{pp_mesh.ndim}-D mesh with dims {pp_mesh.mesh_dim_names}; pass mesh['pp']."
            )
        if pp_mesh.get_coordinate() is None:
            raise ValueError(
                f"dmuon.StepGroup: this rank ({dist.get_rank()}) is not in pp_mesh (ranks "
                f"{pp_mesh.mesh.tolist()}); pass the pipeline dim that holds it, mesh['pp'] of "
                "a mesh built with init_device_mesh on every rank."
            )
        return pp_mesh.get_group() if pp_mesh.size() > 1 else None
    if isinstance(pp_mesh, dist.ProcessGroup):
        return pp_mesh if dist.get_world_size(pp_mesh) > 1 else None
    raise TypeError(
        f"dmuon.StepGroup: pp_mesh must be a DeviceMesh (mesh['pp']), a ProcessGroup or None, "
        f"got {type(pp_mesh).__name__}."
    )
