"""``dmuon.Muon``: Muon on the matrices this rank owns, AdamW on everything else.

Owns the owner step and the two routes: which matrices share a Newton-Schulz call, the
optimizer state, torch's AdamW; the Muon route's math is ``muon_update``'s, its one road to the
kernels. It must not move data itself: it asks the model's state before the step
(``before_step``) and after it (``after_step``: the weights follow the masters, published
across replicas).

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

import functools
import itertools
import math
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from dmuon import _profiler_labels as labels
from dmuon import muon_update
from dmuon._log import log_once
from dmuon._text import preview_names
from dmuon._torch_internals import profiler_range
from dmuon.consistency import check_ranks_agree
from dmuon.data_parallel import check_data_parallel_layout
from dmuon.ddp import check_gradients_are_averaged
from dmuon.experts import ExpertStack, agreed_name, is_expert_piece
from dmuon.fqn import canonical_fqn
from dmuon.hooks import get_dedicated_state
from dmuon.muon_update import (
    MOMENTUM_DTYPES,
    NORMUON_BETA2,
    NORMUON_EPS,
    dequantized,
    int8_scale_shape,
    matrix_shape_of,
    quantize_,
)
from dmuon.nonfinite import check_policy
from dmuon.ns_counts import NewtonSchulzCounts
from dmuon.offload import MasterOffload, check_masters_can_be_offloaded
from dmuon.optim_layout import LAYOUT_KEY, check_layout, layout_record, without_layout
from dmuon.overlap import SPECULATION_GRAPH_MAX_NUMEL, OverlappedStep, OverlapStepStats
from dmuon.param import MUON_ROUTE, DedicatedParam, is_dedicated
from dmuon.routing import (
    ADJUST_LR,
    HF_NO_DECAY,
    RULE_KEYS,
    SHARDED_ADAMW_ROUTE,
    WHY_NOT_DEDICATED,
    WHY_PREDICATE,
    WHY_ROUTES_OVERRIDE,
    ExpertSliceOwner,
    NoDecay,
    ParamFacts,
    RoutingRow,
    momentum_dtype_name,
    no_decay_fqns,
    plan_groups,
    route_summaries,
    routing_rows,
)
from dmuon.step_group import StepGroup, StepMember
from dmuon.tp import ChunkExchange
from dmuon_kernels.coefficients import KELLER_COEFFICIENTS
from dmuon_kernels.newton_schulz import NewtonSchulz

# NorMuon's per-row state ([Note: NorMuon] in ``muon_update``): (m,), or (k, m) for an expert
# piece. A checkpoint without it (plain Muon's) loads with this entry starting at zero.
ROW_SECOND_MOMENT = "row_second_moment"
# An int8 momentum's state ([Note: 8-bit momentum] in ``muon_update``): other names than a float
# buffer's, so a checkpoint never loads one into the other.
MOMENTUM_INT8, MOMENTUM_SCALE = "momentum_int8", "momentum_scale"
_FUSED_ADAMW_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Newton-Schulz input of one batched call, at 2 bytes an element: the iteration's transient
# workspace (a few times its input) stays near a GiB however many matrices share a shape.
NS_CALL_BYTES = 256 * 2**20


class Muon(torch.optim.Optimizer):
    """Distributed Muon for a model prepared with ``dmuon.dedicate_params``.

    Args:
        model: the model ``dedicate_params`` was called on (before or after ``fully_shard``).
        lr, momentum, nesterov, weight_decay: the Muon route (decoupled weight decay).
        ns_backend: ``"gram"``, ``"direct"`` or a configured ``dmuon.NewtonSchulz``; every rank
            must use the same one (checked once at construction).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW route.
        replicate_async: under HSDP, publish the new weights across replicas asynchronously
            after ``step()`` (waited for by the next forward) instead of synchronously.
        nonfinite: what a step does when a gradient holds NaN or inf on any rank: ``"skip"``
            (the default: every rank skips the step, weights and optimizer state untouched,
            with a warning naming the step and the parameters), ``"raise"`` (RuntimeError
            naming the parameters, nothing updated) or ``"ignore"`` (torch's behaviour: no
            check, and the update makes every weight it reaches NaN). The check reads the norm
            of a ``dmuon.clip_grad_norm_`` over these gradients when one ran (a scalar to the
            host, nothing recomputed); otherwise it costs one fused max-abs pass over this
            rank's gradients, one all-reduce of a flag and one host synchronisation.
        step_group: a ``dmuon.StepGroup`` shared by the optimizers of every part of a model
            that trains in one step (pipeline stages, here and on the ranks of its ``pp_mesh``):
            the non-finite decision, and ``dmuon.clip_grad_norm_``'s norm, then span them all.
            None: this optimizer alone.
        normuon, normuon_beta2, normuon_eps: NorMuon (Li et al., 2025, arXiv 2510.05491):
            after Newton-Schulz, each row of the update is divided by the root of an EMA
            (``normuon_beta2``) of its mean square, then the whole is rescaled to the
            Frobenius norm of an orthogonal matrix, so ``adjust_lr`` keeps its meaning (the
            update's RMS is 0.2 lr under ``"match_rms_adamw"``, as the paper's rule). State:
            one fp32 number per row. See [Note: NorMuon] in ``dmuon.muon_update``.
        momentum_dtype: the dtype the Muon momentum is stored in: ``torch.float32`` (the
            default), ``torch.bfloat16`` (half its memory) or ``torch.int8`` (int8 with an fp32
            scale per 256 elements of a row: about a quarter; [Note: 8-bit momentum] in
            ``dmuon.muon_update``); the arithmetic is fp32 either way, the buffer rounded once
            per step on store.
        offload_masters: keep the fp32 masters of the Muon route in CPU memory (pinned under
            CUDA) between steps, so they take no device memory during forward and backward;
            ``step()`` brings them to the device one Newton-Schulz call ahead on a side stream
            and copies them home on another ([Note: offloaded masters] in
            ``dmuon.offload``). Bit-identical to the run without it; costs 2 x 4 bytes of
            host-device traffic per owned element per step. Needs parameters in a dtype other
            than fp32 (the master is then a copy of its own); not with ``overlap_step``,
            tensor-parallel matrices or expert stacks (each refused with a message). The AdamW
            route's masters (norms, biases) stay on the device.
        adjust_lr: the Muon learning rate of an (m, n) matrix is ``lr`` times
            ``0.2 * sqrt(max(m, n))`` (``"match_rms_adamw"``, the default: the update's RMS is
            AdamW's), ``sqrt(max(1, m / n))`` (``"spectral"``, torch.optim.Muon's default) or 1
            (None). ``Muon.torch_compatible(model, ...)`` reproduces torch.optim.Muon.
        allow_no_muon: construct even when no dedicated parameter is a matrix (AdamW alone);
            otherwise that raises, since it is almost always a predicate that matched nothing.
            The check reads ``model``, which every rank of its mesh dedicated alike, so those
            ranks all raise or none does; across pipeline stages (different models) the caller
            decides: a stage without matrices passes True when another stage has some
            (``dmuon_titan`` sums the stages' counts over the ``pp`` dim and does so).
        param_groups: ``[{"params": fqns | (name, param) -> bool, "lr": ..., ...}, ...]``,
            applied in order on top of the routes (a parameter takes the first group that
            matches). A group may set ``lr`` and ``weight_decay`` (any route), ``momentum``,
            ``nesterov``, ``adjust_lr``, ``normuon``, ``normuon_beta2``, ``normuon_eps`` and
            ``momentum_dtype`` (Muon), ``betas`` and ``eps`` (AdamW); a key that
            does not apply to a parameter the group matches raises. Each becomes one torch
            param group per update rule it covers. A predicate sees a dedicated parameter as a
            meta tensor of its full shape (its value lives on the owner only), so every rank
            decides alike.
        no_decay: which parameters get no weight decay. ``"hf"`` (the default) is HF
            Trainer's rule: biases, the parameters of ``nn.LayerNorm`` modules and parameters
            named like norms (``layernorm``, ``rmsnorm``, ``norm``, ``*_norm``). Embeddings
            are decayed, as in HF. A function ``(name, param) -> bool`` chooses them itself;
            None or False decays every parameter by its group's ``weight_decay``. A group that
            sets ``weight_decay`` explicitly wins over this rule.

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
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_backend: str | NewtonSchulz = "gram",
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        replicate_async: bool = True,
        nonfinite: str = "skip",
        allow_no_muon: bool = False,
        adjust_lr: str | None = "match_rms_adamw",
        param_groups: list[dict] | None = None,
        no_decay: NoDecay = HF_NO_DECAY,
        step_group: StepGroup | None = None,
        overlap_step: bool = False,
        normuon: bool = False,
        normuon_beta2: float = NORMUON_BETA2,
        normuon_eps: float = NORMUON_EPS,
        momentum_dtype: torch.dtype | str = torch.float32,
        offload_masters: bool = False,
    ) -> None:
        _check_hyperparameters(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            adamw_lr=adamw_lr,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay,
            replicate_async=replicate_async,
            overlap_step=overlap_step,
            normuon=normuon,
            normuon_beta2=normuon_beta2,
            normuon_eps=normuon_eps,
            offload_masters=offload_masters,
        )
        momentum_dtype = momentum_dtype_name(momentum_dtype)
        if adjust_lr not in ADJUST_LR:
            raise ValueError(
                f"dmuon.Muon: adjust_lr={adjust_lr!r} is not one of {ADJUST_LR}: "
                "'match_rms_adamw' (lr x 0.2 sqrt(max(m, n)), the default), 'spectral' "
                "(lr x sqrt(max(1, m / n)), torch.optim.Muon's default) or None (lr as given)."
            )
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
        self._newton_schulz = _resolve_newton_schulz(ns_backend)
        self.replicate_async = replicate_async
        self.overlap_step = overlap_step
        self.offload_masters = offload_masters
        self.nonfinite = check_policy(nonfinite)
        self._steps_taken = 0
        # Newton-Schulz outputs applied per owned matrix ([Note: one Newton-Schulz per matrix
        # per step] in ``dmuon.ns_counts``); read through ``dmuon.inspect.newton_schulz_counts``.
        self._ns_counts = NewtonSchulzCounts()
        # id(master) -> the TP-sharded parameter whose chunk it holds (masters never change).
        self._tp_chunks = {
            id(p.master): p for p in self._dedicated.iter_owned_masters() if p.is_tp_sharded
        }
        # id(master) -> its row-block sizes ([Note: row blocks] in ``dmuon.row_blocks``).
        self._row_blocks = {
            id(p.master): p.row_blocks
            for p in self._dedicated.iter_owned_masters()
            if p.row_blocks is not None
        }

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
        self._check_ranks_agree()
        self.step_group = step_group if step_group is not None else StepGroup()
        self.step_group.join(
            StepMember(self, self._dedicated, self.nonfinite, self._named_gradients)
        )
        self._overlap = self._start_overlap() if overlap_step else None
        self._offload = self._start_offload() if offload_masters else None
        self._compile_step_kernels_ahead()
        _log_route_summaries(self.routing())

    def _compile_step_kernels_ahead(self) -> None:
        """Start compiling the fused step kernels for this rank's Muon matrices, so that they
        compile together while the first forward and backward run rather than one by one in
        the first step ([Note: compiles ahead] in ``dmuon_kernels._fused_triton``)."""
        for group in self.param_groups:
            if group["route"] != MUON_ROUTE:
                continue
            shapes_by_device: dict[torch.device, set[tuple[int, int]]] = defaultdict(set)
            for master in group["params"]:
                if master.numel() == 0 or id(master) in self._tp_chunks:
                    continue
                for entry in _matrices_of(master, self._row_blocks.get(id(master))):
                    shapes_by_device[master.device].add(_entry_shape(entry))
            for device, shapes in shapes_by_device.items():
                muon_update.compile_kernels_ahead(
                    self._newton_schulz,
                    device,
                    shapes,
                    nesterov=group["nesterov"],
                    momentum_dtype=MOMENTUM_DTYPES[group["momentum_dtype"]],
                    normuon=group["normuon"],
                )

    def _start_offload(self) -> MasterOffload:
        """The CPU homes of ``offload_masters=True`` ([Note: offloaded masters] in
        ``dmuon.offload``) for the Muon route's masters this rank owns."""
        check_masters_can_be_offloaded(self._dedicated.params.values(), self.overlap_step)
        in_muon_groups = {
            id(master)
            for group in self.param_groups
            if group["route"] == MUON_ROUTE
            for master in group["params"]
        }
        owned = [
            (p, self._dedicated.boundary_of(p))
            for p in self._dedicated.iter_owned_masters()
            if id(p.master) in in_muon_groups
        ]
        return MasterOffload(owned, self._dedicated.device)

    def _start_overlap(self) -> OverlappedStep:
        """The speculation of ``overlap_step=True`` ([Note: the overlapped step] in
        ``dmuon.overlap``), listening to the model's gradients as they land."""
        # Decided from facts every rank has, so every rank raises alike.
        options = [
            f"{key}={group[key]!r}"
            for group in self.param_groups
            if group["route"] == MUON_ROUTE
            for key, plain in (("normuon", False), ("momentum_dtype", "float32"))
            if group[key] != plain
        ]
        if any(p.row_blocks is not None for p in self._dedicated.params.values()):
            options.append("dedicate_params(row_blocks=...)")
        if options:
            raise ValueError(
                "dmuon.Muon(overlap_step=True) does not combine yet with "
                f"{', '.join(sorted(set(options)))}: its speculation keeps plain fp32 momentum "
                "of whole matrices. Drop overlap_step=True, or those options."
            )
        if self._dedicated.gradient_listener is not None:
            raise ValueError(
                "dmuon.Muon(overlap_step=True): this model already has an optimizer with "
                "overlap_step=True; each model (each pipeline stage) takes one dmuon.Muon."
            )
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
            speculate=self._speculate_unit,
            apply=self._apply_call,
            device=self._dedicated.device,
        )
        self._dedicated.gradient_listener = overlap
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
        try:
            if self.nonfinite != "ignore" and self._skip_for_nonfinite_gradients():
                return loss
            if self._overlap is not None:  # the commit reads what the speculation wrote
                self._overlap.wait_for_speculation()
            self._dedicated.before_step()
            for index, group in enumerate(self.param_groups):
                if group["route"] == MUON_ROUTE:
                    with profiler_range(labels.OWNER_STEP):
                        self._muon_step(index, group)
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
        super().load_state_dict(without_layout(state_dict))
        for group, kept in zip(self.param_groups, before):
            for key, value in kept.items():
                if key in RULE_KEYS or key not in group:
                    group[key] = value
            if group["route"] != MUON_ROUTE:
                continue
            dtype = MOMENTUM_DTYPES[group["momentum_dtype"]]
            for param in group["params"]:  # torch cast float buffers to the masters' fp32
                if self.state.get(param):
                    _conform_momentum(self.state[param], dtype)

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
                    dtype = MOMENTUM_DTYPES[group["momentum_dtype"]]
                    _momentum_of(self.state[param], param, None, dtype, create=torch.zeros)
                    if group["normuon"]:
                        _second_moment_of(self.state[param], param, None)
                else:
                    self.state[param].update(_new_adamw_state(_local(param)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._dedicated.zero_master_grads(set_to_none)

    # ---- the Muon route -------------------------------------------------------------------------

    def _muon_step(self, index: int, group: dict) -> None:
        tp_sharded = self._tp_chunks
        self._tensor_parallel_muon_step(
            group, [tp_sharded[id(m)] for m in group["params"] if id(m) in tp_sharded]
        )
        masters = [
            master
            for master in group["params"]
            if master.grad is not None and master.numel() > 0 and id(master) not in tp_sharded
        ]
        # Overlapped: one chunk's matrices at a time, committed from backward's speculation
        # where it is valid, computed here otherwise (see [Note: the overlapped step]).
        units = (
            [masters] if self._overlap is None else self._overlap.units_to_compute(index, masters)
        )
        calls = [call for unit in units for call in _ns_calls_of(unit, self._row_blocks)]
        if self._offload is not None:  # the masters come from CPU memory a call ahead
            self._offload.run(calls, functools.partial(self._muon_update, group))
            return
        for call in calls:
            self._muon_update(group, call)

    def _muon_update(self, group: dict, masters: list[tuple[nn.Parameter, Piece]]) -> None:
        """The Muon step of ``masters``: matrices (or experts of expert pieces, or row blocks)
        of one Newton-Schulz shape, equal (rows, cols) adjacent; the math is ``muon_update``'s."""
        momentum_dtype = MOMENTUM_DTYPES[group["momentum_dtype"]]
        grads, momenta, scales, first_steps = [], [], [], []
        for master, piece in masters:
            state = self.state[master]
            first_step, momentum, scale = _momentum_of(state, master, piece, momentum_dtype)
            grads.append(_matrix(master.grad, piece))
            momenta.append(momentum)
            scales.append(scale)
            first_steps.append(first_step)
        int8 = momentum_dtype == torch.int8
        orthogonal = self._orthogonal(group, grads, momenta, first_steps, scales if int8 else None)
        self._apply_call(group, masters, orthogonal)

    def _orthogonal(
        self,
        group: dict,
        grads: list[torch.Tensor],
        momenta: list[torch.Tensor],
        first_steps: list[bool],
        scales: list[torch.Tensor] | None = None,
        new_momenta: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Momentum and Nesterov (into ``momenta``, or from them into ``new_momenta``) and one
        batched Newton-Schulz of one call's matrices; returns its output (B, short, long)."""
        with profiler_range(labels.NEWTON_SCHULZ):
            return muon_update.orthogonalized_matrices(
                self._newton_schulz,
                grads,
                momenta,
                first_steps,
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                scales=scales,
                graph_max_numel=None if self._overlap is None else SPECULATION_GRAPH_MAX_NUMEL,
                new_momenta=new_momenta,
            )

    def _apply_call(
        self, group: dict, masters: list[tuple[nn.Parameter, Piece]], orthogonal: torch.Tensor
    ) -> None:
        """NorMuon's rows if on, then decay and the scaled update of one call's masters from
        its Newton-Schulz output."""
        normuon = None
        if group["normuon"]:
            moments = [_second_moment_of(self.state[m], m, piece) for m, piece in masters]
            normuon = (moments, group["normuon_beta2"], group["normuon_eps"])
        muon_update.apply_matrices_(
            [_matrix(master, piece) for master, piece in masters],
            orthogonal,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            adjust_lr=group["adjust_lr"],
            normuon=normuon,
        )
        self._ns_counts.received(masters)

    def _speculate_unit(
        self,
        group: dict,
        masters: list[nn.Parameter],
        grads: dict[int, torch.Tensor],
        scratch: dict[int, torch.Tensor],
    ) -> list[tuple[list[tuple[nn.Parameter, int | None]], torch.Tensor]]:
        """The overlapped step's work during backward on one unit: ``_muon_update``'s, with
        each master's gradient from ``grads`` (id -> its landed gradient) and its momentum
        computed from the state's buffer into a new one (``scratch``, id -> buffer), the state
        left untouched; returns each call's matrices and Newton-Schulz output, which
        ``_apply_call`` applies at commit."""
        first_step_of, read = {}, {}
        for master in masters:
            buffer = self.state.get(master, {}).get("momentum_buffer")
            if buffer is not None:
                scratch[id(master)], first_step_of[id(master)] = torch.empty_like(buffer), False
                read[id(master)] = buffer
            else:  # as ``_momentum_of`` creates it: zeros for an expert piece, whose experts
                # each run ``buf = momentum * 0 + g``
                create = torch.zeros if is_expert_piece(master) else torch.empty
                scratch[id(master)] = create(
                    _momentum_shape(master), dtype=torch.float32, device=master.device
                )
                first_step_of[id(master)] = not is_expert_piece(master)
                read[id(master)] = scratch[id(master)]  # read and written in place
        calls = []
        for call in _ns_calls_of(masters, self._row_blocks):
            grads_of_call = [_matrix(grads[id(master)], expert) for master, expert in call]
            momenta = [_matrix(read[id(master)], expert) for master, expert in call]
            new_momenta = [_matrix(scratch[id(master)], expert) for master, expert in call]
            first_steps = [first_step_of[id(master)] for master, _ in call]
            output = self._orthogonal(
                group, grads_of_call, momenta, first_steps, new_momenta=new_momenta
            )
            calls.append((call, output))
        return calls

    def _tensor_parallel_muon_step(self, group: dict, params: list[DedicatedParam]) -> None:
        """The Muon route of TP-sharded matrices; see [Note: tensor-parallel matrices] in
        ``dmuon.tp``. Every TP rank of the owner runs it with the same matrices, in one order.

        Momentum and Nesterov are element-wise, so each TP rank applies them to its chunk; the
        chunks of the Muon input meet on the matrix's runner, which normalises and
        orthogonalises the whole matrix; each TP rank applies its chunk of the result.
        """
        params = [p for p in params if p.master.grad is not None]
        if not params:
            return
        mu = group["momentum"]
        momentum_dtype = MOMENTUM_DTYPES[group["momentum_dtype"]]
        inputs = []
        for p in params:
            first_step, momentum, _ = _momentum_of(
                self.state[p.master], p.master, None, momentum_dtype
            )
            update = muon_update.momentum_(
                _matrix(p.master.grad, None), momentum, first_step, mu, group["nesterov"]
            )
            inputs.append(update.view(p.local_shape))
        mesh = self._dedicated.mesh
        exchange = ChunkExchange(
            layouts=[p.tp for p in params],
            runners=[p.owner.tp for p in params],
            tp_ranks=mesh.tp_ranks,
            group=mesh.tp_group,
        )
        full_inputs = exchange.gather(inputs)
        results = muon_update.orthogonalized(
            self._newton_schulz, {i: (u, params[i].tp.shape) for i, u in full_inputs.items()}
        )
        device = params[0].master.device
        chunks = exchange.scatter(results, self._newton_schulz.iteration_dtype(device), device)
        for p, chunk in zip(params, chunks):
            muon_update.apply_update_(
                p.master,
                chunk,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                adjust_lr=group["adjust_lr"],
                matrix_shape=tuple(p.shape),
            )
        self._ns_counts.received((p.master, None) for p in params)

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


def _matrix_shape(param: torch.Tensor) -> tuple[int, int]:
    """(m, n) of a weight, trailing dims flattened into n; of each expert of an expert piece."""
    if is_expert_piece(param):
        return param.shape[1], param.shape[2]
    return matrix_shape_of(param.shape)


Piece = int | slice | None
"""Which matrix of a master an entry is: None (the master), ``i`` (expert i of an expert
piece) or ``slice(start, stop)`` (a row block)."""


def _matrices_of(
    master: torch.Tensor, row_blocks: tuple[int, ...] | None = None
) -> list[tuple[torch.Tensor, Piece]]:
    """The matrices Muon orthogonalises in ``master``: itself, each expert of an expert piece
    (k, m, n), or each of its row blocks; each gets its own Newton-Schulz and lr scale."""
    if is_expert_piece(master):
        return [(master, expert) for expert in range(master.shape[0])]
    if row_blocks is not None:
        starts = itertools.accumulate(row_blocks, initial=0)
        return [(master, slice(start, start + rows)) for start, rows in zip(starts, row_blocks)]
    return [(master, None)]


def _ns_calls_of(
    masters: list[nn.Parameter], row_blocks: dict[int, tuple[int, ...]]
) -> Iterator[list[tuple[nn.Parameter, Piece]]]:
    """The batched Newton-Schulz calls of ``masters`` (``row_blocks``: id(master) -> its row
    blocks), each a list of matrices. Newton-Schulz runs on rows <= cols, so an (m, n) and an
    (n, m) matrix share one call (Llama's gate/up and down projections, say); same-shape runs
    stay adjacent for the element-wise batches."""
    by_ns_shape: dict[tuple[int, int], list[tuple[nn.Parameter, Piece]]] = defaultdict(list)
    for master in masters:
        for entry in _matrices_of(master, row_blocks.get(id(master))):
            rows, cols = _entry_shape(entry)
            by_ns_shape[(min(rows, cols), max(rows, cols))].append(entry)
    for (short, long), same_shape in by_ns_shape.items():
        same_shape.sort(key=_entry_shape)  # (rows, cols) adjacent
        yield from _ns_calls(same_shape, short * long)


def _entry_shape(entry: tuple[torch.Tensor, Piece]) -> tuple[int, int]:
    """(rows, cols) of the matrix an entry of ``_matrices_of`` stands for."""
    master, piece = entry
    rows, cols = _matrix_shape(master)
    return (piece.stop - piece.start, cols) if isinstance(piece, slice) else (rows, cols)


def _ns_calls(
    masters: list[tuple[torch.Tensor, Piece]], numel: int
) -> Iterator[list[tuple[torch.Tensor, Piece]]]:
    """``masters`` in equal runs of at most ``NS_CALL_BYTES`` of fp16 Newton-Schulz input (the
    iteration's workspace is a few times its input, and lives only during the call)."""
    per_call = max(1, NS_CALL_BYTES // (2 * numel))
    calls = -(-len(masters) // per_call)
    size = -(-len(masters) // calls)
    for start in range(0, len(masters), size):
        yield masters[start : start + size]


def _matrix(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """(m, n) view of a master-shaped tensor (weight or gradient): the matrix, one expert, or
    one row block."""
    if piece is None:
        return tensor.view(_matrix_shape(tensor))
    if isinstance(piece, slice):
        return tensor.view(matrix_shape_of(tensor.shape))[piece]
    return tensor[piece]


def _momentum_shape(master: torch.Tensor) -> tuple[int, ...]:
    """Muon's momentum of a master: (m, n), or (k, m, n) for an expert piece."""
    return tuple(master.shape) if is_expert_piece(master) else _matrix_shape(master)


def _momentum_of(
    state: dict, master: torch.Tensor, piece: Piece, dtype: torch.dtype, create=None
) -> tuple[bool, torch.Tensor, torch.Tensor | None]:
    """``(first_step, the (m, n) momentum buffer, its int8 scales or None)`` of one matrix,
    created on its first step in ``dtype`` (a buffer held in another dtype, as torch's
    ``load_state_dict`` or a change of ``momentum_dtype`` leaves it, is converted).

    An expert piece keeps one (k, m, n) buffer and a matrix in row blocks one (m, n) buffer,
    created as zeros: ``buf = momentum * 0 + g`` is exactly the first step's ``buf = g`` for
    each of its matrices. An int8 buffer is created as zeros too (its scales must be finite).
    """
    _conform_momentum(state, dtype)
    int8 = dtype == torch.int8
    key = MOMENTUM_INT8 if int8 else "momentum_buffer"
    buf = state.get(key)
    first_step = buf is None
    if first_step:
        create = create or (torch.zeros if piece is not None or int8 else torch.empty)
        shape = _momentum_shape(master)
        buf = state[key] = create(shape, dtype=dtype, device=master.device)
        if int8:
            scale_shape = int8_scale_shape(shape)
            state[MOMENTUM_SCALE] = create(scale_shape, dtype=torch.float32, device=master.device)
    scale = state[MOMENTUM_SCALE] if int8 else None
    if piece is None:
        return first_step, buf, scale
    return False, buf[piece], None if scale is None else scale[piece]


def _conform_momentum(state: dict, dtype: torch.dtype) -> None:
    """Hold the momentum of ``state`` (if any) in ``dtype``: a float buffer cast, an int8 one
    ([Note: 8-bit momentum]) quantised or dequantised."""
    if dtype == torch.int8:
        if "momentum_buffer" in state:
            values = state.pop("momentum_buffer").to(torch.float32)
            q = torch.empty(values.shape, dtype=torch.int8, device=values.device)
            scale = torch.empty(int8_scale_shape(values.shape), device=values.device)
            quantize_(q, scale, values)
            state[MOMENTUM_INT8], state[MOMENTUM_SCALE] = q, scale
    elif MOMENTUM_INT8 in state:
        values = dequantized(state.pop(MOMENTUM_INT8), state.pop(MOMENTUM_SCALE))
        state["momentum_buffer"] = values.to(dtype)
    elif "momentum_buffer" in state and state["momentum_buffer"].dtype != dtype:
        state["momentum_buffer"] = state["momentum_buffer"].to(dtype)


def _second_moment_of(state: dict, master: torch.Tensor, piece: Piece) -> torch.Tensor:
    """NorMuon's per-row second moment of one matrix (fp32, zeros on its first step)."""
    moment = state.get(ROW_SECOND_MOMENT)
    if moment is None:
        shape = _momentum_shape(master)[:-1]  # (m,), or (k, m) for an expert piece
        moment = torch.zeros(shape, dtype=torch.float32, device=master.device)
        state[ROW_SECOND_MOMENT] = moment
    return moment if piece is None else moment[piece]


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


def _resolve_newton_schulz(ns_backend: str | NewtonSchulz) -> NewtonSchulz:
    if isinstance(ns_backend, NewtonSchulz):
        return ns_backend
    if isinstance(ns_backend, str):
        return NewtonSchulz(backend=ns_backend)
    raise TypeError(
        f"ns_backend must be 'gram', 'direct' or a dmuon.NewtonSchulz, got "
        f"{type(ns_backend).__name__}: {ns_backend!r}."
    )


def _check_hyperparameters(
    *,
    nesterov,
    replicate_async,
    overlap_step,
    offload_masters,
    adamw_betas,
    momentum,
    normuon,
    normuon_beta2,
    **values: float,
) -> None:
    """Refuse what torch.optim would take silently or fail on later, showing the value."""
    for name, value in {**values, "momentum": momentum, "normuon_beta2": normuon_beta2}.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ValueError(f"dmuon.Muon: {name} must be a finite number, got {value!r}.")
        if value < 0:
            raise ValueError(f"dmuon.Muon: {name} must be a non-negative number, got {value!r}.")
    if not 0 <= momentum < 1:
        raise ValueError(f"dmuon.Muon: momentum must be in [0, 1), got {momentum!r}.")
    if not 0 <= normuon_beta2 < 1:
        raise ValueError(f"dmuon.Muon: normuon_beta2 must be in [0, 1), got {normuon_beta2!r}.")
    flags = {
        "nesterov": nesterov,
        "replicate_async": replicate_async,
        "overlap_step": overlap_step,
        "normuon": normuon,
        "offload_masters": offload_masters,
    }
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"dmuon.Muon: {name} must be True or False, got {value!r}.")
    if (
        not isinstance(adamw_betas, (tuple, list))
        or len(adamw_betas) != 2
        or not all(
            isinstance(beta, (int, float)) and not isinstance(beta, bool) and 0 <= beta < 1
            for beta in adamw_betas
        )
    ):
        raise ValueError(
            "dmuon.Muon: adamw_betas must be a pair of numbers in [0, 1), e.g. (0.9, 0.999), "
            f"got {adamw_betas!r}."
        )
