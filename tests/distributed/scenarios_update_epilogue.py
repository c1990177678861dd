"""Scenarios of the Muon update written by Newton-Schulz's last product ([Note: the update
epilogue] in ``dmuon_kernels.update_epilogue``) on every rank of a gloo pool. The epilogue is a
CUDA path; here it is switched on for the CPU's fp32 iteration (``addmm_`` into the master), so
the owners' steps take it on 1-D and HSDP meshes, with resident and offloaded masters, against
the single-process fp32 reference. The offload scenarios' model and training are reused: bf16
compute, so each owner's fp32 master is a copy of its own.
"""

from __future__ import annotations

import contextlib
import sys

from dmuon.hooks import get_dedicated_state
from tests.distributed import scenarios_offload as offload
from tests.distributed.models import batches, loss_fn
from tests.distributed.scenarios_protocol import relative_errors


@contextlib.contextmanager
def epilogue_on():
    """The epilogue on for CPU tensors, counting its products (the pool's processes outlive a
    scenario, so the switch is restored)."""
    module = sys.modules["dmuon_kernels.newton_schulz"]  # the package attribute is the function
    switch, product, calls = module.epilogue_enabled, module.final_update_, []

    def counted(*args, **kwargs):
        calls.append(1)
        return product(*args, **kwargs)

    module.epilogue_enabled, module.final_update_ = (lambda X: True), counted
    try:
        yield calls
    finally:
        module.epilogue_enabled, module.final_update_ = switch, product


def epilogue_against_reference(replicas: int = 1) -> dict:
    """Resident and offloaded masters trained with the epilogue, and the fp32 reference: whether
    the two runs' weights are bit-identical after every step, the resident run's worst relative
    error of an owned master against the reference per step, and how many products this rank's
    epilogue ran."""
    with offload.one_matrix_per_call(), epilogue_on() as calls:
        resident, resident_optimizer = offload.build(replicas, offload=False)
        model, optimizer = offload.build(replicas, offload=True)
        reference, reference_optimizer = offload.build_reference()
        every = batches(offload.STEPS, 1, per_rank=offload.GLOBAL_ROWS)
        identical, max_errors = [], []
        for step in range(offload.STEPS):
            offload.train(resident, resident_optimizer, range(step, step + 1))
            offload.train(model, optimizer, range(step, step + 1))
            loss_fn(reference, every[step]).backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            mine = offload.weights(resident)
            identical.append(offload.identical(offload.weights(model), mine))
            owned = {p.fqn for p in get_dedicated_state(resident).iter_owned_masters()}
            errors = relative_errors({k: v for k, v in mine.items() if k in owned}, reference)
            max_errors.append(max(errors.values(), default=0.0))
    return {"identical": identical, "max_errors": max_errors, "products": len(calls)}
