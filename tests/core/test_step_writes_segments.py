"""The plain step writes each master's new weight, rounded, into its local segment, and the
publish after it copies only what was written since ([Note: the step writes the segments] in
``dmuon.muon_route``), in one process on the CPU: the segment is the master rounded after every
step, the run is bit-identical to the variants whose publish makes the copies (the overlapped
step, offloaded masters), and a master written after the update (QK-clip, a master-update hook,
a load after a failed step) is copied again. The copies are counted from the aten ops issued."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate
from tests.distributed.models_moe import MoEDecoder, moe_predicate
from tests.distributed.scenarios_qk_clip import attention_heads, loss_of, make_model, predicate_of

FP32_NS = functools.partial(NewtonSchulz, dtype=torch.float32, kernel="cublas")
BF16 = {"defaults": {"param_dtype": torch.bfloat16}}
ROW_BLOCKS = {"layers.1.up_proj.weight": [40, 12], "layers.*.q_proj.weight": 6}


class SegmentWrites(TorchDispatchMode):
    """Which parameters' segment values the copy ops of one ``step()`` wrote into: during the
    update (``by_update``) or in the publish after the master-update hooks (``by_publish``),
    told apart by a master-update hook of its own, registered last."""

    def __init__(self, model) -> None:
        super().__init__()
        self._state = get_dedicated_state(model)
        self._ranges = {
            fqn: (v.data_ptr(), v.data_ptr() + v.numel() * v.element_size())
            for fqn, v in segment_values(model).items()
        }
        self.by_update: list[str] = []
        self.by_publish: list[str] = []
        self._written = self.by_update

    def __enter__(self):
        self._handle = self._state.register_master_update_hook(self._publish_begins)
        return super().__enter__()

    def __exit__(self, *exc):
        self._handle.remove()
        return super().__exit__(*exc)

    def _publish_begins(self) -> None:
        self._written = self.by_publish

    def _owner(self, tensor: torch.Tensor) -> str | None:
        ptr = tensor.data_ptr()
        return next((f for f, (lo, hi) in self._ranges.items() if lo <= ptr < hi), None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            destinations = [args[0]]
        elif func is torch.ops.aten._foreach_copy_.default:
            destinations = args[0]
        else:
            destinations = []
        self._written += [f for t in destinations if (f := self._owner(t)) is not None]
        return func(*args, **(kwargs or {}))


def muon_params(model) -> list:
    return [p for p in get_dedicated_state(model).iter_owned_masters() if p.route == "muon"]


def segment_values(model) -> dict[str, torch.Tensor]:
    """Each Muon master's weight in its local segment (the unsharded parameter's storage)."""
    return {p.fqn: p.unsharded.detach() for p in muon_params(model)}


def bf16_model(moe: bool = False, skip_layer: int | None = None, **dedicate_options):
    torch.manual_seed(0)
    model = MoEDecoder() if moe else TinyDecoder(skip_layer=skip_layer)
    model = model.to(torch.bfloat16)
    dmuon.dedicate_params(model, None, moe_predicate if moe else proj_predicate, **dedicate_options)
    return model


def train(model, optimizer, steps: int = 3, check=None) -> tuple[list[float], list[list[str]]]:
    """``steps`` steps, ``check(writes)`` after each with its ``SegmentWrites``; returns the
    losses and what each step's publish copied."""
    losses, published = [], []
    for tokens in batches(steps, 1):
        loss = loss_fn(model, tokens)
        loss.backward()
        with SegmentWrites(model) as writes:
            optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        published.append(writes.by_publish)
        if check is not None:
            check(writes)
    return losses, published


def assert_segments_are_the_masters_rounded(model) -> None:
    for p in muon_params(model):
        rounded = p.master_value().detach().to(p.param_dtype)
        assert torch.equal(p.unsharded.detach(), rounded), p.fqn


def fail() -> None:
    raise RuntimeError("a master-update hook failed")


def step_failing_before_its_publish(model, optimizer) -> None:
    """One backward and a ``step()`` whose master-update hook raises: the update ran (and wrote
    the segments), the publish did not."""
    handle = get_dedicated_state(model).register_master_update_hook(fail)
    loss_fn(model, batches(1, 1)[0]).backward()
    with pytest.raises(RuntimeError, match="a master-update hook failed"):
        optimizer.step()
    handle.remove()


def force_epilogue(monkeypatch) -> None:
    """The CUDA path's last product (the update written into the masters and the copies) on the
    CPU: selects the path, the numbers are the real kernels'."""
    module = sys.modules["dmuon_kernels.newton_schulz"]  # ``newton_schulz`` is the function
    monkeypatch.setattr(module, "epilogue_enabled", lambda X: True)


@pytest.mark.parametrize("epilogue", [False, True])
@pytest.mark.parametrize(
    "case",
    ["plain", "int8 momentum", "bf16 momentum", "row blocks", "expert pieces", "skipped layer"],
)
def test_after_each_step_the_segment_is_the_master_rounded_and_the_publish_copies_none(
    monkeypatch, case, epilogue
):
    if epilogue:
        force_epilogue(monkeypatch)
    options = {"int8 momentum": {"momentum_dtype": "int8"}}.get(case, {})
    options |= {"bf16 momentum": {"momentum_dtype": torch.bfloat16}}.get(case, {})
    model = bf16_model(
        moe=case == "expert pieces",
        skip_layer=1 if case == "skipped layer" else None,
        **({"row_blocks": ROW_BLOCKS} if case == "row blocks" else {}),
    )
    optimizer = dmuon.Muon(model, ns_backend=FP32_NS(), weight_decay=0.1, **options)
    params = muon_params(model)
    # A layer skipped in forward has no gradient: the step leaves its master and segment alone.
    untouched = {p.fqn for p in params if case == "skipped layer" and ".1." in p.fqn}
    stepped = {p.fqn for p in params} - untouched
    if case == "expert pieces":
        assert any(p.experts is not None for p in params)

    def check(writes: SegmentWrites) -> None:
        assert_segments_are_the_masters_rounded(model)
        assert set(writes.by_update) == stepped  # the update wrote each stepped one
        assert set(writes.by_publish) == untouched  # and the publish only the others
        assert not any(p.segment_fresh for p in params)  # every mark consumed

    train(model, optimizer, check=check)


def test_the_plain_step_is_bit_identical_to_the_overlapped_step_whose_publish_copies():
    results = []
    for overlap_step in (False, True):
        model = bf16_model()
        optimizer = dmuon.Muon(
            model, ns_backend=FP32_NS(), weight_decay=0.1, overlap_step=overlap_step
        )
        losses, copied = train(model, optimizer)
        results.append((losses, segment_values(model), copied))
    (losses, segments, copied), (overlapped_losses, overlapped, overlapped_copied) = results
    assert overlapped_losses == losses
    assert all(torch.equal(segments[k], overlapped[k]) for k in segments)
    assert copied == [[]] * 3 and all(overlapped_copied)  # the overlapped step's publish copies


def test_the_plain_step_is_bit_identical_to_offloaded_masters_which_copy_their_own():
    """Offloaded masters take no copy from the kernel: ``dmuon.offload`` writes each segment
    with one copy before the master goes home, also during the update."""
    results = []
    for offload in (False, True):
        model = bf16_model(row_blocks=ROW_BLOCKS)
        optimizer = dmuon.Muon(
            model, ns_backend=FP32_NS(), offload_masters=offload, momentum_dtype=torch.bfloat16
        )
        losses, published = train(model, optimizer)
        results.append((losses, segment_values(model), published))
    (losses, segments, published), (offloaded_losses, offloaded, offloaded_published) = results
    assert offloaded_losses == losses
    assert all(torch.equal(segments[k], offloaded[k]) for k in segments)
    assert published == offloaded_published == [[]] * 3


def test_a_master_written_through_master_value_after_the_update_is_copied_again():
    model = bf16_model()
    optimizer = dmuon.Muon(model, ns_backend=FP32_NS())
    state = get_dedicated_state(model)
    p = state.params["layers.0.q_proj.weight"]
    state.register_master_update_hook(lambda: p.master_value().mul_(0.5))

    def check(writes: SegmentWrites) -> None:
        assert writes.by_publish == [p.fqn]
        assert_segments_are_the_masters_rounded(model)

    train(model, optimizer, check=check)


def test_qk_clip_after_the_plain_step_reaches_the_segment():
    model = make_model()
    dmuon.dedicate_params(model, None, predicate_of(False), param_policy=BF16)
    optimizer = dmuon.Muon(model, lr=0.02, weight_decay=0.01, ns_backend=FP32_NS())
    clip = dmuon.QKClip(model, optimizer, attention_heads(model), threshold=1.5)
    for i, layer in enumerate(model.layers):
        layer.attn.record = functools.partial(clip.record, f"layers.{i}.attn")
    refreshed = set()
    for tokens in batches(3, 1):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 weights, fp32 norms
            loss = loss_of(model, tokens % 37)
        loss.backward()
        with SegmentWrites(model) as writes:
            optimizer.step()
        optimizer.zero_grad()
        assert_segments_are_the_masters_rounded(model)
        assert bool(writes.by_publish) == (clip.clipped_heads > 0)
        refreshed |= set(writes.by_publish)
    assert refreshed and all("q_proj" in f or "k_proj" in f for f in refreshed)


def test_a_master_that_is_its_segment_takes_no_copy():
    torch.manual_seed(0)
    model = TinyDecoder()  # fp32 compute: each master is its segment
    dmuon.dedicate_params(model, None, proj_predicate)
    optimizer = dmuon.Muon(model, ns_backend=FP32_NS(), weight_decay=0.1)
    params = muon_params(model)
    assert all(p.master.data_ptr() == p.unsharded.data_ptr() for p in params)

    def check(writes: SegmentWrites) -> None:
        assert writes.by_publish == writes.by_update == []
        assert not any(p.segment_fresh for p in params)

    train(model, optimizer, check=check)


@pytest.mark.parametrize("moe", [False, True])
def test_a_step_that_failed_before_its_publish_leaves_no_mark_over_a_later_load(moe):
    model = bf16_model(moe=moe)
    optimizer = dmuon.Muon(model, ns_backend=FP32_NS())
    step_failing_before_its_publish(model, optimizer)
    assert all(p.segment_fresh for p in muon_params(model))  # written, never published
    # A load writes every master; the next forward publishes it, marks or not.
    torch.manual_seed(1)
    loaded = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)
    seen = {}
    handles = [
        module.register_forward_pre_hook(
            lambda module, args, name=name: seen.update(
                {f"{name}.{n}": t.detach().clone() for n, t in module.named_parameters()}
            )
        )
        for name, module in model.named_modules()
        if name.startswith("layers.") and name.count(".") == 1  # the hook boundaries
    ]
    loss_fn(model, batches(1, 1)[0])
    for h in handles:
        h.remove()
    names = {"layers.0.q_proj.weight", "layers.1.q_proj.weight"}
    if moe:
        names |= {"layers.0.w_in", "layers.1.w_out"}
    for name in names:
        assert torch.equal(seen[name], loaded[name].to(torch.bfloat16)), name


def test_a_step_that_failed_before_its_publish_leaves_no_mark_to_the_next_step():
    """The next step writes the masters without copies (NorMuon writes the output out): a mark
    left from the failed step would keep its publish from copying them."""
    model = bf16_model()
    optimizer = dmuon.Muon(model, ns_backend=FP32_NS())
    step_failing_before_its_publish(model, optimizer)
    optimizer.zero_grad()
    for group in optimizer.param_groups:
        group["normuon"] = True

    def check(writes: SegmentWrites) -> None:
        assert writes.by_update == [] and len(writes.by_publish) == len(muon_params(model))
        assert_segments_are_the_masters_rounded(model)

    train(model, optimizer, steps=1, check=check)
