"""SYRK autotune verdicts and their JSON cache: concurrency, corruption, invalidation, logging.

Everything here runs on the CPU: the cache is plain standard library, and the autotuner runs its
real cross-check and timing on CPU tensors when given CPU backends (the dispatcher only asks it
on CUDA). The candidates are small backends written here: one exact, one wrong by 1%.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from dmuon_kernels import _log
from dmuon_kernels.syrk import autotune, cublas
from dmuon_kernels.syrk import cache as cache_module
from dmuon_kernels.syrk.autotune import SyrkAutotuner, SyrkProblem
from dmuon_kernels.syrk.cache import (
    CACHE_FORMAT,
    CACHE_FORMAT_VERSION,
    Verdict,
    VerdictCache,
    cache_file_name,
    default_cache_dir,
)

GPU = "Test GPU X1"


def a_verdict(backend: str = "quack", candidate: str = "quack", **fields) -> Verdict:
    """A verdict about a (64, 128) fp16 SYRK; a winner gets timings unless ``fields`` say."""
    if backend == candidate:
        fields = {"candidate_ms": 0.5, "cublas_ms": 1.0, **fields}
    problem = {"op": "syrk", "shape": (64, 128), "batch": 0, "dtype": "float16", "with_c": False}
    return Verdict(
        backend=backend,
        candidate=candidate,
        reason="test",
        recorded="2026-12-01T00:00:00+00:00",
        **{**problem, **fields},
    )


def verdict_json(backend: str = "quack", candidate: str = "quack", **fields) -> dict:
    """``a_verdict(...)`` as the file holds it."""
    return a_verdict(backend, candidate, **fields).to_json()


class ExactBackend:
    """A SYRK backend that rounds the float64 product once: more accurate than cuBLAS."""

    def __init__(self, relative_error: float = 0.0, library_version: str = "1.0") -> None:
        self.relative_error = relative_error
        self.library_version = library_version
        self.calls = 0

    def is_available(self) -> tuple[bool, str]:
        return True, "test backend"

    def versions(self) -> dict[str, str]:
        return {"test-lib": self.library_version}

    def syrk(self, A, C, alpha, beta):
        self.calls += 1
        A64 = A.double()
        out = alpha * (1.0 + self.relative_error) * (A64 @ A64.mT)
        if C is not None:
            out = out + beta * C.double()
        return out.to(A.dtype)

    def matmul(self, A, B, C, alpha, beta):
        return self.symmetric_product(A, B, C, alpha, beta)

    def symmetric_product(self, A, B, C, alpha, beta):
        self.calls += 1
        out = alpha * (1.0 + self.relative_error) * (A.double() @ B.double())
        if C is not None:
            out = out + beta * C.double()
        return out.to(A.dtype)


class SyrkOnlyBackend:
    """A backend that implements ``syrk`` alone, like the CuTe kernel."""

    def __init__(self) -> None:
        self.exact = ExactBackend()

    def is_available(self) -> tuple[bool, str]:
        return True, "test backend"

    def syrk(self, A, C, alpha, beta):
        return self.exact.syrk(A, C, alpha, beta)


def tuner_with(
    tmp_path: Path, candidate: ExactBackend, min_flop: int = 0, **challengers: object
) -> SyrkAutotuner:
    backends = {"cublas": cublas, "exact": candidate, **challengers}
    return SyrkAutotuner(
        cache_dir=tmp_path,
        get_backend=backends.__getitem__,
        challengers=tuple(challengers),
        min_flop=min_flop,
    )


def a_matrix(rows: int = 24, cols: int = 40, dtype=torch.float16, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


def autotune_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "SYRK autotune" in r.getMessage()]


@pytest.fixture(autouse=True)
def _visible_autotune_log(monkeypatch):
    monkeypatch.delenv(autotune.AUTOTUNE_LOG_ENV, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")


# -- the cache file ------------------------------------------------------------------------------


def test_cache_dir_comes_from_dmuon_cache_dir_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("DMUON_CACHE_DIR")
    assert default_cache_dir() == Path("~/.cache/dmuon").expanduser()
    assert cache_file_name("NVIDIA H200 (SM90)") == "syrk-autotune-nvidia-h200-sm90.json"


def test_a_verdict_survives_in_a_readable_json_file(tmp_path):
    VerdictCache(GPU, tmp_path).put("key-a", a_verdict(candidate_error=0.001, cublas_error=0.002))
    document = json.loads((tmp_path / cache_file_name(GPU)).read_text())
    assert document["format"] == CACHE_FORMAT
    assert document["format_version"] == CACHE_FORMAT_VERSION
    assert document["gpu"] == GPU
    assert document["verdicts"] == {
        "key-a": {
            "backend": "quack",
            "candidate": "quack",
            "reason": "test",
            "op": "syrk",
            "shape": [64, 128],
            "batch": 0,
            "dtype": "float16",
            "with_c": False,
            "recorded": "2026-12-01T00:00:00+00:00",
            "candidate_error": 0.001,
            "cublas_error": 0.002,
            "candidate_ms": 0.5,
            "cublas_ms": 1.0,
        }
    }
    restored = VerdictCache(GPU, tmp_path).get("key-a")
    assert restored == a_verdict(candidate_error=0.001, cublas_error=0.002)
    assert restored.won and restored.speedup == 2.0


def test_measurements_not_taken_are_left_out_of_the_file_and_read_back_as_none(tmp_path):
    failed = a_verdict("cublas", "cute", candidate_error=0.5, cublas_error=0.001)
    VerdictCache(GPU, tmp_path).put("k", failed)
    (stored,) = json.loads((tmp_path / cache_file_name(GPU)).read_text())["verdicts"].values()
    assert "candidate_ms" not in stored and "cublas_ms" not in stored
    restored = VerdictCache(GPU, tmp_path).get("k")
    assert restored == failed
    assert (restored.won, restored.candidate_ms, restored.speedup) == (False, None, 0.0)


def test_writers_merge_with_what_is_on_disk(tmp_path):
    first, second = VerdictCache(GPU, tmp_path), VerdictCache(GPU, tmp_path)
    first.put("from-first", a_verdict("quack"))
    second.put("from-second", a_verdict("cublas"))  # second never read the file before
    fresh = VerdictCache(GPU, tmp_path)
    assert fresh.get("from-first") == a_verdict("quack")
    assert fresh.get("from-second") == a_verdict("cublas")


WRITER_SCRIPT = textwrap.dedent(
    """
    import importlib.util, sys, warnings
    warnings.simplefilter("error")  # a corrupt read would warn: make it fail the process
    spec = importlib.util.spec_from_file_location("verdict_cache", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    writer, count, folder = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    verdict = module.Verdict(
        backend="cublas", candidate="quack", reason="w", op="syrk", shape=(8, 8), batch=0,
        dtype="float16", with_c=False, recorded="now",
    )
    for i in range(count):
        module.VerdictCache("Test GPU X1", folder).put(f"w{writer}-k{i}", verdict)
        # read the shared file back while the other writers are replacing it
        reader = module.VerdictCache("Test GPU X1", folder)
        assert reader.get(f"w{writer}-k{i}") == verdict, (writer, i)
    """
)


def test_eight_processes_writing_at_once_lose_nothing_and_never_corrupt_the_file(tmp_path):
    # Real processes (like 8 ranks of one node) load the cache module by path: it needs no torch.
    script = tmp_path / "writer.py"
    script.write_text(WRITER_SCRIPT)
    folder = tmp_path / "cache"
    writers, per_writer = 8, 25
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), cache_module.__file__, str(w), str(per_writer), folder],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(writers)
    ]
    failures = []
    for process in processes:
        _, stderr = process.communicate(timeout=120)
        if process.returncode != 0:
            failures.append(stderr)
    assert failures == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        document = json.loads((folder / cache_file_name(GPU)).read_text())
    expected = {f"w{w}-k{i}" for w in range(writers) for i in range(per_writer)}
    assert set(document["verdicts"]) == expected
    assert [p.name for p in folder.iterdir() if p.suffix == ".tmp"] == []


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not valid JSON"),
        # json's decoder recurses once per bracket: deep nesting raised RecursionError from get()
        ("[" * 100_000 + "]" * 100_000, "nests JSON arrays or objects too deeply to decode"),
        (
            '{"format": "dmuon-syrk-autotune", "verdicts": {"k": '
            + "[" * 100_000
            + "]" * 100_000
            + "}}",
            "nests JSON arrays or objects too deeply to decode",
        ),
        ('["a", "list"]', "top level is a list"),
        (json.dumps({"format": "someone-else", "verdicts": {}}), "format is 'someone-else'"),
        (
            json.dumps({"format": CACHE_FORMAT, "format_version": 99, "gpu": GPU, "verdicts": {}}),
            "format_version is 99",
        ),
        (
            json.dumps(
                {"format": CACHE_FORMAT, "format_version": 1, "gpu": "Other GPU", "verdicts": {}}
            ),
            "written for GPU 'Other GPU'",
        ),
        (
            json.dumps(
                {"format": CACHE_FORMAT, "format_version": 1, "gpu": GPU, "verdicts": {"k": 3}}
            ),
            "verdict 'k' is not a verdict: it is a int, not an object",
        ),
        (
            json.dumps(
                {
                    "format": CACHE_FORMAT,
                    "format_version": 1,
                    "gpu": GPU,
                    "verdicts": {"k": {"backend": "quack", "candidate_ms": 0.5}},
                }
            ),
            "verdict 'k' is not a verdict: its 'candidate' is None, not a backend name",
        ),
        (
            json.dumps(
                {
                    "format": CACHE_FORMAT,
                    "format_version": 1,
                    "gpu": GPU,
                    "verdicts": {"k": verdict_json(shape=(64, "128"))},
                }
            ),
            "its 'shape' is [64, '128'], not a list of 2 or 3 sizes",
        ),
        (
            json.dumps(
                {
                    "format": CACHE_FORMAT,
                    "format_version": 1,
                    "gpu": GPU,
                    "verdicts": {"k": verdict_json(cublas_ms="fast")},
                }
            ),
            "its 'cublas_ms' is 'fast', not a number",
        ),
        (
            json.dumps(
                {
                    "format": CACHE_FORMAT,
                    "format_version": 1,
                    "gpu": GPU,
                    "verdicts": {"k": {**verdict_json(), "candidate_ms": None}},
                }
            ),
            "it names 'quack' the winner without both timings",
        ),
    ],
    ids=[
        "corrupt",
        "deeply-nested",
        "deeply-nested-verdict",
        "not-an-object",
        "foreign",
        "newer-format",
        "other-gpu",
        "bad-verdict",
        "old-untyped-verdict",
        "bad-shape",
        "bad-timing",
        "winner-without-timing",
    ],
)
def test_an_invalid_file_is_ignored_with_one_warning_and_rebuilt(tmp_path, content, problem):
    path = tmp_path / cache_file_name(GPU)
    path.write_text(content)
    cache = VerdictCache(GPU, tmp_path)
    with pytest.warns(RuntimeWarning, match="autotune cache .* is ignored because") as caught:
        assert cache.get("k") is None
        cache.put("k2", a_verdict())  # re-reads the bad file to merge: no second warning
        assert cache.get("k") is None
    assert len(caught) == 1
    assert problem in str(caught[0].message)
    assert "delete it" in str(caught[0].message)
    rebuilt = json.loads(path.read_text())
    assert rebuilt["format"] == CACHE_FORMAT
    assert rebuilt["verdicts"] == {"k2": verdict_json()}


def test_a_folder_in_place_of_the_file_gives_one_warning_for_the_read_and_the_writes(tmp_path):
    path = tmp_path / cache_file_name(GPU)
    path.mkdir()  # cannot be read, and cannot be replaced by a file: one problem
    cache = VerdictCache(GPU, tmp_path)
    with pytest.warns(RuntimeWarning) as caught:
        assert cache.get("k") is None
        cache.put("k", a_verdict())
        cache.put("k2", a_verdict())
    assert len(caught) == 1
    assert "is ignored because it cannot be read" in str(caught[0].message)
    assert cache.get("k") == a_verdict()  # the verdicts stay in memory


def test_a_corrupt_file_warns_once_per_process_whatever_reads_it(tmp_path):
    (tmp_path / cache_file_name(GPU)).write_text("{not json")
    with pytest.warns(RuntimeWarning, match="not valid JSON") as caught:
        for _ in range(3):  # several tuners (each with its cache object) on the same file
            assert VerdictCache(GPU, tmp_path).get("k") is None
    assert len(caught) == 1


def test_an_unwritable_folder_warns_once_for_all_its_verdicts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = VerdictCache(GPU, blocker / "sub")
    with pytest.warns(RuntimeWarning, match="could not be written") as caught:
        for key in ("k1", "k2", "k3"):
            cache.put(key, a_verdict())
    assert len(caught) == 1


class _WritesMarkerWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_in_place_of_the_cache_is_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    path = tmp_path / cache_file_name(GPU)
    path.write_bytes(pickle.dumps(_WritesMarkerWhenUnpickled(marker)))
    with pytest.warns(RuntimeWarning, match="not valid JSON"):
        assert VerdictCache(GPU, tmp_path).get("anything") is None
    assert not marker.exists()


def test_an_unwritable_cache_folder_keeps_verdicts_in_memory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = VerdictCache(GPU, blocker / "sub")  # cannot create a folder under a file
    with pytest.warns(RuntimeWarning, match="could not be written"):
        cache.put("k", a_verdict())
    assert cache.get("k") == a_verdict()


# -- the autotuner -------------------------------------------------------------------------------


def test_a_wrong_candidate_fails_the_cross_check_and_cublas_is_kept(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    wrong = ExactBackend(relative_error=0.01)
    assert tuner_with(tmp_path, wrong).choose("exact", a_matrix()) == "cublas"
    (verdict,) = json.loads((tmp_path / "syrk-autotune-cpu.json").read_text())["verdicts"].values()
    assert verdict["backend"] == "cublas"
    assert "failed the cross-check" in verdict["reason"]
    assert verdict["candidate_error"] > autotune.ERROR_RATIO_LIMIT * verdict["cublas_error"]
    assert any("backend=cublas" in line and "verdict" in line for line in autotune_lines(caplog))


def test_a_correct_candidate_passes_and_the_verdict_records_both_timings(tmp_path):
    exact = ExactBackend()
    chosen = tuner_with(tmp_path, exact).choose("exact", a_matrix())
    (verdict,) = json.loads((tmp_path / "syrk-autotune-cpu.json").read_text())["verdicts"].values()
    assert chosen == verdict["backend"]
    # The faster one wins; on this CPU either may, so check the rule, not the outcome.
    expected = "exact" if verdict["candidate_ms"] < 0.99 * verdict["cublas_ms"] else "cublas"
    assert chosen == expected
    assert verdict["candidate_error"] <= verdict["cublas_error"]
    assert (verdict["shape"], verdict["dtype"], verdict["with_c"]) == ([24, 40], "float16", False)


def test_autotune_lines_are_rank_tagged_and_name_shape_dtype_and_backend(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    tuner_with(tmp_path, ExactBackend()).choose("exact", a_matrix(24, 40))
    started, verdict = autotune_lines(caplog)
    assert started == (
        "[DMuon][rank=3/8] SYRK autotune candidate started shape=(24,40) dtype=float16 "
        "backend=exact"
    )
    assert verdict.startswith("[DMuon][rank=3/8] SYRK autotune verdict shape=(24,40) dtype=float16")


def test_dmuon_syrk_autotune_log_0_silences_the_lines_but_still_tunes(
    tmp_path, caplog, monkeypatch
):
    monkeypatch.setenv("DMUON_SYRK_AUTOTUNE_LOG", "0")
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    candidate = ExactBackend(relative_error=0.01)
    assert tuner_with(tmp_path, candidate).choose("exact", a_matrix()) == "cublas"
    assert candidate.calls > 0
    assert autotune_lines(caplog) == []


def test_a_cached_verdict_is_reused_by_a_new_process_without_retuning(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    first = tuner_with(tmp_path, ExactBackend()).choose("exact", a_matrix())
    caplog.clear()
    candidate = ExactBackend()
    again = tuner_with(tmp_path, candidate)  # a fresh tuner: empty memory, same folder
    assert again.choose("exact", a_matrix(seed=5)) == first
    assert candidate.calls == 0
    assert autotune_lines(caplog) == []


def test_a_library_version_change_invalidates_the_verdict(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    tuner_with(tmp_path, ExactBackend(library_version="1.0")).choose("exact", a_matrix())
    caplog.clear()
    upgraded = ExactBackend(library_version="2.0")
    tuner_with(tmp_path, upgraded).choose("exact", a_matrix())
    assert upgraded.calls > 0
    assert any("candidate started" in line for line in autotune_lines(caplog))
    verdicts = json.loads((tmp_path / "syrk-autotune-cpu.json").read_text())["verdicts"]
    assert sorted(re.search(r"test-lib=([^,]+)", key).group(1) for key in verdicts) == [
        "1.0",
        "2.0",
    ]


def test_each_problem_gets_its_own_verdict(tmp_path):
    candidate = ExactBackend()
    tuner = tuner_with(tmp_path, candidate)
    A = a_matrix(16, 32)
    C = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)).half()
    C = (C + C.mT) / 2
    tuner.choose("exact", A)
    tuner.choose("exact", A, C)
    tuner.choose("exact", a_matrix(16, 32, dtype=torch.bfloat16))
    tuner.choose("exact", A.expand(3, 16, 32))
    tuner.choose("exact", C, C, op=autotune.SYMMETRIC_PRODUCT)
    tuner.choose("exact", C, op=autotune.MATMUL, B=A)  # (16, 16) @ (16, 32)
    calls = candidate.calls
    tuner.choose("exact", a_matrix(16, 32, seed=9))  # same problem, other values: no tuning
    assert candidate.calls == calls
    keys = json.loads((tmp_path / "syrk-autotune-cpu.json").read_text())["verdicts"]
    assert len(keys) == 6
    (matmul_verdict,) = [v for v in keys.values() if v["op"] == "matmul"]
    assert matmul_verdict["shape"] == [16, 16, 32]


def test_a_problem_under_min_flop_runs_cublas_without_tuning_or_a_verdict(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    A = a_matrix(24, 40)
    flop = autotune.SyrkProblem.of(A, None).flop
    candidate = ExactBackend()
    assert tuner_with(tmp_path, candidate, min_flop=flop + 1).choose("exact", A) == "cublas"
    assert candidate.calls == 0
    assert autotune_lines(caplog) == []
    assert not (tmp_path / "syrk-autotune-cpu.json").exists()
    tuner_with(tmp_path, candidate, min_flop=flop).choose("exact", A)  # at the bound: tuned
    assert candidate.calls > 0


def test_problem_flop_counts_the_full_product_as_cublas_computes_it():
    A, S = a_matrix(24, 40), a_matrix(24, 24)
    assert autotune.SyrkProblem.of(A, None).flop == 2 * 24 * 24 * 40
    assert autotune.SyrkProblem.of(A.expand(3, 24, 40), None).flop == 3 * 2 * 24 * 24 * 40
    assert autotune.SyrkProblem.of(S, S, autotune.SYMMETRIC_PRODUCT, S).flop == 2 * 24**3
    assert autotune.SyrkProblem.of(S, None, autotune.MATMUL, A).flop == 2 * 24 * 24 * 40


def test_the_process_wide_tuner_leaves_problems_under_about_a_tenth_of_a_millisecond_to_cublas():
    assert autotune.default_autotuner().min_flop == autotune.MIN_TUNED_FLOP == 2**36


def test_the_process_wide_tuner_tunes_symmetric_products_only_and_leaves_matmul_to_cublas():
    assert autotune.default_autotuner().tuned_ops == autotune.TUNED_OPS
    assert autotune.TUNED_OPS == (autotune.SYRK, autotune.SYMMETRIC_PRODUCT)


def test_an_operation_outside_tuned_ops_runs_cublas_without_tuning_or_a_verdict(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    candidate = ExactBackend()
    tuner = SyrkAutotuner(
        cache_dir=tmp_path,
        get_backend={"cublas": cublas, "exact": candidate}.__getitem__,
        challengers=(),
        tuned_ops=autotune.TUNED_OPS,
    )
    S = a_matrix(24, 24)
    assert tuner.choose("exact", S, op=autotune.MATMUL, B=a_matrix(24, 40)) == "cublas"
    assert candidate.calls == 0 and autotune_lines(caplog) == []
    assert not (tmp_path / "syrk-autotune-cpu.json").exists()
    tuner.choose("exact", a_matrix(24, 40))  # syrk: tuned
    assert candidate.calls > 0


def test_each_candidate_is_a_timed_phase_and_its_verdict_line_says_how_long(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    _log.clear_recorded_phases()
    tuner_with(tmp_path, ExactBackend()).choose("exact", a_matrix(24, 40))
    (phase,) = _log.recorded_phases()
    assert (phase.kind, phase.what) == ("autotune", "shape=(24,40) dtype=float16 backend=exact")
    assert phase.seconds > 0 and phase.depth == 0
    verdict = autotune_lines(caplog)[-1]
    assert re.search(r"\); took \d+\.\d s$", verdict), verdict


def test_tuning_never_advances_the_global_random_generator(tmp_path):
    before = torch.get_rng_state()
    tuner_with(tmp_path, ExactBackend()).choose("exact", a_matrix())
    assert torch.equal(torch.get_rng_state(), before)


def test_a_candidate_without_symmetric_product_keeps_cublas_for_that_operation(tmp_path):
    class SyrkOnly:
        def versions(self):
            return {}

        def syrk(self, A, C, alpha, beta):
            return ExactBackend().syrk(A, C, alpha, beta)

    backends = {"cublas": cublas, "syrk_only": SyrkOnly()}
    tuner = SyrkAutotuner(cache_dir=tmp_path, get_backend=backends.__getitem__)
    S = a_matrix(16, 16)
    assert tuner.choose("syrk_only", S, op=autotune.SYMMETRIC_PRODUCT) == "cublas"


def test_a_matmul_key_holds_all_three_dimensions():
    problem = SyrkProblem(
        M=1024, K=1024, batch=0, dtype=torch.float16, has_c=True, op="matmul", N=4096
    )
    key = autotune.verdict_key(problem, "quack", {})
    assert key.startswith("op=matmul;M=1024;K=1024;N=4096;batch=0;")
    assert problem.describe() == "shape=(1024,1024,4096) dtype=float16 op=matmul with_c=True"


def test_the_cache_key_holds_problem_candidate_and_every_version():
    problem = SyrkProblem(M=4096, K=14336, batch=8, dtype=torch.bfloat16, has_c=True)
    key = autotune.verdict_key(problem, "quack", {"torch": "2.11", "quack-kernels": "0.5.0"})
    assert key == (
        "op=syrk;M=4096;K=14336;batch=8;dtype=bfloat16;with_c=1;candidate=quack;"
        "versions=quack-kernels=0.5.0,torch=2.11"
    )


def test_autotune_log_switch_accepts_the_usual_spellings(monkeypatch):
    for value, enabled in [("0", False), ("false", False), ("OFF", False), ("1", True), ("", True)]:
        monkeypatch.setenv("DMUON_SYRK_AUTOTUNE_LOG", value)
        assert autotune.autotune_log_enabled() is enabled, value
    monkeypatch.delenv("DMUON_SYRK_AUTOTUNE_LOG")
    assert autotune.autotune_log_enabled()


def test_an_autotune_log_value_that_is_not_on_or_off_raises_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_SYRK_AUTOTUNE_LOG", "quiet")
    with pytest.raises(
        ValueError, match=r"DMUON_SYRK_AUTOTUNE_LOG='quiet' is not an on/off value: use one of"
    ):
        tuner_with(tmp_path, ExactBackend()).choose("exact", a_matrix())


def test_cache_module_imports_nothing_but_the_standard_library():
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.util, sys; "
            f"s = importlib.util.spec_from_file_location('c', {cache_module.__file__!r}); "
            "m = importlib.util.module_from_spec(s); sys.modules['c'] = m; "
            "s.loader.exec_module(m); "
            "print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert result.stdout.strip() == "False"


def test_each_challenger_gets_its_own_verdict_and_a_wrong_one_never_runs(tmp_path):
    wrong = ExactBackend(relative_error=0.01)
    tuner = tuner_with(tmp_path, ExactBackend(), wrong=wrong)
    assert tuner.choose("exact", a_matrix()) in ("exact", "cublas")
    verdicts = json.loads((tmp_path / "syrk-autotune-cpu.json").read_text())["verdicts"]
    by_candidate = {verdict["candidate"]: verdict for verdict in verdicts.values()}
    assert set(by_candidate) == {"exact", "wrong"}
    assert by_candidate["wrong"]["backend"] == "cublas"
    assert "failed the cross-check" in by_candidate["wrong"]["reason"]


def test_a_challenger_is_only_tuned_for_the_operations_it_implements(tmp_path):
    tuner = tuner_with(tmp_path, ExactBackend(), syrk_only=SyrkOnlyBackend())
    assert tuner.contenders("exact", "syrk") == ["exact", "syrk_only"]
    assert tuner.contenders("exact", "symmetric_product") == ["exact"]
    assert tuner.contenders("syrk_only", "syrk") == ["syrk_only"]


def test_of_the_winning_verdicts_the_largest_speedup_over_cublas_runs_the_problem():
    def verdict(backend, candidate, candidate_ms, cublas_ms):
        return a_verdict(backend, candidate, candidate_ms=candidate_ms, cublas_ms=cublas_ms)

    # Measured in different runs: cute's 0.50 ms against a slower cuBLAS run is the larger
    # speed-up (2.2x) although quack's 0.48 ms is the smaller time.
    quack, cute = verdict("quack", "quack", 0.48, 0.60), verdict("cute", "cute", 0.50, 1.10)
    assert autotune.fastest_winner([quack, cute]) == "cute"
    assert autotune.fastest_winner([quack, verdict("cublas", "cute", 0.9, 1.0)]) == "quack"
    assert autotune.fastest_winner([a_verdict("cublas", "cute")]) == "cublas"
    assert autotune.fastest_winner([]) == "cublas"


def test_tune_returns_the_typed_verdict_it_records(tmp_path):
    tuner = tuner_with(tmp_path, ExactBackend(relative_error=0.01))
    problem = SyrkProblem.of(a_matrix(), None)
    verdict = tuner.tune("exact", problem, torch.device("cpu"))
    assert isinstance(verdict, Verdict)
    assert (verdict.backend, verdict.candidate, verdict.won) == ("cublas", "exact", False)
    assert (verdict.op, verdict.shape, verdict.batch, verdict.dtype) == (
        "syrk",
        (24, 40),
        0,
        "float16",
    )
    assert verdict.candidate_error > verdict.cublas_error and verdict.candidate_ms is None
    assert VerdictCache("cpu", tmp_path).get(next(iter(tuner.cache_for("cpu").keys()))) == verdict


# -- the prior: the expected winner first, the others only if it loses ---------------------------


def prior_tuner(tmp_path: Path, expected: str, **backends: object) -> SyrkAutotuner:
    """A tuner over ``backends`` (the first is the ladder's candidate) whose prior expects
    ``expected`` to win every problem."""
    return SyrkAutotuner(
        cache_dir=tmp_path,
        get_backend={"cublas": cublas, **backends}.__getitem__,
        challengers=tuple(backends),
        prior=lambda problem, device: expected,
    )


def seed_verdict(tuner: SyrkAutotuner, candidate: str, A: torch.Tensor, won: bool) -> None:
    """Record a verdict for ``candidate`` on A's problem, as an earlier process would have."""
    problem = SyrkProblem.of(A, None)
    timings = {"candidate_ms": 0.5 if won else 2.0, "cublas_ms": 1.0}
    backend = candidate if won else "cublas"
    cache, key = tuner._key(candidate, problem, A.device)
    cache.put(key, problem.verdict(candidate, backend, "seeded", **timings), persist=True)


def test_a_prior_whose_pick_won_leaves_the_other_contenders_untuned(tmp_path, caplog):
    first, second = ExactBackend(), ExactBackend()
    tuner = prior_tuner(tmp_path, "second", first=first, second=second)
    A = a_matrix()
    seed_verdict(tuner, "second", A, won=True)
    with caplog.at_level(logging.INFO):
        assert tuner.choose("first", A) == "second"
    assert first.calls == 0 and second.calls == 0  # nothing compiled, measured or run
    (line,) = [s for s in autotune_lines(caplog) if "skipped" in s]
    assert "backend=first: second won it" in line and "DMUON_SYRK_AUTOTUNE_PRIOR=0" in line


def test_a_prior_whose_pick_loses_tunes_every_other_contender(tmp_path):
    wrong, other = ExactBackend(relative_error=0.01), ExactBackend()
    tuner = prior_tuner(tmp_path, "wrong", other=other, wrong=wrong)
    tuner.choose("other", a_matrix())
    verdicts = json.loads((tmp_path / "syrk-autotune-cpu.json").read_text())["verdicts"]
    by_candidate = {verdict["candidate"]: verdict for verdict in verdicts.values()}
    assert set(by_candidate) == {"wrong", "other"}  # the pick failed its cross-check
    assert "failed the cross-check" in by_candidate["wrong"]["reason"] and other.calls > 0


def test_the_prior_switch_off_tunes_every_contender(tmp_path, monkeypatch):
    monkeypatch.setenv("DMUON_SYRK_AUTOTUNE_PRIOR", "0")
    first, second = ExactBackend(), ExactBackend()
    tuner = prior_tuner(tmp_path, "second", first=first, second=second)
    A = a_matrix()
    seed_verdict(tuner, "second", A, won=True)
    tuner.choose("first", A)
    assert first.calls > 0 and second.calls == 0  # the seeded verdict is still used


def test_without_a_prior_a_won_verdict_does_not_stop_the_others_being_tuned(tmp_path):
    first, second = ExactBackend(), ExactBackend()
    tuner = tuner_with(tmp_path, first, second=second)
    A = a_matrix()
    seed_verdict(tuner, "exact", A, won=True)
    tuner.choose("exact", A)
    assert first.calls == 0 and second.calls > 0


def test_the_sm90_prior_follows_the_measured_winners(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)

    def pick(M: int, K: int, batch: int = 0, op: str = "syrk") -> str | None:
        return autotune.measured_prior(SyrkProblem(M, K, batch, torch.float16, False, op), cuda)

    # CuTe on one matrix with a Gram edge of 4096 to 8191, quack everywhere else.
    assert [pick(4096, 4096), pick(4096, 14336), pick(8191, 8192, 1)] == ["cute"] * 3
    assert [pick(4095, 4096), pick(8192, 8192), pick(8192, 28672)] == ["quack"] * 3
    assert [pick(704, 1024, 96), pick(2048, 5632, 10), pick(4096, 4096, 8)] == ["quack"] * 3
    assert pick(2048, 2048, 8, "symmetric_product") == "quack"
    assert autotune.measured_prior(SyrkProblem.of(a_matrix(), None), torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert pick(4096, 4096) is None  # nothing measured there: every contender is tuned


def test_the_process_wide_tuner_uses_the_measured_prior():
    assert autotune.default_autotuner().prior is autotune.measured_prior


def test_tuning_runs_the_kernel_variant_newton_schulz_runs(monkeypatch):
    """quack compiles one variant per (alpha == 1, beta == 1): each product with C is tuned on
    the variant the iteration calls, or a first step compiles a kernel it never runs."""
    ns_module = sys.modules["dmuon_kernels.newton_schulz"]  # the package exports the function
    called: set[tuple[str, bool, bool]] = set()

    def recording(op: str, product):
        def call(*args, C=None, alpha=1.0, beta=0.0, **kwargs):
            if C is not None:
                called.add((op, alpha == 1.0, beta == 1.0))
            return product(*args, C=C, alpha=alpha, beta=beta, **kwargs)

        return call

    for op in ("syrk", "symmetric_product", "matmul"):
        monkeypatch.setattr(ns_module, op, recording(op, getattr(ns_module, op)))
    for backend in ("gram", "direct"):
        ns_module.newton_schulz(a_matrix(16, 40, torch.float32), backend=backend)
    tuned = set()
    for op in {op for op, _, _ in called}:  # the full products take no C ((a·I + poly)·X)
        problem = SyrkProblem(16, 16, 0, torch.float16, True, op, 40 if op == "matmul" else 0)
        inputs = autotune._tuning_inputs(problem, torch.device("cpu"))
        tuned.add((op, inputs.alpha == 1.0, inputs.beta == 1.0))
    assert called == tuned, (called, tuned)
