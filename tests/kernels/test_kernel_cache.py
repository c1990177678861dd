"""Compiled kernels on disk (``syrk.kernel_cache``): a fresh process loads instead of compiling,
any change of identity compiles again, a damaged file is replaced after one warning, concurrent
processes compile each kernel once, a compile is announced by rank-tagged lines, and objects are
loaded only from a folder and files that belong to the user and that no one else can write.

The "kernels" here are byte strings with a header, so everything runs on the CPU; the CuTe
backend's real objects are tested in tests/gpu/test_cold_start_gpu.py."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from dmuon_kernels import _log
from dmuon_kernels.syrk import kernel_cache
from dmuon_kernels.syrk.kernel_cache import CompiledKernelCache, kernel_name, symbol_prefix

SOURCE = str(Path(kernel_cache.__file__).resolve().parents[1])  # .../dmuon_kernels
IDENTITY = {"tiles": "Sm90TileConfig(128x128)", "dtype": "float16", "library": "1.0"}
HEADER = b"KERNEL:"


class Compiler:
    """Compiles a byte-string kernel and counts how often; loads check the header and symbol."""

    def __init__(self, body: bytes = b"syrk") -> None:
        self.body = body
        self.compiles = 0

    def compile(self) -> bytes:
        self.compiles += 1
        return HEADER + self.body

    @staticmethod
    def dump(kernel: bytes, symbol: str) -> bytes:
        return symbol.encode() + b"\n" + kernel

    @staticmethod
    def load(path: Path, symbol: str) -> bytes:
        stored_symbol, _, kernel = path.read_bytes().partition(b"\n")
        if stored_symbol != symbol.encode() or not kernel.startswith(HEADER):
            raise ValueError("not a kernel object")
        return kernel

    def get(self, cache: CompiledKernelCache, identity=IDENTITY) -> bytes:
        return cache.get_or_compile("test kernel", identity, self.compile, self.load, self.dump)


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch):
    monkeypatch.delenv("DMUON_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")


def test_a_kernel_compiled_once_is_loaded_by_a_fresh_process(tmp_path):
    first = Compiler()
    assert first.get(CompiledKernelCache(tmp_path)) == HEADER + b"syrk"
    later = Compiler()
    assert later.get(CompiledKernelCache(tmp_path)) == HEADER + b"syrk"  # a new cache: new memory
    assert (first.compiles, later.compiles) == (1, 0)
    (stored,) = tmp_path.glob("*.o")
    assert stored.name == kernel_name(IDENTITY) + ".o"
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_any_change_of_identity_compiles_again(tmp_path):
    Compiler().get(CompiledKernelCache(tmp_path))
    upgraded = Compiler(b"syrk v2")
    kernel = upgraded.get(CompiledKernelCache(tmp_path), {**IDENTITY, "library": "2.0"})
    assert kernel == HEADER + b"syrk v2" and upgraded.compiles == 1
    assert len(list(tmp_path.glob("*.o"))) == 2  # the old object is left, never read again


def test_the_name_hashes_the_whole_identity_in_any_order():
    assert kernel_name(IDENTITY) == kernel_name(dict(reversed(list(IDENTITY.items()))))
    assert kernel_name(IDENTITY) != kernel_name({**IDENTITY, "dtype": "bfloat16"})
    assert symbol_prefix(kernel_name(IDENTITY)).isidentifier()


@pytest.mark.parametrize("content", [b"", b"garbage", b"dmuon_x\nKERNEL:half"], ids=str)
def test_a_damaged_object_is_compiled_again_and_replaced_after_one_warning(tmp_path, content):
    cache = CompiledKernelCache(tmp_path)
    cache.path(IDENTITY).write_bytes(content)
    compiler = Compiler()
    with pytest.warns(RuntimeWarning, match=r"loading test kernel from it failed") as caught:
        assert compiler.get(cache) == HEADER + b"syrk"
    assert len(caught) == 1 and "compiled again and the file replaced" in str(caught[0].message)
    assert compiler.compiles == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Compiler().get(CompiledKernelCache(tmp_path)) == HEADER + b"syrk"


def test_dmuon_kernel_cache_0_compiles_every_time_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_KERNEL_CACHE", "0")
    compiler = Compiler()
    compiler.get(CompiledKernelCache(tmp_path))
    compiler.get(CompiledKernelCache(tmp_path))
    assert compiler.compiles == 2
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_folder_still_gives_the_kernel_with_one_warning(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    compiler = Compiler()
    with pytest.warns(RuntimeWarning, match=r"its folder cannot be created"):
        assert compiler.get(CompiledKernelCache(blocker / "kernels")) == HEADER + b"syrk"


def test_the_folder_follows_dmuon_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path))
    assert CompiledKernelCache().folder == tmp_path / "kernels"


def test_a_compile_is_announced_with_rank_tagged_lines(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    Compiler().get(CompiledKernelCache(tmp_path))
    started, finished = [r.getMessage() for r in caplog.records]
    assert started == (
        "[DMuon][rank=0/2] compiling test kernel (first use on this machine; saved to "
        f"{tmp_path} for later processes)"
    )
    assert finished.startswith("[DMuon][rank=0/2] compiled test kernel in ")
    caplog.clear()
    Compiler().get(CompiledKernelCache(tmp_path))  # loaded: nothing to announce
    assert caplog.records == []


# Each process asks for the same kernel at once; the compile sleeps so the others must wait.
RANK_SCRIPT = textwrap.dedent(
    """
    import sys, time, types
    from pathlib import Path
    # the packages as bare namespaces: their __init__ (and torch) are not needed here
    for name, folder in (("dmuon_kernels", sys.argv[3]), ("dmuon_kernels.syrk", sys.argv[3] + "/syrk")):
        package = sys.modules[name] = types.ModuleType(name)
        package.__path__ = [folder]
    from dmuon_kernels.syrk.kernel_cache import CompiledKernelCache
    folder, rank = Path(sys.argv[1]), sys.argv[2]
    def compile():
        (folder / f"compiled-by-{rank}").touch()
        time.sleep(0.5)
        return b"KERNEL:shared"
    def dump(kernel, symbol):
        return symbol.encode() + b"\\n" + kernel
    def load(path, symbol):
        stored, _, kernel = path.read_bytes().partition(b"\\n")
        assert stored == symbol.encode() and kernel == b"KERNEL:shared", kernel
        return kernel
    kernel = CompiledKernelCache(folder / "kernels").get_or_compile(
        "shared kernel", {"k": "v"}, compile, load, dump)
    assert kernel == b"KERNEL:shared"
    """
)


def test_concurrent_processes_compile_each_kernel_once_and_the_others_load_it(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), str(rank), SOURCE],
            env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "4"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(4)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert [p.returncode for p in processes] == [0] * 4, [err for _, err in outputs]
    assert len(list(tmp_path.glob("compiled-by-*"))) == 1
    stderr = "".join(err for _, err in outputs)
    assert stderr.count("] compiling shared kernel") == 1
    assert "waiting for another process to finish compiling shared kernel" in stderr


def test_the_module_knows_no_kernel_library():
    assert "cutlass" not in kernel_cache.__dict__ and "torch" not in kernel_cache.__dict__


@pytest.fixture
def library_cache_variables_unset(tmp_path, monkeypatch):
    """DMUON_CACHE_DIR in ``tmp_path``, the libraries' variables unset, and whatever the test
    sets them to undone afterwards (``delenv`` alone records nothing for an unset variable)."""
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path))
    for variable in ("CUTE_DSL_CACHE_DIR", "QUACK_CACHE_DIR"):
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)


@pytest.mark.parametrize(
    ("variable", "folder"), [("CUTE_DSL_CACHE_DIR", "cutlass-dsl"), ("QUACK_CACHE_DIR", "quack")]
)
def test_library_compile_caches_live_next_to_dmuons_unless_the_user_chose(
    variable, folder, tmp_path, monkeypatch, library_cache_variables_unset
):
    kernel_cache.share_compile_caches()
    assert os.environ[variable] == str(tmp_path / folder)
    monkeypatch.setenv(variable, "/elsewhere")
    kernel_cache.share_compile_caches()
    assert os.environ[variable] == "/elsewhere"
    monkeypatch.delenv(variable)
    monkeypatch.setenv("DMUON_KERNEL_CACHE", "0")
    kernel_cache.share_compile_caches()
    assert variable not in os.environ


def test_the_user_choosing_one_library_cache_still_shares_the_other(
    tmp_path, monkeypatch, library_cache_variables_unset
):
    monkeypatch.setenv("CUTE_DSL_CACHE_DIR", "/elsewhere")
    kernel_cache.share_compile_caches()
    assert os.environ["CUTE_DSL_CACHE_DIR"] == "/elsewhere"
    assert os.environ["QUACK_CACHE_DIR"] == str(tmp_path / "quack")


# -- whose objects are loaded (see [Note: whose objects are loaded]) ----------------------------


def test_the_kernels_folder_is_created_private(tmp_path):
    Compiler().get(CompiledKernelCache(tmp_path / "kernels"))
    assert stat.S_IMODE((tmp_path / "kernels").stat().st_mode) == 0o700
    (stored,) = (tmp_path / "kernels").glob("*.o")
    assert stat.S_IMODE(stored.stat().st_mode) & 0o077 == 0


def test_a_group_writable_folder_is_not_used_and_one_warning_names_it_and_the_fix(tmp_path):
    folder = tmp_path / "shared"
    first = Compiler()
    first.get(CompiledKernelCache(folder))  # an object that would load, had the folder stayed
    folder.chmod(0o770)
    cache, compiler = CompiledKernelCache(folder), Compiler()
    with pytest.warns(RuntimeWarning) as caught:
        assert compiler.get(cache) == HEADER + b"syrk"
        assert compiler.get(cache) == HEADER + b"syrk"
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"dmuon compiled-kernel cache {folder}: its group can write it (mode 0770)" in message
    assert f"chmod 700 {folder}" in message and "DMUON_CACHE_DIR" in message
    assert compiler.compiles == 2  # compiled in the process, every time, nothing loaded
    assert len(list(folder.glob("*.o"))) == 1  # and nothing saved there


def test_a_folder_others_can_write_is_named_so(tmp_path):
    folder = tmp_path / "world"
    folder.mkdir(mode=0o700)
    folder.chmod(0o777)
    assert kernel_cache.trust_problem(folder) == "its group and others can write it (mode 0777)"
    folder.chmod(0o702)
    assert kernel_cache.trust_problem(folder) == "others can write it (mode 0702)"
    folder.chmod(0o755)
    assert kernel_cache.trust_problem(folder) is None


def test_a_group_writable_object_is_not_loaded_but_compiled_and_replaced(tmp_path):
    Compiler().get(CompiledKernelCache(tmp_path))
    stored = CompiledKernelCache(tmp_path).path(IDENTITY)
    stored.chmod(0o664)
    compiler = Compiler()
    with pytest.warns(RuntimeWarning, match=r"its group can write it \(mode 0664\), so it is not"):
        assert compiler.get(CompiledKernelCache(tmp_path)) == HEADER + b"syrk"
    assert compiler.compiles == 1
    assert stat.S_IMODE(stored.stat().st_mode) & 0o077 == 0  # replaced by this user's own


can_chown = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a file away needs root"
)


@can_chown
def test_an_object_of_another_owner_is_never_loaded(tmp_path):
    stranger = os.geteuid() + 4321
    cache = CompiledKernelCache(tmp_path)
    stored = cache.path(IDENTITY)
    stored.write_bytes(symbol_prefix(kernel_name(IDENTITY)).encode() + b"\nKERNEL:planted")
    stored.chmod(0o600)
    os.chown(stored, stranger, -1)
    compiler = Compiler()
    with pytest.warns(RuntimeWarning, match=rf"it belongs to uid {stranger}, not to this user"):
        assert compiler.get(cache) == HEADER + b"syrk"  # not the planted kernel
    assert compiler.compiles == 1
    assert stored.stat().st_uid == os.geteuid()


@can_chown
def test_a_folder_of_another_owner_is_not_used(tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, os.geteuid() + 4321, -1)
    compiler = Compiler()
    with pytest.warns(RuntimeWarning, match=r"belongs to uid \d+, not to this user"):
        assert compiler.get(CompiledKernelCache(folder)) == HEADER + b"syrk"
    assert list(folder.iterdir()) == []


def test_library_caches_stay_at_their_defaults_when_the_folder_is_shared(
    tmp_path, monkeypatch, library_cache_variables_unset
):
    for name in ("cutlass-dsl", "quack"):
        (tmp_path / name).mkdir(mode=0o700)
        (tmp_path / name).chmod(0o775)
    monkeypatch.setattr(kernel_cache, "_warned_library_folders", set())
    with pytest.warns(RuntimeWarning) as caught:
        kernel_cache.share_compile_caches()
        kernel_cache.share_compile_caches()  # one warning per folder and process
    assert "CUTE_DSL_CACHE_DIR" not in os.environ and "QUACK_CACHE_DIR" not in os.environ
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    assert "so nvidia-cutlass-dsl keeps its own compile cache at its default" in messages[0]
    assert "so quack-kernels keeps its own compile cache at its default" in messages[1]


def test_library_cache_folders_are_created_private(
    tmp_path, monkeypatch, library_cache_variables_unset
):
    kernel_cache.share_compile_caches()
    for name in ("cutlass-dsl", "quack"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o700


def test_a_compile_and_a_load_are_recorded_as_phases(tmp_path):
    _log.clear_recorded_phases()
    Compiler().get(CompiledKernelCache(tmp_path))
    Compiler().get(CompiledKernelCache(tmp_path))
    phases = [(p.kind, p.what) for p in _log.recorded_phases()]
    assert phases == [("compile", "test kernel"), ("load", "test kernel")]
