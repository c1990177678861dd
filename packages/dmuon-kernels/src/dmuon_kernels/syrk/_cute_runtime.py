"""What both CuTe DSL SYRK kernels share on the host side: element types, the pointer and stream
arguments of a compiled kernel, and compiling against placeholder arguments.

Imports nvidia-cutlass-dsl at module level, so only the kernel modules (``_cute_kernel``,
``_cute_sm90_kernel``) import it; it holds no device code and must not look at torch tensors.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

# torch dtype name -> CuTe element type (the only two the kernels implement).
ELEMENT_TYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}


def pointer(dtype_name: str, address: int):
    """A 16-byte aligned global-memory pointer argument for a compiled kernel."""
    return cute.runtime.make_ptr(
        ELEMENT_TYPES[dtype_name], address, cute.AddressSpace.gmem, assumed_align=16
    )


def stream_handle(raw_stream: int):
    """A CUDA stream argument (``torch.cuda.current_stream().cuda_stream``)."""
    return cuda.CUstream(raw_stream)


def compile_with_placeholders(kernel: Any, dtype_name: str, *scalars: Any):
    """``cute.compile`` of a kernel taking ``(a_ptr, d_ptr, c_ptr, *scalars, stream)``: null
    pointers and a fake stream stand in, since shapes and addresses are runtime arguments."""
    pointers = [pointer(dtype_name, 0) for _ in range(3)]
    return cute.compile(kernel, *pointers, *scalars, cute.runtime.make_fake_stream())
