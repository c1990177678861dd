"""Compiled kernels kept on disk, so that a fresh process loads them instead of compiling.

Owns where compiled kernel objects live (``<DMUON_CACHE_DIR>/kernels/<name>.o``), their names,
writing them safely while other ranks read or write, and the one-compiler-per-kernel rule. It
never compiles or loads a kernel itself: the backend passes ``compile``, ``load`` and ``dump``
callables, so this module stays plain standard library and knows no kernel library.

[Note: names, versions and concurrent ranks]

- A kernel's name is a hash of everything its object code depends on (the backend passes it as
  ``identity``: the kernel library's version, a digest of the kernel sources, the tile
  configuration, dtype, epilogue, GPU architecture). Any change gives another name, so a stale
  object is never loaded; old files are simply never read again.
- Writes are atomic (temporary file, fsync, ``os.replace``): a reader sees a whole object or
  none. An object that fails to load (truncated by a full disk, written by an incompatible
  library) is reported once with a warning, recompiled and replaced.
- One process compiles each kernel: an advisory lock per name (``flock``) makes the other ranks
  of the machine wait, then load what the first one wrote. Different kernels compile in
  parallel. The lock dies with its holder, so a crashed rank never blocks the others.
- ``DMUON_KERNEL_CACHE=0`` compiles in every process and touches no file.

Loading an object runs its host code: the folder must be the user's own (the default is under
the home directory), as for any compiler cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from dmuon_kernels._env import KERNEL_CACHE_ENV, env_flag
from dmuon_kernels._log import log_rank_tagged
from dmuon_kernels.syrk.cache import (
    CACHE_DIR_ENV,
    atomic_write_bytes,
    default_cache_dir,
    exclusive_lock,
)

KERNELS_FOLDER = "kernels"
OBJECT_SUFFIX = ".o"
# The symbol prefix of an exported kernel: "dmuon_" + the first hex digits of its name.
SYMBOL_DIGITS = 24

Kernel = TypeVar("Kernel")


def kernel_name(identity: Mapping[str, str]) -> str:
    """The file stem of a kernel: SHA-256 of its identity (sorted keys), in hex."""
    text = json.dumps({str(k): str(v) for k, v in identity.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def symbol_prefix(name: str) -> str:
    """The C symbol prefix under which the kernel named ``name`` is exported."""
    return "dmuon_" + name[:SYMBOL_DIGITS]


class CompiledKernelCache:
    """Compiled kernels under ``<folder>/`` (default ``<DMUON_CACHE_DIR>/kernels``, read when
    first needed). ``enabled=None`` reads ``DMUON_KERNEL_CACHE`` at each lookup."""

    def __init__(
        self, folder: str | os.PathLike[str] | None = None, *, enabled: bool | None = None
    ):
        self._folder = Path(folder).expanduser() if folder is not None else None
        self._enabled = enabled
        self._warned: set[str] = set()

    @property
    def folder(self) -> Path:
        return self._folder if self._folder is not None else default_cache_dir() / KERNELS_FOLDER

    @property
    def enabled(self) -> bool:
        return env_flag(KERNEL_CACHE_ENV, default=True) if self._enabled is None else self._enabled

    def path(self, identity: Mapping[str, str]) -> Path:
        return self.folder / (kernel_name(identity) + OBJECT_SUFFIX)

    def get_or_compile(
        self,
        description: str,
        identity: Mapping[str, str],
        compile: Callable[[], Kernel],
        load: Callable[[Path, str], Kernel],
        dump: Callable[[Kernel, str], bytes],
    ) -> Kernel:
        """The kernel ``identity`` names: loaded from disk when a process on this machine
        compiled it before, else compiled (one process at a time per kernel) and saved.

        ``load(path, symbol)`` and ``dump(kernel, symbol)`` read and write the backend's object
        format; ``description`` names the kernel in progress lines and warnings.
        """
        if not self.enabled:
            return _compile_with_progress(description, compile, None)
        name = kernel_name(identity)
        path = self.folder / (name + OBJECT_SUFFIX)
        symbol = symbol_prefix(name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._warn_once(path, f"its folder cannot be created ({exc})")
            return _compile_with_progress(description, compile, None)

        def waiting() -> None:
            log_rank_tagged(f"waiting for another process to finish compiling {description}")

        with exclusive_lock(path, on_wait=waiting):  # another rank compiling it finishes first
            kernel = self._load(path, symbol, load, description)
            if kernel is not None:
                return kernel
            kernel = _compile_with_progress(description, compile, path)
            self._store(path, symbol, kernel, dump, description)
        return kernel

    def _load(
        self,
        path: Path,
        symbol: str,
        load: Callable[[Path, str], Kernel],
        description: str,
    ) -> Kernel | None:
        if not path.exists():
            return None
        try:
            return load(path, symbol)
        except Exception as exc:  # a damaged or incompatible object: compile it again
            self._warn_once(
                path,
                f"loading {description} from it failed ({type(exc).__name__}: {exc}); it is "
                "compiled again and the file replaced",
            )
            return None

    def _store(
        self,
        path: Path,
        symbol: str,
        kernel: Kernel,
        dump: Callable[[Kernel, str], bytes],
        description: str,
    ) -> None:
        try:
            atomic_write_bytes(path, dump(kernel, symbol))
        except Exception as exc:  # the kernel is compiled and runs; only the next process pays
            self._warn_once(path, f"saving {description} failed ({type(exc).__name__}: {exc})")

    def _warn_once(self, path: Path, problem: str) -> None:
        if str(path) in self._warned:
            return
        self._warned.add(str(path))
        message = (
            f"dmuon compiled-kernel cache {path}: {problem}. Set {CACHE_DIR_ENV} to a writable "
            f"folder, or {KERNEL_CACHE_ENV}=0 to compile in every process."
        )
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _compile_with_progress(
    description: str, compile: Callable[[], Kernel], path: Path | None
) -> Kernel:
    """``compile()`` between two rank-tagged lines, so a long compile never looks like a hang."""
    where = f"; saved to {path.parent} for later processes" if path is not None else ""
    log_rank_tagged(f"compiling {description} (first use on this machine{where})")
    start = time.perf_counter()
    kernel = compile()
    log_rank_tagged(f"compiled {description} in {time.perf_counter() - start:.1f} s")
    return kernel


# The libraries' own caches of compiled kernels, by default in /tmp (which many machines wipe at
# reboot); dmuon points them next to its own, each in its folder:
# - nvidia-cutlass-dsl's cache of compiled modules (what quack's kernels and ours compile
#   through); the library reads the variable when it compiles.
# - quack-kernels' cache of its compiled kernels (0.5: default /tmp/<user>/quack_cache). quack
#   reads the variable once, when ``quack.cache`` is first imported (``import quack`` does), so
#   it must be set before the first ``import quack`` of the process. quack's autotuner (off
#   unless QUACK_CACHE_AUTOTUNING=1) reads the same variable at each tuning.
CUTLASS_DSL_CACHE_ENV = "CUTE_DSL_CACHE_DIR"
CUTLASS_DSL_FOLDER = "cutlass-dsl"
QUACK_CACHE_ENV = "QUACK_CACHE_DIR"
QUACK_FOLDER = "quack"
_SHARED_COMPILE_CACHES = (
    (CUTLASS_DSL_CACHE_ENV, CUTLASS_DSL_FOLDER),
    (QUACK_CACHE_ENV, QUACK_FOLDER),
)


def share_compile_caches() -> None:
    """Point nvidia-cutlass-dsl's file cache at ``<DMUON_CACHE_DIR>/cutlass-dsl`` and
    quack-kernels' at ``<DMUON_CACHE_DIR>/quack``, each unless the user chose a folder
    (``CUTE_DSL_CACHE_DIR``, ``QUACK_CACHE_DIR``); neither when dmuon's kernel cache is off
    (``DMUON_KERNEL_CACHE=0``). The backends call it before they import cutlass or quack."""
    if not env_flag(KERNEL_CACHE_ENV, default=True):
        return
    for variable, folder in _SHARED_COMPILE_CACHES:
        if not os.environ.get(variable):
            os.environ[variable] = str(default_cache_dir() / folder)


_default_cache: CompiledKernelCache | None = None


def default_kernel_cache() -> CompiledKernelCache:
    """The process-wide cache the backends use (folder from ``DMUON_CACHE_DIR``)."""
    global _default_cache
    if _default_cache is None:
        _default_cache = CompiledKernelCache()
    return _default_cache
