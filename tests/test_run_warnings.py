"""What spoils training without stopping it is said on the console (issue 32 point 9), once a run,
naming the iteration, and counted at its end: rollout and validation images that are NaN or inf
(a diverged adapter; they decode black and score as black images), and an iteration whose every
prompt group got one reward (std 0: no learning signal)."""

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ocr_server import ocr_server
import zygote

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "ocr"
RUN = ["--model", "tiny", "--device", "cpu", "--train-data", str(DATA / "train.txt"),
       "--eval-data", str(DATA / "test.txt"), "--resolution", "64", "--prompts-per-rank", "2",
       "--group-size", "4", "--eval-prompts", "2", "--eval-steps", "2", "--eval-judge", "none",
       "--max-sequence-length", "96", "--run-name", "run"]
ONCE = "(warned once: the end of the run counts them)"


def train(tiny_model_dir, out, *extra):
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    cmd = [sys.executable, "crd.py", *RUN, "--output-dir", str(out), *map(str, extra)]
    result = zygote.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stdout.splitlines()


@pytest.mark.long
def test_nan_images_of_a_diverged_sampling_adapter_are_warned_once_and_counted(tiny_model_dir,
                                                                               tmp_path):
    """A checkpoint whose sampling adapter holds a NaN weight (as a diverged EMA would) renders NaN
    images: iterations 2 and 3 roll out and validate with it (every step is skipped as
    non-finite, so no adapter moves), and their black images all score 0.0."""
    train(tiny_model_dir, tmp_path, "--reward", "brightness", "--num-iterations", 1,
          "--eval-every", 1)
    adapters = tmp_path / "run" / "global_step_1" / "adapters.safetensors"
    tensors = load_file(adapters)
    key = next(k for k in sorted(tensors) if k.startswith("sampling.") and ".lora_B." in k)
    tensors[key] = torch.full_like(tensors[key], float("nan"))
    save_file(tensors, adapters)
    lines = train(tiny_model_dir, tmp_path, "--reward", "brightness", "--num-iterations", 3,
                  "--eval-every", 1, "--max-nonfinite-steps", 100, "--resume-from",
                  adapters.parent)
    warnings = [line for line in lines if "warning" in line]
    assert warnings == [
        "iteration 2: warning: 8 of 8 rollout images are NaN or inf (a diverged policy?): they "
        f"decode black and are scored as black images {ONCE}",
        "iteration 2: warning: every prompt group's images got the same reward (std 0 in all 2 "
        "groups): the advantages are 0, so the reward gives no learning signal (a constant "
        f"reward?) {ONCE}",
        "the validation after iteration 2: warning: 2 of 2 validation images are NaN or inf (a "
        "diverged sampling adapter?): they decode black and are scored as black images "
        f"{ONCE}",
        "warning: rollout images were NaN or inf 2 time(s), first in iteration 2",
        "warning: every prompt group's reward had std 0 2 time(s), first in iteration 2",
        "warning: validation images were NaN or inf 2 time(s), first in the validation after "
        "iteration 2"]


def test_a_constant_reward_is_warned_once_and_counted(tiny_model_dir, tmp_path):
    """A reward server that reads no text in any image (scores all 0): no learning signal."""
    with ocr_server(read=lambda image: "") as (url, server):
        lines = train(tiny_model_dir, tmp_path, "--reward", "vllm", "--reward-urls", url,
                      "--num-iterations", 2, "--eval-every", 0)
    warnings = [line for line in lines if "warning" in line]
    assert warnings == [
        "iteration 1: warning: every prompt group's images got the same reward (std 0 in all 2 "
        "groups): the advantages are 0, so the reward gives no learning signal (a constant "
        f"reward?) {ONCE}",
        "warning: every prompt group's reward had std 0 2 time(s), first in iteration 1"]
