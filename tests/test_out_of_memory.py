"""An allocation that fails ends a run with one line naming the phase, the memory in use and the
flags that lower it; the last completed iteration is saved when the failed one had not stepped the
optimizer yet, and summary.json says what stopped the run. The failure is made where the real one
comes from: the n-th transformer call of a kind raises torch's OutOfMemoryError."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "ocr"
RUN = ["--model", "tiny", "--reward", "brightness", "--device", "cpu", "--train-data",
       str(DATA / "train.txt"), "--eval-data", str(DATA / "test.txt"), "--resolution", "64",
       "--prompts-per-rank", "2", "--group-size", "4", "--train-batch-size", "4",
       "--num-iterations", "2", "--eval-every", "0", "--save-every", "10",
       "--max-sequence-length", "96", "--run-name", "run"]

# Runs crd.py as __main__ with the n-th transformer forward of one kind (grad: the policy's;
# no grad: the rollout's and the reference passes') raising CUDA's out-of-memory error.
# Usage: python WRAPPER KIND N [crd.py arguments...]
FAILING_ALLOCATION = """
import runpy, sys, torch
sys.path.insert(0, ".")
import rollout
kind, fail_at = sys.argv[1], int(sys.argv[2])
calls = {"grad": 0, "no_grad": 0}
forward = rollout.predict_velocity
def failing(*args, **kwargs):
    which = "grad" if torch.is_grad_enabled() else "no_grad"
    calls[which] += 1
    if which == kind and calls[which] == fail_at:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    return forward(*args, **kwargs)
rollout.predict_velocity = failing
import common
common.predict_velocity = failing
sys.argv = ["crd.py", *sys.argv[3:]]
runpy.run_path("crd.py", run_name="__main__")
"""


def run_failing(tmp_path, tiny_model_dir, kind, fail_at):
    wrapper = tmp_path / "failing_allocation.py"
    wrapper.write_text(FAILING_ALLOCATION)
    cmd = [sys.executable, str(wrapper), kind, str(fail_at), *RUN, "--output-dir", str(tmp_path)]
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("kind, fail_at, phase, saved", [
    # the 2nd iteration's 2nd micro batch: the policy has stepped once, so the saved iteration 1 cannot be written
    ("grad", 10, "the training of iteration 2", False),
    # the 2nd iteration's first rollout forward: an iteration makes 10 rollout calls and 7 for the
    # reference and old passes (their chunks are calls too)
    ("no_grad", 18, "the rollout of iteration 2", True),
])
def test_out_of_memory_is_one_line_and_keeps_the_last_iteration(kind, fail_at, phase, saved,
                                                                tiny_model_dir, tmp_path):
    result = run_failing(tmp_path, tiny_model_dir, kind, fail_at)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"crd.py: error: out of memory in {phase} (")
    assert "GiB peak resident memory on the CPU" in line
    for flag in ("--forward-batch-size", "--policy-timesteps-per-forward",
                 "--gradient-checkpointing", "--text-encoder-device"):
        assert flag in line
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert not summary["completed"] and summary["stopped_by"].startswith(f"out of memory in {phase}")
    assert summary["iterations"] == 1
    assert (run / "global_step_1").is_dir() == saved
    assert line.endswith(f"the latest checkpoint is {run / 'global_step_1'}" if saved
                         else "no checkpoint was saved")
    if saved:
        state = json.loads((run / "global_step_1" / "trainer_state.json").read_text())
        assert state["iteration"] == 1 and state["optimizer_steps"] == 2
