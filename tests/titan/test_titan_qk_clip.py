"""The QK-clip as a dmuon-titan job option (``--dmuon.qk_clip_threshold``): torchtitan's
DeepSeek-V3 debug model (multi-head latent attention) with the Kimi recipe's DistMuon cuts, on 2
gloo ranks, trains like the single-process reference that applies the same clip after each step
(the rule of ``tests/core/test_qk_clip_mla.py``: Kimi K2's report for MLA, section 2.1), with
gradient accumulation and under pipeline parallelism too (each stage's attention clipped on its
own part, the pipeline's metadata-inference forwards left out); and a threshold no head reaches
changes no bit of the run without the option."""

from __future__ import annotations

# First: its import-time workarounds must precede torchtitan's own import (see its docstring).
import tests.titan.titan_on_cpu  # noqa: F401

# isort: split
import math

import pytest
import torch

import dmuon_titan
from tests.titan.scenarios_titan import train, train_reference
from tests.titan.test_titan_training import BF16_UPDATE_TOLERANCE, assert_like_reference

# The 2-rank DeepSeek-V3 recipe job of test_titan_training.py, its reference and bounds.
JOB = {"model": "deepseek_v3", "distmuon_recipe": True, "ns": "fp32", "seq_len": 64}
ALPHA = 0.5


class ReferenceQKClip:
    """Kimi K2's MLA clip in one process: each step's forward records every head's largest
    causal logit (float64, from the q and k each inner attention gets, with torchtitan's softmax
    scale); after the step, a head over ``threshold`` scales its content query rows by
    gamma^alpha, its rotary query rows by gamma and its content key rows (``wkv_b``) by
    gamma^(1 - alpha), gamma = threshold / S_h. ``history`` keeps each step's maxima."""

    def __init__(self, threshold: float, alpha: float = ALPHA) -> None:
        self.threshold, self.alpha = threshold, alpha
        self.history: list[dict[str, list[float]]] = []
        self.clipped_heads = 0

    def __call__(self, model: torch.nn.Module):
        self.attention = {
            name: module
            for name, module in model.named_modules()
            if hasattr(module, "wkv_b") and hasattr(module, "inner_attention")
        }
        self.maxima: dict[str, torch.Tensor] = {}
        for name, module in self.attention.items():
            module.inner_attention.register_forward_pre_hook(
                lambda inner, args, kwargs, name=name: self._observe(name, args, kwargs),
                with_kwargs=True,
            )
        return self._after_step

    def _observe(self, name: str, args: tuple, kwargs: dict) -> None:
        assert kwargs.get("attention_masks") is None  # causal SDPA (titan_on_cpu)
        q, k = (x.detach().transpose(1, 2).double() for x in args[:2])  # (b, heads, seq, dim)
        logits = kwargs["scale"] * q @ k.transpose(-1, -2)
        seq = q.shape[2]
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        maxima = logits.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))
        previous = self.maxima.get(name)
        self.maxima[name] = maxima if previous is None else torch.maximum(previous, maxima)

    @torch.no_grad()
    def _after_step(self) -> None:
        self.history.append({name: values.tolist() for name, values in self.maxima.items()})
        for name, module in self.attention.items():
            nope, rope = module.qk_nope_head_dim, module.qk_rope_head_dim
            query = module.wq_b if getattr(module, "wq_b", None) is not None else module.wq
            for h, s_max in enumerate(self.maxima[name].tolist()):
                if s_max <= self.threshold:
                    continue
                self.clipped_heads += 1
                gamma = self.threshold / s_max
                q_rows, kv_rows = h * (nope + rope), h * (nope + module.v_head_dim)
                query.weight[q_rows : q_rows + nope] *= gamma**self.alpha
                query.weight[q_rows + nope : q_rows + nope + rope] *= gamma
                module.wkv_b.weight[kv_rows : kv_rows + nope] *= gamma ** (1 - self.alpha)
        self.maxima = {}


@pytest.fixture(scope="module")
def without_clip(pool2) -> dict:
    return pool2.run(train, job_options=JOB)[0]


def test_the_qk_clip_options_are_checked_with_the_fix_in_the_message():
    with pytest.raises(ValueError, match=r"qk_clip_threshold=0\.0 is not a positive logit"):
        dmuon_titan.DMuonConfig(qk_clip_threshold=0.0)
    with pytest.raises(ValueError, match=r"qk_clip_alpha=1\.5 is not in \[0, 1\]"):
        dmuon_titan.DMuonConfig(qk_clip_alpha=1.5)
    with pytest.raises(ValueError, match=r"qk_clip_gqa='per_head' is not one of"):
        dmuon_titan.DMuonConfig(qk_clip_gqa="per_head")


def test_a_threshold_no_head_reaches_changes_no_bit_of_the_run(pool2, without_clip):
    observed = ReferenceQKClip(math.inf)
    train_reference(without_clip, after_step=observed)
    highest = max(s for step in observed.history for values in step.values() for s in values)
    options = {**JOB, "dmuon_options": {"qk_clip_threshold": 2 * highest}}
    run = pool2.run(train, job_options=options)[0]
    assert run["logged"] == without_clip["logged"]
    for name, value in without_clip["final"].items():
        assert torch.equal(run["final"][name], value), name


@pytest.mark.parametrize(
    "accumulation", [{}, {"microbatch": 1}], ids=["one_forward", "gradient_accumulation"]
)
def test_a_clipping_threshold_trains_like_the_reference_that_clips_after_each_step(
    pool2, without_clip, accumulation
):
    # With gradient accumulation each rank runs its 2 rows a step in 2 forwards of 1: the clip
    # takes the maximum over both and runs once, in the step (the reference's single forward).
    # The threshold: the median of the heads' largest logits in the first step, so that about
    # half the heads are clipped then (and some in later steps).
    observed = ReferenceQKClip(math.inf)
    train_reference(without_clip, after_step=observed)
    first = sorted(s for values in observed.history[0].values() for s in values)
    threshold = (first[len(first) // 2 - 1] + first[len(first) // 2]) / 2

    options = {**JOB, "dmuon_options": {"qk_clip_threshold": threshold, "qk_clip_alpha": ALPHA}}
    run = pool2.run(train, job_options={**options, **accumulation})[0]
    assert run["accumulation_steps"] == (2 if accumulation else 1)
    clip = ReferenceQKClip(threshold)
    reference = train_reference(run, after_step=clip)
    assert clip.clipped_heads >= len(first) // 2
    assert_like_reference(
        run, reference, weights=1e-2, losses=1e-3, matrix_updates=BF16_UPDATE_TOLERANCE
    )
    # The clip moved the key rows well beyond the bound the run is held to: the same run without
    # it differs by 33% of the update of block 0's wkv_b (measured), over 3 times the bound.
    unclipped = train_reference(run, after_step=ReferenceQKClip(math.inf))
    name = "layers.0.attention.wkv_b.weight"
    update = reference["final"][name] - run["initial"][name]
    moved = (reference["final"][name] - unclipped["final"][name]).norm()
    assert moved > 3 * BF16_UPDATE_TOLERANCE * update.norm()


def test_a_clipping_threshold_under_pipeline_parallelism_trains_like_the_reference(
    pool2, without_clip
):
    # pp 2 on 2 ranks: block 0 (dense) on stage 0, block 1 (MoE) on stage 1, each stage's
    # attention clipped by its own part's clip, on its own optimizer. One data-parallel rank
    # reads the 4 rows a step of the 2-rank job above, in 4 microbatches of 1: the clip takes
    # the maximum over the pipeline's microbatches and runs once a step. The threshold: the
    # median of the heads' largest logits in the first step, as in the test above.
    observed = ReferenceQKClip(math.inf)
    train_reference(without_clip, after_step=observed)
    first = sorted(s for values in observed.history[0].values() for s in values)
    threshold = (first[len(first) // 2 - 1] + first[len(first) // 2]) / 2

    pipelined = {"pp": 2, "dp_shard": 1, "local_batch": 4}
    options = {**JOB, **pipelined, "dmuon_options": {"qk_clip_threshold": threshold}}
    run = pool2.run(train, job_options=options)[0]
    clip = ReferenceQKClip(threshold)
    reference = train_reference(run, after_step=clip)
    assert clip.clipped_heads >= len(first) // 4
    # Both stages clipped: each block's attention has a head over the threshold at some step.
    for layer in ("layers.0.attention", "layers.1.attention"):
        assert any(max(step[layer]) > threshold for step in clip.history), layer
    assert_like_reference(
        run, reference, weights=1e-2, losses=1e-3, matrix_updates=BF16_UPDATE_TOLERANCE
    )
    unclipped = train_reference(run, after_step=ReferenceQKClip(math.inf))
    for layer in (0, 1):
        name = f"layers.{layer}.attention.wkv_b.weight"
        update = reference["final"][name] - run["initial"][name]
        moved = (reference["final"][name] - unclipped["final"][name]).norm()
        assert moved > 3 * BF16_UPDATE_TOLERANCE * update.norm(), name
