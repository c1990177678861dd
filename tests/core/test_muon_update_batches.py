"""How the Muon update batches its element-wise passes (``dmuon.muon_update``): every matrix of one
(rows, cols) in one fused call, whatever its size (the fused kernels launch a constant number of
kernels a call and materialise nothing); the variants that make fp32 copies of whole matrices
(NorMuon, int8 momentum) in batches bounded by ``MATERIALISED_BATCH_BYTES``, with the values of
one batch."""

import torch

from dmuon import muon_update
from dmuon.muon_update import INT8_BLOCK, apply_matrices_, int8_scale_shape, quantize_
from dmuon_kernels.newton_schulz import NewtonSchulz

LR, WEIGHT_DECAY = 0.02, 0.1


def spy(monkeypatch, name):
    """Wrap ``muon_update.<name>`` (the real function) and record each call's list length."""
    real, sizes = getattr(muon_update, name), []

    def recorded(first, *args, **kwargs):
        sizes.append(len(first))
        return real(first, *args, **kwargs)

    monkeypatch.setattr(muon_update, name, recorded)
    return sizes


def test_the_plain_update_takes_every_matrix_of_a_shape_in_one_call_however_large(monkeypatch):
    # 2048 x 2049 is over 4M elements: such matrices used to take one call each.
    generator = torch.Generator().manual_seed(0)
    masters = [torch.randn(2048, 2049, generator=generator) for _ in range(3)]
    masters += [torch.randn(6, 4, generator=generator) for _ in range(2)]  # tall
    orthogonal = [torch.randn(2048, 2049, generator=generator) for _ in range(3)]
    orthogonal += [torch.randn(4, 6, generator=generator) for _ in range(2)]  # rows <= cols
    expected = []
    for master, ortho in zip(masters, orthogonal):
        update = ortho if ortho.shape == master.shape else ortho.mT
        scale = muon_update.lr_scale("match_rms_adamw", *master.shape)
        expected.append(master * (1 - LR * WEIGHT_DECAY) - LR * scale * update)
    sizes = spy(monkeypatch, "apply_updates_")
    for start, stop in ((0, 3), (3, 5)):
        apply_matrices_(
            masters[start:stop],
            torch.stack(orthogonal[start:stop]),
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            adjust_lr="match_rms_adamw",
        )
    assert sizes == [3, 2]
    for master, value in zip(masters, expected):
        torch.testing.assert_close(master, value, rtol=1e-6, atol=1e-6)


def test_normuon_updates_go_in_bounded_batches_with_the_values_of_one_batch(monkeypatch):
    generator = torch.Generator().manual_seed(1)
    masters = [torch.randn(6, 10, generator=generator) for _ in range(5)]
    orthogonal = torch.randn(5, 6, 10, generator=generator)
    moments = [torch.rand(6, generator=generator) for _ in range(5)]

    def applied(batch_bytes):
        monkeypatch.setattr(muon_update, "MATERIALISED_BATCH_BYTES", batch_bytes)
        copies, copied_moments = [m.clone() for m in masters], [v.clone() for v in moments]
        apply_matrices_(
            copies,
            orthogonal,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            adjust_lr="match_rms_adamw",
            normuon=(copied_moments, 0.95, 1e-8),
        )
        return copies, copied_moments

    sizes = spy(monkeypatch, "normuon_rows")
    one_batch = applied(2**30)
    assert sizes == [5]
    sizes.clear()
    bounded = applied(2 * 4 * 6 * 10)  # two matrices' fp32 copies a batch
    assert sizes == [2, 2, 1]
    for got, want in zip(bounded, one_batch):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_int8_momenta_are_dequantised_in_bounded_batches_with_the_values_of_one_batch(
    monkeypatch,
):
    generator = torch.Generator().manual_seed(2)
    shape = (4, 2 * INT8_BLOCK)
    grads = [torch.randn(shape, generator=generator) for _ in range(5)]
    initial = [torch.randn(shape, generator=generator) for _ in range(5)]
    newton_schulz = NewtonSchulz(dtype=torch.float32)

    def orthogonalized(batch_bytes):
        monkeypatch.setattr(muon_update, "MATERIALISED_BATCH_BYTES", batch_bytes)
        momenta = [torch.empty(shape, dtype=torch.int8) for _ in range(5)]
        scales = [torch.empty(int8_scale_shape(shape)) for _ in range(5)]
        for q, scale, value in zip(momenta, scales, initial):
            quantize_(q, scale, value)
        output = muon_update.orthogonalized_matrices(
            newton_schulz,
            grads,
            momenta,
            [False] * 5,
            momentum=0.95,
            nesterov=True,
            scales=scales,
        )
        return output, momenta, scales

    sizes = spy(monkeypatch, "normalized_inputs_")
    one_batch = orthogonalized(2**30)
    assert sizes == [5]
    sizes.clear()
    bounded = orthogonalized(2 * 4 * shape[0] * shape[1])  # two matrices' fp32 copies a batch
    assert sizes == [2, 2, 1]
    assert torch.equal(bounded[0], one_batch[0])
    for got, want in zip(bounded[1:], one_batch[1:]):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
