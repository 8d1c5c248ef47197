"""The benchmarks as a new user meets them on a CPU machine: one line where a GPU is needed, and
progress lines from those that run for minutes there."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*argv, env=None, timeout=300):
    return subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_recipe_on_a_machine_without_a_gpu_is_one_line(tmp_path):
    """No CUDA device (hidden here, as on a CPU machine): one line, exit 1, no results file."""
    out = tmp_path / "recipe.json"
    result = run("benchmark/recipe.py", "--out", out, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        "recipe.py: error: needs a CUDA GPU (torch sees none): it times crd.py's full-size recipe; "
        "on a CPU, try the README's tiny demo"]
    assert not out.exists() and not list(tmp_path.iterdir())
