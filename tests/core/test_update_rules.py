"""The opt-in update rules in one process: NorMuon's row normalisation and bf16 momentum against
their formulas, row blocks' arguments and their cost in the partition (docs/update-rules.md).
The distributed runs against the reference are in tests/distributed/test_update_rules.py."""

import functools
import math

import pytest
import torch

import dmuon
from dmuon.muon_update import INT8_BLOCK, dequantized, int8_scale_shape, normuon_rows, quantize_
from dmuon.partition import ParamSpec, ns_cost, plan_ownership
from dmuon_kernels import newton_schulz
from dmuon_kernels.fused import muon_momentum_, muon_normalized_inputs_
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate
from tests.distributed.models_moe import MoEDecoder, expert_stack_names, moe_predicate
from tests.reference_optim import ReferenceMuonAdamW

# ---- NorMuon ------------------------------------------------------------------------------


def normuon_formula(orthogonal, v, beta2, eps):
    """[Note: NorMuon] in float64, one matrix."""
    o = orthogonal.double()
    v = beta2 * v.double() + (1 - beta2) * (o * o).mean(dim=1)
    o_hat = o / (v.sqrt()[:, None] + eps)
    rows, cols = o.shape
    return o_hat * math.sqrt(min(rows, cols)) / o_hat.norm(), v


def test_normuon_rows_follow_the_formula_and_update_the_second_moments_in_place():
    generator = torch.Generator().manual_seed(0)
    orthogonal = torch.randn(3, 7, 12, generator=generator)
    moments = [torch.rand(7, generator=generator) for _ in range(3)]
    before = [m.clone() for m in moments]
    # Transposed views, as Newton-Schulz hands back a tall matrix's rows.
    tall = [o.mT.contiguous().mT for o in orthogonal]
    updates = normuon_rows(tall, moments, beta2=0.9, eps=1e-8)
    for i in range(3):
        expected, expected_v = normuon_formula(orthogonal[i], before[i], 0.9, 1e-8)
        torch.testing.assert_close(updates[i].double(), expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(moments[i].double(), expected_v, rtol=1e-6, atol=0)
        # The rescale gives the Frobenius norm of an orthogonal (7, 12): sqrt(7).
        assert updates[i].norm().item() == pytest.approx(math.sqrt(7), rel=1e-6)


def test_normuon_of_a_zero_update_is_zero_not_nan():
    moments = [torch.zeros(4)]
    (update,) = normuon_rows([torch.zeros(4, 5)], moments, beta2=0.95, eps=1e-8)
    assert torch.equal(update, torch.zeros(4, 5))
    assert torch.equal(moments[0], torch.zeros(4))


def test_normuon_equalises_the_rows_of_an_unbalanced_update():
    # Row 0 ten times row 1: after one step from v = 0 both rows have the same norm.
    orthogonal = torch.tensor([[10.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    (update,) = normuon_rows([orthogonal], [torch.zeros(2)], beta2=0.95, eps=0.0)
    assert update.norm(dim=1).tolist() == pytest.approx([1.0, 1.0], rel=1e-6)


# ---- bf16 momentum: the torch fallback of the fused passes ------------------------------------


def test_a_bf16_buffer_is_updated_in_fp32_and_rounded_once_and_nesterov_uses_the_fp32_value():
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(5, 8, generator=generator) for _ in range(2)]
    buffers = [torch.randn(5, 8, generator=generator).bfloat16() for _ in range(2)]
    old = [b.float() for b in buffers]
    out = torch.empty(2, 5, 8, dtype=torch.float32)
    muon_normalized_inputs_(grads, buffers, [False, False], 0.95, True, out)
    for i in range(2):
        wide = 0.95 * old[i] + grads[i]
        assert buffers[i].dtype == torch.bfloat16
        assert torch.equal(buffers[i], wide.bfloat16())
        update = grads[i] + 0.95 * wide  # the unrounded buffer
        torch.testing.assert_close(out[i], update / update.norm(), rtol=1e-6, atol=1e-7)


def test_the_tensor_parallel_momentum_pass_treats_a_bf16_buffer_alike():
    generator = torch.Generator().manual_seed(2)
    grad = torch.randn(4, 6, generator=generator)
    buf = torch.randn(4, 6, generator=generator).bfloat16()
    wide = 0.9 * buf.float() + grad
    update, square_sum = muon_momentum_(grad, buf, 0.9, nesterov=True)
    assert torch.equal(buf, wide.bfloat16())
    assert update.dtype == torch.float32
    torch.testing.assert_close(update, grad + 0.9 * wide)
    assert square_sum.item() == pytest.approx((grad + 0.9 * wide).double().square().sum().item())


def test_momentum_dtype_other_than_fp32_or_bf16_is_refused():
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    with pytest.raises(ValueError) as error:
        dmuon.Muon(model, momentum_dtype=torch.float16)
    assert str(error.value) == (
        "dmuon.Muon: momentum_dtype=torch.float16 is not one of torch.float32 (the default), "
        "torch.bfloat16 (half the memory) or torch.int8 (int8 with block scales, about a "
        "quarter); the arithmetic stays fp32."
    )


def test_bf16_momentum_halves_the_muon_state_and_normuon_adds_one_number_per_row():
    def state_bytes(**options):
        torch.manual_seed(0)
        model = TinyDecoder()
        dmuon.dedicate_params(model, None, proj_predicate)
        optimizer = dmuon.Muon(model, **options)
        optimizer.init_state()
        return sum(
            t.numel() * t.element_size()
            for group in optimizer.param_groups
            if group["route"] == "muon"
            for p in group["params"]
            for t in optimizer.state[p].values()
        )

    matrices = [(30, 30), (30, 30), (1, 30), (52, 30), (30, 52)]  # one layer's projections
    numel = 3 * sum(m * n for m, n in matrices)
    rows = 3 * sum(m for m, _ in matrices)
    assert state_bytes() == 4 * numel
    assert state_bytes(momentum_dtype=torch.bfloat16) == 2 * numel
    assert state_bytes(momentum_dtype="bfloat16", normuon=True) == 2 * numel + 4 * rows
    # int8: one byte an element and one fp32 scale per row (every row here is <= 256 long).
    assert state_bytes(momentum_dtype=torch.int8) == numel + 4 * rows


# ---- int8 momentum ------------------------------------------------------------------------------


def test_int8_momentum_keeps_each_element_within_half_a_level_of_its_runs_scale():
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(5, 300, generator=generator) * torch.logspace(-3, 3, 5).unsqueeze(1)
    values[2, 256:] = 0.0  # an all-zero run: scale 0, values 0
    q = torch.empty(5, 300, dtype=torch.int8)
    scale = torch.empty(int8_scale_shape((5, 300)))
    assert scale.shape == (5, 2)
    quantize_(q, scale, values)
    assert torch.equal(scale[:, 0], values[:, :INT8_BLOCK].abs().amax(dim=1))
    assert scale[2, 1].item() == 0.0
    restored = dequantized(q, scale)
    bound = torch.repeat_interleave(scale, INT8_BLOCK, dim=1)[:, :300] / 254
    assert ((restored - values).abs() <= bound * (1 + 1e-5)).all()
    assert torch.equal(restored[2, 256:], torch.zeros(44))
    assert q.abs().max().item() == 127


def test_an_int8_state_dict_loads_into_a_float_momentum_optimizer_dequantised():
    torch.manual_seed(0)
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    int8 = dmuon.Muon(model, momentum_dtype=torch.int8)
    for _ in range(2):
        model(torch.randint(0, 37, (2, 5))).sum().backward()
        int8.step()
        int8.zero_grad()
    saved = int8.state_dict()
    fp32 = dmuon.Muon(model)
    fp32.load_state_dict(saved)
    muon_group = fp32.param_groups[0]
    assert muon_group["momentum_dtype"] == "float32"
    for param in muon_group["params"]:
        state, quantised = fp32.state[param], int8.state[param]
        assert set(state) == {"momentum_buffer"}
        expected = dequantized(quantised["momentum_int8"], quantised["momentum_scale"])
        assert torch.equal(state["momentum_buffer"], expected)


# ---- row blocks -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row_blocks", "kind", "message"),
    [
        (
            {"layers.*.k_proj.weight": 6},
            ValueError,
            "dedicate_params: row_blocks pattern 'layers.*.k_proj.weight' matches no dedicated "
            "matrix on the Muon route. Use canonical names as in model.named_parameters() (glob "
            "patterns allowed: 'layers.*.q_proj.weight').",
        ),
        (
            {"layers.0.q_proj.weight": 7},
            ValueError,
            "dedicate_params: row_blocks of layers.0.q_proj.weight (30, 30): 7 rows per block "
            "must be >= 1 and divide its 30 rows; give the head dim, or a list of block sizes "
            "summing to the rows.",
        ),
        (
            {"layers.0.up_proj.weight": [40, 10]},
            ValueError,
            "dedicate_params: row_blocks of layers.0.up_proj.weight (52, 30): the block sizes "
            "[40, 10] sum to 50, not its 52 rows.",
        ),
        (
            {"layers.0.up_proj.weight": "q,k,v"},
            TypeError,
            "dedicate_params: row_blocks of layers.0.up_proj.weight (52, 30): expected rows per "
            "block (an int) or a list of block sizes (ints >= 1), got 'q,k,v'.",
        ),
    ],
    ids=["no-match", "not-dividing", "wrong-sum", "wrong-type"],
)
def test_bad_row_blocks_are_refused_naming_the_parameter_and_the_fix(row_blocks, kind, message):
    with pytest.raises(kind) as error:
        dmuon.dedicate_params(TinyDecoder(), None, proj_predicate, row_blocks=row_blocks)
    assert str(error.value) == message


def test_row_blocks_given_by_a_function_reach_the_dedicated_parameters():
    model = TinyDecoder()
    dmuon.dedicate_params(
        model,
        None,
        proj_predicate,
        row_blocks=lambda name, p: 10 if name.endswith("q_proj.weight") else None,
    )
    state = dmuon.hooks.get_dedicated_state(model)
    assert {name: p.row_blocks for name, p in state.params.items() if p.row_blocks} == {
        f"layers.{i}.q_proj.weight": (10, 10, 10) for i in range(3)
    }


def test_the_partition_costs_a_matrix_in_row_blocks_as_the_sum_of_its_blocks():
    heads = ParamSpec(name="q", shape=(4096, 4096), layer_id="0", row_blocks=(128,) * 32)
    whole = ParamSpec(name="k", shape=(4096, 4096), layer_id="0")
    plan = plan_ownership([heads, whole], num_shards=2, small_param_numel=0)
    cost = {unit.names[0]: unit.cost for unit in plan.units}
    assert cost["q"] == 32 * ns_cost((128, 4096))
    assert cost["k"] == ns_cost((4096, 4096))
    assert cost["k"] / cost["q"] == pytest.approx(99.4, abs=0.1)


def test_a_param_spec_with_row_blocks_not_summing_to_its_rows_is_refused():
    with pytest.raises(ValueError, match="row_blocks must be sizes >= 1 summing to the rows"):
        ParamSpec(name="q", shape=(8, 4), layer_id=None, row_blocks=(4, 3))


def test_int8_momentum_and_normuon_on_expert_stacks_match_the_reference_per_expert():
    """One process (every piece owned here): each expert's int8 buffer, scales and NorMuon
    statistics are slices of its piece's (k, ...) state, as the reference keeps them apart."""
    torch.manual_seed(0)
    model = MoEDecoder()
    torch.manual_seed(0)
    reference = MoEDecoder()
    dmuon.dedicate_params(model, None, moe_predicate)
    options = {"normuon": True, "momentum_dtype": torch.int8}
    optimizer = dmuon.Muon(model, ns_backend=NewtonSchulz(dtype=torch.float32), **options)
    reference_optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        moe_predicate,
        orthogonalize=functools.partial(newton_schulz, dtype=torch.float32),
        expert_stacks=expert_stack_names(reference),
        momentum_dtype=torch.int8,
        normuon_beta2=0.95,
    )
    for batch in batches(3, 1):
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_fn(reference, batch).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    state = dmuon.hooks.get_dedicated_state(model)
    expected = dict(reference.named_parameters())
    for piece in state.iter_owned_masters():
        start, stop = piece.experts or (None, None)
        target = expected[piece.stack.fqn][start:stop] if piece.stack else expected[piece.fqn]
        error = ((piece.master - target).norm() / target.norm()).item()
        assert error < 1e-3, (piece.fqn, error)
        if piece.stack is not None:
            entries = optimizer.state[piece.master]
            experts = stop - start
            assert entries["momentum_int8"].shape == (experts, *piece.shape[1:])
            assert entries["momentum_scale"].shape == (experts, piece.shape[1], 1)
            assert entries["row_second_moment"].shape == (experts, piece.shape[1])
