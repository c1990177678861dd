"""The READMEs' programs run as written, taken from the Markdown itself.

- README.md, "## Use it": the complete training program, on 2 gloo processes (torchrun); in CI,
  where .ci/wheels runs it from the built wheels alongside, not a second time.
- README.md, "## Save and resume": trained and saved on 2 gloo processes, resumed on 1; the
  resumed steps' losses equal the uninterrupted run's.
- packages/dmuon-kernels/README.md, "## Use": the Newton-Schulz example, in this process.

Run as a script, this file makes the same checks with the interpreter that runs it:
``python tests/test_readme_programs.py dmuon`` (the training program; prints its output) or
``... dmuon-kernels`` (the kernels example). ``.ci/wheels`` runs it that way in a clean
environment holding only torch and the built wheels, so it imports nothing outside the standard
library at the top.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
READMES = {
    "dmuon": (REPOSITORY_ROOT / "README.md", "## Use it"),
    "dmuon-resume": (REPOSITORY_ROOT / "README.md", "## Save and resume"),
    "dmuon-kernels": (REPOSITORY_ROOT / "packages" / "dmuon-kernels" / "README.md", "## Use"),
}
LAUNCH_TIMEOUT_S = 300
# Set by .ci/run, whose .ci/wheels runs the "Use it" program from the built wheels: the suite then
# skips its own run of that same program (its other checks still run).
WHEELS_RAN_USE_IT_ENV = "DMUON_TEST_WHEELS_RAN_USE_IT"


def python_block(readme: Path, heading: str) -> str:
    """The one ```python block between ``heading`` and the next ``## `` heading."""
    sections = re.split(r"^(?=## )", readme.read_text(), flags=re.MULTILINE)
    matching = [section for section in sections if section.startswith(heading + "\n")]
    if len(matching) != 1:
        raise ValueError(f"{readme} has {len(matching)} {heading!r} sections, expected 1")
    blocks = re.findall(r"^```python\n(.*?)^```$", matching[0], flags=re.MULTILINE | re.DOTALL)
    if len(blocks) != 1:
        raise ValueError(
            f"the {heading!r} section of {readme} has {len(blocks)} ```python blocks, expected 1"
        )
    return blocks[0]


def printed_losses(stdout: str) -> list[float]:
    return [float(value) for value in re.findall(r"loss (\d+\.\d+)", stdout)]


def torchrun(program: Path, processes: int, *arguments: str) -> str:
    """stdout of ``torchrun --nproc-per-node <processes> <program> <arguments>`` in its folder."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    result = subprocess.run(
        [*launcher, f"--nproc-per-node={processes}", str(program), *arguments],
        cwd=program.parent,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def check_the_training_program(workdir: Path) -> str:
    """Runs README.md's program with ``torchrun --nproc-per-node 2``; checks that it trained."""
    program = workdir / "train.py"
    program.write_text(python_block(*READMES["dmuon"]))
    stdout = torchrun(program, 2)
    losses = printed_losses(stdout)
    assert len(losses) >= 2, stdout
    assert losses[-1] < losses[0] / 2, f"the loss did not fall: {losses}"
    return stdout


def check_the_resume_program(workdir: Path) -> str:
    """Runs README.md's save-and-resume program on 2 processes, then resumes it on 1."""
    import torch

    program = workdir / "resume.py"
    program.write_text(python_block(*READMES["dmuon-resume"]))
    uninterrupted = printed_losses(torchrun(program, 2))
    resumed_stdout = torchrun(program, 1, "ckpt/step-5")
    resumed = printed_losses(resumed_stdout)
    assert len(uninterrupted) == 10 and len(resumed) == 5, resumed_stdout
    for step, (expected, got) in enumerate(zip(uninterrupted[5:], resumed), start=6):
        assert abs(expected - got) <= 2e-5 * abs(expected), (step, uninterrupted, resumed)
    exported = torch.load(workdir / "model.pt")
    assert set(exported) == {"embed.weight", "lm_head.weight", "lm_head.bias"} | {
        f"layers.{i}.{kind}" for i in range(2) for kind in ("weight", "bias")
    }
    return resumed_stdout


def check_the_kernels_example() -> dict:
    """Runs the kernels README's example here; returns its names (``update``, ``ns``, ...)."""
    import torch

    names: dict = {}
    exec(compile(python_block(*READMES["dmuon-kernels"]), "dmuon-kernels README", "exec"), names)
    update = names["update"]
    assert update.shape == (1024, 4096) and update.dtype == torch.float32
    assert torch.isfinite(update).all()
    return names


def test_the_use_it_section_is_a_complete_training_program():
    program = python_block(*READMES["dmuon"])
    compile(program, "README.md: Use it", "exec")
    for step in (
        "init_process_group",
        "init_device_mesh",
        "dmuon.dedicate_params",
        "fully_shard(layer",
        "dmuon.Muon",
        "destroy_process_group",
    ):
        assert step in program


def test_the_use_it_program_trains_on_two_gloo_processes(tmp_path):
    if os.environ.get(WHEELS_RAN_USE_IT_ENV) == "1":
        import pytest

        pytest.skip(f"{WHEELS_RAN_USE_IT_ENV}=1: .ci/wheels ran it from the built wheels")
    check_the_training_program(tmp_path)


def test_the_save_and_resume_program_resumes_on_another_world_size_like_uninterrupted(tmp_path):
    check_the_resume_program(tmp_path)


def test_the_kernels_example_orthogonalises_in_fp32_on_cpu():
    names = check_the_kernels_example()
    if names["device"] == "cpu":
        torch = names["torch"]
        assert names["ns"].iteration_dtype(torch.device("cpu")) is torch.float32


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "dmuon"
    if which == "dmuon":
        with tempfile.TemporaryDirectory() as workdir:
            sys.stdout.write(check_the_training_program(Path(workdir)))
    elif which == "dmuon-resume":
        with tempfile.TemporaryDirectory() as workdir:
            sys.stdout.write(check_the_resume_program(Path(workdir)))
    elif which == "dmuon-kernels":
        check_the_kernels_example()
    else:
        sys.exit(f"usage: {sys.argv[0]} [dmuon|dmuon-resume|dmuon-kernels]; got {which!r}")
