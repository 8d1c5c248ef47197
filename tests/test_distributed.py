"""crd.py under torchrun on CPU (gloo, 2 processes, tiny model): the world size must not change the training.

1 process with 2 groups per optimizer step vs 2 processes with 1 group each (gradients all-reduced): the same
adapters and logs; every rank holds the same adapters and optimizer state; a resume under torchrun continues exactly.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard_logs import scalars

import crd

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data" / "ocr"
TINY_RUN = ["--model", "tiny", "--reward", "brightness", "--device", "cpu", "--train-data", str(DATA / "train.txt"),
            "--eval-data", str(DATA / "test.txt"), "--resolution", "64", "--eval-prompts", "4", "--eval-steps", "4",
            "--learning-rate", "3e-3", "--group-size", "4", "--eval-every", "0", "--save-every", "1",
            "--max-sequence-length", "96"]  # as tests/test_trainers.py
TIMEOUT = 180  # seconds per run; a run takes ~10 s on 2 CPU cores
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID")

# Runs crd.py unchanged as __main__ on every rank; when it exits (a distributed trainer ends in os._exit), writes that
# rank's adapters and optimizer moments, which the trainer itself only saves on rank 0, from the trainer's globals.
# Usage: python WRAPPER ROOT OUT_DIR [crd.py arguments...]
RANK_DUMP = '''
import os, runpy, sys
from pathlib import Path
root, out = Path(sys.argv[1]), Path(sys.argv[2])
sys.argv = [str(root / "crd.py"), *sys.argv[3:]]
sys.path.insert(0, str(root))
exit_now = os._exit

def dump_then_exit(code):
    frame = sys._getframe(1)
    while "optimizer" not in frame.f_globals:  # the trainer's own frame, below its Run's
        frame = frame.f_back
    run = frame.f_globals
    from safetensors.torch import save_file
    from lora_adapters import lora_state_dict
    tensors = {f"{name}.{key}": value.contiguous() for name in ("policy", "old", "sampling")
               for key, value in lora_state_dict(run["transformer"], name).items()}
    for i, param_state in run["optimizer"].state_dict()["state"].items():
        tensors.update({f"adam.{i}.{key}": value.reshape(-1).contiguous() for key, value in param_state.items()})
    save_file(tensors, out / f"rank{run['run'].rank}.safetensors")
    exit_now(code)

os._exit = dump_then_exit
runpy.run_path(str(root / "crd.py"), run_name="__main__")
'''


def start(tiny_model_dir, out_dir, *extra, nproc=2, script="crd.py", script_args=()):
    """Start crd.py (or `script`) on the tiny model, under torchrun when nproc > 1, in a session of its own:
    (process, command)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env["CRD_CACHE"] = str(tiny_model_dir.parent)
    launcher = [sys.executable]
    if nproc > 1:
        env["OMP_NUM_THREADS"] = "1"  # 2 ranks on 2 cores
        launcher += ["launch.py", "--standalone", "--nproc-per-node", str(nproc)]  # torchrun, with the shell's exit codes
    cmd = [*launcher, script, *map(str, script_args), *TINY_RUN, "--output-dir", str(out_dir), *map(str, extra)]
    process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    return process, cmd


def train(tiny_model_dir, out_dir, *extra, nproc=2, script="crd.py", script_args=()):
    """Run crd.py (or `script`) to its end (see `start`); the whole process tree is killed on timeout."""
    process, cmd = start(tiny_model_dir, out_dir, *extra, nproc=nproc, script=script, script_args=script_args)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its workers: the session started above
        stdout, stderr = process.communicate()
        raise AssertionError(f"{' '.join(cmd)} timed out after {TIMEOUT} s:\n{stderr[-3000:]}") from None
    if process.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({process.returncode}):\n{stderr[-3000:]}")
    return stdout


def adapters(run_dir, step):
    return load_file(run_dir / f"global_step_{step}" / "adapters.safetensors")


def norm(tensors):
    return float(sum(t.double().square().sum() for t in tensors).sqrt())


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    """1 process, 2 groups of 4, both in one optimizer step, 2 iterations: the run directory."""
    out = tmp_path_factory.mktemp("one_process")
    train(tiny_model_dir, out, "--run-name", "run", "--num-iterations", 2, "--prompts-per-rank", 2,
          "--train-batch-size", 8, nproc=1)
    return out / "run"


@pytest.fixture(scope="module")
def two_processes(tiny_model_dir, tmp_path_factory):
    """2 processes, 1 group of 4 each, one optimizer step per rank and iteration, 2 iterations: the run directory."""
    out = tmp_path_factory.mktemp("two_processes")
    train(tiny_model_dir, out, "--run-name", "run", "--num-iterations", 2, "--prompts-per-rank", 1)
    return out / "run"


def test_two_processes_train_like_one_process_on_the_same_global_batch(one_process, two_processes):
    before = adapters(one_process, 1)
    for step in (1, 2):
        ours, theirs = adapters(two_processes, step), adapters(one_process, step)
        assert ours.keys() == theirs.keys()
        # Float noise from other batch shapes (8 vs 4 images per forward) is magnified by Adam on near-zero gradients in
        # a few elements; a real mismatch (other prompts, noise or timesteps on a rank) moves nearly all of them by ~lr.
        far = sum(int(((ours[k] - theirs[k]).abs() > 1e-4).sum()) for k in ours) / sum(t.numel() for t in ours.values())
        assert far < 5e-3, (step, far)
        if step == 2:  # the gap is far smaller than what one iteration changes
            gap, change = norm(ours[k] - theirs[k] for k in ours), norm(theirs[k] - before[k] for k in theirs)
            assert gap < 0.05 * change, (gap, change)
    for tag in ("train/reward_mean", "train/reward_std", "charts/grad_norm"):
        logged, expected = scalars(two_processes, tag), scalars(one_process, tag)
        assert logged == pytest.approx(expected, rel=1e-4) and sorted(logged) == [1, 2], tag


def test_snapshot_decays_count_two_steps_per_iteration_at_any_world_size(one_process, two_processes):
    """Both runs take 1 optimizer step per iteration (test_trainers' runs take 2): the EMA schedules still read
    k = 2 x iterations done."""
    args = crd.Args()
    for run in (one_process, two_processes):
        assert scalars(run, "charts/decay_old") == pytest.approx({n: crd.ema_decay(2 * n, *args.old_decay) for n in (1, 2)})
        assert scalars(run, "charts/decay_sampling") == pytest.approx({1: 0.0, 2: 0.0})


def test_two_processes_log_the_losses_of_one_process(one_process, two_processes):
    for tag in ("losses/loss", "losses/policy_loss", "losses/kl_loss"):
        logged, expected = scalars(two_processes, tag), scalars(one_process, tag)
        assert logged == pytest.approx(expected, rel=1e-4) and sorted(logged) == [1, 2], tag


def test_every_rank_holds_the_same_adapters_and_optimizer_state(tiny_model_dir, tmp_path):
    """Each rank dumps its own state at the end (a runpy wrapper around the unchanged crd.py). Rank 0 alone validates
    after every iteration, which must not make the ranks drift apart."""
    wrapper = tmp_path / "rank_dump.py"
    wrapper.write_text(RANK_DUMP)
    train(tiny_model_dir, tmp_path, "--run-name", "run", "--num-iterations", 2, "--prompts-per-rank", 1,
          "--eval-every", 1, script=wrapper, script_args=(ROOT, tmp_path))
    rank0, rank1 = load_file(tmp_path / "rank0.safetensors"), load_file(tmp_path / "rank1.safetensors")
    assert rank0.keys() == rank1.keys() and any(k.startswith("adam.") for k in rank0)
    assert [k for k in rank0 if not torch.equal(rank0[k], rank1[k])] == []
    saved = adapters(tmp_path / "run", 2)  # what rank 0 saved is what every rank trained
    assert all(torch.equal(saved[k], rank1[k]) for k in saved)
    assert any(v.abs().max() > 0 for k, v in saved.items() if k.startswith("policy.") and "lora_B" in k)  # it trained


def test_resume_under_torchrun_continues_exactly(two_processes, tiny_model_dir, tmp_path):
    """2 processes: 1 iteration, then a resume for 1 more: the adapters and logs of the uninterrupted run."""
    train(tiny_model_dir, tmp_path, "--run-name", "run", "--num-iterations", 1, "--prompts-per-rank", 1)
    resumed = tmp_path / "run"
    train(tiny_model_dir, tmp_path, "--num-iterations", 2, "--prompts-per-rank", 1,
          "--resume-from", resumed / "global_step_1")
    ours, expected = adapters(resumed, 2), adapters(two_processes, 2)
    assert ours.keys() == expected.keys() and [k for k in ours if not torch.equal(ours[k], expected[k])] == []
    for tag in ("train/reward_mean", "losses/loss", "charts/grad_norm"):
        logged, straight = scalars(resumed, tag), scalars(two_processes, tag)
        assert logged == {step: straight[step] for step in logged} and max(logged) == 2, tag  # as test_trainers


def test_resume_at_another_world_size(two_processes, tiny_model_dir, tmp_path):
    """A 2-process checkpoint resumed by 1 process holding both groups continues the same training."""
    train(tiny_model_dir, tmp_path, "--run-name", "run", "--num-iterations", 1, "--prompts-per-rank", 1)
    resumed = tmp_path / "run"
    train(tiny_model_dir, tmp_path, "--num-iterations", 2, "--prompts-per-rank", 2, "--train-batch-size", 8,
          "--resume-from", resumed / "global_step_1", nproc=1)
    ours, theirs, before = adapters(resumed, 2), adapters(two_processes, 2), adapters(two_processes, 1)
    gap, change = norm(ours[k] - theirs[k] for k in ours), norm(theirs[k] - before[k] for k in theirs)
    assert gap < 0.05 * change, (gap, change)
    assert scalars(resumed, "train/reward_mean")[2] == pytest.approx(scalars(two_processes, "train/reward_mean")[2], rel=1e-4)


def test_summary_holds_the_peak_memory_of_every_rank(two_processes):
    summary = json.loads((two_processes / "summary.json").read_text())
    assert summary["world_size"] == 2 and sorted(summary["peak_mem_gib"]) == ["actor rank 0 cpu", "actor rank 1 cpu"]
    assert all(peak > 0 for peak in summary["peak_mem_gib"].values())


def test_sigterm_under_torchrun_stops_every_rank_with_a_checkpoint(tiny_model_dir, tmp_path):
    """SIGTERM to the launcher's process group, as a scheduler or `timeout` sends it (torchrun starts each worker in a
    session of its own and forwards the signal): the workers finish the iteration, rank 0 saves a complete checkpoint
    once and records the stop, and the launcher exits 143 with one line, no traceback from it or any worker."""
    process, _ = start(tiny_model_dir, tmp_path, "--run-name", "run", "--num-iterations", 1000, "--save-every", 1000,
                       "--prompts-per-rank", 1)
    deadline = time.time() + TIMEOUT
    while not list(tmp_path.glob("run/events.*")) and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)
    try:
        _, stderr = process.communicate(timeout=TIMEOUT)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 143 and "Traceback" not in stderr, stderr[-3000:]
    assert "launch.py: stopped by SIGTERM, which torchrun forwarded to the ranks" in stderr
    (saved,) = (tmp_path / "run").glob("*global_step_*")  # one, complete (no temporary directory left)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] is False and summary["stopped_by"] == "SIGTERM" and summary["world_size"] == 2
    assert summary["iterations"] == int(saved.name.split("_")[-1]) >= 1
    # rank 0 names the ranks the signal reached (both, unless one got it an iteration later) and their host
    assert re.search(rf"^crd\.py: SIGTERM reached (ranks 0, 1|rank [01]) on {re.escape(socket.gethostname())}: every "
                     rf"rank stopped after iteration {summary['iterations']}; --resume-from latest continues$",
                     stderr, re.M), stderr[-3000:]
    state = json.loads((saved / "trainer_state.json").read_text())
    assert state["iteration"] == summary["iterations"] and state["world_size"] == 2
    assert {key.split(".")[0] for key in adapters(tmp_path / "run", state["iteration"])} == {"policy", "old", "sampling"}
    assert torch.load(saved / "optimizer.pt", weights_only=True)["state"]  # Adam moments: it trained


# a rank that stands for a trainer: it waits for a stop, "saves" and exits as the trainers do
STOPPABLE_RANK = '''
import os, sys, time
sys.path.insert(0, sys.argv[1])
import distributed
stop = distributed.GracefulStop()
print("started", os.environ["RANK"], os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE"), flush=True)
while stop.signum is None and len(sys.argv) < 3:
    time.sleep(0.01)
print("saved", os.environ["RANK"], stop.signum, flush=True)
sys.exit(128 + stop.signum if stop.signum else 0)
'''


def launch(tmp_path, *torchrun_args, script_args=()):
    (tmp_path / "rank.py").write_text(STOPPABLE_RANK)
    env = {k: v for k, v in os.environ.items()
           if k not in DIST_ENV and k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    cmd = [sys.executable, "launch.py", "--standalone", *torchrun_args, str(tmp_path / "rank.py"),
           str(ROOT), *script_args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def test_sigusr1_to_launch_py_stops_the_ranks_as_sigterm(tmp_path):
    """Slurm's --signal=USR1: launch.py has torchrun forward SIGTERM to the ranks, which save and
    exit 143, and says so in one line; without it, SIGUSR1 would kill torchrun's agent at once."""
    process = launch(tmp_path, "--nproc-per-node", "2")
    try:
        started = [process.stdout.readline() for _ in range(2)]
        assert sorted(line.split()[:2] for line in started) == [["started", "0"], ["started", "1"]]
        os.kill(process.pid, signal.SIGUSR1)
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 143 and "Traceback" not in stderr, stderr[-3000:]
    assert sorted(line for line in stdout.splitlines() if line.startswith("saved")) == [
        "saved 0 15", "saved 1 15"]
    assert stdout.count("SIGTERM: finishing this iteration") == 2  # torchrun's SIGTERM, not USR1
    assert stderr.splitlines()[-1] == (
        "launch.py: stopped by SIGUSR1 (handled as SIGTERM), which torchrun forwarded to the ranks "
        "(they save at the end of their iteration)")


@pytest.mark.parametrize("restarts", [0, 1])
def test_launch_py_gives_restarted_ranks_a_store_of_their_own(tmp_path, restarts):
    """With --max-restarts, launch.py sets what a restart after a killed rank 0 needs (run.sh no
    longer does it for it): the ranks see TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""
    process = launch(tmp_path, "--nproc-per-node", "1", "--max-restarts", str(restarts),
                     script_args=["--no-wait"])
    stdout, stderr = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0, stderr[-3000:]
    assert stdout.splitlines()[0] == f"started 0 {'1' if restarts else None}"
