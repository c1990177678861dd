"""``dmuon.Muon``: Muon on the matrices this rank owns, AdamW on everything else.

Owns the torch optimizer surface (param groups, ``step``, ``zero_grad``, ``state_dict`` and
``load_state_dict``, ``init_state``), the step's orchestration and the AdamW route (torch's
AdamW). The Muon route (its state layout, its Newton-Schulz batches, the plain, overlapped,
offloaded and tensor-parallel work) is ``dmuon.muon_route``'s, its math ``muon_update``'s. It
must not move data itself: it asks the model's state before the step (``before_step``) and
after it (``after_step``: the weights follow the masters, published across replicas).

Routes (``dmuon.routing`` decides each parameter's route, group and hyperparameters):
- ``"muon"``: the fp32 masters of the dedicated matrices this rank owns (the master of an
  expert piece, (k, m, n), holds k matrices, each with its own Newton-Schulz and momentum);
- ``"adamw"``: the fp32 masters of owned dedicated non-matrix parameters (and of matrices
  ``routes=`` sent there);
- ``"sharded_adamw"``: every other trainable parameter of the model (FSDP2's sharded DTensors:
  updated shard-locally by the same AdamW).
Each torch param group holds one update rule (its ``"route"`` key: ``"muon"`` or ``"adamw"``),
so ``torch.optim.lr_scheduler`` and HF's schedulers scale every group.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from dmuon import _profiler_labels as labels
from dmuon import kernel_switch, muon_state
from dmuon._log import log_once
from dmuon._text import preview_names
from dmuon._torch_internals import profiler_range
from dmuon.consistency import check_ranks_agree
from dmuon.data_parallel import check_data_parallel_layout
from dmuon.ddp import check_gradients_are_averaged
from dmuon.experts import ExpertStack, agreed_name
from dmuon.fqn import canonical_fqn
from dmuon.hooks import DedicatedState, get_dedicated_state
from dmuon.muon_options import AdjustLr, MomentumDtype, MuonOptions, NonfinitePolicy
from dmuon.muon_route import MuonRoute
from dmuon.muon_update import MOMENTUM_DTYPES
from dmuon.ns_counts import NewtonSchulzCounts
from dmuon.offload import MasterOffload, check_masters_can_be_offloaded
from dmuon.optim_layout import LAYOUT_KEY, check_layout, layout_record, without_layout
from dmuon.overlap import OverlappedStep, OverlapStepStats, check_speculation_options
from dmuon.param import MUON_ROUTE, is_dedicated
from dmuon.routing import (
    RULE_KEYS,
    SHARDED_ADAMW_ROUTE,
    WHY_NOT_DEDICATED,
    WHY_PREDICATE,
    WHY_ROUTES_OVERRIDE,
    ExpertSliceOwner,
    NoDecay,
    ParamFacts,
    RoutingRow,
    no_decay_fqns,
    plan_groups,
    route_summaries,
    routing_rows,
)
from dmuon.step_group import StepGroup, StepMember
from dmuon_kernels.coefficients import KELLER_COEFFICIENTS
from dmuon_kernels.newton_schulz import NewtonSchulz, NSBackend

_FUSED_ADAMW_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# ``dmuon.Muon``'s keywords take their defaults from here (one place: ``dmuon.MuonOptions``).
_DEFAULTS = MuonOptions()


class Muon(torch.optim.Optimizer):
    """Distributed Muon for a model prepared with ``dmuon.dedicate_params``.

    Args:
        model: the model ``dedicate_params`` was called on (before or after ``fully_shard``).
        lr, momentum, ..., offload_masters: the fields of ``dmuon.MuonOptions`` (documented
            there), with its defaults, validated once by it; ``Muon.from_options(model,
            options, **overrides)`` takes a ``MuonOptions`` instead. ``optimizer.options`` is
            the one this optimizer was built with.

    ``optimizer.routing()`` lists every parameter's route, owner, lr, weight decay and why; a
    summary line per route is logged (INFO, rank 0) on the ``dmuon`` logger at construction.

    Gradients follow torch's rules: each backward adds the averaged gradient into the owners'
    fp32 masters, ``step()`` leaves it there, and ``optimizer.zero_grad()`` or
    ``model.zero_grad()`` clears it (``dedicate_params`` makes the model's ``zero_grad`` reach
    the masters). A skipped step followed by ``zero_grad()`` leaks nothing into the next.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = _DEFAULTS.lr,
        momentum: float = _DEFAULTS.momentum,
        nesterov: bool = _DEFAULTS.nesterov,
        weight_decay: float = _DEFAULTS.weight_decay,
        ns_backend: NSBackend | NewtonSchulz = _DEFAULTS.ns_backend,
        adamw_lr: float = _DEFAULTS.adamw_lr,
        adamw_betas: tuple[float, float] = _DEFAULTS.adamw_betas,
        adamw_eps: float = _DEFAULTS.adamw_eps,
        adamw_weight_decay: float = _DEFAULTS.adamw_weight_decay,
        replicate_async: bool = _DEFAULTS.replicate_async,
        nonfinite: NonfinitePolicy = _DEFAULTS.nonfinite,
        allow_no_muon: bool = _DEFAULTS.allow_no_muon,
        adjust_lr: AdjustLr | None = _DEFAULTS.adjust_lr,
        param_groups: list[dict] | None = _DEFAULTS.param_groups,
        no_decay: NoDecay = _DEFAULTS.no_decay,
        step_group: StepGroup | None = _DEFAULTS.step_group,
        overlap_step: bool = _DEFAULTS.overlap_step,
        normuon: bool = _DEFAULTS.normuon,
        normuon_beta2: float = _DEFAULTS.normuon_beta2,
        normuon_eps: float = _DEFAULTS.normuon_eps,
        momentum_dtype: torch.dtype | MomentumDtype = _DEFAULTS.momentum_dtype,
        offload_masters: bool = _DEFAULTS.offload_masters,
    ) -> None:
        options = MuonOptions(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_backend=ns_backend,
            adamw_lr=adamw_lr,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay,
            replicate_async=replicate_async,
            nonfinite=nonfinite,
            allow_no_muon=allow_no_muon,
            adjust_lr=adjust_lr,
            param_groups=param_groups,
            no_decay=no_decay,
            step_group=step_group,
            overlap_step=overlap_step,
            normuon=normuon,
            normuon_beta2=normuon_beta2,
            normuon_eps=normuon_eps,
            momentum_dtype=momentum_dtype,
            offload_masters=offload_masters,
        )
        momentum_dtype = options.momentum_dtype_name
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"dmuon.Muon takes the model itself, got {type(model).__name__}: dmuon.Muon("
                "model, lr=0.02, adamw_lr=1e-3), not dmuon.Muon(model.parameters(), ...). It "
                "finds the owners' fp32 masters and the other parameters through the model "
                "that dmuon.dedicate_params prepared."
            )
        self._dedicated = get_dedicated_state(model)
        if not allow_no_muon and not any(
            p.route == MUON_ROUTE for p in self._dedicated.params.values()
        ):
            raise ValueError(
                "dmuon.Muon: no parameter is on the Muon route (dedicate_params selected "
                f"{len(self._dedicated.params)} parameters, none a matrix), so this optimizer "
                "would run AdamW alone. Fix the predicate of dmuon.dedicate_params (print the 2-D "
                "parameters' names: [(n, p.shape) for n, p in model.named_parameters() if "
                "p.ndim == 2]), or pass allow_no_muon=True if AdamW alone is intended (a "
                "pipeline stage without block matrices, when other stages have some)."
            )
        check_data_parallel_layout(self._dedicated)
        self._dedicated.ensure_adopted()
        check_gradients_are_averaged(self._dedicated)
        self.options = options
        self._newton_schulz = options.newton_schulz()
        self.replicate_async = replicate_async
        self.overlap_step = overlap_step
        self.offload_masters = offload_masters
        self.nonfinite = nonfinite
        self._steps_taken = 0
        # Newton-Schulz outputs applied per owned matrix ([Note: one Newton-Schulz per matrix
        # per step] in ``dmuon.ns_counts``); read through ``dmuon.inspect.newton_schulz_counts``.
        self._ns_counts = NewtonSchulzCounts()
        self._muon_route = MuonRoute(
            optimizer=self,
            newton_schulz=self._newton_schulz,
            owned=list(self._dedicated.iter_owned_masters()),
            mesh=self._dedicated.mesh,
            ns_counts=self._ns_counts,
            overlapped=overlap_step,
            segment_values=self._dedicated.owned_segment_values(),
        )

        self._facts, local_tensors = _param_facts(model, self._dedicated)
        # id(tensor) -> canonical FQN of what this rank steps (an expert piece's: its own name).
        self._names_by_id = {
            id(tensor): fqn
            for fqn in local_tensors
            for tensor in _local_tensors(local_tensors, fqn)
        }
        self._names_by_id.update(
            {id(p.master): p.fqn for p in self._dedicated.iter_owned_masters()}
        )
        self._routing_plan = plan_groups(
            self._facts,
            {
                MUON_ROUTE: dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                 weight_decay=weight_decay, adjust_lr=adjust_lr, normuon=normuon,
                                 normuon_beta2=normuon_beta2, normuon_eps=normuon_eps,
                                 momentum_dtype=momentum_dtype),
                "adamw": dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                              weight_decay=adamw_weight_decay),
            },
            param_groups,
            no_decay_fqns(model, no_decay, self._facts),
        )  # fmt: skip
        torch_groups = [
            group.torch_group([t for f in group.fqns for t in _local_tensors(local_tensors, f)])
            for group in self._routing_plan.groups
        ]
        super().__init__(torch_groups, defaults={})
        self._groups_planned = True
        self._check_tensor_parallel_options()
        # Decided once: the ranks and the pipeline stages must agree on it (kernel_switch).
        self._compiles_in_background = kernel_switch.background_compile_wanted(
            self._newton_schulz, self._dedicated
        )
        self._check_ranks_agree()
        # Every refusal before the step group and the model state take this optimizer: a
        # refused one left in them would refuse the caller's next try on this model.
        if overlap_step:
            check_speculation_options(self.param_groups, self._dedicated.params.values())
        if offload_masters:
            check_masters_can_be_offloaded(self._dedicated.params.values(), overlap_step)
        self._dedicated.check_can_take_optimizer(overlap_step=overlap_step)
        self.step_group = step_group if step_group is not None else StepGroup()
        self.step_group.join(
            StepMember(
                self,
                self._dedicated,
                self.nonfinite,
                self._named_gradients,
                self._compiles_in_background,
            )
        )
        self._overlap = self._start_overlap() if overlap_step else None
        self._offload = self._start_offload() if offload_masters else None
        self._muon_route.compile_kernels_ahead(self.param_groups)
        if self._compiles_in_background:
            kernel_switch.start_for_optimizer(
                self._newton_schulz, self._dedicated, self.param_groups, self._overlap
            )
        _log_route_summaries(self.routing())

    def _start_offload(self) -> MasterOffload:
        """The CPU homes of ``offload_masters=True`` ([Note: offloaded masters] in
        ``dmuon.offload``) for the Muon route's masters this rank owns (checked at
        construction: ``check_masters_can_be_offloaded``)."""
        return self._dedicated.attach_offload(
            master
            for group in self.param_groups
            if group["route"] == MUON_ROUTE
            for master in group["params"]
        )

    def _start_overlap(self) -> OverlappedStep:
        """The speculation of ``overlap_step=True`` ([Note: the overlapped step] in
        ``dmuon.overlap``), listening to the model's gradients as they land (its options checked
        at construction: ``dmuon.overlap.check_speculation_options``)."""
        boundary_of = {
            id(p.master): self._dedicated.boundary_of(p)
            for p in self._dedicated.iter_owned_masters()
            if p.route == MUON_ROUTE and not p.is_tp_sharded
        }
        overlap = OverlappedStep(
            param_groups=self.param_groups,
            boundary_of=boundary_of,
            boundaries=self._dedicated.boundaries,
            muon_groups=[
                i for i, group in enumerate(self.param_groups) if group["route"] == MUON_ROUTE
            ],
            state=self.state,
            speculate=self._muon_route.speculate,
            apply=self._muon_route.apply,
            device=self._dedicated.device,
        )
        self._dedicated.attach_overlap(overlap)  # refused if the model has one already
        return overlap

    def overlap_stats(self) -> OverlapStepStats:
        """With ``overlap_step=True``: how many Muon matrices were computed during backward,
        committed, discarded and recomputed by ``step()`` (see ``dmuon.inspect.overlap_stats``)."""
        if self._overlap is None:
            raise ValueError(
                "dmuon.Muon.overlap_stats: this optimizer was built with overlap_step=False; "
                "pass dmuon.Muon(model, ..., overlap_step=True) to overlap the owner step with "
                "backward."
            )
        return self._overlap.stats

    def add_param_group(self, param_group: dict) -> None:
        """Refused once constructed: dmuon plans every group from the model (routes, owners,
        checkpoint FQNs), so a group added later would have none of them."""
        if getattr(self, "_groups_planned", False):
            raise TypeError(
                "dmuon.Muon plans its param groups from the model and cannot take one added "
                "later. Pass it at construction: dmuon.Muon(model, param_groups=[{'params': "
                "[fqn, ...] or lambda name, p: ..., 'lr': ...}]); a tensor outside the model "
                "needs its own torch optimizer."
            )
        super().add_param_group(param_group)

    @classmethod
    def from_options(cls, model: nn.Module, options: MuonOptions, **overrides) -> Muon:
        """``dmuon.Muon`` with ``options``, any field replaced by ``overrides`` (keywords as
        ``dmuon.Muon``'s): ``Muon.from_options(model, options, lr=0.01)``."""
        if not isinstance(options, MuonOptions):
            raise TypeError(
                f"dmuon.Muon.from_options takes a dmuon.MuonOptions, got "
                f"{type(options).__name__}; pass keywords to dmuon.Muon(model, lr=..., ...) "
                "instead, or dmuon.MuonOptions(lr=..., ...)."
            )
        values = {field.name: getattr(options, field.name) for field in dataclasses.fields(options)}
        return cls(model, **{**values, **overrides})

    @classmethod
    def torch_compatible(
        cls,
        model: nn.Module,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        adjust_lr: str | None = "spectral",
        **kwargs,
    ) -> Muon:
        """The update of ``torch.optim.Muon`` (same defaults), within bf16 rounding.

        torch's Newton-Schulz: Keller Jordan's coefficients, the direct iteration in bf16, and
        its default learning-rate rule ``sqrt(max(1, m / n))``. Its momentum is an EMA, ours a
        sum; Newton-Schulz normalises its input, so the updates agree to bf16 rounding. The
        AdamW route and the other options are ``dmuon.Muon``'s (``**kwargs``).
        """
        newton_schulz = NewtonSchulz(
            backend="direct",
            coefficients=KELLER_COEFFICIENTS,
            dtype=torch.bfloat16,
            kernel="cublas",
        )
        return cls(
            model,
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_backend=newton_schulz,
            adjust_lr=adjust_lr,
            **kwargs,
        )

    @property
    def newton_schulz(self) -> NewtonSchulz:
        return self._newton_schulz

    @property
    def model_state(self) -> DedicatedState:
        """The model state this optimizer was built on (``get_dedicated_state(model)``): the
        owners' masters its step updates and publishes. Read-only; the clip, QK-clip,
        checkpoints and ``dmuon.inspect`` compare it with their model's to refuse an optimizer
        of another model."""
        return self._dedicated

    def routing(self) -> list[RoutingRow]:
        """Every trainable parameter: ``(fqn, shape, route, owner_rank, lr, weight_decay, why)``.

        ``route`` is ``"muon"``, ``"adamw"`` (owner-side, on the fp32 master) or
        ``"sharded_adamw"`` (left to FSDP2); ``owner_rank`` is the owner's global rank (None
        when not dedicated; for an (E, m, n) expert stack, one ``ExpertSliceOwner(start, stop,
        rank)`` per range of its experts, under expert parallelism of every EP slot); ``lr`` and ``weight_decay`` are its group's current
        values (a scheduler's changes included); ``why`` says what decided it: ``"predicate"``,
        ``"routes override"`` or ``"not dedicated"``, then ``"no_decay rule"`` and
        ``"param_groups[i]"`` where they apply. The same list on every rank; no collective.
        """
        return routing_rows(self._facts, self._routing_plan, self.param_groups)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._steps_taken += 1
        kernel_switch.at_step_boundary(self.step_group, self._steps_taken)
        try:
            if self.nonfinite != "ignore" and self._skip_for_nonfinite_gradients():
                return loss
            if self._overlap is not None:  # the commit reads what the speculation wrote
                self._overlap.wait_for_speculation()
            self._dedicated.before_step()
            for index, group in enumerate(self.param_groups):
                if group["route"] == MUON_ROUTE:
                    with profiler_range(labels.OWNER_STEP):
                        self._muon_route.step(index, group, self._overlap, self._offload)
                else:
                    with profiler_range(labels.ADAMW_STEP):
                        self._adamw_step(group)
        finally:
            if self._overlap is not None:  # what was not committed is stale after any step
                self._overlap.discard()
        self._dedicated.after_step(asynchronous=self.replicate_async)
        return loss

    def _skip_for_nonfinite_gradients(self) -> bool:
        """True when the step must be skipped: a gradient of the step group (every optimizer of
        it, on every rank) holds NaN or inf. Raises for ``nonfinite="raise"``."""
        bad, decided_here = self.step_group.nonfinite_gradients(self)
        if not bad:
            return False
        where = f"step {self._steps_taken}: {len(bad)} parameters have NaN or inf gradients ({preview_names(bad)})"
        if self.nonfinite == "raise":
            raise RuntimeError(
                f"dmuon.Muon: {where}. Nothing was updated. Find the source (loss scale, data, "
                "learning rate), or pass nonfinite='skip' to skip such steps."
            )
        if not decided_here:  # the optimizer that decided for the step group warned
            return True
        warnings.warn(
            f"dmuon.Muon: {where}; the step is skipped on every rank (nonfinite='skip'): weights "
            "and optimizer state are unchanged. Call zero_grad() before the next backward.",
            UserWarning,
            stacklevel=3,
        )
        return True

    def _named_gradients(self) -> list[tuple[str, torch.Tensor]]:
        """(canonical FQN, this rank's gradient) of every parameter this rank steps that has
        one."""
        names = self._names_by_id
        return [
            (names.get(id(param), "?"), _local(param.grad))
            for group in self.param_groups
            for param in group["params"]
            if param.grad is not None
        ]

    def state_dict(self) -> dict:
        """This rank's state, keyed by index as in torch, with the layout that wrote it
        (``dmuon.optim_layout.LAYOUT_KEY``): it loads on this rank and layout only; resharding
        is ``dmuon.checkpoint``'s (see [Note: per-rank state dicts] in ``dmuon.optim_layout``)."""
        _refuse_torch_checkpoint_state_dict(sys._getframe(1), "get_optimizer_state_dict")
        return {
            **super().state_dict(),
            LAYOUT_KEY: layout_record(self._dedicated.mesh, self._facts),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the update rule and the state's dtypes stay this optimizer's
        (``normuon``, ``momentum_dtype``: a checkpoint of another rule loads into this one), and
        a key the saved groups lack (an option newer than the checkpoint) keeps its value.

        Collective over every rank: a dict written on another rank or layout (or, with
        several ranks, without a layout record) raises ValueError on every rank before anything
        changes (see [Note: per-rank state dicts] in ``dmuon.optim_layout``)."""
        _refuse_torch_checkpoint_state_dict(sys._getframe(1), "set_optimizer_state_dict")
        check_layout(state_dict, layout_record(self._dedicated.mesh, self._facts))
        before = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]
        state, groups = self.state, self.param_groups
        super().load_state_dict(without_layout(state_dict))
        # torch puts a new state dict and new groups in their place, but the overlapped step
        # holds these objects (``OverlappedStep(state=..., param_groups=...)``): left stale, it
        # would speculate from the old momenta and commit into the old dict. So the loaded
        # values go into the objects it holds.
        state.clear()
        state.update(self.state)
        for group, loaded in zip(groups, self.param_groups, strict=True):
            group.update(loaded)
        self.state, self.param_groups = state, groups
        for group, kept in zip(self.param_groups, before):
            for key, value in kept.items():
                if key in RULE_KEYS or key not in group:
                    group[key] = value
            if group["route"] != MUON_ROUTE:
                continue
            dtype = MOMENTUM_DTYPES[group["momentum_dtype"]]
            for param in group["params"]:  # torch cast float buffers to the masters' fp32
                if self.state.get(param):
                    muon_state.conform_momentum(self.state[param], dtype)

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the state every parameter's next step would create (zeros).

        The update is the same as from no state (a zero momentum gives ``buf = g``; AdamW
        starts at step 0), so a checkpoint taken before a parameter's first gradient still
        holds every entry and loads on any layout (``dmuon.checkpoint`` calls this). Parameters
        frozen since construction get theirs too: one frozen for a while keeps its saved state
        through a resume, where the state dict to load into must have its entries.
        """
        for group in self.param_groups:
            for param in group["params"]:
                if self.state[param]:
                    continue
                if group["route"] == MUON_ROUTE:
                    muon_state.init_state(self.state[param], param, group)
                else:
                    self.state[param].update(_new_adamw_state(_local(param)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._dedicated.zero_master_grads(set_to_none)

    # ---- the AdamW route ------------------------------------------------------------------------

    def _adamw_step(self, group: dict) -> None:
        """torch's own AdamW on this rank's tensors (DTensors as their local shards): one
        multi-tensor pass (fused on CUDA, foreach elsewhere) per device and dtype, no host sync."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            weight = _local(param)
            state = self.state[param]
            if not state:
                state.update(_new_adamw_state(weight))
            params.append(weight)
            grads.append(_local(param.grad))
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        fused = all(_fused_adamw_runs_on(p) for p in params)
        beta1, beta2 = group["betas"]
        adamw(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=not fused, fused=fused, amsgrad=False, beta1=beta1, beta2=beta2,
            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )  # fmt: skip

    # ---- construction checks --------------------------------------------------------------------

    def _check_tensor_parallel_options(self) -> None:
        """NorMuon's row statistics need the whole matrix on one rank, and an int8 momentum's
        scales do not follow a TP chunk's layout: not yet for TP chunks (decided from facts
        every rank has, so every rank raises alike)."""
        tp_sharded = {p.fqn for p in self._dedicated.params.values() if p.is_tp_sharded}
        for planned, group in zip(self._routing_plan.groups, self.param_groups):
            clash = [fqn for fqn in planned.fqns if fqn in tp_sharded]
            if group["route"] != MUON_ROUTE or not clash:
                continue
            if group["normuon"]:
                raise ValueError(
                    f"dmuon.Muon: normuon=True is not supported yet for tensor-parallel matrices "
                    f"({preview_names(clash)}). Turn it off for them with a param group: "
                    'param_groups=[{"params": [...], "normuon": False}].'
                )
            if group["momentum_dtype"] == "int8":
                raise ValueError(
                    "dmuon.Muon: momentum_dtype=torch.int8 is not supported yet for "
                    f"tensor-parallel matrices ({preview_names(clash)}). Use torch.bfloat16 for "
                    'them with a param group: param_groups=[{"params": [...], '
                    '"momentum_dtype": torch.bfloat16}].'
                )

    def _check_ranks_agree(self) -> None:
        check_ranks_agree(
            self._dedicated.mesh.world_group,
            {
                "newton_schulz": (
                    "Newton-Schulz settings (ns_backend / NewtonSchulz(...))",
                    self._newton_schulz.config,
                ),
                "background_compile": (
                    "decisions to compile the Newton-Schulz kernels in a background job "
                    "(DMUON_KERNEL_COMPILE, DMUON_KERNEL_CACHE, and whether each host trusts "
                    "its DMUON_CACHE_DIR: see the kernels README)",
                    self._compiles_in_background,
                ),
                "dedicated": (
                    "dedicated parameters (names and shapes)",
                    [(agreed_name(p), tuple(p.shape)) for p in self._dedicated.params.values()],
                ),
                "routing": (
                    "parameter groups (param_groups=, no_decay=, routes=)",
                    [(f.fqn, self._routing_plan.group_of[f.fqn]) for f in self._facts],
                ),
                "hyperparameters": (
                    "hyperparameters (lr, momentum, weight decay, AdamW settings, ...)",
                    # replicate_async first: the message shows the start of a long list.
                    [
                        {
                            "replicate_async": self.replicate_async,
                            "nonfinite": self.nonfinite,
                            "overlap_step": self.overlap_step,
                            "offload_masters": self.offload_masters,
                        }
                    ]
                    + [
                        {k: v for k, v in group.items() if k != "params"}
                        for group in self.param_groups
                    ],
                ),
            },
        )


def _param_facts(model: nn.Module, dedicated) -> tuple[list[ParamFacts], dict[str, torch.Tensor]]:
    """What every rank knows of each trainable parameter, and this rank's tensor of each (an
    owned master, or FSDP2's parameter); see ``dmuon.routing``."""
    overrides = dedicated.route_overrides
    facts: list[ParamFacts] = []
    local: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        name = canonical_fqn(name)  # as dedicate_params names them: see ``dmuon.fqn``
        stack = dedicated.stacks.get(name)
        if stack is not None:  # one row for the stack; this rank's tensors: its owned pieces
            if stack.requires_grad:
                facts.append(_expert_stack_facts(stack))
                local[name] = tuple(piece.master for piece in stack.owned_pieces())
            continue
        p = dedicated.params.get(name)
        if p is not None:
            if not p.requires_grad:
                continue
            stand_in = torch.empty(p.shape, dtype=p.placeholder.dtype, device="meta")
            facts.append(
                ParamFacts(
                    fqn=name,
                    shape=tuple(p.shape),
                    route=p.route,
                    why_route=WHY_ROUTES_OVERRIDE if p.route_override else WHY_PREDICATE,
                    owner_rank=dedicated.mesh.global_rank(p.owner),
                    stand_in=stand_in.requires_grad_(True),
                )
            )
            if p.master is not None:
                local[name] = p.master
        elif param.requires_grad and not is_dedicated(param):
            facts.append(
                ParamFacts(
                    fqn=name,
                    shape=tuple(param.shape),
                    route=SHARDED_ADAMW_ROUTE,
                    why_route=WHY_ROUTES_OVERRIDE if name in overrides else WHY_NOT_DEDICATED,
                    owner_rank=None,
                    stand_in=param,
                )
            )
            local[name] = param
    return facts, local


def _expert_stack_facts(stack: ExpertStack) -> ParamFacts:
    """An expert stack as one parameter of its full shape, owned slice by slice: every slice,
    those of the other EP slots too (``every_piece``), so the row is the same on every rank."""
    stand_in = torch.empty(stack.shape, dtype=stack.placeholder.dtype, device="meta")
    return ParamFacts(
        fqn=stack.fqn,
        shape=tuple(stack.shape),
        route=stack.route,
        why_route=WHY_ROUTES_OVERRIDE if stack.route_override else WHY_PREDICATE,
        owner_rank=tuple(
            ExpertSliceOwner(piece.start, piece.stop, piece.owner_rank)
            for piece in stack.every_piece
        ),
        stand_in=stand_in.requires_grad_(True),
    )


def _local_tensors(local: dict, fqn: str) -> tuple[torch.Tensor, ...]:
    """This rank's tensors of ``fqn``: none, one, or an expert stack's owned pieces."""
    tensors = local.get(fqn, ())
    return tensors if isinstance(tensors, tuple) else (tensors,)


def _log_route_summaries(rows: list[RoutingRow]) -> None:
    """One INFO line per route on rank 0, visible without logging set-up (``dmuon._log``)."""
    for line in route_summaries(rows):
        log_once("[DMuon] %s", line)


def _refuse_torch_checkpoint_state_dict(caller, dmuon_function: str) -> None:
    """torch.distributed.checkpoint.state_dict maps optimizer state to names through the model's
    parameters; the owners' fp32 masters are not among them, and it would fail with a bare
    ``KeyError`` after a zero-lr warm-up step. Refuse there, naming the function that works."""
    if caller.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict":
        raise RuntimeError(
            "torch.distributed.checkpoint.state_dict cannot name dmuon.Muon's state: it lives on "
            "the owners' fp32 masters, which are not parameters of the model. Use "
            f"dmuon.checkpoint.{dmuon_function} (the same signature), or "
            "dmuon.checkpoint.get_state_dict / set_state_dict."
        )


def _new_adamw_state(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    # torch's layout: the fused kernel reads the step on the weight's device, foreach on the CPU.
    step_device = weight.device if _fused_adamw_runs_on(weight) else torch.device("cpu")
    return {
        "step": torch.zeros((), dtype=torch.float32, device=step_device),
        "exp_avg": torch.zeros_like(weight, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(weight, memory_format=torch.preserve_format),
    }


def _fused_adamw_runs_on(weight: torch.Tensor) -> bool:
    return weight.device.type == "cuda" and weight.dtype in _FUSED_ADAMW_DTYPES


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
