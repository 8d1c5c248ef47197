"""A resume of a run that has done all its --num-iterations (issue 32 point 9): one line naming the
run and its last checkpoint, and how to train longer; nothing is written, no TensorBoard events
file is added. A checkpoint named by hand is a rerun by mistake (exit 1); --resume-from latest,
what run.sh passes with RUN_NAME and what a requeued job or a restart runs again, exits 0, and
run.sh then starts no reward server."""

import os
import sys
from pathlib import Path

import pytest

from test_run_sh import fake_tools, free_port, run_sh
import zygote

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "ocr"
RUN = ["--model", "tiny", "--reward", "brightness", "--device", "cpu", "--train-data",
       str(DATA / "train.txt"), "--eval-data", str(DATA / "test.txt"), "--resolution", "64",
       "--prompts-per-rank", "2", "--group-size", "4", "--num-iterations", "1",
       "--eval-every", "0", "--max-sequence-length", "96"]


def train(tiny_model_dir, out, *extra):
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    cmd = [sys.executable, "crd.py", *RUN, "--output-dir", str(out), *map(str, extra)]
    return zygote.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def listing(run):
    """Every file of the run directory with its size and modification time."""
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*"))}


@pytest.fixture(scope="module")
def complete_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("complete")
    done = train(tiny_model_dir, out, "--run-name", "run")
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "run"


@pytest.mark.parametrize("resume, code", [("checkpoint", 1), ("latest", 0)])
def test_resuming_a_complete_run_says_so_and_writes_nothing(resume, code, complete_run,
                                                            tiny_model_dir):
    before = listing(complete_run)
    assert len(list(complete_run.glob("events.out.tfevents.*"))) == 1
    step = complete_run / "global_step_1"
    flags = (["--resume-from", step] if resume == "checkpoint"
             else ["--run-name", "run", "--resume-from", "latest"])
    result = train(tiny_model_dir, complete_run.parent, *flags)
    assert result.returncode == code and "Traceback" not in result.stderr, result.stderr[-3000:]
    message = (f"{complete_run} is complete: its global_step_1 has done all 1 iterations "
               "(--num-iterations); to train it longer, resume it with a larger --num-iterations")
    if code:
        assert result.stderr.strip().splitlines() == [f"crd.py: error: {message}"]
    else:
        assert result.stdout.strip().splitlines()[-1] == f"crd.py: {message}"
        assert result.stderr == ""
    assert listing(complete_run) == before


def test_run_sh_with_run_name_of_a_complete_run_exits_0_without_a_reward_server(
        tiny_model_dir, tmp_path):
    """The same command twice, as a requeued job runs it: the second finds the run complete in its
    --dry-run and ends there, before it would wait for a reward server."""
    env = {**fake_tools(tmp_path), "CRD_CACHE": str(tiny_model_dir.parent),
           "OUTPUT_DIR": str(tmp_path / "runs"), "REWARD_PORT": str(free_port()),
           "TRAIN_DATA": str(DATA / "train.txt"), "EVAL_DATA": str(DATA / "test.txt"),
           "GROUP_SIZE": "2", "IMAGE_RESOLUTION": "64", "TOTAL_TRAINING_STEPS": "1",
           "EVAL_PROMPTS": "3", "RUN_NAME": "done"}
    flags = ["--model", "tiny", "--device", "cpu", "--prompts-per-rank", "1", "--eval-every", "0",
             "--text-encoder-device", "cpu"]
    first = run_sh(env, "crd", *flags)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "runs" / "done"
    before = listing(run)
    again = run_sh(env, "crd", *flags)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert again.stdout.strip().splitlines()[-1] == (
        f"crd.py: {run} is complete: its global_step_1 has done all 1 iterations "
        "(--num-iterations); to train it longer, resume it with a larger --num-iterations")
    assert "vllm serve" not in again.stdout
    assert listing(run) == before
