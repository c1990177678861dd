"""Torch's habits on a dmuon model, in one process: torch's gradient clipping refuses a dmuon
model naming ``dmuon.clip_grad_norm_`` and a torch optimizer over its parameters naming
``dmuon.Muon``, both leave a plain model alone; ``dmuon.clip_grad_norm_`` called with torch's
arguments says what it takes; and the ``dmuon`` logger is the application's: a level it set
stays, and the partition line shows without any set-up. (Across ranks:
tests/distributed/test_torch_habits.py.)"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import dmuon
from dmuon._torch_internals import TORCH_CLIPPING_MODULE
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.nn.utils.clip_grad_norm` is now deprecated:FutureWarning"
)
FP32_NS = NewtonSchulz(dtype=torch.float32, kernel="cublas")
# torch's functions that read ``p.grad`` of the parameters they are given, as a user calls them.
TORCH_CLIPPING = {
    "clip_grad_norm_": lambda params: torch.nn.utils.clip_grad_norm_(params, 1e-3),
    "clip_grads_with_norm_": lambda params: torch.nn.utils.clip_grads_with_norm_(
        params, 1e-3, torch.tensor(1.0)
    ),
    "clip_grad_value_": lambda params: torch.nn.utils.clip_grad_value_(params, 1e-4),
    "clip_grad_norm": lambda params: torch.nn.utils.clip_grad_norm(params, 1e-3),
}
REFUSAL = (
    r"torch\.nn\.utils\.{name} read the gradient of a dedicated parameter, which dmuon keeps "
    r"on its owner rank's fp32 master: .* Clip with dmuon\.clip_grad_norm_\(model, optimizer, "
    r"max_norm\)"
)


def dedicated_model():
    torch.manual_seed(0)
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    return model, dmuon.Muon(model, ns_backend=FP32_NS)


def every_gradient(model) -> dict[str, torch.Tensor]:
    """The masters' gradients and the others', by name (copies)."""
    state = get_dedicated_state(model)
    grads = {p.fqn: p.master.grad.clone() for p in state.iter_owned_masters()}
    for name, param in model.named_parameters():
        if name not in state.params and param.grad is not None:
            grads[name] = param.grad.clone()
    return grads


def first_dedicated_name(model) -> str:
    return next(name for name in get_dedicated_state(model).params)


# ---- torch's clipping -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TORCH_CLIPPING))
def test_torchs_clipping_of_a_dmuon_models_parameters_raises_naming_dmuon_clip_grad_norm(name):
    model, _ = dedicated_model()
    loss_fn(model, batches(1, 1)[0]).backward()
    before = every_gradient(model)

    reader = "clip_grad_norm_" if name == "clip_grad_norm" else name  # the deprecated alias
    pattern = REFUSAL.format(name=reader)
    with pytest.raises(RuntimeError, match=pattern):
        TORCH_CLIPPING[name](model.parameters())

    after = every_gradient(model)
    assert all(torch.equal(after[key], before[key]) for key in before), "a gradient was scaled"


@pytest.mark.parametrize("name", sorted(TORCH_CLIPPING))
def test_torchs_clipping_functions_live_where_the_placeholder_looks_for_readers(name):
    # A torch that moved them would make the refusal silent: this test says so first.
    assert getattr(torch.nn.utils, name).__module__ == TORCH_CLIPPING_MODULE


def test_torchs_clipping_works_on_a_dmuon_model_whose_dedicated_parameters_are_frozen():
    # A frozen dedicated parameter has no gradient anywhere: torch's norm over the others is
    # the right one, so nothing is refused.
    model, optimizer = dedicated_model()
    for name in get_dedicated_state(model).params:
        model.get_parameter(name).requires_grad_(False)
    loss_fn(model, batches(1, 1)[0]).backward()
    expected = dmuon.clip_grad_norm_(model, optimizer, math.inf)

    total = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)

    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", sorted(TORCH_CLIPPING))
def test_torchs_clipping_of_a_plain_model_is_unchanged_with_dmuon_imported(name):
    torch.manual_seed(0)
    model, twin = TinyDecoder(), TinyDecoder()
    twin.load_state_dict(model.state_dict())
    batch = batches(1, 1)[0]
    loss_fn(model, batch).backward()
    loss_fn(twin, batch).backward()
    expected = torch.sqrt(sum(p.grad.double().square().sum() for p in twin.parameters()))
    coefficient = min(1.0, 1e-3 / (expected.item() + 1e-6))

    TORCH_CLIPPING[name](model.parameters())

    for (key, param), reference in zip(model.named_parameters(), twin.parameters(), strict=True):
        if name == "clip_grad_value_":
            wanted = reference.grad.clamp(-1e-4, 1e-4)
        elif name == "clip_grads_with_norm_":  # the given norm, 1.0
            wanted = reference.grad * (1e-3 / (1.0 + 1e-6))
        else:
            wanted = reference.grad * coefficient
        torch.testing.assert_close(param.grad, wanted, rtol=1e-5, atol=0, msg=key)


def test_reading_a_placeholders_gradient_outside_torchs_clipping_gives_none():
    # [Note: torch's clipping on a dmuon model] in dmuon.clip: the placeholder has no gradient,
    # and torch's own zero_grad and every `p.grad is None` check go on reading it as such.
    model, _ = dedicated_model()
    loss_fn(model, batches(1, 1)[0]).backward()
    placeholder = model.get_parameter(first_dedicated_name(model))
    assert placeholder.grad is None
    model.zero_grad(set_to_none=False)
    model.zero_grad()


# ---- torch's optimizers ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_a_torch_optimizer_over_a_dmuon_models_parameters_raises_naming_dmuon_muon(name):
    # It would step every parameter but the dedicated matrices, without a word.
    model, _ = dedicated_model()
    optimizer = getattr(torch.optim, name)(model.parameters(), lr=1e-3)
    loss_fn(model, batches(1, 1)[0]).backward()
    with pytest.raises(
        RuntimeError,
        match=(
            rf"torch\.optim\.{name} read the gradient of a dedicated parameter, which dmuon keeps "
            r"on its owner rank's fp32 master: .* would never update the dedicated matrices\. "
            r"Train a model dmuon\.dedicate_params prepared with dmuon\.Muon\(model, \.\.\.\)"
        ),
    ):
        optimizer.step()


def test_a_torch_optimizer_of_a_plain_model_is_unchanged_with_dmuon_imported():
    torch.manual_seed(0)
    model = TinyDecoder()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn(model, batches(1, 1)[0]).backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), before[name] - 0.1 * grads[name], msg=name)
        assert param.grad is None


# ---- dmuon.clip_grad_norm_'s arguments ------------------------------------------------------------


def test_dmuon_clip_grad_norm_with_torchs_arguments_says_what_it_takes():
    model, _ = dedicated_model()
    loss_fn(model, batches(1, 1)[0]).backward()
    with pytest.raises(
        TypeError,
        match=(
            r"dmuon\.clip_grad_norm_ takes \(model, optimizer, max_norm\), not torch's "
            r"\(parameters, max_norm\): got a generator as the model and 1\.0 as the optimizer\. "
        ),
    ):
        dmuon.clip_grad_norm_(model.parameters(), 1.0)


def test_dmuon_clip_grad_norm_without_max_norm_says_what_it_takes():
    model, optimizer = dedicated_model()
    loss_fn(model, batches(1, 1)[0]).backward()
    with pytest.raises(TypeError, match=r"dmuon\.clip_grad_norm_ takes \(model, optimizer, max_"):
        dmuon.clip_grad_norm_(model, optimizer)


def test_dmuon_clip_grad_norm_with_a_list_of_parameters_says_what_it_takes():
    model, optimizer = dedicated_model()
    with pytest.raises(
        TypeError, match=r"got a list of DedicatedPlaceholder, Parameter as the model"
    ):
        dmuon.clip_grad_norm_(list(model.parameters()), optimizer, 1.0)


# ---- logging --------------------------------------------------------------------------------------

# A fresh interpreter: logging's configuration is per process.
_PROGRAM = """
import logging, sys
import torch
import dmuon
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, proj_predicate

{setup}
model = TinyDecoder()
dmuon.dedicate_params(model, None, proj_predicate)
dmuon.Muon(model, ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"))
print("level", logging.getLevelName(logging.getLogger("dmuon").level))
"""


def run_program(setup: str) -> subprocess.CompletedProcess:
    program = _PROGRAM.format(setup=textwrap.dedent(setup))
    return subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=300
    )


def test_the_partition_line_and_the_route_summary_show_without_any_logging_set_up():
    result = run_program("")
    assert result.stderr.count("[DMuon] dmuon partition: ") == 1
    assert result.stderr.count("[DMuon] route muon (") == 1


def test_a_level_the_application_set_on_the_dmuon_logger_stays():
    result = run_program('logging.getLogger("dmuon").setLevel(logging.WARNING)')
    assert "level WARNING" in result.stdout
    assert "dmuon partition: " not in result.stderr
    assert "[DMuon]" not in result.stderr


def test_the_applications_logging_configuration_gets_dmuons_lines_once():
    result = run_program('logging.basicConfig(level=logging.INFO, format="app: %(message)s")')
    assert result.stderr.count("dmuon partition: ") == 1
    assert "app: " in result.stderr and "dmuon partition: " in result.stderr
    assert "level NOTSET" in result.stdout


def test_a_plain_module_in_a_dmuon_model_keeps_torchs_clipping():
    # A sub-module with no dedicated parameter: torch's clip over its parameters is right.
    model, _ = dedicated_model()
    loss_fn(model, batches(1, 1)[0]).backward()
    plain: nn.Module = model.embed
    expected = torch.linalg.vector_norm(plain.weight.grad)
    total = torch.nn.utils.clip_grad_norm_(plain.parameters(), math.inf)
    torch.testing.assert_close(total, expected)
