"""Runs a module of this folder in a fresh interpreter under ``TRITON_INTERPRET=1`` (Triton reads
it when kernels are defined, so it cannot be switched on inside the test process) and returns
the JSON lines it prints: the interpreted kernels' results for a test to hold to bounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, timeout: int) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    completed = subprocess.run(
        [sys.executable, "-m", module],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-4000:]
    return [json.loads(line) for line in completed.stdout.splitlines()]
