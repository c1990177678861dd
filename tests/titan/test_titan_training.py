"""dmuon-titan with torchtitan's own Trainer and llama3 debug model on gloo: the trained weights,
the losses and the logged gradient norms equal a single-process reference's, on 1-D FSDP, HSDP,
tensor and pipeline parallelism, in float32 and in torchtitan's mixed precision.

[Note: norms in float32 on the CPU]
A float32 norm of a large gradient on the CPU is only good to about 1e-4 relative (the output
head's (2048, 256) gradient: 2.00034 in one tensor, 2.00050 as the norm of its two halves' norms,
2.00061 in float64), and the distributed run and the reference group the same squares
differently. So logged gradient norms are compared at 1e-3; the clip they feed scales every
gradient by the same factor, to which Newton-Schulz and AdamW are nearly insensitive, so the
weights still agree tightly.
"""

import pytest

from tests.titan.scenarios_titan import build_error, train, train_reference

NORM_TOLERANCE = 1e-3  # see [Note: norms in float32 on the CPU]
# fp32 Newton-Schulz: the runs differ by the order of float additions in the gradients (sums
# over 512 tokens and the ranks); measured 1.2e-5 after 3 steps on the 256 x 768 matrices.
FP32_TOLERANCE = 5e-5
# bf16 in the update's path (torch.optim.Muon's bf16 Newton-Schulz, or a bf16 forward): two
# runs whose inputs differ by roundings agree on a matrix's update (its change over the run) to a
# few bf16 ulps, as tests/core/test_torch_compatible.py measures (3%, 4 ulps, with full-rank
# gradients); 8 ulps of room. Compared on the updates: Muon moves these matrices by tens of
# percent a step, so their weights alone would hide nothing and show everything. Measured here:
# 3.8% (mixed precision) and 2.8% (HSDP), both on the attention output of the narrowed model.
BF16_UPDATE_TOLERANCE = 8 * 2.0**-7
# The bf16 tests narrow the model to dimension 128 (MLP 384): CPUs without bf16 matrix units
# multiply bf16 matrices some 50 times slower than float32 ones, and at the debug model's 256
# these two tests took most of this file's time, in Newton-Schulz and the bf16 backward.
# Full-rank gradients need more tokens a step than a matrix has rows (128): with fewer, both
# runs turn the rounding noise in the gradient's null space into different junk. 256 tokens a
# step here (2 x 4 x 32 in the mixed-precision test, 4 x 2 x 32 under HSDP).
NARROW_FULL_RANK = {"width": 128, "seq_len": 32, "local_batch": 4}


def relative_error(value, expected) -> float:
    return ((value - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_like_reference(
    run: dict,
    reference: dict,
    *,
    weights: float,
    losses: float,
    matrix_updates: float | None = None,
) -> None:
    """Losses, logged norms and final weights as the reference's; with ``matrix_updates``, the
    dedicated matrices are compared by their updates (final minus initial) at that bound."""
    assert len(run["logged"]) == len(reference["logged"])
    for (loss, norm), (ref_loss, ref_norm) in zip(run["logged"], reference["logged"]):
        assert loss == pytest.approx(ref_loss, rel=losses)
        assert norm == pytest.approx(ref_norm, rel=NORM_TOLERANCE)
    assert run["final"].keys() == reference["final"].keys()
    by_update = set(run["dedicated"]) if matrix_updates is not None else set()
    by_update = {key for key in run["final"] if _of_dedicated(key, by_update)}
    errors, update_errors = {}, {}
    for name, value in run["final"].items():
        expected = reference["final"][name]
        if name in by_update:
            start = run["initial"][name]
            update_errors[name] = relative_error(value - start, expected - start)
        else:
            errors[name] = relative_error(value, expected)
    worst = max(errors.items(), key=lambda item: item[1])
    assert worst[1] < weights, worst
    if update_errors:
        worst = max(update_errors.items(), key=lambda item: item[1])
        assert worst[1] < matrix_updates, worst


def _of_dedicated(key: str, dedicated: set[str]) -> bool:
    """``key`` holds (part of) a dedicated matrix: the fused QKV's split keys belong to it."""
    module = key.rsplit(".", 2)[0]
    return key in dedicated or any(name.startswith(module + ".") for name in dedicated)


def test_dmuon_in_torchtitan_trains_like_the_float32_reference_in_one_process(pool2):
    run = pool2.run(train, job_options={"ns": "fp32"})[0]
    # The dedicated matrices are the blocks' (fused QKV, output, MLP) under canonical names;
    # embeddings, norms and the output head stay with FSDP2 and AdamW.
    assert len(run["dedicated"]) == 2 * 5
    assert all(name.startswith("layers.") for name in run["dedicated"])
    assert not any("_checkpoint_wrapped_module" in name for name in run["dedicated"])
    reference = train_reference(run)
    assert_like_reference(run, reference, weights=FP32_TOLERANCE, losses=1e-6)


def test_hsdp_with_torchtitans_dim_names_trains_like_torch_muon_and_adamw(pool4):
    job = {"dp_replicate": 2, "dp_shard": 2, "ns": "torch", **NARROW_FULL_RANK, "local_batch": 2}
    run = pool4.run(train, job_options=job)[0]
    reference = train_reference(run)
    assert_like_reference(
        run, reference, weights=FP32_TOLERANCE, losses=1e-4, matrix_updates=BF16_UPDATE_TOLERANCE
    )


def test_pipeline_stages_with_one_clip_train_like_the_unpipelined_reference(pool4):
    run = pool4.run(train, job_options={"pp": 2, "dp_shard": 2, "ns": "fp32"})[0]
    reference = train_reference(run)
    assert_like_reference(run, reference, weights=FP32_TOLERANCE, losses=1e-6)


def test_pipeline_stages_without_block_matrices_train_on_adamw_like_the_reference(pool2):
    # torchtitan's own split of one block a stage: the embeddings and the norm + head are
    # stages without a block matrix (two stages a rank, interleaved), trained on AdamW alone.
    job = {"pp": 2, "dp_shard": 1, "pp_layers_per_stage": 1, "pp_schedule": "Interleaved1F1B"}
    run = pool2.run(train, job_options={**job, "ns": "fp32"})[0]
    assert len(run["dedicated"]) == 2 * 5
    reference = train_reference(run)
    assert_like_reference(run, reference, weights=FP32_TOLERANCE, losses=1e-6)


def test_a_pipeline_job_without_any_muon_matrix_is_refused_on_every_rank(pool2):
    job = {"pp": 2, "dp_shard": 1, "dmuon_options": {"muon_params": "^no_such_parameter$"}}
    messages = pool2.run(build_error, job_options=job)
    assert all("no parameter is on the Muon route" in (message or "") for message in messages)


def test_tensor_parallel_blocks_train_like_the_reference(pool4):
    run = pool4.run(train, job_options={"tp": 2, "dp_shard": 2, "ns": "fp32"})[0]
    reference = train_reference(run)
    assert_like_reference(run, reference, weights=FP32_TOLERANCE, losses=1e-6)


def test_torchtitans_mixed_precision_trains_like_torch_muon_on_a_bf16_forward(pool2):
    # bf16 parameters and fp32 reduction, as torchtitan's defaults, and torch.optim.Muon's bf16
    # Newton-Schulz: each rank's gradient is rounded to bf16 before the sum, the reference's
    # full-batch one once, so the runs agree to bf16 rounding, not to fp32's.
    job = {"mixed_precision": True, "ns": "torch", **NARROW_FULL_RANK}
    run = pool2.run(train, job_options=job)[0]
    reference = train_reference(run)
    assert_like_reference(
        run, reference, weights=1e-2, losses=1e-2, matrix_updates=BF16_UPDATE_TOLERANCE
    )


def test_blocks_compiled_with_full_graphs_train_like_the_reference(pool2):
    # torchtitan's per-block torch.compile(fullgraph=True), dmuon's hooks kept outside the graph
    # (dmuon_titan.parallelize [Note: compiled blocks]); eager backend: dynamo's capture alone.
    run = pool2.run(train, job_options={"ns": "fp32", "compile": True})[0]
    reference = train_reference(run)
    assert_like_reference(run, reference, weights=FP32_TOLERANCE, losses=1e-6)


def test_a_moe_jobs_distmuon_recipe_trains_like_a_reference_written_from_the_recipe(pool2):
    # torchtitan's Muon recipe format (kimi_k2_7's): the fused QKV per head, the attention
    # output and the router gate owned, the experts per expert; read by dmuon-titan, not
    # re-typed. The reference runs Newton-Schulz per head block and per expert from the same
    # recipe. The experts compute in bfloat16 (torchtitan's grouped matmul): their updates are
    # compared at bf16's bound, on full-rank gradients (256 tokens a step, top 2 of 4 experts:
    # about 128 a (64, 256) expert; see NARROW_FULL_RANK).
    job = {"model": "qwen3_moe", "distmuon_recipe": True, "ns": "fp32", "seq_len": 64}
    run = pool2.run(train, job_options=job)[0]
    assert len(run["dedicated"]) == 2 * 6  # per block: wqkv, wo, router gate, three stacks
    assert run["optimizer"]["row_blocks"] and len(run["optimizer"]["expert_stacks"]) == 2 * 3
    reference = train_reference(run)
    assert_like_reference(
        run, reference, weights=1e-2, losses=1e-3, matrix_updates=BF16_UPDATE_TOLERANCE
    )


def test_deepseek_v3s_mla_moe_with_a_distmuon_recipe_trains_like_the_reference(pool2):
    # MLA as the Kimi recipes cut it: wq per query head, wkv_b per key/value head, wkv_a and wo
    # owned; block 0 dense (owned MLP), block 1 MoE (router and shared experts owned, the
    # routed experts per expert).
    job = {"model": "deepseek_v3", "distmuon_recipe": True, "ns": "fp32", "seq_len": 64}
    run = pool2.run(train, job_options=job)[0]
    assert len(run["dedicated"]) == (4 + 3) + (4 + 1 + 3 + 3)
    reference = train_reference(run)
    assert_like_reference(
        run, reference, weights=1e-2, losses=1e-3, matrix_updates=BF16_UPDATE_TOLERANCE
    )
