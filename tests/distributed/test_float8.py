"""torchao's float8 training on dedicated projections (issue 44 item 3), on gloo.

``convert_to_float8_training`` before ``dedicate_params``: every recipe trains like the same
float8 model in one process with the plain Muon + AdamW reference. Converted after, the first
forward refuses with the fix. See [Note: float8 training on dedicated weights] in
``dmuon.float8``; the scenarios and why the reference runs each rank's rows apart:
``scenarios_float8.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchao.float8", reason="torchao is not installed")

from tests.distributed.scenarios_float8 import (
    converted_after_dedicate_error,
    train_float8_against_reference,
)
from tests.distributed.test_protocol import FP32_TOLERANCE


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_float8_projections_train_like_the_single_process_float8_reference(pool2, recipe):
    # Each float8 cast sees the same tensor in dmuon and the reference ([Note: a float8
    # reference sees each rank's rows]): the first step's losses are bit-equal, and later steps
    # differ by the fp32 gradient additions' order, as in test_protocol.
    results = pool2.run(train_float8_against_reference, recipe=recipe)
    for rank, result in enumerate(results):
        assert result["module_types"] == ["Float8Linear"]
        assert result["owners"] == [0, 1]
        assert result["losses"][0] == result["reference_losses"][0], f"rank {rank}"
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=FP32_TOLERANCE)
        worst = max(result["max_errors"])
        assert worst < FP32_TOLERANCE, f"rank {rank}: max relative error {worst:.3e}"


def test_converting_to_float8_after_dedicate_params_is_refused_at_the_first_forward(pool2):
    for message in pool2.run(converted_after_dedicate_error):
        assert message.startswith(
            "dmuon.dedicate_params selected 'layers.0.up_proj.weight' on a Linear that is no "
            "longer part of the model: layers.0.up_proj is now a "
            "torchao.float8.float8_linear.Float8Linear. dmuon moves that weight on the module "
            "dedicate_params saw, so that Float8Linear would compute with the 0-element "
            "placeholder instead of the weight. Convert before dmuon.dedicate_params: "
            "torchao.float8.convert_to_float8_training(model, ...), then dmuon.dedicate_params"
        ), message


def test_any_module_swapped_after_dedicate_params_is_refused_at_the_first_forward(pool2):
    for message in pool2.run(converted_after_dedicate_error, swap="linear"):
        assert message == (
            "dmuon.dedicate_params selected 'layers.0.down_proj.weight' on a Linear that is no "
            "longer part of the model: layers.0.down_proj is now a torch.nn.modules.linear."
            "Linear. dmuon moves that weight on the module dedicate_params saw, so that Linear "
            "would compute with the 0-element placeholder instead of the weight. Replace or "
            "wrap modules before dmuon.dedicate_params, then dedicate and shard."
        )
