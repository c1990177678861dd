"""The names dmuon gives its phases in a profiler trace (``torch.profiler.record_function``).

Owns the label of every phase, one constant each, so a trace reads the same wherever a phase runs
and the tests check the names the code uses. A leaf: it imports nothing of dmuon, and it must
not decide where a phase begins or ends (the modules that run the phases open the ranges).

[Note: profiler labels]
FSDP2 labels its phases ``FSDP::pre_forward``, ``FSDP::all_gather``, ... with the module's FQN
after them; dmuon does the same with ``dmuon::``: a phase of one hook boundary is labelled
``"dmuon::<phase> (<fqn>)"`` (the bare label for the root module, as FSDP2), a phase of the
whole model or of the optimizer ``"dmuon::<phase>"``. A range is opened once per phase, never
per parameter: ``record_function`` costs a few microseconds of host time even with no profiler
running (7 us measured on a CPU host), so the labels stay at the granularity of boundaries,
batches of collectives and Newton-Schulz calls, and none is opened while no profiler runs
(``_torch_internals.profiler_range``: 0.7 us for the check). A collective's range covers its issue (and, for the ``*_wait`` labels, its
wait); on CUDA the transfer itself runs later on the device.

Per boundary, once per pass unless said:
- ``PRE_FORWARD``: its forward begins (the broadcast's wait included).
- ``BROADCAST``: the broadcasts of its weights from their owners are issued (in its pre-forward,
  or earlier by a prefetch; again in its pre-backward when the weights were freed after forward).
- ``BROADCAST_WAIT``: forward or backward waits for those broadcasts.
- ``PRE_BACKWARD``: its backward begins (the re-broadcast's wait included).
- ``POST_BACKWARD``: its backward is done: weights freed, gradients sent (``REDUCE``).
- ``REDUCE``: its gradients are packed and their reduces to the owners issued.
- ``REDUCE_WAIT``: the owners wait for the reduces and run the replicate-axis stage (HSDP).
- ``WAIT_PUBLISH``: a publish of the new weights across replicas still in flight is waited
  for (HSDP: by the next forward's broadcast, or the next step).

Per model or optimizer:
- ``FINALIZE_BACKWARD``: the end of backward (once per backward): the remaining reduces waited
  for, the gradients averaged and given to the owners' masters.
- ``OWNER_STEP``: Muon's step of a param group's owned matrices (momentum, Newton-Schulz,
  update); ``NEWTON_SCHULZ`` inside it, once per batched call of one shape (its momentum and
  Nesterov included). Tensor-parallel matrices, orthogonalised whole after a gather, have no
  ``NEWTON_SCHULZ`` range of their own.
- ``ADAMW_STEP``: the AdamW route of a param group.
- ``PUBLISH``: after the step, every boundary's copies follow the masters (the HSDP broadcasts
  across replicas are issued here).
- ``SPECULATE``: the overlapped step, during backward: a unit's momentum and Newton-Schulz
  computed ahead (``dmuon.overlap``); ``COMMIT``: ``step()`` applies a unit speculated so.
- ``CLIP_GRAD_NORM``: ``dmuon.clip_grad_norm_``: the total norm and the scaling.
"""

from __future__ import annotations

PRE_FORWARD = "dmuon::pre_forward"
BROADCAST = "dmuon::broadcast"
BROADCAST_WAIT = "dmuon::broadcast_wait"
PRE_BACKWARD = "dmuon::pre_backward"
POST_BACKWARD = "dmuon::post_backward"
REDUCE = "dmuon::reduce"
REDUCE_WAIT = "dmuon::reduce_wait"
WAIT_PUBLISH = "dmuon::wait_publish"

FINALIZE_BACKWARD = "dmuon::finalize_backward"
OWNER_STEP = "dmuon::owner_step"
NEWTON_SCHULZ = "dmuon::newton_schulz"
ADAMW_STEP = "dmuon::adamw_step"
PUBLISH = "dmuon::publish"
SPECULATE = "dmuon::speculate"
COMMIT = "dmuon::commit"
CLIP_GRAD_NORM = "dmuon::clip_grad_norm"

# Every label above, in the order of a training step.
ALL_LABELS = (
    PRE_FORWARD,
    BROADCAST,
    BROADCAST_WAIT,
    PRE_BACKWARD,
    POST_BACKWARD,
    REDUCE,
    REDUCE_WAIT,
    FINALIZE_BACKWARD,
    CLIP_GRAD_NORM,
    SPECULATE,
    OWNER_STEP,
    NEWTON_SCHULZ,
    COMMIT,
    ADAMW_STEP,
    PUBLISH,
    WAIT_PUBLISH,
)


def of_boundary(label: str, fqn: str) -> str:
    """``label`` for the boundary whose module is ``fqn``: ``"label (fqn)"``, or ``label`` for
    the root module (``""``), as FSDP2 names its groups."""
    return f"{label} ({fqn})" if fqn else label
