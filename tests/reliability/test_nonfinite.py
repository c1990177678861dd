"""nonfinite="skip" | "raise" and clip_grad_norm_(error_if_nonfinite=True) across ranks: a NaN on
one rank only is seen by every rank, which all take the same decision."""

from tests.reliability.scenarios_reliability import nan_gradient_on_rank_1_only


def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank(pool2):
    results = pool2.run(nan_gradient_on_rank_1_only, nonfinite="skip")
    for result in results:
        assert result["outcome"] == "stepped"  # step() returned, having skipped
        assert result["unchanged"]
    assert any("step 2" in w and "skipped on every rank" in w for w in results[0]["warnings"])


def test_a_nan_gradient_on_one_rank_raises_on_every_rank_with_nonfinite_raise(pool2):
    results = pool2.run(nan_gradient_on_rank_1_only, nonfinite="raise")
    for result in results:
        assert result["outcome"].startswith("raised: dmuon.Muon: step 2:")
        assert result["unchanged"]


def test_clip_grad_norm_error_if_nonfinite_raises_on_every_rank_before_clipping(pool2):
    results = pool2.run(nan_gradient_on_rank_1_only, nonfinite="ignore", clip=True)
    for result in results:
        assert "the total norm of the gradients is nan" in result["outcome"]
        assert result["unchanged"]
