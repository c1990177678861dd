"""What both CuTe DSL SYRK kernels share on the host side: element types, the pointer and stream
arguments of a compiled kernel, compiling against placeholder arguments, and exporting a
compiled kernel to an object file and loading it back (``syrk.kernel_cache`` keeps them).

Imports nvidia-cutlass-dsl at module level, so only the kernel modules (``_cute_kernel``,
``_cute_sm90_kernel``) and the adapter's probe import it; it holds no device code and must not look at torch tensors.
"""

from __future__ import annotations

from pathlib import Path
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


# Loaded object modules: their execution engines must live as long as the kernels they hold.
_loaded_modules: list[Any] = []


def dump_compiled(compiled: Any, symbol: str) -> bytes:
    """A compiled kernel as a relocatable object (its host launch code and cubin), exported
    under the C symbol prefix ``symbol``; ``load_compiled`` turns it back into a kernel."""
    return compiled.dump_to_object(symbol)


def load_compiled(path: Path, symbol: str) -> Any:
    """The kernel ``dump_compiled`` saved at ``path``: callable with the same arguments as the
    compiled one, without tracing or compiling anything."""
    module = cute.runtime.load_module(str(path))
    kernel = getattr(module, symbol)
    _loaded_modules.append(module)
    return kernel


def compile_with_placeholders(kernel: Any, dtype_name: str, *scalars: Any):
    """``cute.compile`` of a kernel taking ``(a_ptr, d_ptr, c_ptr, *scalars, stream)``: null
    pointers and a fake stream stand in, since shapes and addresses are runtime arguments."""
    pointers = [pointer(dtype_name, 0) for _ in range(3)]
    return cute.compile(kernel, *pointers, *scalars, cute.runtime.make_fake_stream())
