"""Accuracy yardsticks shared by the GPU kernel tests: an fp32 reference product and the rule
that a kernel's error against it stays within twice cuBLAS's own error (plus a small floor)."""

import torch


def fp32_product(A, B, C, alpha, beta):
    """alpha·A·B + beta·C in true fp32 (no TF32)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        out = alpha * (A.float() @ B.float())
        return out if C is None else out + beta * C.float()
    finally:
        torch.set_float32_matmul_precision(previous)


def relative_error(actual, reference):
    return ((actual.float() - reference).norm() / reference.norm()).item()


def assert_within_twice_cublas(out, cublas_out, reference, dtype):
    floor = 0.25 * torch.finfo(dtype).eps / 2
    error, cublas_error = relative_error(out, reference), relative_error(cublas_out, reference)
    assert error <= 2 * cublas_error + floor, (error, cublas_error)
