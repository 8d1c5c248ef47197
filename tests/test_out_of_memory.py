"""An allocation that fails ends a run with one line naming the phase, the memory in use and the
flags that lower it; the last completed iteration is saved when the failed one had not stepped the
optimizer yet, and summary.json says what stopped the run. The failure is made where the real one
comes from: the n-th transformer call of a kind raises torch's OutOfMemoryError. evaluate.py's
line names its phase and flags, and what it had sampled before is scored and kept. Images per
iteration whose memory cannot fit stop a trainer before its first rollout, with an estimate."""

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import zygote

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "ocr"
RUN = ["--model", "tiny", "--reward", "brightness", "--device", "cpu", "--train-data",
       str(DATA / "train.txt"), "--eval-data", str(DATA / "test.txt"), "--resolution", "64",
       "--prompts-per-rank", "2", "--group-size", "4", "--train-batch-size", "4",
       "--num-iterations", "2", "--eval-every", "0", "--save-every", "10",
       "--max-sequence-length", "96", "--run-name", "run"]

# Runs SCRIPT (crd.py, evaluate.py) as __main__ with the n-th call of one kind raising CUDA's
# out-of-memory error: a transformer forward (grad: the policy's; no grad: the rollout's, the
# reference passes' and evaluate.py's sampling), a score (the brightness reward's) or the loading
# of the SD3 pipeline.
# Usage: python WRAPPER SCRIPT KIND N [SCRIPT's arguments...]
FAILING_ALLOCATION = """
import runpy, sys, torch
sys.path.insert(0, ".")
import ocr_reward, rollout, sd3
script, kind, fail_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
calls = {"grad": 0, "no_grad": 0, "score": 0, "load": 0}
def failing(which, function):
    def call(*args, **kwargs):
        calls[which] += 1
        if which == kind and calls[which] == fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return function(*args, **kwargs)
    return call
forwards = {which: failing(which, rollout.predict_velocity) for which in ("grad", "no_grad")}
def forward(*args, **kwargs):
    return forwards["grad" if torch.is_grad_enabled() else "no_grad"](*args, **kwargs)
rollout.predict_velocity = forward
import iteration
iteration.predict_velocity = forward
ocr_reward.brightness = failing("score", ocr_reward.brightness)
sd3.load_pipeline = failing("load", sd3.load_pipeline)
sys.argv = [script, *sys.argv[4:]]
runpy.run_path(script, run_name="__main__")
"""


def run_failing(tmp_path, tiny_model_dir, kind, fail_at, script="crd.py", args=None):
    wrapper = tmp_path / "failing_allocation.py"
    wrapper.write_text(FAILING_ALLOCATION)
    args = args or [*RUN, "--output-dir", str(tmp_path)]
    cmd = [sys.executable, str(wrapper), script, kind, str(fail_at), *args]
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    return zygote.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


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


def test_out_of_memory_in_the_first_iteration_leaves_a_summary_and_a_run_that_starts_again(
        tiny_model_dir, tmp_path):
    result = run_failing(tmp_path, tiny_model_dir, "no_grad", 1)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("crd.py: error: out of memory in the rollout of iteration 1 (")
    assert line.endswith("no checkpoint was saved")
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 0 and not summary["completed"]
    assert summary["stopped_by"].startswith("out of memory in the rollout of iteration 1")
    assert not list(run.glob("global_step_*"))
    again = zygote.run([sys.executable, "crd.py", *RUN, "--output-dir", str(tmp_path),
                            "--resume-from", "latest"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env={**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "a new run, replacing" in again.stdout and "summary.json" in again.stdout
    assert json.loads((run / "summary.json").read_text())["completed"]


def test_out_of_memory_while_loading_names_the_phase(tiny_model_dir, tmp_path):
    result = run_failing(tmp_path, tiny_model_dir, "load", 1)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("crd.py: error: out of memory in loading the models (")
    assert "--gradient-checkpointing" in line and line.endswith("no checkpoint was saved")


EVALUATE = ["--eval-data", str(DATA / "test.txt"), "--num-prompts", "8", "--batch-size", "4",
            "--model", "tiny", "--reward", "brightness", "--judge", "none", "--device", "cpu",
            "--resolution", "64", "--num-steps", "10", "--name", "base"]


@pytest.mark.long
@pytest.mark.parametrize("kind, fail_at, phase, kept", [
    ("load", 1, "loading the models", 0),
    # 10 steps of one transformer call per chunk of 4 prompts: the 15th is the second chunk's
    ("no_grad", 15, "the sampling of prompts 4-7", 4),  # the first chunk, sampled, is scored
    ("score", 2, "the scoring of prompts 4-7", 4),
])
def test_evaluate_out_of_memory_is_one_line_and_keeps_what_is_scored(kind, fail_at, phase, kept,
                                                                     tiny_model_dir, tmp_path):
    evaluate = [*EVALUATE, "--output-dir", str(tmp_path / "evals")]
    result = run_failing(tmp_path, tiny_model_dir, kind, fail_at, "evaluate.py", evaluate)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    results = tmp_path / "evals" / "base" / "results.jsonl"
    assert result.stderr.strip().splitlines()[-1] == (
        f"evaluate.py: error: out of memory in {phase} ("
        + re.search(r"\(([\d.]+ GiB peak resident memory on the CPU)\)", result.stderr).group(1)
        + "): lower --forward-batch-size (rows per transformer call) or --batch-size (the reward's"
        " batch), or move the text encoders with --text-encoder-device or the reward model with "
        f"--reward-device; {kept} of 8 prompts are scored in {results}; the same command continues")
    lines = results.read_text().splitlines()[1:]
    assert [json.loads(line)["index"] for line in lines] == list(range(kept))
    if not kept:  # nothing kept: the same command is an ordinary evaluation, tested elsewhere
        return
    again = zygote.run([sys.executable, "evaluate.py", *evaluate], cwd=ROOT, timeout=300,
                           env={**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)},
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{kept} of 8 prompts already scored" in again.stdout


@pytest.mark.parametrize("script", ["crd.py", "dgpo.py"])
def test_images_that_cannot_fit_stop_before_the_first_rollout_with_an_estimate(script,
                                                                              tiny_model_dir,
                                                                              tmp_path):
    """2 prompts x a million images: terabytes on any machine. The trainer stops right after
    loading, with the estimate and what it counts, instead of growing for minutes."""
    flags = [*RUN, "--group-size", "1000000", "--train-batch-size", "1000000"]
    started = time.monotonic()
    result = zygote.run([sys.executable, script, *flags, "--output-dir", str(tmp_path)],
                            cwd=ROOT, env={**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)},
                            capture_output=True, text=True, timeout=300)
    assert time.monotonic() - started < 120
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "error" in line]
    assert re.fullmatch(
        rf"{script}: error: --prompts-per-rank 2 x --group-size 1000000 = 2000000 images need "
        r"about ([\d.]+) GiB of the CPU's memory, which has [\d.]+ GiB available \(prompt "
        r"embeddings [\d.]+, latents [\d.]+, training rows and their reference and old velocities "
        r"[\d.]+, decoded images [\d.]+, activations of a policy forward of 3000000 rows [\d.]+ "
        r"GiB; the model and its other work come on top\): lower --group-size or "
        r"--prompts-per-rank, or --policy-timesteps-per-forward, or add --gradient-checkpointing",
        line)
    assert not (tmp_path / "run").exists()  # nothing was written
