"""Every message and recipe of the seed's troubleshooting page, as dmuon has it.

One test per entry, in the page's order (install, setup, runtime correctness, performance, HSDP,
tensor parallelism). Entries whose case needs several ranks are tested where the protocol is,
and named here:

- HSDP mesh shapes, every variant (unnamed, 1-D, dims of two meshes, the same or overlapping
  dims, 2-D as mesh; any names work):
  ``tests/distributed/test_protocol.py::test_bad_meshes_and_call_orders_raise_messages_that_show_the_fix``
  (here: the one-process case);
- "previous event still pending" (two ``step()`` calls without a forward, HSDP async publish):
  ``tests/distributed/test_protocol.py::test_two_steps_without_a_forward_drain_the_pending_publish_and_stay_correct``;
- different NS kernels on different ranks: ``test_protocol.py::test_different_newton_schulz_requests_across_ranks_raise_on_every_rank``;
- checkpoints across topologies: ``tests/distributed/test_checkpoint.py``.
"""

from __future__ import annotations

import inspect
import json
import re
import warnings

import pytest
import torch

import dmuon
from dmuon_kernels._torch_support import require_torch
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate
from tests.reliability.scenarios_reliability import tp_parameter_on_an_unnamed_mesh


def prepared(**kwargs):
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    return model, dmuon.Muon(model, **kwargs)


# ---- install --------------------------------------------------------------------------------


def test_an_old_torch_is_refused_naming_the_version_and_the_upgrade():
    with pytest.raises(ImportError, match=r"requires torch>=2\.11 .* pip install 'torch>=2\.11'"):
        require_torch("dmuon-core", "2.4.0")


def test_get_ns_backend_names_the_form_and_the_kernel_that_runs():
    assert re.fullmatch(r"Gram NS · kernel=\w+ \(.+\)", dmuon.get_ns_backend())


def test_an_explicit_quack_kernel_that_cannot_run_fails_fast_with_the_install_hint():
    if torch.cuda.is_available():
        pytest.skip("tests the refusal on a machine without an SM90 GPU")
    with pytest.raises(RuntimeError, match=r"pip install dmuon-kernels\[quack\].*kernel=\"auto\""):
        dmuon.NewtonSchulz(kernel="quack")


# ---- setup ----------------------------------------------------------------------------------


def test_dedicate_params_takes_the_keywords_newer_code_passes():
    parameters = inspect.signature(dmuon.dedicate_params).parameters
    assert {"replicate_mesh", "hook_boundary_predicate", "param_policy", "compute_dtype"} <= set(
        parameters
    )


def test_a_predicate_that_matches_nothing_warns_with_the_seed_text_and_the_debugging_loop():
    with pytest.warns(UserWarning) as record:
        dmuon.dedicate_params(TinyDecoder(), None, lambda name, p: "linear" in name)
    message = str(record[0].message)
    assert message.startswith("dedicate_params: no parameters matched the predicate")
    assert "for name, param in model.named_parameters():" in message


def test_a_replicate_mesh_without_its_shard_mesh_shows_the_named_2d_mesh_fix():
    with pytest.raises(ValueError, match=re.escape('mesh_dim_names=("replicate", "shard")')):
        dmuon.dedicate_params(TinyDecoder(), None, proj_predicate, replicate_mesh=object())


# ---- runtime correctness --------------------------------------------------------------------


def test_the_cublas_reference_kernel_recipe_for_nan_hunting_runs():
    ns = dmuon.NewtonSchulz(kernel="cublas")  # = deterministic=True
    assert ns.kernel == "cublas"
    model, optimizer = prepared(ns_backend=ns)
    loss_fn(model, batches(1, 1)[0]).backward()
    optimizer.step()


def test_the_legacy_compute_dtype_maps_to_param_policy_and_none_inherits():
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate, compute_dtype=None)
    params = dmuon.inspect.view(model).params
    assert all(p.param_dtype == torch.float32 for p in params.values())


def test_model_output_objects_keep_their_type_through_the_hooks():
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    output = model(batches(1, 1)[0])
    assert type(output) is torch.Tensor  # HF ModelOutput: tests/hf/test_model_output.py


# ---- performance ----------------------------------------------------------------------------


def test_the_diagnostic_summaries_of_the_seed_print_as_json():
    model, optimizer = prepared()
    assert json.dumps(dmuon.summarize_param_groups(model, optimizer), default=str)
    assert json.dumps(dmuon.summarize_comm_plan(model), default=str)


def test_the_forward_unshard_profile_is_collected_when_requested(monkeypatch):
    monkeypatch.setenv("DMUON_RECORD_FORWARD_PROFILE", "1")
    model, _ = prepared()
    loss_fn(model, batches(1, 1)[0])
    profile = dmuon.collect_forward_unshard_profile(model, synchronize=True)
    assert profile


def test_sync_and_async_publish_are_both_accepted():
    for replicate_async in (True, False):
        prepared(replicate_async=replicate_async)


# ---- HSDP and tensor parallelism ------------------------------------------------------------


def test_waiting_for_pending_publishes_before_exit_is_always_safe():
    model, optimizer = prepared()
    loss_fn(model, batches(1, 1)[0]).backward()
    optimizer.step()
    dmuon.wait_all_replicate_broadcasts(model)
    dmuon.wait_all_replicate_broadcasts(model)


def test_two_steps_without_a_forward_raise_nothing():
    model, optimizer = prepared()
    loss_fn(model, batches(1, 1)[0]).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
        optimizer.step()


def test_a_tensor_parallel_parameter_on_an_unnamed_mesh_gets_the_seed_error_and_fix(gloo_pool):
    (message,) = gloo_pool(1).run(tp_parameter_on_an_unnamed_mesh)
    assert message.startswith("DMuon requires named DeviceMesh for TP detection")
    assert 'mesh_dim_names=("dp", "tp")' in message
