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

[Note: whose objects are loaded]

Loading an object runs its host code, and ``DMUON_CACHE_DIR`` is often pointed at a folder that
a cluster shares. So, as ssh does with its keys, an object is loaded only when the folder it
lies in and the file itself belong to this user (the effective uid) and neither is writable by
its group or by others (``trust_problem``):

- a folder that fails this (a shared, group-writable one; another user's) is not used at all:
  one warning names it and the fix, and kernels are compiled in the process, nothing loaded
  from or saved there;
- a file that fails it (another user's, or group-writable, in a folder that passes) is not
  loaded: one warning, then the kernel is compiled and the file replaced by this user's own;
- dmuon creates the folder with mode 0700, and its files (``atomic_write_bytes``) with 0600.

The libraries' own caches load objects too, so ``share_compile_caches`` points them into
``DMUON_CACHE_DIR`` only where their folder passes the same check (each created with mode
0700), and leaves them at the library's default otherwise. On systems without POSIX owners
(Windows) the check is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from dmuon_kernels._env import KERNEL_CACHE_ENV, env_flag
from dmuon_kernels._log import COMPILE, LOAD, WAIT, log_rank_tagged, record_phase, timed_phase
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
# Folders dmuon creates for compiled objects: only their owner may enter them.
PRIVATE_FOLDER_MODE = 0o700
# Group and others may not write where objects are loaded from (see [Note: whose objects ...]).
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_WRITERS = {
    stat.S_IWGRP: "its group",
    stat.S_IWOTH: "others",
    _WRITABLE_BY_OTHERS: "its group and others",
}

Kernel = TypeVar("Kernel")


def kernel_name(identity: Mapping[str, str]) -> str:
    """The file stem of a kernel: SHA-256 of its identity (sorted keys), in hex."""
    text = json.dumps({str(k): str(v) for k, v in identity.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def symbol_prefix(name: str) -> str:
    """The C symbol prefix under which the kernel named ``name`` is exported."""
    return "dmuon_" + name[:SYMBOL_DIGITS]


def trust_problem(path: Path) -> str | None:
    """Why objects under (or at) ``path`` must not be loaded, or None when ``path`` belongs to
    this user and neither its group nor others can write it (see [Note: whose objects are
    loaded]). None where the system has no POSIX owners. Symbolic links are followed: what
    counts is what a load would open."""
    if not hasattr(os, "geteuid"):
        return None
    try:
        status = os.stat(path)
    except OSError as exc:
        return f"its owner cannot be read ({exc})"
    user = os.geteuid()
    if status.st_uid != user:
        return f"it belongs to uid {status.st_uid}, not to this user (uid {user})"
    writable = status.st_mode & _WRITABLE_BY_OTHERS
    if writable:
        return f"{_WRITERS[writable]} can write it (mode {stat.S_IMODE(status.st_mode):04o})"
    return None


def make_private_folder(folder: Path) -> None:
    """Create ``folder`` (and missing parents) for compiled objects; the folder itself gets mode
    0700. An existing folder is left as it is (``trust_problem`` judges it)."""
    folder.mkdir(mode=PRIVATE_FOLDER_MODE, parents=True, exist_ok=True)


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
        folder = self.folder
        path = folder / (name + OBJECT_SUFFIX)
        symbol = symbol_prefix(name)
        try:
            make_private_folder(folder)
        except OSError as exc:
            self._warn_once(path, f"its folder cannot be created ({exc})")
            return _compile_with_progress(description, compile, None)
        problem = trust_problem(folder)
        if problem is not None:
            self._warn_untrusted_folder(folder, problem)
            return _compile_with_progress(description, compile, None)

        waited_since: list[float] = []

        def waiting() -> None:
            log_rank_tagged(f"waiting for another process to finish compiling {description}")
            waited_since.append(time.perf_counter())

        with exclusive_lock(path, on_wait=waiting):  # another rank compiling it finishes first
            if waited_since:
                record_phase(WAIT, description, waited_since[0])
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
        problem = trust_problem(path)
        if problem is not None:
            self._warn_once(
                path,
                f"{problem}, so it is not loaded (loading an object runs its code); "
                f"{description} is compiled again and the file replaced by this user's own",
            )
            return None
        try:
            with timed_phase(LOAD, description):
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

    def _warn_untrusted_folder(self, folder: Path, problem: str) -> None:
        if str(folder) in self._warned:
            return
        self._warned.add(str(folder))
        warnings.warn(untrusted_folder_message(folder, problem), RuntimeWarning, stacklevel=4)


def untrusted_folder_message(folder: Path, problem: str, *, library: str | None = None) -> str:
    """The warning for a cache folder that fails ``trust_problem``: what is wrong, what dmuon
    does instead, and the fix."""
    instead = (
        f"so {library} keeps its own compile cache at its default location, not here"
        if library is not None
        else "so no compiled kernel is loaded from or saved to it: kernels are compiled in this "
        "process instead"
    )
    return (
        f"dmuon compiled-kernel cache {folder}: {problem}. Loading a compiled kernel runs its "
        f"code, so dmuon loads kernels only from a folder that belongs to you and that no one "
        f"else can write, {instead}. Fix: make the folder yours and private (`chmod 700 "
        f"{folder}`; `chown` it to yourself if it is another user's), or set {CACHE_DIR_ENV} to "
        f"a folder of your own (the default is ~/.cache/dmuon); {KERNEL_CACHE_ENV}=0 compiles "
        "in every process and silences this warning."
    )


def _compile_with_progress(
    description: str, compile: Callable[[], Kernel], path: Path | None
) -> Kernel:
    """``compile()`` between two rank-tagged lines, so a long compile never looks like a hang."""
    where = f"; saved to {path.parent} for later processes" if path is not None else ""
    log_rank_tagged(f"compiling {description} (first use on this machine{where})")
    with timed_phase(COMPILE, description) as phase:
        kernel = compile()
    log_rank_tagged(f"compiled {description} in {phase.seconds:.1f} s")
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


_LIBRARY_NAMES = {CUTLASS_DSL_CACHE_ENV: "nvidia-cutlass-dsl", QUACK_CACHE_ENV: "quack-kernels"}
_warned_library_folders: set[str] = set()


def share_compile_caches() -> None:
    """Point nvidia-cutlass-dsl's file cache at ``<DMUON_CACHE_DIR>/cutlass-dsl`` and
    quack-kernels' at ``<DMUON_CACHE_DIR>/quack``, each unless the user chose a folder
    (``CUTE_DSL_CACHE_DIR``, ``QUACK_CACHE_DIR``); neither when dmuon's kernel cache is off
    (``DMUON_KERNEL_CACHE=0``). Each folder is created with mode 0700 and used only when it
    passes ``trust_problem`` (the libraries load objects from it too); otherwise the library
    keeps its default, after one warning naming the folder and the fix. The backends call it
    before they import cutlass or quack."""
    if not env_flag(KERNEL_CACHE_ENV, default=True):
        return
    for variable, name in _SHARED_COMPILE_CACHES:
        if os.environ.get(variable):
            continue
        folder = default_cache_dir() / name
        try:
            make_private_folder(folder)
        except OSError as exc:
            problem: str | None = f"it cannot be created ({exc})"
        else:
            problem = trust_problem(folder)
        if problem is None:
            os.environ[variable] = str(folder)
        elif str(folder) not in _warned_library_folders:
            _warned_library_folders.add(str(folder))
            message = untrusted_folder_message(folder, problem, library=_LIBRARY_NAMES[variable])
            warnings.warn(message, RuntimeWarning, stacklevel=2)


_default_cache: CompiledKernelCache | None = None


def default_kernel_cache() -> CompiledKernelCache:
    """The process-wide cache the backends use (folder from ``DMUON_CACHE_DIR``)."""
    global _default_cache
    if _default_cache is None:
        _default_cache = CompiledKernelCache()
    return _default_cache
