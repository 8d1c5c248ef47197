"""Faults of issue 32 with real files, processes and signals: a full disk while a checkpoint's
optimizer.pt, the TensorBoard events file or evaluate.py's grid is written, two evaluate.py on one results directory, the
permissions of a checkpoint's files, and evaluate.py scoring a checkpoint as its run validated."""

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import tyro

import checkpoint
import crd
import evaluate
import lora_adapters
import run_summary
import sd3
from settings import ScoringArgs, flat_settings, with_settings
from test_trainers import ROOT
import zygote

# README's demo ("The two commands"): {flag: value}
DEMO = {"--model": "tiny", "--reward": "brightness", "--train-data": "tests/data/ocr/train.txt",
        "--eval-data": "tests/data/ocr/test.txt", "--resolution": "64", "--prompts-per-rank": "2",
        "--group-size": "4", "--num-iterations": "6", "--eval-every": "3", "--save-every": "3",
        "--eval-prompts": "8", "--eval-steps": "10", "--device": "cpu"}
# the demo stopped after its first iteration, validated and saved there; no PP-OCR judge (0.5 s an
# image here), which reads the validation images without changing them or the reward
SHORT_DEMO = {**DEMO, "--num-iterations": "1", "--eval-every": "1", "--save-every": "1",
              "--eval-judge": "none"}
# evaluate.py on the demo's held-out prompts and reward, without a protocol flag
SCORE_DEMO = ["--eval-data", "tests/data/ocr/test.txt", "--num-prompts", "8", "--reward",
              "brightness", "--judge", "none", "--device", "cpu"]


def command(script, flags, *extra):
    return [sys.executable, script, *[str(x) for pair in flags.items() for x in pair],
            *map(str, extra)]


def env(tiny_model_dir):
    return {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}


def file_size_limit(limit):
    """preexec_fn: the kernel refuses writes past `limit` bytes in any file (EFBIG, as a full disk
    refuses them with ENOSPC; Python ignores SIGXFSZ)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


@pytest.fixture(scope="module")
def demo(tiny_model_dir, tmp_path_factory):
    """The short demo's run directory, and evaluate.py's results directory of its checkpoint."""
    out = tmp_path_factory.mktemp("demo")
    zygote.run(command("crd.py", SHORT_DEMO, "--output-dir", out / "runs", "--run-name", "run"),
                   cwd=ROOT, env=env(tiny_model_dir), check=True, capture_output=True, timeout=600)
    run = out / "runs" / "run"
    zygote.run(command("evaluate.py", {}, "--checkpoint", run / "global_step_1", *SCORE_DEMO,
                           "--output-dir", out / "evals"),
                   cwd=ROOT, env=env(tiny_model_dir), check=True, capture_output=True, timeout=600)
    (results,) = (out / "evals").iterdir()
    return run, results


def scored(results_dir):
    """The prompt indices in results.jsonl, in their order (every line must be whole JSON)."""
    lines = (results_dir / "results.jsonl").read_text().splitlines()
    return [json.loads(line)["index"] for line in lines[1:]]


def test_evaluate_scores_a_checkpoint_as_its_run_validated(demo):
    """No protocol flag: the demo's 64 px, 10 steps, CFG 4.5, seeds 0.. and 256 T5 tokens come from
    the checkpoint, and the score is the run's own eval/reward_mean at that iteration, to the bit
    (the trainer averages the float32 rewards)."""
    run, results = demo
    evaluated = json.loads((results / "results.json").read_text())
    settings = evaluated["settings"]
    protocol = {key: settings[key] for key in ("resolution", "num_steps", "guidance", "seed",
                                               "max_sequence_length")}
    assert protocol == {"resolution": 64, "num_steps": 10, "guidance": 4.5, "seed": 0,
                        "max_sequence_length": 256}
    state = json.loads((run / "global_step_1" / "trainer_state.json").read_text())
    (logged,) = [reward for iteration, reward, _ in state["eval"] if iteration == 1]
    scores = np.array([r["score"] for r in evaluated["prompts"]], dtype=np.float32)
    assert len(scores) == 8 and float(np.mean(scores)) == logged
    assert evaluated["mean"] == pytest.approx(logged, rel=1e-6)


def test_protocol_flags_override_the_checkpoints_and_help_says_where_defaults_come_from(
        tmp_path, capsys, monkeypatch):
    """A flag given wins over the checkpoint's value, even when it is the recipe's; without a
    checkpoint the recipe's protocol stays the default."""
    args = {"resolution": 64, "eval_steps": 10, "eval_guidance": 1.0, "eval_seed": 7,
            "max_sequence_length": 96}
    (tmp_path / "trainer_state.json").write_text(json.dumps({"args": args}))
    given = tyro.cli(evaluate.Args, args=["--checkpoint", str(tmp_path), "--num-steps", "40"])
    assert evaluate.take_protocol(given) == {"--seed": 7, "--guidance": 1.0, "--resolution": 64,
                                             "--max-sequence-length": 96}
    assert (given.num_steps, given.guidance, given.seed) == (40, 1.0, 7)
    base = tyro.cli(evaluate.Args, args=[])
    evaluate.check_args(base)
    assert (base.resolution, base.num_steps, base.guidance, base.seed,
            base.max_sequence_length) == (512, 40, 4.5, 0, 256)
    args["eval_steps"] = "10"
    (tmp_path / "trainer_state.json").write_text(json.dumps({"args": args}))
    with pytest.raises(SystemExit, match=re.escape(
            f"--checkpoint {tmp_path}: its trainer_state.json records eval_steps '10', not a "
            "number; pass --num-steps")):
        evaluate.check_args(evaluate.Args(checkpoint=str(tmp_path)))
    monkeypatch.setenv("COLUMNS", "200")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        tyro.cli(evaluate.Args, args=["--help"])
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    for flag, field, recipe in [("--seed", "eval_seed", "0"), ("--num-steps", "eval_steps", "40"),
                                ("--guidance", "eval_guidance", "4.5"),
                                ("--resolution", "resolution", "512"),
                                ("--max-sequence-length", "max_sequence_length", "256")]:
        assert re.search(rf"{flag} (INT|FLOAT) .*?\(default: --checkpoint's {field}, else "
                         rf"{re.escape(recipe)}\)", text), flag


def test_evaluate_scores_the_adapter_the_checkpoint_records_unless_adapter_is_given(
        tmp_path, capsys, monkeypatch):
    """The adapter a checkpoint's run validated with (trainer_state.json's validation_adapter) is
    the default; --adapter wins; a checkpoint written before the record is scored with sampling,
    as then; a record that is not a name is one line."""
    state = {"args": {"resolution": 64}, "validation_adapter": "policy"}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    recorded = tyro.cli(evaluate.Args, args=["--checkpoint", str(tmp_path)])
    assert evaluate.take_protocol(recorded) == {"--adapter": "policy", "--resolution": 64}
    assert recorded.adapter == "policy"
    given = tyro.cli(evaluate.Args, args=["--checkpoint", str(tmp_path), "--adapter", "old"])
    assert evaluate.take_protocol(given) == {"--resolution": 64} and given.adapter == "old"
    (tmp_path / "trainer_state.json").write_text(json.dumps({"args": {"resolution": 64}}))
    old = tyro.cli(evaluate.Args, args=["--checkpoint", str(tmp_path)])
    assert evaluate.take_protocol(old) == {"--resolution": 64} and old.adapter == "sampling"
    (tmp_path / "trainer_state.json").write_text(json.dumps({**state, "validation_adapter": 5}))
    with pytest.raises(SystemExit, match=re.escape(
            f"--checkpoint {tmp_path}: its trainer_state.json records validation_adapter 5, not an "
            "adapter's name; pass --adapter")):
        evaluate.check_args(evaluate.Args(checkpoint=str(tmp_path)))
    monkeypatch.setenv("COLUMNS", "200")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        tyro.cli(evaluate.Args, args=["--help"])
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "(default: the one --checkpoint's run validated, else sampling)" in text


def test_a_full_disk_at_evaluates_grid_is_one_line_naming_it(demo, tiny_model_dir, tmp_path):
    """The same command again (every prompt scored) rewrites results.json and grid.png; the kernel
    refuses the grid's writes: one line naming grid.png, exit 1, results.jsonl intact, no cut
    PNG."""
    run, results = demo
    out = tmp_path / "evals"
    shutil.copytree(results, out / results.name)
    copied = out / results.name
    lines = (copied / "results.jsonl").read_text()
    grid, summary = (copied / "grid.png").stat().st_size, (copied / "results.json").stat().st_size
    assert grid > 2 * summary  # the limit below lets results.json through, not the grid
    failed = zygote.run(command("evaluate.py", {}, "--checkpoint", run / "global_step_1",
                                    *SCORE_DEMO, "--output-dir", out),
                            cwd=ROOT, env=env(tiny_model_dir), capture_output=True, text=True,
                            timeout=600, preexec_fn=file_size_limit((grid + summary) // 2))
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert failed.stderr.strip().splitlines()[-1] == (
        f"evaluate.py: error: cannot write {copied / 'grid.png'} (File too large): 8 of 8 prompts "
        f"are scored in {copied / 'results.jsonl'}; the same command continues once there is room")
    assert (copied / "results.jsonl").read_text() == lines and scored(copied) == list(range(8))
    assert not (copied / "grid.png").exists()


def test_a_second_evaluate_on_the_same_results_stops_naming_the_first(demo, tiny_model_dir,
                                                                      tmp_path):
    """Results of a run stopped after 6 of its 8 prompts: the first has read them and is about to
    score prompts 6 and 7 (stopped there by SIGSTOP); the second, on the same directory, stops at
    once with one line naming the first's pid instead of scoring them too. The first then ends
    with each prompt scored once."""
    run, results = demo
    out = tmp_path / "evals"
    shutil.copytree(results, out / results.name)
    lines = (out / results.name / "results.jsonl").read_text().splitlines(keepends=True)
    (out / results.name / "results.jsonl").write_text("".join(lines[:1 + 6]))
    more = command("evaluate.py", {}, "--checkpoint", run / "global_step_1", *SCORE_DEMO,
                   "--output-dir", out)
    first = subprocess.Popen(more, cwd=ROOT, env=env(tiny_model_dir), stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        for line in first.stdout:
            if "prompts already scored" in line:
                break
        first.send_signal(signal.SIGSTOP)
        second = zygote.run(more, cwd=ROOT, env=env(tiny_model_dir), capture_output=True,
                                text=True, timeout=600)
        first.send_signal(signal.SIGCONT)
        first.communicate(timeout=600)
    finally:
        first.kill()
    assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert second.stderr.strip().splitlines()[-1] == (
        f"evaluate.py: error: {out / results.name} is in use by another evaluate.py (pid "
        f"{first.pid}): wait for it to end; the same command then continues its results")
    assert first.returncode == 0
    assert scored(out / results.name) == list(range(8))


def mounted_tmpfs(path):
    """Mount a tmpfs at `path` (as root); skip where this machine does not let the test mount."""
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)]
    try:
        result = zygote.run(mount, capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command: a small tmpfs is what fills up here")
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs ({result.stderr.strip()}): it needs root")


def test_a_full_disk_at_optimizer_pt_stops_the_trainer_with_one_line_and_a_summary(
        demo, tiny_model_dir, tmp_path):
    """A real full disk (a tmpfs with room for the next checkpoint's LoRA and adapters and half
    its optimizer.pt): torch.save's RuntimeError used to escape as a traceback, with no summary.
    The resumed run stops with one line naming the latest complete checkpoint, which stays, and
    a summary.json saying why the run stopped."""
    run, _ = demo
    disk = tmp_path / "disk"
    mounted_tmpfs(disk)
    try:
        shutil.copytree(run, disk / "run")
        step = disk / "run" / "global_step_1"
        sizes = {p.name: p.stat().st_size for p in step.rglob("*") if p.is_file()}
        stat = os.statvfs(disk)
        used = (stat.f_blocks - stat.f_bfree) * stat.f_frsize
        # the new events file takes a few KiB of the half optimizer.pt left
        room = sum(sizes.values()) - sizes["optimizer.pt"] // 2
        zygote.run(["mount", "-o", f"remount,size={used + room}", str(disk)], check=True)
        resumed = zygote.run(command("crd.py", SHORT_DEMO, "--num-iterations", 2,
                                         "--eval-every", 0, "--resume-from", step),
                                 cwd=ROOT, env=env(tiny_model_dir), capture_output=True,
                                 text=True, timeout=600)
        assert resumed.returncode == 1 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
        message = ("could not write the checkpoint global_step_2 ([Errno 28] No space left on "
                   f"device: 'optimizer.pt'); the latest complete checkpoint is {step}")
        assert resumed.stderr.strip().splitlines()[-1] == f"crd.py: error: {message}"
        assert sorted(p.name for p in (disk / "run").glob("*global_step*")) == ["global_step_1"]
        assert {p.name: p.stat().st_size for p in step.rglob("*") if p.is_file()} == sizes
        summary = json.loads((disk / "run" / "summary.json").read_text())
        assert summary["completed"] is False and summary["stopped_by"] == message
        assert summary["iterations"] == 2
    finally:
        zygote.run(["umount", str(disk)], check=True)


def test_an_events_file_that_cannot_grow_stops_the_run_with_one_line_and_a_checkpoint(
        tiny_model_dir, tmp_path):
    """Every file limited to 400 kB: the checkpoints (adapters.safetensors 379 kB) fit, TensorBoard's
    events file (a validation grid an iteration, ~80 kB each) outgrows it. It used to print its
    writer thread's traceback and the main thread's, with no summary.json. Now: one line naming
    the events file and the checkpoint kept, a summary saying why, and --resume-from latest ends
    the run."""
    run = tmp_path / "runs" / "run"
    flags = {**DEMO, "--eval-every": "1", "--save-every": "2", "--eval-judge": "none"}
    stopped = zygote.run(command("crd.py", flags, "--output-dir", run.parent, "--run-name",
                                     "run"), cwd=ROOT, env=env(tiny_model_dir),
                             capture_output=True, text=True, timeout=600,
                             preexec_fn=file_size_limit(400_000))
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    why = "could not write the TensorBoard events file (File too large)"
    assert summary["completed"] is False and summary["stopped_by"] == why
    latest = run / f"global_step_{summary['iterations']}"
    assert 2 <= summary["iterations"] < 6 and latest.is_dir()
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"crd.py: error: {why}; the latest checkpoint is {latest}")
    resumed = zygote.run(command("crd.py", flags, "--output-dir", run.parent, "--run-name",
                                     "run", "--resume-from", "latest"),
                             cwd=ROOT, env=env(tiny_model_dir), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["completed"] is True


@pytest.fixture(scope="module")
def lora_transformer(tiny_model_dir):
    """The tiny transformer with rank-4 adapters."""
    pipe = sd3.load_pipeline(str(tiny_model_dir))
    lora_adapters.add_lora_adapters(pipe.transformer, 4, 4)
    return pipe.transformer


def large_optimizer():
    """An AdamW whose state (2 x 1.6 MB) is larger than the tiny model's adapters."""
    weight = torch.zeros(400_000, requires_grad=True)
    optimizer = torch.optim.AdamW([weight])
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    return optimizer


def run_state(tmp_path, iteration):
    """A trainer's state (start_state's fields) of a crd.py run of 2 iterations in tmp_path."""
    args = with_settings(crd.Args(num_iterations=2, train_batch_size=4), output_dir=str(tmp_path))
    return {"iteration": iteration, "optimizer_steps": iteration, "eval": [[0, 0.5, None]],
            "iteration_s": [1.0] * iteration, "start_iterations": [1], "peak_mem_gib": {},
            "sampler": {"epoch": 0, "position": 2}, "args": json.loads(json.dumps(flat_settings(args))),
            "world_size": 1, "algorithm": "crd"}


def refuse_writes_past(limit):
    """Writes of this process past `limit` bytes in a file fail (EFBIG) until the limit is reset."""
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limits[1]))
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, limits)


def test_optimizer_pt_that_cannot_be_written_is_a_run_error_naming_the_latest_checkpoint(
        lora_transformer, tmp_path):
    """torch.save's own write error is a RuntimeError without a reason; the checkpoint's
    optimizer.pt is written so that the kernel's error, and the file, are named."""
    optimizer = large_optimizer()
    checkpoint.save_checkpoint(tmp_path, 1, lora_transformer, optimizer, {"iteration": 1}, 2)
    adapters = (tmp_path / "global_step_1" / "adapters.safetensors").stat().st_size
    assert adapters < 1_000_000 < (tmp_path / "global_step_1" / "optimizer.pt").stat().st_size
    reset = refuse_writes_past(1_000_000)
    try:
        with pytest.raises(checkpoint.RunError) as error:
            checkpoint.save_checkpoint(tmp_path, 2, lora_transformer, optimizer,
                                       {"iteration": 2}, 2)
    finally:
        reset()
    assert str(error.value) == ("could not write the checkpoint global_step_2 ([Errno 27] File "
                                "too large: 'optimizer.pt'); the latest complete checkpoint is "
                                f"{tmp_path / 'global_step_1'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1"]


@pytest.mark.parametrize("before", [None, "SIGTERM"])
def test_a_last_iteration_that_cannot_be_saved_ends_with_a_summary_saying_why(
        before, lora_transformer, tmp_path):
    """The trainers' save at the end (and every --save-every): one line, exit 1, and a summary of
    a run that did not complete, whose stopped_by is that line (after what had stopped it)."""
    optimizer = large_optimizer()
    checkpoint.save_checkpoint(tmp_path, 1, lora_transformer, optimizer, run_state(tmp_path, 1), 2)
    stopped = {"stopped_by": before} if before else {}  # the trainers' call passes none today
    reset = refuse_writes_past(1_000_000)
    try:
        with pytest.raises(SystemExit) as exit_:
            run_summary.save_last_iteration(tmp_path, run_state(tmp_path, 2), lora_transformer,
                                           optimizer, 2, **stopped)
    finally:
        reset()
    failure = ("could not write the checkpoint global_step_2 ([Errno 27] File too large: "
               f"'optimizer.pt'); the latest complete checkpoint is {tmp_path / 'global_step_1'}")
    assert exit_.value.code == f"{Path(sys.argv[0]).name}: error: {failure}"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] is False and summary["iterations"] == 2
    assert summary["stopped_by"] == (f"{before}; then {failure}" if before else failure)
    assert summary["algorithm"] == "crd" and summary["reward"] == ScoringArgs.reward


@pytest.mark.parametrize("umask, files, folders", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_every_file_of_a_checkpoint_follows_the_umask(umask, files, folders, lora_transformer,
                                                      tmp_path):
    """safetensors wrote adapters.safetensors and the exported LoRA 0600 whatever the umask: a
    teammate could read optimizer.pt but not the weights."""
    optimizer = torch.optim.AdamW(lora_adapters.lora_parameters(lora_transformer))
    previous = os.umask(umask)
    try:
        step = checkpoint.save_checkpoint(tmp_path, 1, lora_transformer, optimizer,
                                          {"iteration": 1}, 2)
    finally:
        os.umask(previous)
    modes = {str(p.relative_to(step)): p.stat().st_mode & 0o777 for p in step.rglob("*")}
    assert {"adapters.safetensors", "optimizer.pt", "trainer_state.json", "policy_lora",
            "policy_lora/pytorch_lora_weights.safetensors"} <= modes.keys()
    expected = {name: folders if (step / name).is_dir() else files for name in modes}
    assert modes == expected and step.stat().st_mode & 0o777 == folders
