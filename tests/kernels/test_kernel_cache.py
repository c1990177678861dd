"""Compiled kernels on disk (``syrk.kernel_cache``): a fresh process loads instead of compiling,
any change of identity compiles again, a damaged file is replaced after one warning, concurrent
processes compile each kernel once, and a compile is announced by rank-tagged lines.

The "kernels" here are byte strings with a header, so everything runs on the CPU; the CuTe
backend's real objects are tested in tests/gpu/test_cold_start_gpu.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

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
