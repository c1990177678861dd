"""The dmuon-tools summaries in one process, without torch.distributed (``mesh=None``)."""

import json
import math
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import dmuon
import dmuon_tools
from dmuon_tools.comm_plan import COLLECTIVE_KINDS
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate
from tests.distributed.test_protocol import message_entry

BF16_COMPUTE_FP32_REDUCE = {
    "defaults": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
}


def ns_gflop(shape) -> float:
    """Newton-Schulz FLOPs of a matrix, written out here as the independent reference."""
    short, long = sorted(shape)
    return (6 * short * short * long + 14 * short**3) / 1e9


def dedicated_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if proj_predicate(name, p)]


def test_param_groups_report_route_owner_shape_and_dtypes_of_every_parameter():
    reference = TinyDecoder()
    model = TinyDecoder()
    model.layers[1].attn_norm.weight.requires_grad_(False)
    dmuon.dedicate_params(model, None, proj_predicate, param_policy=BF16_COMPUTE_FP32_REDUCE)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, no_decay=None)  # two groups

    summary = dmuon_tools.summarize_param_groups(model, optimizer)

    json.dumps(summary)  # plain JSON: no default= needed
    dedicated = set(dedicated_names(reference))
    assert list(summary["params"]) == [name for name, _ in reference.named_parameters()]
    for name, expected in reference.named_parameters():
        entry = summary["params"][name]
        assert entry["shape"] == list(expected.shape), name
        assert entry["fsdp2"] is False
        if name in dedicated:
            assert entry["route"] == "muon"
            assert entry["owner"] == {"shard": 0, "replicate": 0}
            assert (entry["owner_rank"], entry["is_owner"]) == (0, True)
            assert (entry["param_dtype"], entry["master_dtype"]) == ("bfloat16", "float32")
            assert entry["reduce_dtype"] == "float32"
            assert entry["group"] == 0
        elif name == "layers.1.attn_norm.weight":
            assert (entry["route"], entry["group"], entry["master_dtype"]) == ("frozen", None, None)
        else:
            assert (entry["route"], entry["owner"], entry["is_owner"]) == ("adamw", None, None)
            assert (entry["param_dtype"], entry["master_dtype"]) == ("float32", "float32")
            assert entry["group"] == 1

    muon, adamw = summary["groups"]
    assert muon["route"] == "muon" and muon["hyperparameters"]["lr"] == 0.02
    assert muon["num_params"] == len(dedicated)
    assert muon["numel"] == sum(
        p.numel() for n, p in reference.named_parameters() if n in dedicated
    )
    trainable_rest = [
        p
        for n, p in reference.named_parameters()
        if n not in dedicated and n != "layers.1.attn_norm.weight"
    ]
    assert adamw["route"] == "adamw" and adamw["hyperparameters"]["lr"] == 1e-3
    assert adamw["hyperparameters"]["betas"] == [0.9, 0.999]
    assert adamw["num_params"] == len(trainable_rest)
    assert adamw["numel"] == sum(p.numel() for p in trainable_rest)
    assert summary["totals"]["muon"]["num_params"] == len(dedicated)
    assert summary["totals"]["frozen"] == {"num_params": 1, "numel": 30}
    assert summary["optimizer"]["newton_schulz"]["backend"] == "gram"
    assert summary["mesh"]["coord"] == {"shard": 0, "replicate": 0}


def test_param_groups_of_a_model_with_wrapped_blocks_report_each_parameter_by_canonical_name():
    model = TinyDecoder()
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dmuon.dedicate_params(model, None, proj_predicate)
        optimizer = dmuon.Muon(model)
    summary = dmuon_tools.summarize_param_groups(model, optimizer)
    assert list(summary["params"]) == [name for name, _ in TinyDecoder().named_parameters()]
    entry = summary["params"]["layers.0.q_proj.weight"]
    assert (entry["dedicated"], entry["route"], entry["is_owner"]) == (True, "muon", True)


def test_param_groups_of_a_model_without_dedicated_parameters_are_all_adamw():
    model = TinyDecoder()
    optimizer = torch.optim.AdamW(model.parameters())
    summary = dmuon_tools.summarize_param_groups(model, optimizer)
    json.dumps(summary)
    assert summary["mesh"] is None
    assert {entry["route"] for entry in summary["params"].values()} == {"adamw"}
    assert summary["groups"][0]["route"] is None
    assert summary["groups"][0]["num_params"] == len(list(model.parameters()))


def test_tied_parameters_are_reported_once_with_the_name_they_are_tied_to():
    model = TinyDecoder(tie_embeddings=True)
    dmuon.dedicate_params(model, None, proj_predicate)
    summary = dmuon_tools.summarize_param_groups(model, dmuon.Muon(model))
    assert summary["params"]["lm_head.weight"]["tied_to"] == "embed.weight"
    assert "tied_to" not in summary["params"]["embed.weight"]
    assert summary["totals"]["adamw"]["numel"] == sum(
        p.numel()
        for n, p in TinyDecoder(tie_embeddings=True).named_parameters()
        if not proj_predicate(n, p)
    )


def test_comm_plan_in_one_process_has_segments_in_compute_and_reduce_dtype_and_no_collectives():
    reference = TinyDecoder()
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate, param_policy=BF16_COMPUTE_FP32_REDUCE)

    plan = dmuon_tools.summarize_comm_plan(model)

    json.dumps(plan)
    assert plan["estimate"] is True and plan["adopted"] is True
    assert [b["name"] for b in plan["boundaries"]] == ["layers.0", "layers.1", "layers.2"]
    for index, boundary in enumerate(plan["boundaries"]):
        shapes = [
            p.shape
            for n, p in reference.named_parameters()
            if n.startswith(f"layers.{index}.") and proj_predicate(n, p)
        ]
        numel = sum(math.prod(s) for s in shapes)
        (segment,) = boundary["segments"]
        assert (segment["shard"], segment["root_rank"], segment["is_local"]) == (0, 0, True)
        assert (segment["dtype"], segment["reduce_dtype"]) == ("bfloat16", "float32")
        assert segment["bytes"] == 2 * numel
        assert segment["message_bytes"] == 4 * sum(message_entry(math.prod(s)) for s in shapes)
        assert boundary["broadcasts_per_step"] == 2  # Z3 by default
    for view in ("this_rank", "all_ranks"):
        for kind in COLLECTIVE_KINDS:
            assert plan[view]["per_kind"][kind]["collectives"] == 0
        assert plan[view]["total"]["payload_bytes"] == 0
    load = plan["load"]
    expected_gflop = sum(
        ns_gflop(reference.get_parameter(n).shape) for n in dedicated_names(reference)
    )
    assert load["num_slots"] == 1 and load["imbalance"] == 1.0
    assert load["total_gflop"] == pytest.approx(expected_gflop, rel=1e-12)
    assert load["per_owner"][0]["rank"] == 0


def init_weights(model: nn.Module) -> None:
    torch.manual_seed(0)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def test_comm_plan_of_a_meta_device_model_before_materialisation_equals_the_adopted_one():
    with torch.device("meta"):
        model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    before = dmuon_tools.summarize_comm_plan(model)
    model.to_empty(device="cpu")
    init_weights(model)
    dmuon.Muon(model)  # adopts the weights
    after = dmuon_tools.summarize_comm_plan(model)
    assert (before["adopted"], after["adopted"]) == (False, True)
    for key in ("boundaries", "this_rank", "all_ranks", "load"):
        assert before[key] == after[key], key


def test_comm_plan_needs_dedicated_parameters():
    with pytest.raises(ValueError, match=r"call dmuon.dedicate_params\(model, mesh, predicate\)"):
        dmuon_tools.summarize_comm_plan(TinyDecoder())


def train(model: nn.Module, steps: int) -> None:
    optimizer = dmuon.Muon(model)
    for batch in batches(steps, 1):
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_forward_profile_without_the_env_var_says_how_to_enable_it(monkeypatch):
    monkeypatch.delenv("DMUON_RECORD_FORWARD_PROFILE", raising=False)
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    train(model, 1)
    assert dmuon_tools.collect_forward_unshard_profile(model, synchronize=True) == {
        "enabled": False,
        "hint": "set DMUON_RECORD_FORWARD_PROFILE=1 before dmuon.dedicate_params",
    }


def test_forward_profile_counts_waits_and_prefetches_per_boundary(monkeypatch):
    monkeypatch.setenv("DMUON_RECORD_FORWARD_PROFILE", "1")
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    untouched = dmuon_tools.collect_forward_unshard_profile(model)
    assert [b["waits"] for b in untouched["boundaries"]] == [0, 0, 0]
    train(model, 3)

    profile = dmuon_tools.collect_forward_unshard_profile(model)

    json.dumps(profile)
    assert profile["enabled"] is True and profile["synchronized"] is False
    boundaries = profile["boundaries"]
    assert [b["name"] for b in boundaries] == ["layers.0", "layers.1", "layers.2"]
    assert [b["waits"] for b in boundaries] == [3, 3, 3]
    # The forward order is known from the second step on; the first boundary is never prefetched.
    assert [b["prefetched"] for b in boundaries] == [0, 2, 2]
    assert all(b["host_ms"] >= 0.0 for b in boundaries)
    assert profile["totals"]["waits"] == 9 and profile["totals"]["prefetched"] == 4
    assert profile["totals"]["cuda_wait_ms"] == {
        "events": 0,
        "timed": 0,
        "pending": 0,
        "sum": 0.0,
        "mean": None,
        "max": None,
    }


@pytest.mark.parametrize(
    "name", ["summarize_param_groups", "summarize_comm_plan", "collect_forward_unshard_profile"]
)
def test_dmuon_resolves_the_diagnostics_to_dmuon_tools_by_name(name):
    assert getattr(dmuon, name) is getattr(dmuon_tools, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_forward_profile_on_cuda_times_every_wait_with_events_after_synchronize(monkeypatch):
    monkeypatch.setenv("DMUON_RECORD_FORWARD_PROFILE", "1")
    model = TinyDecoder().cuda()
    dmuon.dedicate_params(model, None, proj_predicate)
    optimizer = dmuon.Muon(model)
    for batch in batches(2, 1):
        loss_fn(model, batch.cuda()).backward()
        optimizer.step()
        optimizer.zero_grad()

    profile = dmuon_tools.collect_forward_unshard_profile(model, synchronize=True)

    assert profile["synchronized"] is True
    for boundary in profile["boundaries"]:
        cuda = boundary["cuda_wait_ms"]
        assert cuda["events"] == boundary["waits"] == 2
        assert (cuda["timed"], cuda["pending"]) == (2, 0)
        assert 0.0 <= cuda["max"] <= cuda["sum"]
