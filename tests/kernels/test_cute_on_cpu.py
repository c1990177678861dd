"""What the CuTe DSL backend ("cute") promises on a machine without a GPU or without cutlass.

The kernels themselves are tested in tests/gpu/test_cute_gpu.py; here: availability and its
reason, the errors a user gets, the host-side batch splitting, the tile configuration chosen per
shape (and that every configuration the GPU tests name exists), and, where nvidia-cutlass-dsl is
installed, that both kernels compile offline (no GPU needed) for their architectures.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dmuon_kernels.syrk import SYMMETRIC_PRODUCT, autotune
from dmuon_kernels.syrk import cute as cute_backend
from tests.gpu.cute_cases import SHAPES, VARIANT_IDS, VARIANTS, shape_config

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")


@needs_no_cuda
def test_cute_reports_itself_unavailable_without_a_gpu():
    available, reason = cute_backend.is_available()
    assert not available
    assert "needs a CUDA GPU with SM80 or newer" in reason


@pytest.fixture
def fresh_probe(monkeypatch):
    """Forget the process's probe result so the test's import path is probed."""
    monkeypatch.setattr(cute_backend, "_probe_result", None)
    for name in [n for n in sys.modules if n == "cutlass" or n.startswith("cutlass.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "dmuon_kernels.syrk._cute_kernel", raising=False)
    monkeypatch.delitem(sys.modules, "dmuon_kernels.syrk._cute_sm90_kernel", raising=False)


def test_missing_cutlass_is_the_reason_with_the_install_hint(fresh_probe, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: None)
    reason = cute_backend._cute_api()
    assert reason == (
        "nvidia-cutlass-dsl is not installed (pip install dmuon-kernels[cute] (not on PyPI yet: "
        'from a checkout of the repository, pip install "./packages/dmuon-kernels[cute]"))'
    )
    assert cute_backend.versions() == {}


def test_a_broken_cutlass_install_is_reported_with_its_import_error(
    fresh_probe, tmp_path, monkeypatch
):
    package = tmp_path / "cutlass"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent("raise ImportError('libcute_dsl.so: cannot open shared object file')\n")
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reason = cute_backend._cute_api()
    assert isinstance(reason, str)
    assert "failed to import (ImportError: libcute_dsl.so" in reason
    assert "pip install dmuon-kernels[cute]" in reason


def test_fp32_input_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"takes float16 or bfloat16, got A.dtype=torch.float32"):
        cute_backend.syrk(torch.ones(8, 8))


def test_cpu_input_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"runs on CUDA tensors, got A on cpu; move A to the GPU"):
        cute_backend.syrk(torch.ones(8, 8, dtype=torch.float16))


def test_symmetric_product_refuses_operands_of_different_shapes():
    A = torch.ones(8, 8, dtype=torch.float16)
    with pytest.raises(
        ValueError, match=r"square A and B of one shape, got A \(8, 8\) and B \(8, 4\)"
    ):
        cute_backend.symmetric_product(A, torch.ones(8, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"runs on CUDA tensors, got A on cpu"):
        cute_backend.symmetric_product(A, A)


def test_auto_tunes_cute_for_symmetric_products_as_well(tmp_path):
    tuner = autotune.SyrkAutotuner(tmp_path, challengers=("quack", "cute"))
    assert tuner.contenders("quack", SYMMETRIC_PRODUCT) == ["quack", "cute"]


def test_an_unknown_tile_configuration_names_the_choices():
    A = torch.ones(8, 8, dtype=torch.float16)
    with pytest.raises(
        ValueError, match=r"config must be one of '128x128_4warps', .* or None; got 'huge'"
    ):
        cute_backend.syrk(A, config="huge")
    for path, choices in cute_backend.SHAPE_CLASS_CONFIGS.items():
        assert all(cute_backend.TILE_CONFIGS[name].path == path for name in choices.values())


def test_an_unknown_path_names_the_choices():
    A = torch.ones(8, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"path must be one of 'sm80', 'sm90' or None; got 'sm70'"):
        cute_backend.syrk(A, path="sm70")


def test_a_config_of_another_path_is_refused_with_the_fix():
    A = torch.ones(8, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"belongs to path 'sm80', not 'sm90'; pass one of them"):
        cute_backend.syrk(A, config="64x64_4warps", path="sm90")


def test_batch_chunks_cover_the_batch_in_int32_sized_aligned_launches():
    chunks = cute_backend._batch_chunks(100, 2**24, 1000 * 1000)
    assert chunks[0][0] == 0 and chunks[-1][1] == 100
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    sizes = [stop - start for start, stop in chunks]
    assert all(size * 2**24 < 2**31 for size in sizes)
    assert all(size % 8 == 0 for size in sizes[:-1])  # D offsets stay 16-byte aligned
    assert cute_backend._batch_chunks(3, 4096 * 4096, 4096 * 4096) == [(0, 3)]
    assert max(stop - start for start, stop in cute_backend._batch_chunks(10**5, 64, 64)) <= 65535


def test_a_matrix_too_large_for_int32_indexing_names_the_fallback():
    with pytest.raises(ValueError, match=r"more than 2\^31 - 1; use kernel='cublas'"):
        cute_backend._batch_chunks(1, 8192 * 262_144 + 8192, 8192 * 8192)


# SM counts the choice of tiling depends on: H100 SXM / H200, H100 PCIe, H20, A100.
SM_COUNTS = (132, 114, 78, 108)
A_GPU = torch.device("cuda", 0)  # a device object only: nothing here touches CUDA


@pytest.fixture(params=SM_COUNTS, ids=lambda count: f"{count}_sms")
def gpu_with_sms(request, monkeypatch):
    """``A_GPU`` with this many SMs, as far as the adapter's tiling choice asks."""
    monkeypatch.setitem(cute_backend._sm_counts, A_GPU, request.param)
    return A_GPU


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_every_configuration_the_gpu_tests_name_exists_with_the_variants_path_and_epilogue(
    gpu_with_sms, variant
):
    path, epilogue = variant
    for shape in SHAPES:
        name = shape_config(shape, gpu_with_sms, variant)
        assert name in cute_backend.TILE_CONFIGS, (shape, name)
        tiles = cute_backend.TILE_CONFIGS[name]
        assert tiles.path == path, (shape, name)
        assert getattr(tiles, "epilogue", cute_backend.DIRECT) == epilogue, (shape, name)
        # a staged epilogue runs its direct twin when M is not a multiple of 8
        runnable = cute_backend.TILE_CONFIGS[cute_backend.runnable_config(name, shape[1])]
        expected = epilogue if shape[1] % 8 == 0 else cute_backend.DIRECT
        assert getattr(runnable, "epilogue", cute_backend.DIRECT) == expected, (shape, name)


def test_the_gpu_tests_run_every_sm90_tiling_with_every_epilogue(monkeypatch):
    names = set()
    for sm_count in SM_COUNTS:
        monkeypatch.setitem(cute_backend._sm_counts, A_GPU, sm_count)
        names.update(
            shape_config(shape, A_GPU, variant) for shape in SHAPES for variant in VARIANTS
        )
    for tiling in ("sm90_64x64", "sm90_128x128", "sm90_256x128"):
        assert {tiling, f"{tiling}_smem", f"{tiling}_smem_flat"} <= names


def test_hopper_chooses_small_tiles_below_a_round_of_sms_and_stages_large_problems(monkeypatch):
    monkeypatch.setitem(cute_backend._sm_counts, A_GPU, 132)
    assert cute_backend.choose_config(640, 1, A_GPU, "sm90") == "sm90_64x64"
    assert cute_backend.choose_config(4096, 1, A_GPU, "sm90") == "sm90_128x128_smem_flat"
    # 1056 tiles of 256x128 are 8 even rounds on 132 SMs
    assert cute_backend.choose_config(8192, 1, A_GPU, "sm90") == "sm90_256x128_smem_flat"
    assert cute_backend.choose_config(4096, 1, A_GPU, "sm80") == "128x128_4warps"
    assert cute_backend.choose_config(640, 1, A_GPU, "sm80") == "64x64_4warps"


def test_with_epilogue_names_the_twin_and_refuses_what_has_none():
    assert cute_backend.with_epilogue("sm90_256x128_smem_flat", "smem") == "sm90_256x128_smem"
    assert cute_backend.with_epilogue("sm90_256x128_smem", "direct") == "sm90_256x128"
    assert cute_backend.with_epilogue("sm90_64x64", "smem_flat") == "sm90_64x64_smem_flat"
    assert cute_backend.with_epilogue("sm90_64x64", "direct") == "sm90_64x64"
    with pytest.raises(ValueError, match=r"config '128x128_4warps' is an SM80 tiling"):
        cute_backend.with_epilogue("128x128_4warps", "smem")
    with pytest.raises(
        ValueError, match=r"epilogue must be one of \('direct', 'smem', 'smem_flat'\)"
    ):
        cute_backend.with_epilogue("sm90_64x64", "tma")


needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not installed"
)

# Compiles in a fresh interpreter: the DSL reads its target architecture when cutlass is imported.
_COMPILE_SCRIPT = """
from dmuon_kernels.syrk import {module} as kernel
from dmuon_kernels.syrk import _cute_tiles as tiles
for dtype_name, has_c, config_class, fields in {cases}:
    kernel.compile_syrk(dtype_name, has_c, getattr(tiles, config_class)(**fields))
    print("compiled", dtype_name, has_c, fields, flush=True)
"""


def compile_offline(module: str, arch: str, configs: list) -> subprocess.CompletedProcess:
    """Compile each config (alternately fp16 with C and bf16 without it: both of each per
    config would double the compile time) for ``arch`` in a fresh interpreter."""
    cases = [
        (
            *(("float16", True) if index % 2 == 0 else ("bfloat16", False)),
            type(config).__name__,
            dataclasses.asdict(config),
        )
        for index, config in enumerate(configs)
    ]
    source = Path(cute_backend.__file__).resolve().parents[2]
    env = dict(os.environ, CUTE_DSL_ARCH=arch)
    env["PYTHONPATH"] = os.pathsep.join([str(source), env.get("PYTHONPATH", "")])
    script = _COMPILE_SCRIPT.format(module=module, cases=cases)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == len(cases)
    return result


def named_configs(path: str) -> list:
    """Every tile configuration the adapter can run on ``path``, by name."""
    return [t for _, t in sorted(cute_backend.TILE_CONFIGS.items()) if t.path == path]


def test_every_staged_epilogue_config_has_a_direct_twin_for_unaligned_m():
    staged = [
        n
        for n, t in cute_backend.TILE_CONFIGS.items()
        if getattr(t, "epilogue", "direct") != "direct"
    ]
    expected = {
        f"sm90_{t}_{e}" for t in ("128x128", "256x128", "64x64") for e in ("smem", "smem_flat")
    }
    assert expected <= set(staged)
    for name in staged:
        tiles = cute_backend.TILE_CONFIGS[name]
        twin = cute_backend.runnable_config(name, 4100)  # 4100 rows are not 16-byte multiples
        assert twin == name.removesuffix("_" + tiles.epilogue)
        direct = cute_backend.TILE_CONFIGS[twin]
        assert (direct.tile, direct.cooperative, direct.epilogue) == (
            tiles.tile,
            tiles.cooperative,
            "direct",
        )
        assert cute_backend.runnable_config(name, 4104) == name
    assert cute_backend.runnable_config("sm90_128x128", 4100) == "sm90_128x128"


def test_large_sm90_problems_stage_the_epilogue_and_keep_the_tiling_of_their_direct_twin():
    large = cute_backend.SHAPE_CLASS_CONFIGS[cute_backend.SM90]["large"]
    for name in (large, cute_backend.SM90_COOPERATIVE_CONFIG):
        tiles = cute_backend.TILE_CONFIGS[name]
        assert tiles.epilogue == "smem_flat"
        twin = cute_backend.TILE_CONFIGS[cute_backend.runnable_config(name, 4100)]
        assert (twin.tile, twin.cooperative, twin.epilogue) == (
            tiles.tile,
            tiles.cooperative,
            "direct",
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"epilogue": "tma"}, r"epilogue must be one of \('direct', 'smem', 'smem_flat'\)"),
        ({"tile": 96}, r"tile and tile_k must be multiples of 64 \(wgmma rows"),
        ({"consumers": 3}, r"consumers must be 1 or 2"),
        ({"consumers": 1, "cooperative": True}, r"the cooperative kernel has two consumers"),
    ],
    ids=["epilogue", "tile", "consumers", "cooperative"],
)
def test_an_sm90_tiling_the_kernel_cannot_compile_is_refused_when_built(fields, message):
    with pytest.raises(ValueError, match=message):
        cute_backend.Sm90TileConfig(**{"tile": 128, "tile_k": 64, "stages": 4, **fields})


def test_an_sm80_tiling_with_a_k_tile_off_the_swizzle_atom_is_refused_when_built():
    with pytest.raises(ValueError, match=r"tile_k must be a multiple of 64 \(one swizzle atom\)"):
        cute_backend.Sm80TileConfig(tile=128, tile_k=32, stages=3, warps_m=2, warps_n=2)


def test_every_named_configuration_belongs_to_one_path_and_knows_its_cta_shape():
    assert {t.path for t in cute_backend.TILE_CONFIGS.values()} == {"sm80", "sm90"}
    cooperative = cute_backend.TILE_CONFIGS["sm90_256x128"]
    assert (cooperative.rows, cooperative.halves, cooperative.threads) == (256, 2, 384)
    # 4096 rows: 16 row blocks of 256, each with 2r + 2 tiles of 128 columns
    assert cooperative.triangle_tiles(4096) == 16 * 17
    assert cute_backend.TILE_CONFIGS["sm90_128x128"].triangle_tiles(4096) == 32 * 33 // 2
    assert cute_backend.TILE_CONFIGS["128x128_4warps"].threads == 128


@needs_cutlass
def test_the_sm90_kernel_compiles_offline_for_hopper_with_every_named_configuration():
    one_consumer = cute_backend.Sm90TileConfig(tile=128, tile_k=64, stages=5, consumers=1)
    compile_offline("_cute_sm90_kernel", "sm_90a", [*named_configs("sm90"), one_consumer])


@needs_cutlass
def test_the_sm80_kernel_compiles_offline_for_ampere_with_every_named_configuration():
    compile_offline("_cute_kernel", "sm_80", named_configs("sm80"))


class _SignatureOnly:
    """What the launch plan reads of A: shape, strides, dtype and device (no CUDA needed)."""

    def __init__(self, *shape, dtype=torch.float16):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, A_GPU

    def stride(self):
        return torch.empty(self.shape, device="meta").stride()


@pytest.fixture
def offline_hopper(monkeypatch):
    """A Hopper with 132 SMs whose kernels 'compile' to recorded names, for the launch plan."""
    compiled = []

    class Module:
        @staticmethod
        def compile_syrk(dtype_name, has_c, tiles):
            compiled.append((dtype_name, has_c, tiles))
            return lambda *args: None

    api = cute_backend._CuteApi({cute_backend.SM80: Module, cute_backend.SM90: Module}, "test")
    monkeypatch.setattr(cute_backend, "_probe_result", api)
    monkeypatch.setattr(cute_backend, "kernel_path", lambda device: cute_backend.SM90)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(cute_backend._sm_counts, A_GPU, 132)
    monkeypatch.setattr(cute_backend, "_plans", {})
    monkeypatch.setattr(cute_backend, "_compiled", {})
    return compiled


def test_a_launch_plan_is_worked_out_once_per_signature(offline_hopper):
    A = _SignatureOnly(4096, 4100)
    plan = cute_backend._launch_plan(A, False, None, None)
    assert cute_backend._launch_plan(A, False, None, None) is plan
    tiles = cute_backend.TILE_CONFIGS["sm90_128x128_smem_flat"]
    assert len(offline_hopper) == 1 and offline_hopper[0] == ("float16", False, tiles)
    assert (plan.path, plan.batch, plan.M, plan.K) == ("sm90", 1, 4096, 4100)
    assert plan.padded_shape == (4096, 4104)  # K padded to 16 bytes for TMA
    assert plan.grid == (4104, tiles.triangle_tiles(4096))
    assert plan.chunks == ((0, 1),) and plan.sm_count == 132
    cute_backend._launch_plan(A, True, None, None)  # with C: its own plan and kernel
    assert len(cute_backend._plans) == 2 and len(offline_hopper) == 2


def test_a_launch_plan_of_the_sm80_path_pads_to_whole_tiles(offline_hopper):
    plan = cute_backend._launch_plan(_SignatureOnly(3, 200, 777), True, None, "sm80")
    tiles = cute_backend.TILE_CONFIGS[cute_backend.choose_config(200, 3, A_GPU, "sm80")]
    m_tiles, k_tiles = -(-200 // tiles.tile), -(-777 // tiles.tile_k)
    assert plan.path == "sm80" and plan.batch == 3
    assert plan.grid == (m_tiles, k_tiles)
    assert plan.padded_shape == (m_tiles * tiles.tile, k_tiles * tiles.tile_k)


def test_an_invalid_config_is_refused_before_any_plan(offline_hopper):
    with pytest.raises(ValueError, match=r"config 'sm90_64x64' belongs to path 'sm90', not"):
        cute_backend._check_choice("sm90_64x64", "sm80")
    assert cute_backend._plans == {}


# A fresh interpreter compiles one kernel into a kernel cache folder; a second one loads it.
_SAVE_AND_LOAD_SCRIPT = """
import sys
from pathlib import Path
from dmuon_kernels.syrk import _cute_runtime as runtime, _cute_sm90_kernel as kernel
from dmuon_kernels.syrk._cute_tiles import TILE_CONFIGS
from dmuon_kernels.syrk.kernel_cache import CompiledKernelCache
compiles = []
def compile_kernel():
    compiles.append(1)
    return kernel.compile_syrk("float16", True, TILE_CONFIGS["sm90_64x64"])
loaded = CompiledKernelCache(Path(sys.argv[1])).get_or_compile(
    "offline test kernel", {"config": "sm90_64x64"}, compile_kernel,
    runtime.load_compiled, runtime.dump_compiled)
print("compiled" if compiles else "loaded", callable(loaded))
"""


@needs_cutlass
def test_a_compiled_kernel_saved_offline_loads_back_with_its_signature(tmp_path):
    source = Path(cute_backend.__file__).resolve().parents[2]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_CACHE_DIR=str(tmp_path / "dsl"))
    env["PYTHONPATH"] = os.pathsep.join([str(source), env.get("PYTHONPATH", "")])
    runs = [
        subprocess.run(
            [sys.executable, "-c", _SAVE_AND_LOAD_SCRIPT, str(tmp_path / "kernels")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        for _ in range(2)
    ]
    assert [run.returncode for run in runs] == [0, 0], runs[-1].stderr[-4000:]
    first, second = (run.stdout.split(" ", 1) for run in runs)
    assert (first[0], second[0]) == ("compiled", "loaded")
    assert first[1].strip() == second[1].strip() == "True"
