"""The persistent SYRK autotune cache: one readable JSON file of verdicts per GPU model.

Owns the file format, where the file lives (``DMUON_CACHE_DIR``, default ``~/.cache/dmuon``),
validation of what is read back, and safe concurrent writes. It must not time or run kernels,
and it must not import torch: it is plain standard library so that any process (and the tests'
writer processes) can load it cheaply.

Safety rules, each one tested:

- The file is JSON and only JSON: nothing read back is unpickled, imported or executed.
- Writes are atomic: the merged content goes to a temporary file in the same folder, is flushed
  to disk, then ``os.replace``-d over the old file, so a reader sees the old or the new file,
  never half of one.
- Writers merge: each write re-reads the file under an advisory lock (``flock`` where the OS has
  it) and adds its verdicts to what is there, so eight ranks writing at once lose nothing.
- A corrupt file, or one written by another program, another format version or for another GPU
  model, is ignored with ONE warning per cache object and replaced by the next write.
- Verdict keys include the library versions, so an upgrade makes old verdicts unreachable.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

try:  # POSIX only; elsewhere the atomic replace alone still prevents corrupt files
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

CACHE_DIR_ENV = "DMUON_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/dmuon"

# What identifies our files. Bump CACHE_FORMAT_VERSION when the layout of a verdict changes.
CACHE_FORMAT = "dmuon-syrk-autotune"
CACHE_FORMAT_VERSION = 1

Verdict = dict[str, object]


def default_cache_dir() -> Path:
    """``$DMUON_CACHE_DIR`` when set and non-empty, else ``~/.cache/dmuon``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def cache_file_name(gpu_model: str) -> str:
    """``syrk-autotune-nvidia-h200.json`` for ``"NVIDIA H200"``: one file per GPU model."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu_model.lower()).strip("-") or "unknown-gpu"
    return f"syrk-autotune-{slug}.json"


def _is_valid_verdict(verdict: object) -> bool:
    return (
        isinstance(verdict, dict)
        and isinstance(verdict.get("backend"), str)
        and bool(verdict["backend"])
    )


class VerdictCache:
    """The verdicts of one GPU model, in memory and in ``<cache_dir>/<cache_file_name(gpu)>``.

    ``get`` serves from memory and reads the file once on first use; ``put`` records in memory
    and merges into the file (``persist=False`` keeps a verdict in memory only, for outcomes that
    should be retried by the next process, such as running out of memory while tuning).
    """

    def __init__(self, gpu_model: str, cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.gpu_model = gpu_model
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self._verdicts: dict[str, Verdict] = {}
        self._loaded_from_disk = False
        self._warned_invalid_file = False

    @property
    def path(self) -> Path:
        folder = self.cache_dir if self.cache_dir is not None else default_cache_dir()
        return folder / cache_file_name(self.gpu_model)

    def get(self, key: str) -> Verdict | None:
        if not self._loaded_from_disk:
            self._loaded_from_disk = True
            for disk_key, verdict in self._read_disk().items():
                self._verdicts.setdefault(disk_key, verdict)
        return self._verdicts.get(key)

    def put(self, key: str, verdict: Verdict, *, persist: bool = True) -> None:
        self._verdicts[key] = dict(verdict)
        if persist:
            self._merge_into_disk({key: self._verdicts[key]})

    def keys(self) -> list[str]:
        return list(self._verdicts)

    # -- disk -------------------------------------------------------------------------------------

    def _read_disk(self) -> dict[str, Verdict]:
        """The file's verdicts, or {} when it is missing, unreadable, corrupt or foreign."""
        path = self.path
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # nothing cached there yet
            return {}
        except OSError as exc:
            self._warn_invalid(path, f"it cannot be read ({exc})")
            return {}
        try:
            document = json.loads(raw.decode("utf-8"))
        except ValueError as exc:  # includes UnicodeDecodeError
            self._warn_invalid(path, f"it is not valid JSON ({exc})")
            return {}
        problem = self._document_problem(document)
        if problem is not None:
            self._warn_invalid(path, problem)
            return {}
        return dict(document["verdicts"])

    def _document_problem(self, document: object) -> str | None:
        if not isinstance(document, dict):
            return f"its top level is a {type(document).__name__}, not an object"
        if document.get("format") != CACHE_FORMAT:
            return f"its format is {document.get('format')!r}, not {CACHE_FORMAT!r}"
        if document.get("format_version") != CACHE_FORMAT_VERSION:
            return (
                f"its format_version is {document.get('format_version')!r}, "
                f"this dmuon-kernels reads {CACHE_FORMAT_VERSION}"
            )
        if document.get("gpu") != self.gpu_model:
            return f"it was written for GPU {document.get('gpu')!r}, not {self.gpu_model!r}"
        verdicts = document.get("verdicts")
        if not isinstance(verdicts, dict):
            return "its 'verdicts' entry is not an object"
        bad = [key for key, verdict in verdicts.items() if not _is_valid_verdict(verdict)]
        if bad:
            return f"{len(bad)} verdict(s) have no backend name, e.g. {bad[0]!r}"
        return None

    def _warn_invalid(self, path: Path, problem: str) -> None:
        if self._warned_invalid_file:
            return
        self._warned_invalid_file = True
        warnings.warn(
            f"dmuon SYRK autotune cache {path} is ignored because {problem}. Shapes will be "
            f"re-tuned and the file rewritten; delete it (or set {CACHE_DIR_ENV} to another "
            "folder) to silence this warning.",
            RuntimeWarning,
            stacklevel=3,
        )

    def _merge_into_disk(self, new_verdicts: Mapping[str, Verdict]) -> None:
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _exclusive_lock(path):
                merged = self._read_disk()
                merged.update(new_verdicts)
                document = {
                    "format": CACHE_FORMAT,
                    "format_version": CACHE_FORMAT_VERSION,
                    "gpu": self.gpu_model,
                    "verdicts": dict(sorted(merged.items())),
                }
                _atomic_write_json(path, document)
        except OSError as exc:
            # A read-only home or a full disk must not stop training: the verdict stays in memory.
            warnings.warn(
                f"dmuon SYRK autotune cache {path} could not be written ({exc}); verdicts stay "
                f"in memory for this process. Set {CACHE_DIR_ENV} to a writable folder.",
                RuntimeWarning,
                stacklevel=3,
            )


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an advisory lock on ``<path>.lock`` so concurrent read-merge-writes serialise."""
    if fcntl is None:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a+b") as lock_file:
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        except OSError:  # a file system without flock: the atomic replace still protects readers
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _atomic_write_json(path: Path, document: object) -> None:
    """Write ``document`` to a temporary file beside ``path``, fsync it, then rename over."""
    descriptor, temporary = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=1, sort_keys=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
