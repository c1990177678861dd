"""The first step never waits for a kernel compile (``DMUON_KERNEL_COMPILE=background``, the
default): a fresh process's ``dmuon.Muon`` steps on cuBLAS while a separate process builds its
Newton-Schulz kernels into the (empty) ``DMUON_CACHE_DIR``, switches on a later step, and from
then on runs what a process that compiled first (``DMUON_KERNEL_COMPILE=wait``) runs.

Each test runs fresh Python processes with a private cache folder (as a first training job on
a fresh machine would) and reads their report, recorded phases and rank-tagged lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

# One Muon group whose two matrices make one Newton-Schulz input (2, 2048, 4096): every product
# of its iteration is at least MIN_TUNED_FLOP, so "auto" tunes each.
TRAIN_SCRIPT = textwrap.dedent(
    """
    import json, sys, time, torch
    from torch import nn
    import dmuon
    from dmuon_kernels import _log
    from dmuon_kernels.background_compile import background_compile
    from dmuon_kernels.newton_schulz import NewtonSchulz, normalized_input
    from dmuon_kernels.syrk import autotune, readiness
    from dmuon_kernels.syrk.dispatch import auto_candidate

    mode, out_dir = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = nn.ModuleDict({"layers": nn.ModuleList([nn.Sequential(
        nn.Linear(2048, 4096, bias=False), nn.Linear(4096, 2048, bias=False))])}).cuda()
    dmuon.dedicate_params(
        model, None, lambda name, p: p.ndim == 2,
        layer_id_fn=lambda name: ".".join(name.split(".")[:2]),
        hook_boundary_predicate=lambda module: isinstance(module, nn.Sequential),
    )
    optimizer = dmuon.Muon(model)
    compiles = background_compile()
    generator = torch.Generator(device="cuda").manual_seed(5)
    G = torch.randn(2, 2048, 4096, device="cuda", generator=generator)
    X = normalized_input(G, eps=1e-7, dtype=torch.float16)
    report = {"auto_candidate": auto_candidate(torch.device("cuda"))[0],
              "deferred_at_start": readiness.tuning_deferred(), "steps": []}

    # The first Newton-Schulz call of the step's shape, before any step.
    _log.clear_recorded_phases()
    start = time.perf_counter()
    before = optimizer.newton_schulz.iterate_normalized(X.clone())
    torch.cuda.synchronize()
    report["first_ns_seconds"] = time.perf_counter() - start
    report["first_ns_phases"] = [[p.kind, p.what, p.seconds] for p in _log.recorded_phases()]
    cublas = NewtonSchulz(kernel="cublas").iterate_normalized(X.clone())
    report["first_ns_is_cublas"] = bool(torch.equal(before, cublas))

    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        _log.clear_recorded_phases()
        start = time.perf_counter()
        x = torch.randn(8, 2048, device="cuda")
        model["layers"][0](x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        report["steps"].append({
            "seconds": time.perf_counter() - start,
            "deferred_after": readiness.tuning_deferred(),
            "phases": [[p.kind, p.what, p.seconds] for p in _log.recorded_phases()],
        })
        done = len(report["steps"])
        if compiles.switch_step is not None and done >= compiles.switch_step + 2:
            break
        if not compiles.active and compiles.switch_step is None and done >= 3:
            break  # wait mode, or a failed job
        time.sleep(0.5)  # a step of a real model takes a while; the job runs meanwhile

    after = optimizer.newton_schulz.iterate_normalized(X.clone())
    after = optimizer.newton_schulz.iterate_normalized(X.clone())  # the graph's replay
    torch.save(after.cpu(), f"{out_dir}/{mode}.pt")
    report.update(
        switch_step=compiles.switch_step, seconds_to_switch=compiles.seconds_to_switch,
        active=compiles.active, chosen=autotune.chosen_backends(),
    )
    print("report", json.dumps(report))
    """
)


def run_training(tmp_path: Path, mode: str) -> tuple[dict, str]:
    """(report, stderr) of TRAIN_SCRIPT in a fresh process with ``DMUON_KERNEL_COMPILE=mode``
    and its own empty cache folder."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    source_paths = [
        str(REPO / "packages" / name / "src") for name in ("dmuon-kernels", "dmuon-core")
    ]
    env = {
        **os.environ,
        "DMUON_CACHE_DIR": str(tmp_path / f"cache-{mode}"),
        "TRITON_CACHE_DIR": str(tmp_path / f"triton-{mode}"),
        "DMUON_KERNEL_COMPILE": mode,
        "PYTHONPATH": os.pathsep.join([*source_paths, str(REPO), os.environ.get("PYTHONPATH", "")]),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    for name in ("DMUON_SYRK_AUTOTUNE_LOG", "DMUON_KERNEL_CACHE", "DMUON_NS_KERNEL"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, str(script), mode, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [s for s in result.stdout.splitlines() if s.startswith("report ")]
    return json.loads(line.removeprefix("report ")), result.stderr


def builds_a_fast_kernel(kind: str, what: str) -> bool:
    """A phase that tunes, or compiles or loads a quack or CuTe kernel (not a Triton one)."""
    return kind == "autotune" or (
        kind in ("compile", "load") and ("quack" in what or "CuTe" in what)
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("background-compile")
    background, background_log = run_training(tmp_path, "background")
    if background["auto_candidate"] == "cublas":
        pytest.skip("auto resolves to cuBLAS here (no fast backend): nothing to compile")
    wait, wait_log = run_training(tmp_path, "wait")
    return tmp_path, background, background_log, wait, wait_log


def test_the_first_newton_schulz_call_runs_cublas_at_once_and_compiles_nothing(runs):
    _, background, _, _, _ = runs
    assert background["deferred_at_start"]
    assert background["first_ns_is_cublas"]
    assert background["first_ns_seconds"] < 1.0, background["first_ns_seconds"]
    assert not [p for p in background["first_ns_phases"] if builds_a_fast_kernel(p[0], p[1])]


def test_steps_before_the_switch_tune_and_compile_nothing_and_the_switch_comes(runs):
    tmp_path, background, log, _, _ = runs
    switch = background["switch_step"]
    assert switch is not None, log[-4000:]
    assert not background["active"]
    for step in background["steps"][: switch - 1]:
        assert step["deferred_after"]
        assert not [p for p in step["phases"] if builds_a_fast_kernel(p[0], p[1])], step
    assert "run on cuBLAS while their kernels compile in a background process" in log
    assert "Newton-Schulz shape (2, 2048, 4096): kernels compiled in the background" in log
    assert f"step {switch}: every rank's Newton-Schulz kernels are compiled" in log
    cache = tmp_path / "cache-background"
    built = [
        path
        for folder in ("kernels", "quack", "cutlass-dsl")  # CuTe objects, the libraries' caches
        for path in (cache / folder).rglob("*")
        if path.is_file()
    ]
    assert built, f"the job left nothing in {cache}"


def test_after_the_switch_the_process_tunes_loading_the_kernels_the_job_built(runs):
    _, background, log, _, _ = runs
    switch = background["switch_step"]
    after = [p for step in background["steps"][switch - 1 :] for p in step["phases"]]
    assert any(kind == "autotune" for kind, _, _ in after), after
    assert not [p for p in after if p[0] == "compile" and "CuTe" in p[1]], after  # loaded
    # quack reports a load from its cache as a "compile" phase too: a load takes well under the
    # 3-6 s of a compile.
    assert all(p[2] < 2.5 for p in after if p[0] == "compile" and "quack" in p[1]), after
    assert "SYRK autotune verdict" in log


def test_after_the_switch_results_match_a_run_that_compiled_first(runs):
    """The same problems tuned; which backend wins each is a timing, which may differ between
    two processes (the GPU suite runs in shards that share the device), so the outputs are
    compared to within the kernels' roundings instead."""
    tmp_path, background, _, wait, _ = runs
    tuned = sum(background["chosen"].values()), sum(wait["chosen"].values())
    assert tuned[0] == tuned[1], (background["chosen"], wait["chosen"])
    ours = torch.load(tmp_path / "background.pt").float()
    theirs = torch.load(tmp_path / "wait.pt").float()
    error = float((ours - theirs).norm() / theirs.norm())
    assert error < 2e-2, error


def test_wait_mode_starts_no_job_and_tunes_in_its_first_step(runs):
    _, _, _, wait, log = runs
    assert not wait["deferred_at_start"]
    assert wait["switch_step"] is None and not wait["active"]
    assert "background process" not in log
    first_use = wait["first_ns_phases"] + wait["steps"][0]["phases"]
    assert any(kind == "autotune" for kind, _, _ in first_use), first_use


# Starts a job for a large shape, prints its pid, and dies at once without any clean-up.
ORPHAN_SCRIPT = textwrap.dedent(
    """
    import os, torch
    from dmuon_kernels.background_compile import background_compile, job_spec
    from dmuon_kernels.newton_schulz import NewtonSchulz
    compiles = background_compile()
    compiles.submit(job_spec(NewtonSchulz(), torch.device("cuda", 0), [(8, 4096, 8192)]))
    print("job", compiles._job.process.pid, flush=True)
    os._exit(0)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has ended


def test_a_job_whose_trainer_dies_ends_within_seconds(tmp_path):
    env = {
        **os.environ,
        "DMUON_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "packages" / "dmuon-kernels" / "src"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    result = subprocess.run(
        [sys.executable, "-c", ORPHAN_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    (line,) = [s for s in result.stdout.splitlines() if s.startswith("job ")]
    pid = int(line.split()[1])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"the compile job {pid} outlived its trainer by 10 s"
