"""The update GEMM's Triton kernel checked on the CPU through Triton's interpreter.

``update_gemm_interpreted`` runs ``dmuon_kernels._update_gemm_triton.update_gemm_`` on CPU tensors
(in a fresh interpreter with ``TRITON_INTERPRET=1``) for wide and tall masters, tiles smaller and
larger than the matrix, K a multiple of the K tile or not; here each result is held to what
rounding allows. tests/gpu repeats the comparison with the compiled kernel on CUDA, bf16 operands
included.

Bounds: the fp32 master within 1e-6 of the float64 update (fp32 accumulation of fp16 products);
the copy the master rounded to its dtype: exactly for fp16, within one unit in the last place for
bf16 (the interpreter truncates to bf16 where the GPU rounds to nearest).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.kernels.triton_interpreter import run_interpreted

COPY_ULPS = {"torch.float16": 0.0, "torch.bfloat16": 1.0}

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)


def test_the_update_gemm_writes_the_exact_update_and_its_rounded_copy():
    results = run_interpreted("tests.kernels.update_gemm_interpreted", timeout=600)
    assert len(results) == 16, results
    for result in results:
        assert result["master_error"] < 1e-6, result
        copy_dtype = result["case"].split(" -> ")[1].split()[0]
        assert result["copy_ulps"] <= COPY_ULPS[copy_dtype], result
