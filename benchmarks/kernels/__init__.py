"""Kernel benchmarks: SYRK, Newton-Schulz, cuBLAS blocks, dispatch and compile cost."""
