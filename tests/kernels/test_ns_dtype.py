"""``dtype=None``, the default: Newton-Schulz iterates in fp16 on CUDA and fp32 elsewhere, decided
per call by the input's device, while the request that ranks compare stays "auto"."""

from __future__ import annotations

import pytest
import torch

from dmuon_kernels import NewtonSchulz, get_ns_backend, newton_schulz

CPU = torch.device("cpu")


def a_matrix(rows=16, cols=48, seed=0):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def test_the_default_iteration_dtype_is_fp16_on_cuda_and_fp32_elsewhere():
    ns = NewtonSchulz()
    assert ns.dtype is None
    assert ns.iteration_dtype(torch.device("cuda", 0)) == torch.float16
    assert ns.iteration_dtype(CPU) == torch.float32
    assert NewtonSchulz(dtype=torch.bfloat16).iteration_dtype(CPU) == torch.bfloat16


@pytest.mark.parametrize("backend", ["gram", "direct"])
def test_on_cpu_the_default_is_exactly_the_fp32_iteration(backend):
    G = a_matrix()
    assert torch.equal(NewtonSchulz(backend)(G), NewtonSchulz(backend, dtype=torch.float32)(G))
    fp32 = newton_schulz(G, backend=backend, dtype=torch.float32)
    assert torch.equal(newton_schulz(G, backend=backend), fp32)


def test_the_request_is_auto_so_ranks_on_different_devices_agree():
    config = NewtonSchulz().config
    assert config.dtype == "auto"
    assert config == NewtonSchulz(dtype=None).config
    assert config.differences(NewtonSchulz(dtype=torch.float16).config) == {
        "dtype": ("auto", "float16")
    }


def test_the_buffer_for_a_fused_step_has_the_dtype_of_its_device():
    ns = NewtonSchulz()
    buffer = ns.normalized_buffer((2, 4, 8), CPU)
    assert buffer.dtype == torch.float32 and buffer.shape == (2, 4, 8)
    X = torch.nn.functional.normalize(a_matrix(4, 8).expand(2, 4, 8).contiguous(), dim=(-2, -1))
    assert ns.iterate_normalized(X).dtype == torch.float32
    with pytest.raises(
        ValueError,
        match=r"iterate_normalized takes \(B, n, m\) with n <= m in "
        r"torch.float32; got \(2, 4, 8\) in torch.float16",
    ):
        ns.iterate_normalized(X.half())


@pytest.mark.skipif(torch.cuda.is_available(), reason="describes the CPU-only report")
def test_the_cpu_report_adds_no_dtype_note_for_the_default():
    assert get_ns_backend() == "Gram NS · kernel=cublas (CPU, torch fallback)"
    assert "float32 iteration" in get_ns_backend(NewtonSchulz(dtype=torch.float32))
