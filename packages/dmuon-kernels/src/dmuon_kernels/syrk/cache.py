"""The persistent SYRK autotune cache: one readable JSON file of verdicts per GPU model.

Owns the verdict record (``Verdict``) and the file format, where the file lives
(``DMUON_CACHE_DIR``, default ``~/.cache/dmuon``), validation of what is read back, and safe
concurrent writes. It must not time or run kernels, and it must not import torch: it is plain
standard library so that any process (and the tests' writer processes) can load it cheaply.

The file (format version 1)::

    {"format": "dmuon-syrk-autotune", "format_version": 1, "gpu": "NVIDIA H200 (SM90)",
     "verdicts": {"<key: problem, candidate, versions>": {"backend": "cute", "candidate": "cute",
       "reason": "...", "op": "syrk", "shape": [4096, 4096], "batch": 0, "dtype": "float16",
       "with_c": false, "recorded": "2026-11-29T10:00:00+00:00", "candidate_error": 0.0011,
       "cublas_error": 0.0011, "candidate_ms": 0.12, "cublas_ms": 0.2}, ...}}

The four measurements are absent when they were not taken (a candidate that failed the
cross-check has errors but no timings).

Safety rules, each one tested:

- The file is JSON and only JSON: nothing read back is unpickled, imported or executed.
- Writes are atomic: the merged content goes to a temporary file in the same folder, is flushed
  to disk, then ``os.replace``-d over the old file, so a reader sees the old or the new file,
  never half of one.
- Writers merge: each write re-reads the file under an advisory lock (``flock`` where the OS has
  it) and adds its verdicts to what is there, so eight ranks writing at once lose nothing.
- A corrupt file, or one written by another program, another format version or for another GPU
  model, is ignored and replaced by the next write. Whatever is wrong with a file (it cannot be
  read, is not ours, cannot be written), a process warns about it ONCE: the first problem found
  is the one reported, later ones about the same file stay silent.
- Verdict keys include the library versions, so an upgrade makes old verdicts unreachable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
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

# The cache files this process has warned about (one warning per file, whatever the problem).
_warned_paths: set[str] = set()


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """One candidate's outcome on one problem: who runs the problem, why, and what was measured.

    ``backend`` is the candidate when it passed the cross-check against cuBLAS and won the
    timing, else "cublas". The errors are relative to an fp32 product of the same inputs; the
    timings are medians of an interleaved GPU-only run (``syrk.timing``). A measurement that was
    not taken is None (and absent from the file).
    """

    backend: str
    candidate: str
    reason: str
    op: str  # "syrk", "symmetric_product" or "matmul"
    shape: tuple[int, ...]  # (M, K), or (M, K, N) for matmul
    batch: int  # 0: unbatched
    dtype: str  # "float16", "bfloat16"
    with_c: bool
    recorded: str  # UTC, ISO 8601
    candidate_error: float | None = None
    cublas_error: float | None = None
    candidate_ms: float | None = None
    cublas_ms: float | None = None

    @property
    def won(self) -> bool:
        """Whether the candidate runs the problem (else cuBLAS does)."""
        return self.backend == self.candidate

    @property
    def speedup(self) -> float:
        """cuBLAS time over the candidate's, from the same interleaved run; 0 when not timed."""
        if self.candidate_ms is None or self.cublas_ms is None or self.candidate_ms <= 0:
            return 0.0
        return self.cublas_ms / self.candidate_ms

    def to_json(self) -> dict[str, object]:
        """The verdict as a JSON object: the fields in order, measurements not taken left out."""
        document: dict[str, object] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                document[field.name] = list(value) if field.name == "shape" else value
        return document

    @classmethod
    def from_json(cls, document: object) -> Verdict:
        """The verdict a JSON object describes; ValueError naming the first problem. Keys this
        version does not know are ignored."""
        if not isinstance(document, dict):
            raise ValueError(f"it is a {type(document).__name__}, not an object")
        for name, (is_valid, wanted) in _REQUIRED_FIELDS.items():
            if not is_valid(document.get(name)):
                raise ValueError(f"its {name!r} is {document.get(name)!r}, not {wanted}")
        for name in _MEASUREMENTS:
            value = document.get(name)
            if value is not None and not _is_number(value):
                raise ValueError(f"its {name!r} is {value!r}, not a number")
        verdict = cls(
            backend=document["backend"],
            candidate=document["candidate"],
            reason=document["reason"],
            op=document["op"],
            shape=tuple(document["shape"]),
            batch=document["batch"],
            dtype=document["dtype"],
            with_c=document["with_c"],
            recorded=document["recorded"],
            candidate_error=document.get("candidate_error"),
            cublas_error=document.get("cublas_error"),
            candidate_ms=document.get("candidate_ms"),
            cublas_ms=document.get("cublas_ms"),
        )
        if verdict.won and (verdict.candidate_ms is None or verdict.cublas_ms is None):
            raise ValueError(f"it names {verdict.backend!r} the winner without both timings")
        return verdict


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_name(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _is_shape(value: object) -> bool:
    return isinstance(value, list) and len(value) in (2, 3) and all(map(_is_count, value))


# Field -> (check, what the check wants) for the fields every verdict has.
_REQUIRED_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "backend": (_is_name, "a backend name"),
    "candidate": (_is_name, "a backend name"),
    "reason": (lambda value: isinstance(value, str), "a string"),
    "op": (_is_name, "an operation name"),
    "shape": (_is_shape, "a list of 2 or 3 sizes"),
    "batch": (_is_count, "a count"),
    "dtype": (_is_name, "a dtype name"),
    "with_c": (lambda value: isinstance(value, bool), "true or false"),
    "recorded": (lambda value: isinstance(value, str), "a time stamp"),
}
_MEASUREMENTS = ("candidate_error", "cublas_error", "candidate_ms", "cublas_ms")


def default_cache_dir() -> Path:
    """``$DMUON_CACHE_DIR`` when set and non-empty, else ``~/.cache/dmuon``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def cache_file_name(gpu_model: str) -> str:
    """``syrk-autotune-nvidia-h200.json`` for ``"NVIDIA H200"``: one file per GPU model."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu_model.lower()).strip("-") or "unknown-gpu"
    return f"syrk-autotune-{slug}.json"


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
        self._verdicts[key] = verdict
        if persist:
            self._merge_into_disk({key: verdict})

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
        except RecursionError:  # json's C decoder recurses once per nested bracket
            self._warn_invalid(path, "it nests JSON arrays or objects too deeply to decode")
            return {}
        verdicts = self._parse(document)
        if isinstance(verdicts, str):
            self._warn_invalid(path, verdicts)
            return {}
        return verdicts

    def _parse(self, document: object) -> dict[str, Verdict] | str:
        """The verdicts of a decoded file, or why the file is not one of ours for this GPU."""
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
        entries = document.get("verdicts")
        if not isinstance(entries, dict):
            return "its 'verdicts' entry is not an object"
        verdicts = {}
        for key, entry in entries.items():
            try:
                verdicts[key] = Verdict.from_json(entry)
            except ValueError as exc:
                return f"verdict {key!r} is not a verdict: {exc}"
        return verdicts

    def _warn_invalid(self, path: Path, problem: str) -> None:
        _warn_once(
            path,
            f"dmuon SYRK autotune cache {path} is ignored because {problem}. Shapes will be "
            f"re-tuned and the file rewritten where it can be; delete it (or set "
            f"{CACHE_DIR_ENV} to another folder) to silence this warning.",
        )

    def _merge_into_disk(self, new_verdicts: Mapping[str, Verdict]) -> None:
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with exclusive_lock(path):
                merged = self._read_disk()
                merged.update(new_verdicts)
                document = {
                    "format": CACHE_FORMAT,
                    "format_version": CACHE_FORMAT_VERSION,
                    "gpu": self.gpu_model,
                    "verdicts": {key: merged[key].to_json() for key in sorted(merged)},
                }
                atomic_write_bytes(path, (json.dumps(document, indent=1) + "\n").encode())
        except OSError as exc:
            # A read-only home or a full disk must not stop training: the verdict stays in memory.
            _warn_once(
                path,
                f"dmuon SYRK autotune cache {path} could not be written ({exc}); verdicts stay "
                f"in memory for this process. Set {CACHE_DIR_ENV} to a writable folder.",
            )


def _warn_once(path: Path, message: str) -> None:
    """Warn ``message`` unless this process already warned about ``path``: one file with
    something wrong (unreadable, foreign, unwritable: often all at once, as for a folder in its
    place) is one problem, reported once."""
    if str(path) in _warned_paths:
        return
    _warned_paths.add(str(path))
    warnings.warn(message, RuntimeWarning, stacklevel=4)


@contextlib.contextmanager
def exclusive_lock(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an advisory lock on ``<path>.lock`` so concurrent read-merge-writes (or compiles of
    one kernel) serialise across processes; released when the holder exits, even by a crash.
    ``on_wait`` is called once before blocking when another process holds the lock."""
    if fcntl is None:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a+b") as lock_file:
        try:
            try:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        except OSError:  # a file system without flock: the atomic replace still protects readers
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename over: readers
    see the old file or the new one, never part of one."""
    descriptor, temporary = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
