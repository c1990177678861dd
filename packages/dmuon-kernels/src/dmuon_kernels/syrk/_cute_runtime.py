"""What both CuTe DSL SYRK kernels share on the host side: element types, compiling against
placeholder arguments, and exporting a compiled kernel to an object file and loading it back
(``syrk.kernel_cache`` keeps them).

Kernels are compiled with TVM-FFI's calling convention (``--enable-tvm-ffi``): a call passes
plain Python ints (addresses, sizes, the raw CUDA stream) and floats straight to the compiled
host code, which checks and unpacks them in C (``direct_call``). The JIT executor's own
convention wraps each argument in Python objects first: a warmed 4096² ``syrk`` took 101 µs of
host time that way, 34 µs now (H200, ``benchmarks/kernels/bench_dispatch.py``).

Imports nvidia-cutlass-dsl and apache-tvm-ffi at module level, so only the kernel modules
(``_cute_kernel``, ``_cute_sm90_kernel``) and the adapter's probe import it; it holds no device
code and must not look at torch tensors.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import cutlass
import cutlass.cute as cute
import tvm_ffi

# torch dtype name -> CuTe element type (the only two the kernels implement).
ELEMENT_TYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}
COMPILE_OPTIONS = "--enable-tvm-ffi"


def placeholder_pointer(dtype_name: str):
    """A null 16-byte aligned global-memory pointer standing in for an address at compile time
    (a call passes the address as an int)."""
    return cute.runtime.make_ptr(
        ELEMENT_TYPES[dtype_name], 0, cute.AddressSpace.gmem, assumed_align=16
    )


# Loaded object modules: their execution engines must live as long as the kernels they hold.
_loaded_modules: list[Any] = []


def dump_compiled(compiled: Any, symbol: str) -> bytes:
    """A compiled kernel as a relocatable object (its host launch code and cubin), exported
    under the symbol ``symbol``; ``load_compiled`` turns it back into a kernel."""
    with tempfile.TemporaryDirectory(prefix="dmuon-cute-export-") as folder:
        path = Path(folder) / f"{symbol}.o"
        compiled.export_to_c(str(path), symbol)
        return path.read_bytes()


def direct_call(kernel: Any) -> Any:
    """``kernel`` called straight through TVM-FFI. A kernel compiled in this process is a
    ``tvm_ffi.Function`` whose own ``__call__`` first looks through every argument for
    dataclasses to flatten (about 10 µs a call for our 11 plain arguments); a loaded one is a
    plain ``tvm_ffi.Function`` already."""
    if (
        isinstance(kernel, tvm_ffi.Function)
        and type(kernel).__call__ is not tvm_ffi.Function.__call__
    ):
        return functools.partial(tvm_ffi.Function.__call__, kernel)
    return kernel


def load_compiled(path: Path, symbol: str) -> Any:
    """The kernel ``dump_compiled`` saved at ``path``: callable with the same arguments as the
    compiled one, without tracing or compiling anything."""
    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    kernel = getattr(module, symbol)
    _loaded_modules.append(module)
    return kernel


def compile_with_placeholders(kernel: Any, dtype_name: str, *scalars: Any):
    """``cute.compile`` of a kernel taking ``(a_ptr, b_ptr, d_ptr, c_ptr, *scalars, stream)``:
    null pointers and a fake stream stand in, since shapes and addresses are runtime arguments."""
    pointers = [placeholder_pointer(dtype_name) for _ in range(4)]
    return cute.compile(
        kernel, *pointers, *scalars, cute.runtime.make_fake_stream(), options=COMPILE_OPTIONS
    )
