"""The Triton step kernels on CPU tensors through Triton's interpreter, against the torch fallback.

Run by ``test_fused_triton_interpreted`` in a fresh interpreter with ``TRITON_INTERPRET=1`` (Triton
reads it when the kernels are defined). Each case calls a ``dmuon_kernels.fused`` function twice
on copies of the same inputs, once with the kernels routed to CPU tensors and once with the torch
fallback, and prints one JSON line per case with what differs; the test holds those to bounds.
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from dmuon_kernels import _fused_triton, fused  # noqa: E402

MOMENTUM = 0.95
SHAPE = (70, 130)  # neither side a multiple of the 64 x 64 tile


def with_kernels(enabled: bool):
    fused._kernels = (lambda *tensors: _fused_triton) if enabled else (lambda *tensors: None)


def relative(actual: Tensor, expected: Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def ulps(actual: Tensor, expected: Tensor) -> float:
    """The largest difference in units in the last place of ``expected``'s dtype."""
    big = torch.maximum(actual.abs(), expected.abs()).to(expected.dtype)
    spacing = (torch.nextafter(big, torch.full_like(big, float("inf"))) - big).double()
    return ((actual.double() - expected.double()).abs() / spacing).max().item()


def unaligned(rows: int, cols: int, dtype=torch.float32) -> Tensor:
    """A (rows, cols) view 4 bytes into its storage: not 16-byte aligned."""
    return torch.empty(rows * cols + 1, dtype=dtype)[1:].view(rows, cols)


def step_inputs(batch: int, shape: tuple[int, int], grad_dtype, seed: int, aligned: bool):
    generator = torch.Generator().manual_seed(seed)
    grads, buffers = [], []
    for index in range(batch):
        grad = torch.randn(shape, generator=generator)
        grad *= (2.0**70, 1.0, 2.0**-70)[index % 3]  # squared norms over and under fp32's range
        buf = torch.randn(shape, generator=generator) * grad.abs().max()
        grad = grad.to(grad_dtype)
        if not aligned:
            grad = unaligned(*shape, dtype=grad_dtype).copy_(grad)
            buf = unaligned(*shape).copy_(buf)
        grads.append(grad)
        buffers.append(buf)
    return grads, buffers


def normalized_inputs_cases():
    # Transposed outputs meet bf16 gradients at unaligned addresses; the others fp32 aligned ones.
    layouts = ((False, torch.float32, True), (True, torch.bfloat16, False))
    cases = [
        (transposed, grad_dtype, aligned, nesterov, dtype)
        for transposed, grad_dtype, aligned in layouts
        for nesterov in (True, False)
        for dtype in (torch.float16, torch.bfloat16, torch.float32)
    ]
    rows, cols = SHAPE
    first_steps = [False, True, False]
    for transposed, grad_dtype, aligned, nesterov, dtype in cases:
        grads, buffers = step_inputs(3, SHAPE, grad_dtype, seed=1, aligned=aligned)
        results = []
        for enabled in (True, False):
            with_kernels(enabled)
            momenta = [b.clone() for b in buffers]
            out = torch.full((3, cols, rows) if transposed else (3, rows, cols), 7.0).to(dtype)
            fused.muon_normalized_inputs_(grads, momenta, first_steps, MOMENTUM, nesterov, out)
            results.append((momenta, out))
        (kernel_momenta, kernel_out), (torch_momenta, torch_out) = results
        yield {
            "case": "normalized_inputs",
            "transposed": transposed,
            "nesterov": nesterov,
            "dtype": str(dtype),
            "grad_dtype": str(grad_dtype),
            "buffer_error": max(relative(k, t) for k, t in zip(kernel_momenta, torch_momenta)),
            "out_error": max(relative(k, t) for k, t in zip(kernel_out, torch_out)),
            "out_ulps": ulps(kernel_out, torch_out),
            "finite": bool(kernel_out.isfinite().all()),
        }


def new_momenta_cases():
    """The new momentum into separate buffers (the overlapped step's speculation): the old ones
    untouched, the new ones and the output bit for bit the in-place run's, on either path."""
    rows, cols = SHAPE
    first_steps = [False, True, False]
    grads, buffers = step_inputs(3, SHAPE, torch.float32, seed=2, aligned=True)
    for enabled in (True, False):
        with_kernels(enabled)
        in_place = [b.clone() for b in buffers]
        expected_out = torch.empty(3, rows, cols, dtype=torch.float16)
        fused.muon_normalized_inputs_(grads, in_place, first_steps, MOMENTUM, True, expected_out)
        read = [b.clone() for b in buffers]
        new = [torch.full_like(b, 7.0) for b in buffers]
        out = torch.empty(3, rows, cols, dtype=torch.float16)
        fused.muon_normalized_inputs_(
            grads, read, first_steps, MOMENTUM, True, out, new_momenta=new
        )
        yield {
            "case": "new_momenta",
            "kernels": enabled,
            "read_unchanged": all(torch.equal(r, b) for r, b in zip(read, buffers)),
            "new_equal": all(torch.equal(n, i) for n, i in zip(new, in_place)),
            "out_equal": torch.equal(out, expected_out),
        }


def single_matrix_cases():
    for nesterov in (True, False):
        for first_step in (True, False):
            grads, buffers = step_inputs(1, SHAPE, torch.float32, seed=2, aligned=True)
            results = []
            for enabled in (True, False):
                with_kernels(enabled)
                buf = buffers[0].clone()
                update, sq_norm = fused.muon_momentum_(
                    grads[0], buf, MOMENTUM, nesterov, first_step
                )
                normalized = fused.muon_normalize(
                    update, sq_norm, torch.float16, out=torch.empty(SHAPE[::-1]).half().mT
                )
                recomputed = fused.muon_normalize(update, None, torch.float32)
                results.append((buf, update, sq_norm, normalized, recomputed))
            kernel, reference = results
            yield {
                "case": "momentum_then_normalize",
                "nesterov": nesterov,
                "first_step": first_step,
                "buffer_error": relative(kernel[0], reference[0]),
                "update_error": relative(kernel[1], reference[1]),
                "update_is_buffer": (kernel[1] is kernel[0]) == (not nesterov),
                "sq_norm_error": relative(kernel[2], reference[2]),
                "sq_norm_dtype": str(kernel[2].dtype),
                "normalized_ulps": ulps(kernel[3], reference[3]),
                "recomputed_error": relative(kernel[4], reference[4]),
            }


def normalize_frobenius_cases():
    generator = torch.Generator().manual_seed(3)
    X = torch.randn(4, 50, 90, generator=generator)
    X[1] *= 2.0**100
    X[2] = 0.0
    for view_name, view in (("batch", X), ("transposed", X.mT), ("matrix", X[1])):
        for dtype in (torch.float16, torch.float32):
            outputs = []
            for enabled in (True, False):
                with_kernels(enabled)
                outputs.append(fused.normalize_frobenius(view, eps=1e-7, dtype=dtype))
            yield {
                "case": "normalize_frobenius",
                "view": view_name,
                "dtype": str(dtype),
                "ulps": ulps(*outputs),
                "zero_matrix_is_zero": view_name != "batch" or bool((outputs[0][2] == 0).all()),
            }


def apply_update_cases():
    generator = torch.Generator().manual_seed(4)
    for ortho_layout in ("contiguous", "transposed"):
        for aligned in (True, False):
            masters = [torch.randn(SHAPE, generator=generator) for _ in range(3)]
            if not aligned:
                masters = [unaligned(*SHAPE).copy_(m) for m in masters]
            ns_output = torch.randn(3, *SHAPE[::-1], generator=generator).half()
            if ortho_layout == "transposed":
                updates = list(ns_output.mT)
            else:
                updates = list(torch.randn(3, *SHAPE, generator=generator).half())
            results = []
            for enabled in (True, False):
                with_kernels(enabled)
                copies = [m.clone() for m in masters]
                fused.muon_apply_updates_(copies, updates, 0.02, 0.1, 0.2 * 130**0.5)
                results.append(copies)
            yield {
                "case": "apply_updates",
                "ortho_layout": ortho_layout,
                "aligned": aligned,
                "master_error": max(relative(k, t) for k, t in zip(*results)),
            }


def main() -> None:
    for cases in (
        normalized_inputs_cases,
        new_momenta_cases,
        single_matrix_cases,
        normalize_frobenius_cases,
        apply_update_cases,
    ):
        for result in cases():
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
