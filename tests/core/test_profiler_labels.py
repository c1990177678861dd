"""dmuon's phase labels in one process (``dedicate_params(model, None, ...)``; [Note: profiler
labels] in ``dmuon._profiler_labels``): a training step under ``torch.profiler`` shows each
phase by name, as often as it runs. (On several ranks, HSDP and the overlapped step:
tests/distributed/test_profiler_labels.py.)"""

import torch
from torch.profiler import ProfilerActivity, profile

import dmuon
from dmuon import _profiler_labels as labels
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate


def test_one_process_step_records_every_phase_label_once_per_boundary_and_pass():
    torch.manual_seed(0)
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    optimizer = dmuon.Muon(model, ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"))
    first, second = batches(2, 1)
    loss_fn(model, first).backward()
    optimizer.step()
    optimizer.zero_grad()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_fn(model, second).backward()
        dmuon.clip_grad_norm_(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    counts = {e.key: e.count for e in prof.key_averages() if e.key.startswith("dmuon::")}
    names = [group.name for group in get_dedicated_state(model).boundaries]
    assert names == ["layers.0", "layers.1", "layers.2"]
    muon = [group for group in optimizer.param_groups if group["route"] == "muon"]
    ns_shapes = {(min(m.shape), max(m.shape)) for group in muon for m in group["params"]}
    expected = {labels.of_boundary(label, name): count for name in names for label, count in [
        (labels.PRE_FORWARD, 1),
        (labels.BROADCAST, 2),  # forward, and backward after Z3 freed the weights
        (labels.BROADCAST_WAIT, 2),
        (labels.PRE_BACKWARD, 1),
        (labels.POST_BACKWARD, 1),
        (labels.REDUCE, 1),
        (labels.REDUCE_WAIT, 1),
    ]}  # fmt: skip
    expected |= {
        labels.FINALIZE_BACKWARD: 1,
        labels.CLIP_GRAD_NORM: 1,
        labels.OWNER_STEP: len(muon),
        labels.NEWTON_SCHULZ: len(ns_shapes),  # one batched call per shape
        labels.ADAMW_STEP: len(optimizer.param_groups) - len(muon),
        labels.PUBLISH: 1,
    }
    assert counts == expected


def test_every_label_is_named_in_dmuons_namespace_and_a_boundarys_carries_its_fqn():
    assert all(label.startswith("dmuon::") for label in labels.ALL_LABELS)
    assert len(set(labels.ALL_LABELS)) == len(labels.ALL_LABELS)
    assert labels.of_boundary(labels.BROADCAST, "layers.0") == "dmuon::broadcast (layers.0)"
    assert labels.of_boundary(labels.BROADCAST, "") == "dmuon::broadcast"  # the root module


def test_no_range_is_opened_while_no_profiler_runs():
    from dmuon._torch_internals import profiler_range

    named = []
    assert profiler_range(lambda: named.append(1) or "x") is profiler_range("y")  # the no-op
    assert named == []  # a boundary's label is not even formatted
    with profile(activities=[ProfilerActivity.CPU]) as prof, profiler_range(lambda: "dmuon::probe"):
        pass
    assert [e.key for e in prof.key_averages() if e.key == "dmuon::probe"] == ["dmuon::probe"]
