"""param_groups=, no_decay= and routes= in one process: groups, the routing table and errors."""

from __future__ import annotations

import logging

import pytest
import torch

import dmuon
from dmuon import _log as dmuon_log
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate

NORMS_AND_BIASES = {
    name for name, _ in TinyDecoder().named_parameters() if "norm" in name or name.endswith(".bias")
}


def dedicated(routes=None, predicate=proj_predicate) -> TinyDecoder:
    torch.manual_seed(0)
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, predicate, routes=routes)
    return model


def rows_by_name(optimizer) -> dict:
    return {row.fqn: row for row in optimizer.routing()}


def test_by_default_biases_and_norm_weights_get_no_weight_decay_and_embeddings_do():
    optimizer = dmuon.Muon(dedicated(), weight_decay=0.1, adamw_weight_decay=0.01)
    rows = rows_by_name(optimizer)
    assert {name for name, row in rows.items() if row.weight_decay == 0.0} == NORMS_AND_BIASES
    assert rows["embed.weight"].weight_decay == 0.01
    assert rows["lm_head.weight"].weight_decay == 0.01
    assert rows["layers.0.q_proj.weight"].weight_decay == 0.1
    assert rows["norm.weight"].why == "not dedicated, no_decay rule"


def test_no_decay_none_decays_every_parameter_by_its_route():
    optimizer = dmuon.Muon(dedicated(), adamw_weight_decay=0.01, no_decay=None)
    assert [g["source"] for g in optimizer.param_groups] == ["defaults", "defaults"]
    assert {row.weight_decay for row in optimizer.routing() if row.route != "muon"} == {0.01}


def test_an_lr_scheduler_scales_every_group():
    optimizer = dmuon.Muon(
        dedicated(), param_groups=[{"params": ["layers.1.q_proj.weight"], "lr": 0.01}]
    )
    first = [g["lr"] for g in optimizer.param_groups]
    assert len(first) == 4  # muon, adamw, adamw without decay, param_groups[0]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    model = optimizer._dedicated.model
    for batch in batches(2, 1):
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([lr / 4 for lr in first])
    assert rows_by_name(optimizer)["layers.1.q_proj.weight"].lr == pytest.approx(0.0025)


def test_a_user_group_splits_into_one_torch_group_per_route_and_first_match_wins():
    optimizer = dmuon.Muon(
        dedicated(),
        param_groups=[
            {"params": lambda name, p: name.startswith("layers.0."), "lr": 0.01},
            {"params": lambda name, p: name.startswith("layers."), "lr": 0.03},
        ],
    )
    sources = [(g["route"], g["source"], g["lr"]) for g in optimizer.param_groups]
    assert sources == [
        ("muon", "defaults", 0.02),
        ("adamw", "defaults", 1e-3),
        ("adamw", "no_decay rule", 1e-3),
        ("muon", "param_groups[0]", 0.01),
        ("adamw", "param_groups[0], no_decay rule", 0.01),
        ("muon", "param_groups[1]", 0.03),
        ("adamw", "param_groups[1], no_decay rule", 0.03),
    ]
    rows = rows_by_name(optimizer)
    assert rows["layers.0.up_proj.weight"].why == "predicate, param_groups[0]"
    assert rows["layers.2.o_proj.bias"].why == "not dedicated, no_decay rule, param_groups[1]"


def test_a_group_that_applies_to_no_parameter_warns_saying_why():
    with pytest.warns(UserWarning) as caught:
        dmuon.Muon(
            dedicated(),
            param_groups=[
                {"params": lambda name, p: "lm_haed" in name, "lr": 1e-5},
                {"params": ["layers.0.q_proj.weight"], "lr": 0.5},
                {"params": ["layers.0.q_proj.weight", "layers.1.q_proj.weight"], "lr": 0.0},
                {"params": [], "lr": 0.1},
            ],
        )
    messages = [str(warning.message) for warning in caught]
    assert messages == [
        "dmuon.Muon: param_groups[0] (predicate test_a_group_that_applies_to_no_parameter_warns"
        "_saying_why.<locals>.<lambda>) applies to no parameter: its predicate matches none of "
        "the 34 trainable parameters (names as in model.named_parameters()).",
        "dmuon.Muon: param_groups[3] (params []) applies to no parameter: its 'params' list is "
        "empty.",
    ]  # param_groups[2] keeps layers.1.q_proj.weight: it applies to a parameter


def test_adding_a_param_group_after_construction_is_refused_with_the_fix():
    optimizer = dmuon.Muon(dedicated())
    with pytest.raises(TypeError, match=r"cannot take one added later.*param_groups=\["):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.01})


def test_a_fully_shadowed_group_warns_naming_the_earlier_entry():
    with pytest.warns(
        UserWarning,
        match=r"param_groups\[1\] \(params \[layers\.0\.q_proj\.weight\]\) "
        r"applies to no parameter: every parameter it selects \(layers\.0\.q_proj\."
        r"weight\) is taken by the earlier param_groups\[0\]",
    ):
        dmuon.Muon(
            dedicated(),
            param_groups=[
                {"params": lambda name, p: name.startswith("layers.0."), "lr": 0.01},
                {"params": ["layers.0.q_proj.weight"], "lr": 0.5},
            ],
        )


def test_a_predicate_sees_a_dedicated_matrix_as_a_meta_tensor_of_its_full_shape():
    seen = {}

    def record(name, param):
        seen[name] = (param.device.type, tuple(param.shape))
        return False

    dmuon.Muon(dedicated(), param_groups=[{"params": record, "lr": 0.01}])
    assert seen["layers.0.up_proj.weight"] == ("meta", (52, 30))


def test_a_group_weight_decay_wins_over_the_no_decay_rule():
    optimizer = dmuon.Muon(
        dedicated(), param_groups=[{"params": ["norm.bias"], "weight_decay": 0.2}]
    )
    assert rows_by_name(optimizer)["norm.bias"].weight_decay == 0.2


def test_an_unknown_group_key_is_refused_listing_the_accepted_ones():
    with pytest.raises(ValueError) as error:
        dmuon.Muon(dedicated(), param_groups=[{"params": ["norm.bias"], "learning_rate": 1}])
    assert str(error.value) == (
        "dmuon.Muon: param_groups[0] has unknown keys ['learning_rate']; a group accepts "
        "['params', 'lr', 'weight_decay', 'momentum', 'nesterov', 'adjust_lr', 'normuon', "
        "'normuon_beta2', 'normuon_eps', 'momentum_dtype', 'betas', 'eps'] (the Muon route "
        "takes lr, weight_decay, momentum, nesterov, adjust_lr, normuon, normuon_beta2, "
        "normuon_eps, momentum_dtype; the AdamW routes take lr, weight_decay, betas, eps)."
    )


def test_a_key_that_does_not_apply_to_a_route_is_refused_naming_the_parameter():
    with pytest.raises(ValueError) as error:
        dmuon.Muon(
            dedicated(),
            param_groups=[
                {"params": lambda n, p: n.startswith("layers.0.o_proj"), "momentum": 0.9}
            ],
        )
    assert str(error.value) == (
        "dmuon.Muon: param_groups[0] sets ['momentum'], which do not apply to the sharded_adamw "
        "route of 'layers.0.o_proj.bias' (shape (30,)). The Muon route takes ['lr', 'momentum', "
        "'nesterov', 'weight_decay', 'adjust_lr', 'normuon', 'normuon_beta2', 'normuon_eps', "
        "'momentum_dtype'], the AdamW routes ['lr', 'betas', 'eps', 'weight_decay']. Narrow the group's params to one route (e.g. lambda name, p: ... and "
        "p.ndim >= 2), or split it into one group per route."
    )


@pytest.mark.parametrize(
    ("groups", "kind", "message"),
    [
        (
            [{"params": ["nope.weight"], "lr": 0.1}],
            ValueError,
            "dmuon.Muon: param_groups[0]['params'] names 1 parameters the optimizer does not "
            "update: ['nope.weight']. Use the names of model.named_parameters() (trainable ones; "
            "with the task head's prefix, e.g. 'model.layers.0...'), or a predicate (name, param)"
            " -> bool.",
        ),
        (
            [{"params": "norm.bias", "lr": 0.1}],
            TypeError,
            "dmuon.Muon: param_groups[0]['params'] must be a list of FQNs or a predicate (name, "
            "param) -> bool, got str: 'norm.bias'. For one parameter write ['norm.bias'].",
        ),
        (
            [{"lr": 0.1}],
            ValueError,
            "dmuon.Muon: param_groups[0] has no 'params': give the FQNs it holds (a list of names"
            " from model.named_parameters()) or a predicate (name, param) -> bool.",
        ),
        (
            [["norm.bias"]],
            TypeError,
            'dmuon.Muon: param_groups[0] must be a dict, got list: {"params": ["lm_head.weight"] '
            'or lambda name, p: ..., "lr": ..., ...}.',
        ),
        (
            [{"params": ["norm.bias"], "lr": -1.0}],
            ValueError,
            "dmuon.Muon: param_groups[0]['lr'] must be a finite non-negative number, got -1.0.",
        ),
        (
            [{"params": ["norm.bias"], "betas": (0.9,)}],
            ValueError,
            "dmuon.Muon: param_groups[0]['betas'] must be a pair of numbers in [0, 1), e.g. "
            "(0.9, 0.95), got (0.9,).",
        ),
        (
            [{"params": ["layers.0.q_proj.weight"], "nesterov": 1}],
            TypeError,
            "dmuon.Muon: param_groups[0]['nesterov'] must be True or False, got 1.",
        ),
        (
            [{"params": ["layers.0.q_proj.weight"], "adjust_lr": "rms"}],
            ValueError,
            "dmuon.Muon: param_groups[0]['adjust_lr']='rms' is not one of "
            "('match_rms_adamw', 'spectral', None).",
        ),
        (
            {"params": ["norm.bias"]},
            TypeError,
            "dmuon.Muon: param_groups must be a list of dicts, got dict: param_groups=["
            '{"params": ["lm_head.weight"], "lr": 1e-4}, ...].',
        ),
    ],
)
def test_a_malformed_param_group_is_refused_with_the_fix(groups, kind, message):
    with pytest.raises(kind) as error:
        dmuon.Muon(dedicated(), param_groups=groups)
    assert str(error.value) == message


def test_an_unknown_no_decay_rule_is_refused():
    with pytest.raises(ValueError) as error:
        dmuon.Muon(dedicated(), no_decay="torch")
    assert str(error.value) == (
        "dmuon.Muon: no_decay='torch' is not a rule: pass 'hf' (the default: biases and norm "
        "weights get no weight decay, as in HF Trainer), a function (name, param) -> bool, or "
        "None to decay every parameter by its group's weight_decay."
    )


def test_the_routing_table_of_the_tiny_decoder_lists_every_trainable_parameter_once():
    model = dedicated()
    rows = dmuon.Muon(model).routing()
    assert [row.fqn for row in rows] == [name for name, _ in model.named_parameters()]
    routes = {row.route for row in rows}
    assert routes == {"muon", "sharded_adamw"}
    for row in rows:
        expected = "muon" if proj_predicate(row.fqn, torch.empty(row.shape)) else "sharded_adamw"
        assert row.route == expected, row
        assert (row.owner_rank == 0) == (row.route == "muon")


# ---- routes= ------------------------------------------------------------------------------------


def test_routes_override_the_predicate_for_all_three_routes():
    model = dedicated(
        routes={
            "lm_head.weight": "muon",
            "layers.0.up_proj.weight": "adamw",
            "layers.0.down_proj.weight": "sharded_adamw",
        }
    )
    rows = rows_by_name(dmuon.Muon(model))
    assert (rows["lm_head.weight"].route, rows["lm_head.weight"].why) == ("muon", "routes override")
    assert rows["lm_head.weight"].owner_rank == 0
    assert (rows["layers.0.up_proj.weight"].route, rows["layers.0.up_proj.weight"].owner_rank) == (
        "adamw",
        0,
    )
    assert rows["layers.0.down_proj.weight"][2:4] == ("sharded_adamw", None)
    assert rows["layers.0.down_proj.weight"].why == "routes override"
    assert rows["layers.1.up_proj.weight"].why == "predicate"


def test_a_routes_function_returning_none_leaves_the_predicate_in_charge():
    model = dedicated(routes=lambda name, p: "adamw" if name.endswith("q_proj.weight") else None)
    rows = rows_by_name(dmuon.Muon(model))
    assert rows["layers.2.q_proj.weight"].route == "adamw"
    assert rows["layers.2.o_proj.weight"].route == "muon"


@pytest.mark.parametrize(
    ("routes", "kind", "message"),
    [
        (
            {"norm.weight": "muon"},
            ValueError,
            "dedicate_params: routes puts norm.weight of shape (30,) on the Muon route, but Muon "
            "orthogonalises matrices (2 or more dims). Route it to 'adamw' (owner-side AdamW) or "
            "'sharded_adamw' (left to FSDP2), or leave it out of routes.",
        ),
        (
            {"lm_head.weight": "sgd"},
            ValueError,
            "dedicate_params: routes gives lm_head.weight the route 'sgd'; the routes are "
            "['muon', 'adamw', 'sharded_adamw'] (or None from a function: the predicate decides).",
        ),
        (
            {"head.weight": "adamw"},
            ValueError,
            "dedicate_params: routes names 1 parameters the model does not have: head.weight. Use "
            "the names of model.named_parameters(), e.g. routes={'lm_head.weight': 'adamw'}.",
        ),
        (
            ["lm_head.weight"],
            TypeError,
            "dedicate_params: routes must be a dict {fqn: route} or a function (name, param) -> "
            "route | None, got list: ['lm_head.weight'].",
        ),
    ],
)
def test_a_bad_route_override_is_refused_with_the_fix(routes, kind, message):
    with pytest.raises(kind) as error:
        dedicated(routes=routes)
    assert str(error.value) == message


def test_a_matrix_routed_to_owner_side_adamw_matches_torch_adamw():
    model = dedicated(routes={"layers.0.up_proj.weight": "adamw"})
    torch.manual_seed(0)
    plain = TinyDecoder()
    optimizer = dmuon.Muon(model, no_decay=None)
    master = next(
        p.master for p in optimizer._dedicated.params.values() if p.fqn.endswith("0.up_proj.weight")
    )
    assert any(
        master is t for g in optimizer.param_groups if g["route"] == "adamw" for t in g["params"]
    )
    weight = plain.layers[0].up_proj.weight
    reference = torch.optim.AdamW([weight], lr=1e-3, weight_decay=0.01, foreach=True)
    for batch in batches(3, 1):
        loss_fn(model, batch).backward()
        loss_fn(plain, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        reference.step()
        plain.zero_grad()
        # Keep the rest of the plain model on dmuon's weights, so the gradients stay comparable.
        with torch.no_grad():
            for name, param in plain.named_parameters():
                if name != "layers.0.up_proj.weight":
                    param.copy_(_weight_of(model, optimizer, name))
    torch.testing.assert_close(master, weight, rtol=1e-6, atol=1e-7)


def _weight_of(model, optimizer, name):
    p = optimizer._dedicated.params.get(name)
    return p.master if p is not None else dict(model.named_parameters())[name]


# ---- logging ------------------------------------------------------------------------------------


def test_one_info_line_per_route_is_logged_on_the_dmuon_logger(caplog):
    with caplog.at_level(logging.INFO, logger="dmuon"):
        dmuon.Muon(dedicated(), no_decay=None)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[DMuon] route")]
    assert lines == [
        "[DMuon] route muon (Muon on the owner's fp32 master; update rule muon): 15 parameters, "
        "14,850 elements, lr 0.02, weight_decay 0",
        "[DMuon] route sharded_adamw (AdamW on FSDP2's shards, not dedicated; update rule adamw): "
        "19 parameters, 2,730 elements, lr 0.001, weight_decay 0.01",
    ]


def test_the_dmuon_logger_gets_a_stderr_handler_only_when_nothing_is_configured(monkeypatch):
    root, dmuon_logger = logging.getLogger(), logging.getLogger("dmuon")
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(dmuon_logger, "handlers", [])
    monkeypatch.setattr(dmuon_logger, "level", logging.NOTSET)
    monkeypatch.setattr(dmuon_log, "_handler", None)
    dmuon_log.make_visible()
    dmuon_log.make_visible()
    assert len(dmuon_logger.handlers) == 1
    assert dmuon_logger.getEffectiveLevel() == logging.INFO


def test_the_dmuon_logger_gets_no_handler_when_the_application_configured_logging(monkeypatch):
    dmuon_logger = logging.getLogger("dmuon")
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    monkeypatch.setattr(dmuon_logger, "handlers", [])
    monkeypatch.setattr(dmuon_log, "_handler", None)
    dmuon_log.make_visible()
    assert dmuon_logger.handlers == []


def test_dmuon_tools_prints_the_routing_table_one_line_per_parameter():
    from dmuon_tools import format_routing_table

    text = format_routing_table(dmuon.Muon(dedicated()).routing())
    lines = text.splitlines()
    assert lines[0].split() == [
        "parameter",
        "shape",
        "route",
        "owner",
        "lr",
        "weight",
        "decay",
        "why",
        "update",
        "rule",
    ]
    assert len(lines) == 2 + 34
    assert lines[2].split() == [
        "embed.weight",
        "37x30",
        "sharded_adamw",
        "-",
        "0.001",
        "0.01",
        "not",
        "dedicated",
        "adamw",
    ]
    assert "layers.0.q_proj.weight 30x30 muon 0 0.02 0 predicate muon" in " ".join(text.split())


def test_the_routing_table_names_each_groups_update_rule_normuon_and_momentum_dtype_included():
    from dmuon_tools import format_routing_table

    optimizer = dmuon.Muon(
        dedicated(),
        normuon=True,
        momentum_dtype=torch.bfloat16,
        param_groups=[
            {"params": lambda name, p: name.startswith("layers.0.") and p.ndim == 2,
             "normuon": False, "momentum_dtype": torch.float32},
        ],
    )  # fmt: skip
    rows = rows_by_name(optimizer)
    assert rows["layers.0.q_proj.weight"].update_rule == "muon"
    assert rows["layers.1.q_proj.weight"].update_rule == "normuon, momentum bfloat16"
    assert rows["embed.weight"].update_rule == "adamw"
    text = " ".join(format_routing_table(optimizer.routing()).split())
    assert "layers.1.q_proj.weight 30x30 muon 0 0.02 0 predicate normuon, momentum bfloat16" in text
