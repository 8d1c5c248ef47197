"""Run management (checkpoint.py and the trainers' use of it): full disks, permissions, stale temporary checkpoints,
old and damaged checkpoints, resume rules at another world size, --overwrite, an empty run's summary, the --help text,
EMA schedules that would leave [0, 1] and settings out of their range."""

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoint
import crd
from data import GroupSampler
import dgpo
import distributed
import lora_adapters
import ocr_reward
from ocr_server import ocr_server
import run_dirs
from scoring import GuardedScorer
import sd3
from settings import OutputArgs, ScoringArgs, flat_settings, with_settings
from test_trainers import DATA, ROOT, TINY_RUN, train
import zygote


@pytest.fixture(scope="module")
def lora_transformer(tiny_model_dir):
    """The tiny transformer with rank-4 adapters, and an AdamW over its policy adapter."""
    pipe = sd3.load_pipeline(str(tiny_model_dir))
    lora_adapters.add_lora_adapters(pipe.transformer, 4, 4)
    return pipe.transformer, torch.optim.AdamW(lora_adapters.lora_parameters(pipe.transformer))


def test_a_full_disk_keeps_the_latest_complete_checkpoint_and_says_which(lora_transformer, tmp_path):
    """A real write error (the file-size limit makes the kernel refuse the write, as a full disk does): one line,
    no temporary directory left, the previous checkpoint intact."""
    transformer, optimizer = lora_transformer
    checkpoint.save_checkpoint(tmp_path, 1, transformer, optimizer, {"iteration": 1}, keep_last=2)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))  # Python ignores SIGXFSZ: writes fail with EFBIG
    try:
        with pytest.raises(checkpoint.RunError) as error:
            checkpoint.save_checkpoint(tmp_path, 2, transformer, optimizer, {"iteration": 2}, keep_last=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert "could not write the checkpoint global_step_2 (" in str(error.value) and "File too large" in str(error.value)
    assert str(error.value).endswith(f"the latest complete checkpoint is {tmp_path / 'global_step_1'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1"]
    assert json.loads((tmp_path / "global_step_1" / "trainer_state.json").read_text()) == {"iteration": 1}


def test_checkpoints_follow_the_umask_and_keep_last_0_keeps_all(lora_transformer, tmp_path):
    transformer, optimizer = lora_transformer
    umask = os.umask(0o022)
    try:
        for iteration in (1, 2, 3):
            checkpoint.save_checkpoint(tmp_path, iteration, transformer, optimizer, {"iteration": iteration}, keep_last=0)
    finally:
        os.umask(umask)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["global_step_1", "global_step_2", "global_step_3"]
    assert (tmp_path / "global_step_3").stat().st_mode & 0o777 == 0o755  # readable by the team, as the umask says
    assert (tmp_path / "global_step_3" / "optimizer.pt").stat().st_mode & 0o777 == 0o644
    checkpoint.save_checkpoint(tmp_path, 4, transformer, optimizer, {"iteration": 4}, keep_last=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["global_step_3", "global_step_4"]


def test_claiming_a_run_directory_removes_stale_temporary_checkpoints(tmp_path):
    (tmp_path / ".global_step_5.x7rq2m").mkdir()  # what `kill -9` during a save leaves
    (tmp_path / "global_step_4").mkdir()
    lock = run_dirs.claim_run_directory(tmp_path, resuming=True, overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_4", "run.lock"]
    assert (tmp_path / "run.lock").read_text() == str(os.getpid())
    lock.close()


@pytest.mark.parametrize("torchrun", [False, True])
def test_a_repeated_signal_exits_at_once_except_under_torchrun(torchrun, monkeypatch):
    """Real signals to this process: the first asks for a stop; a copy within a second is the same request; the same
    signal later exits 128 + signal, unless torchrun (which forwards its own copy) launched us; another signal never
    exits."""
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = distributed.GracefulStop()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # a process group's copy
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGINT
        time.sleep(stop.SAME_REQUEST_S)
        if torchrun:
            os.kill(os.getpid(), signal.SIGINT)
        else:
            with pytest.raises(SystemExit) as exit_:
                os.kill(os.getpid(), signal.SIGINT)
            assert exit_.value.code == 130
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def test_a_signal_to_the_trainer_and_then_to_its_process_group_stops_it_gracefully(tmp_path):
    """GNU timeout sends SIGTERM to the trainer and then to its process group, and Slurm to every process of a job: the
    trainer gets two copies, milliseconds apart. It still finishes its iteration and saves (here: a wait that stands
    for them), instead of exiting at the second copy without a checkpoint."""
    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import distributed\n"
        "stop = distributed.GracefulStop()\n"
        "print('started', flush=True)\n"
        "while stop.signum is None:\n"
        "    time.sleep(0.01)\n"
        "time.sleep(0.5)  # the rest of the iteration and the checkpoint\n"
        "print('saved', flush=True)\n"
        "sys.exit(128 + stop.signum)\n")
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    assert process.stdout.readline() == "started\n"
    os.kill(process.pid, signal.SIGTERM)
    time.sleep(0.05)
    os.killpg(process.pid, signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert "saved" in stdout and "exiting now" not in stderr, stderr
    assert process.returncode == 128 + signal.SIGTERM


def test_sigusr1_stops_a_trainer_as_sigterm(tmp_path):
    """Slurm's pre-emption warning (--signal=USR1@...): the trainer finishes its iteration, saves and
    exits 143, which crd.sbatch requeues; a SIGTERM copy of the same request is not a second one."""
    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import distributed\n"
        "stop = distributed.GracefulStop()\n"
        "print('started', flush=True)\n"
        "while stop.signum is None:\n"
        "    time.sleep(0.01)\n"
        "time.sleep(0.5)  # the rest of the iteration and the checkpoint\n"
        "print('saved', flush=True)\n"
        "sys.exit(128 + stop.signum)\n")
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    assert process.stdout.readline() == "started\n"
    os.kill(process.pid, signal.SIGUSR1)
    time.sleep(0.05)
    os.kill(process.pid, signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert stdout.splitlines() == ["SIGUSR1 (handled as SIGTERM): finishing this iteration, then saving a "
                                   "checkpoint (SIGTERM again to exit at once)", "saved"], stderr
    assert process.returncode == 128 + signal.SIGTERM


def test_a_trainer_state_lacking_a_field_is_named(tmp_path):
    """No released version wrote a trainer_state.json without these fields: one lacking them is
    damaged, and named in one line rather than filled in."""
    (tmp_path / "trainer_state.json").write_text(json.dumps({"iteration": 4, "global_step": 16, "peak_mem_gib": 3.5,
                                                             "args": {}, "sampler": {"epoch": 0, "position": 8},
                                                             "eval": [[0, 0.5], [4, 0.75]], "iteration_s": [9.0] * 4}))
    with pytest.raises(checkpoint.RunError, match='"optimizer_steps" must be a whole number >= 0$'):
        checkpoint.read_checkpoint_state(tmp_path)


def test_a_damaged_checkpoint_or_run_directory_is_named_before_the_model_loads(lora_transformer, tmp_path):
    transformer, optimizer = lora_transformer
    args = with_settings(crd.Args(train_batch_size=6, lora_rank=4, lora_alpha=4), output_dir=str(tmp_path))
    state = {"iteration": 1, "optimizer_steps": 4, "sampler": {"epoch": 0, "position": 2}, "eval": [],
             "iteration_s": [1.0], "start_iterations": [1], "peak_mem_gib": {}, "world_size": 1,
             "algorithm": "crd", "data_sha256": {}, "args": json.loads(json.dumps(flat_settings(args)))}
    (tmp_path / "run").mkdir()
    checkpoint.save_checkpoint(tmp_path / "run", 1, transformer, optimizer, state, keep_last=2)
    step = tmp_path / "run" / "global_step_1"

    def resume(path):
        with pytest.raises(checkpoint.RunError) as error:
            run_dirs.prepare_run(with_settings(args, resume_from=str(path)), "crd", 1, True)
        return str(error.value)

    assert "--resume-from" in resume(tmp_path / "run") and "not a checkpoint directory" in resume(tmp_path / "run")
    (step / "trainer_state.json").write_text("[]")
    assert resume(step) == f"--resume-from {step}: {step / 'trainer_state.json'} is not a trainer state (no args, " \
                           "iteration and sampler)"
    (step / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(checkpoint.RunError, match=re.escape(f"--num-iterations 0: {step} has done 1 iterations already")):
        run_dirs.prepare_run(with_settings(args, resume_from=str(step), num_iterations=0), "crd", 1, True)
    adapters = (step / "adapters.safetensors").read_bytes()
    (step / "adapters.safetensors").write_bytes(adapters[:100])
    assert resume(step).startswith(f"{step / 'adapters.safetensors'}: not a readable safetensors file (")
    (step / "adapters.safetensors").write_bytes(adapters)
    optimizer_state = (step / "optimizer.pt").read_bytes()
    (step / "optimizer.pt").unlink()
    assert resume(step) == f"--resume-from {step}: no optimizer.pt in this checkpoint"
    (step / "optimizer.pt").write_bytes(optimizer_state[: len(optimizer_state) // 2])
    with pytest.raises(checkpoint.RunError, match=re.escape(f"{step / 'optimizer.pt'}: not a readable optimizer state")):
        checkpoint.load_checkpoint(step, transformer, optimizer, "cpu")

    (tmp_path / "file").write_text("")
    for dry_run in (False, True):
        with pytest.raises(checkpoint.RunError, match=re.escape(f"cannot create the run directory {tmp_path}/file/r")):
            run_dirs.prepare_run(with_settings(crd.Args(), output_dir=str(tmp_path / "file"), run_name="r",
                                               dry_run=dry_run), "crd", 1, True)
    with pytest.raises(checkpoint.RunError, match=re.escape(f"{tmp_path}/file/r: {tmp_path}/file is a file, not a")):
        run_dirs.prepare_run(with_settings(crd.Args(), output_dir=str(tmp_path / "file"), run_name="r", dry_run=True),
                             "crd", 1, True)


def saved_run(lora_transformer, tmp_path):
    """A checkpoint as the trainers write it, of iteration 1 of a run (rank-4 adapters, alpha 4) on prompt files in
    tmp_path: (its directory, the run's Args; a dry run, so a resume from it neither creates nor locks anything)."""
    transformer, optimizer = lora_transformer
    for name in ("train.txt", "test.txt"):
        shutil.copy(DATA / name, tmp_path / name)
    args = with_settings(crd.Args(train_batch_size=4, lora_rank=4, lora_alpha=4), train_data=str(tmp_path / "train.txt"),
                         eval_data=str(tmp_path / "test.txt"), output_dir=str(tmp_path), run_name="run", dry_run=True)
    state = {"iteration": 1, "optimizer_steps": 1, "eval": [[0, 0.5, None], [1, float("nan"), None]],
             "iteration_s": [2.5], "start_iterations": [1], "peak_mem_gib": {"actor rank 0 cpu": 0.6},
             "sampler": {"epoch": 0, "position": 2}, "args": json.loads(json.dumps(flat_settings(args))), "world_size": 1,
             "algorithm": "crd"}
    (tmp_path / "run").mkdir()
    return checkpoint.save_checkpoint(tmp_path / "run", 1, transformer, optimizer, state, keep_last=0), args


def resume(args, step, **changes):
    """prepare_run of a resume from step (the main process of one): (run directory, lock)."""
    return run_dirs.prepare_run(with_settings(args, resume_from=str(step), **changes), "crd", 1, True)


def edit_state(step, **fields):
    state = json.loads((step / "trainer_state.json").read_text())
    (step / "trainer_state.json").write_text(json.dumps({**state, **fields}))


@pytest.mark.parametrize("field, value, must_be", [
    ("args", [], "an object (the run's settings)"),
    ("iteration", "2", "a whole number >= 0"),
    ("optimizer_steps", -1, "a whole number >= 0"),
    ("sampler", {}, 'an object {"epoch": whole number >= 0, "position": whole number >= 0}'),
    ("sampler", None, 'an object {"epoch": whole number >= 0, "position": whole number >= 0}'),
    ("eval", None, "a list of [iteration, reward, judge's mean or null(, {judge: mean})] entries"),
    ("eval", [[0, "0.5"]], "a list of [iteration, reward, judge's mean or null(, {judge: mean})] entries"),
    ("iteration_s", 5, "a list of numbers"),
    ("start_iterations", [0], "a list of whole numbers >= 1"),
    ("world_size", True, "a whole number >= 1"),
    ("world_size", None, "a whole number >= 1"),
    ("algorithm", None, "a string"),
    ("peak_mem_gib", 3.5, "an object of numbers"),
    ("eval", [[0, 0.5]], "a list of [iteration, reward, judge's mean or null(, {judge: mean})] entries"),
    ("data_sha256", None, "an object of strings"),
    ("validation_adapter", 5, "an adapter's name"),  # absent (a checkpoint from before it): resumes
])
def test_a_damaged_trainer_state_field_is_named_before_the_model_loads(field, value, must_be, lora_transformer,
                                                                         tmp_path):
    """Hand-edited, valid JSON: without the check, each one is a traceback (some after the model loaded, or after an
    iteration ran)."""
    step, args = saved_run(lora_transformer, tmp_path)
    resume(args, step)  # as saved, it resumes
    edit_state(step, **{field: value})
    with pytest.raises(checkpoint.RunError) as error:
        resume(args, step)
    assert str(error.value) == f'{step / "trainer_state.json"}: "{field}" must be {must_be}'


def test_resume_compares_per_rank_sizes_by_their_global_value():
    saved = {"args": {"prompts_per_rank": 1, "train_batch_size": 4, "seed": 1, "device": "cuda"}, "world_size": 2,
             "algorithm": "crd"}
    same_math = SimpleNamespace(prompts_per_rank=2, train_batch_size=8, seed=1, device="cuda:1")
    assert checkpoint.resume_changes(saved, same_math, 1, "crd") == ([], ["device cuda -> cuda:1"])
    other_math = SimpleNamespace(prompts_per_rank=2, train_batch_size=8, seed=1, device="cuda")
    refused, _ = checkpoint.resume_changes(saved, other_math, 2, "crd")
    assert refused == ["prompts per iteration (prompts_per_rank x ranks) 2 -> 4",
                       "images per optimizer step (train_batch_size x ranks) 8 -> 16"]
    damaged = {**saved, "args": {**saved["args"], "prompts_per_rank": None}}  # hand-edited: reported, not multiplied
    assert checkpoint.resume_changes(damaged, same_math, 1, "crd")[0] == ["prompts_per_rank None -> 2"]


def test_adapters_without_an_adapter_name_or_of_another_rank_are_named(lora_transformer, tmp_path):
    """Before the model loads on a resume, and in read_adapters (evaluate.py, the benchmarks, load_checkpoint): a key
    without the adapter's name, a lora_A weight that is not (rank, in), a lora_B weight that is not (out, rank)."""
    step, args = saved_run(lora_transformer, tmp_path)
    path = step / "adapters.safetensors"
    tensors = load_file(path)

    def named(message, **changes):
        with pytest.raises(checkpoint.RunError, match=f"^{re.escape(f'{path}: ')}{message}$"):
            resume(args, step, **changes)
        with pytest.raises(checkpoint.RunError, match=f"^{re.escape(f'{path}: ')}{message}$"):
            checkpoint.read_adapters(step)

    save_file({**tensors, "weight": torch.zeros(4)}, path)
    named(re.escape('the tensor "weight" names no adapter (its keys are "<adapter>.<LoRA key>")'))
    lora_b = next(key for key in tensors if ".lora_B." in key)
    save_file({**tensors, lora_b: torch.zeros(32, 8)}, path)
    named(re.escape(f"{lora_b} has the shape (32, 8), not a rank-4 LoRA's (trainer_state.json records lora_rank 4)"))
    save_file(tensors, path)
    edit_state(step, args={**json.loads(json.dumps(flat_settings(args))), "lora_rank": 8})  # the tensors are rank 4
    named(r"\S+\.lora_A\.weight has the shape \(4, 32\), not a rank-8 LoRA's "
          r"\(trainer_state.json records lora_rank 8\)", lora_rank=8)


def test_a_checkpoint_without_its_lora_alpha_is_named_for_evaluate(lora_transformer, tmp_path):
    step, args = saved_run(lora_transformer, tmp_path)
    saved = json.loads(json.dumps(flat_settings(args)))
    del saved["lora_alpha"]
    edit_state(step, args=saved)
    with pytest.raises(checkpoint.RunError) as error:
        checkpoint.read_adapters(step)
    assert str(error.value) == f"{step}: its trainer_state.json records no Args (lora_rank, lora_alpha: whole " \
                               "numbers >= 1)"


def test_adapters_that_do_not_fit_the_model_are_named(lora_transformer, tmp_path):
    transformer, optimizer = lora_transformer
    step, _ = saved_run(lora_transformer, tmp_path)
    tensors = load_file(step / "adapters.safetensors")
    save_file({key: value for key, value in tensors.items() if not key.startswith("policy.transformer_blocks.0.")},
              step / "adapters.safetensors")
    message = f"{step / 'adapters.safetensors'}: its policy adapter does not fit the model (state dict does not match"
    with pytest.raises(checkpoint.RunError, match="^" + re.escape(message)):
        checkpoint.load_checkpoint(step, transformer, optimizer, "cpu")


def test_a_resume_reports_no_change_of_where_the_run_is_when_that_is_not_given(lora_transformer, tmp_path, capsys):
    """--output-dir and --run-name left out: the run continues in the checkpoint's directory, no change to report."""
    step, args = saved_run(lora_transformer, tmp_path)
    every = args.validation.eval_every
    run_dir, _ = resume(args, step, output_dir=OutputArgs.output_dir, run_name="", eval_every=every + 1)
    assert run_dir == step.parent
    assert capsys.readouterr().out == f"resuming with changed settings: eval_every {every} -> {every + 1}\n"


def test_a_resume_refuses_prompt_files_whose_contents_changed(lora_transformer, tmp_path):
    """The same path, other prompts: the resumed run would train (or validate) on other data. A checkpoint from before
    the hashes were recorded resumes as before."""
    step, args = saved_run(lora_transformer, tmp_path)
    train_data = tmp_path / "train.txt"
    digests = {field: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
               for field, name in (("train_data", "train.txt"), ("eval_data", "test.txt"))}
    assert json.loads((step / "trainer_state.json").read_text())["data_sha256"] == digests
    prompts = train_data.read_text()
    train_data.write_text(prompts.replace("a", "b"))
    with pytest.raises(checkpoint.RunError) as error:
        resume(args, step)
    changed = hashlib.sha256(train_data.read_bytes()).hexdigest()
    assert str(error.value) == (f"--train-data {train_data}: its contents changed since global_step_1 (sha256 "
                                f"{digests['train_data'][:12]}... then, {changed[:12]}... now); a resume needs the "
                                "same prompts (restore the file, or start a new run)")
    train_data.write_text(prompts)
    (tmp_path / "test.txt").write_text("")
    with pytest.raises(checkpoint.RunError, match=f"^--eval-data {re.escape(str(tmp_path / 'test.txt'))}: its "):
        resume(args, step)
    state = json.loads((step / "trainer_state.json").read_text())
    del state["data_sha256"]
    (step / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(checkpoint.RunError, match='"data_sha256" must be an object of strings$'):
        resume(args, step)


def test_prompt_files_edited_during_a_run_are_refused_at_resume(lora_transformer, tmp_path):
    """The trainers fingerprint the prompt files when the run starts, not when it saves: a file edited mid-run keeps
    the fingerprint of what the run trained on, and a resume on the edited file is refused."""
    transformer, optimizer = lora_transformer
    step, args = saved_run(lora_transformer, tmp_path)  # the prompt files in tmp_path, as the run reads them
    started = hashlib.sha256((tmp_path / "train.txt").read_bytes()).hexdigest()
    args = with_settings(args, dry_run=False)
    state = checkpoint.start_state(args, transformer, optimizer, GroupSampler(4, 1, 4, 0, 0, 1), "cpu", 1, "crd",
                                   checkpoint.prompt_files_sha256(flat_settings(args)))
    (tmp_path / "train.txt").write_text((tmp_path / "train.txt").read_text().replace("a", "b"))
    step = checkpoint.save_checkpoint(tmp_path / "run", 2, transformer, optimizer, {**state, "iteration": 2}, 0)
    assert json.loads((step / "trainer_state.json").read_text())["data_sha256"]["train_data"] == started
    with pytest.raises(checkpoint.RunError, match="its contents changed since global_step_2"):
        resume(with_settings(args, dry_run=True), step)


@pytest.mark.long
def test_overwrite_replaces_the_previous_run(tiny_model_dir, tmp_path):
    train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 2, "--eval-every", 0, "--save-every", 1)
    refused = train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 1, "--eval-every", 0, check=False)
    assert refused.returncode != 0 and "already holds a run" in refused.stderr and "Traceback" not in refused.stderr
    train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 1, "--eval-every", 0, "--overwrite")
    run = tmp_path / "run"
    assert [p.name for p in checkpoint.checkpoints(run)] == ["global_step_1"]
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    assert json.loads((run / "summary.json").read_text())["iterations"] == 1


def test_zero_iterations_write_a_valid_summary_with_nulls(tiny_model_dir, tmp_path):
    train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 0, "--eval-every", 0)

    def reject(constant):
        raise ValueError(f"{constant} is not JSON")

    summary = json.loads((tmp_path / "run" / "summary.json").read_text(), parse_constant=reject)
    assert summary["iterations"] == 0 and summary["completed"] is True
    assert summary["mean_iteration_s"] is None and summary["warmup_iteration_s"] is None
    assert summary["train_images_per_s"] is None and summary["mean_iteration_excludes"] == []


@pytest.mark.parametrize("script", ["crd.py", "dgpo.py"])
def test_help_shows_one_default_per_flag(script):
    # as wide as one column of boxes goes: tyro sets them side by side from 130 columns
    result = zygote.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, check=True,
                            env={**os.environ, "COLUMNS": "129"})
    flags = re.split(r"\n[│| ]+(?=--[a-z])", result.stdout)
    for flag in ("--run-name", "--text-encoder-device", "--reward-device", "--keep-last", "--overwrite"):
        (text,) = [f for f in flags if f.startswith((flag + " ", flag + ","))]
        assert text.count("(default") == 1, text
    assert "0: keep all" in next(f for f in flags if f.startswith("--keep-last "))


def test_a_dry_run_checks_the_run_directory_without_creating_it(tiny_model_dir, tmp_path):
    """run.sh checks a run with --dry-run before it starts a reward server: no directory (nor lock) is left behind,
    and a directory that already holds a run is refused there already."""
    fresh = train("crd.py", tiny_model_dir, tmp_path, "--dry-run")
    assert "dry run: arguments valid" in fresh.stdout and not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text("{}")
    held = train("crd.py", tiny_model_dir, tmp_path, "--dry-run", check=False)
    assert held.returncode != 0 and "already holds a run (summary.json)" in held.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["summary.json"]


def test_a_dry_run_refuses_an_iteration_too_large_for_memory_as_the_run_does(tiny_model_dir, tmp_path):
    """run.sh relies on --dry-run: 200,000 images an iteration are refused there, before the models load, in the
    same line the run gives once they have loaded."""
    flags = ("--group-size", 100_000, "--train-batch-size", 100_000)
    dry = train("crd.py", tiny_model_dir, tmp_path, *flags, "--dry-run", check=False)
    run = train("crd.py", tiny_model_dir, tmp_path, *flags, check=False)
    for result in (dry, run):
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = dry.stderr.strip().splitlines()[-1]
    assert line.startswith("crd.py: error: --prompts-per-rank 2 x --group-size 100000 = 200000 images need about")
    available = re.compile(r"which has [0-9.]+ GiB available")  # the machine's, a moment apart
    assert available.sub("", run.stderr.strip().splitlines()[-1]) == available.sub("", line)
    assert "dry run" not in dry.stdout and not (tmp_path / "run").exists()


def test_a_dry_run_of_sd35_medium_s_hub_id_refuses_an_iteration_too_large_before_the_hub(tmp_path):
    """run.sh's default model is the hub id, whose configs a dry run cannot read offline: its shapes
    are the random SD3.5-M's, so 40,000 images are refused there, without asking the hub."""
    data = ROOT / "tests" / "data" / "ocr"
    result = zygote.run(
        [sys.executable, "crd.py", "--dry-run", "--group-size", "10000", "--device", "cpu",
         "--output-dir", str(tmp_path), "--train-data", str(data / "train.txt"),
         "--eval-data", str(data / "test.txt")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "crd.py: error: --prompts-per-rank 4 x --group-size 10000 = 40000 images need about")
    assert "could not load" not in result.stderr and not list(tmp_path.iterdir())


@pytest.mark.long
def test_a_reward_server_that_dies_mid_run_stops_the_run_with_the_last_iteration_saved(tiny_model_dir, tmp_path):
    """A real HTTP reward server (tests/ocr_server.py) goes down once the first iteration's images are scored: the
    second iteration's requests fail through their retries, the run stops before training on them, with one line naming
    the server, a checkpoint of iteration 1 (the sampler where iteration 2 starts, so a resume redoes it) and a summary
    saying what stopped it; the checkpoint resumes."""
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    # 1 prompt x 2 images an iteration; no checkpoint but the one the failure writes
    run_args = ["--reward", "vllm", "--prompts-per-rank", 1, "--group-size", 2, "--eval-every", 0, "--save-every", 100,
                "--reward-retries", 1, "--reward-timeout", 5]
    with ocr_server(read=lambda image: "") as (url, server):
        cmd = [sys.executable, "crd.py", *TINY_RUN, "--output-dir", tmp_path, "--run-name", "run", "--num-iterations", 3,
               *run_args, "--reward-urls", url]
        process = subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while server.requests < 2 and time.time() < deadline and process.poll() is None:
            time.sleep(0.05)
    try:
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if "error" in line]
    assert line == (f"crd.py: error: the reward failed: vLLM server {url} failed 2 attempts (timeout 5 s); last: "
                    "ConnectionError: [Errno 111] Connection refused: stopped after iteration 1 (the latest checkpoint is "
                    f"in {tmp_path / 'run'})")
    run = tmp_path / "run"
    assert [p.name for p in run.glob("*global_step_*")] == ["global_step_1"]
    state = json.loads((run / "global_step_1" / "trainer_state.json").read_text())
    assert state["iteration"] == 1 and state["sampler"] == {"epoch": 0, "position": 1}  # 1 prompt drawn, not 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] is False and summary["iterations"] == 1
    assert summary["stopped_by"] == line.removeprefix("crd.py: error: ").split(": stopped after")[0]
    with ocr_server(read=lambda image: "") as (url, server):  # the server is back: the run continues from iteration 2
        resumed = train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 2, *run_args, "--reward-urls", url,
                        "--resume-from", run / "global_step_1")
    assert "Traceback" not in resumed.stderr and server.requests == 2
    assert json.loads((run / "summary.json").read_text())["completed"] is True


def test_a_failing_scorer_returns_nan_and_keeps_its_first_failure(capsys):
    """Any scorer error, not only a server's: the trainers stop on the NaN; a bug's traceback is printed for its fix."""
    def broken(images, targets):
        raise ValueError(f"cannot read {len(images)} images")

    scorer = GuardedScorer(broken)
    scores, texts = scorer(np.zeros((3, 8, 8, 3), np.uint8), ["a", "b", "c"])
    assert scores.shape == (3,) and np.isnan(scores).all() and texts == ["", "", ""]
    assert scorer.failure == "the reward failed: ValueError('cannot read 3 images')"
    assert "Traceback" in capsys.readouterr().err
    scorer(np.zeros((1, 8, 8, 3), np.uint8), ["a"])
    assert scorer.failure == "the reward failed: ValueError('cannot read 3 images')"  # the first failure
    assert GuardedScorer(ocr_reward.brightness)(np.full((1, 8, 8, 3), 255, np.uint8), ["a"])[0].tolist() == [1.0]


@pytest.mark.parametrize("trainer, flags, message", [
    (crd, dict(sampling_decay=(75, 0.0, 0.0075, 1.5)), "--sampling-decay 75 0 0.0075 1.5: needs an initial decay in"),
    (crd, dict(old_decay=(0, -0.25, 0.005, 0.999)), "--old-decay 0 -0.25 0.005 0.999: needs an initial decay in"),
    (crd, dict(old_decay=(0, 0.25, -0.005, 0.999)), "--old-decay 0 0.25 -0.005 0.999: needs an initial decay in"),
    (dgpo, dict(old_decay=(0.001, 2.0)), "--old-decay 0.001 2: needs a slope >= 0 and a max decay in [0, 1]"),
    (dgpo, dict(switch_to_old_step=-3), "--switch-to-old-step -3: must be at least 0"),
    # NaN or inf where no range bounds it: the snapshot adapters would turn NaN
    (crd, dict(old_decay=(0, 0.25, float("nan"), 0.999)), "--old-decay 0 0.25 nan 0.999: must be "
     "finite numbers"),
    (crd, dict(sampling_decay=(float("inf"), 0.0, 0.0075, 0.999)), "--sampling-decay inf 0 0.0075 "
     "0.999: must be finite numbers"),
    (dgpo, dict(old_decay=(float("inf"), 0.3)), "--old-decay inf 0.3: must be finite numbers"),
])
def test_an_ema_schedule_outside_0_1_is_named(trainer, flags, message):
    trainer.check_args(trainer.Args(train_batch_size=6))  # the defaults pass (train_batch_size as resolved from 0)
    with pytest.raises(SystemExit, match=re.escape(message)):
        trainer.check_args(with_settings(trainer.Args(train_batch_size=6), **flags))



@pytest.mark.parametrize("flags, message", [
    (["--old-decay", 0, 0.25, "nan", 0.999], "--old-decay 0 0.25 nan 0.999: must be finite "
     "numbers"),
    (["--sampling-decay", "inf", 0, 0.0075, 0.999], "--sampling-decay inf 0 0.0075 0.999: must be "
     "finite numbers"),
    (["--reward", "brightness=1e308"], "--reward: reward mix item 'brightness=1e308': the weight "
     "1e+308 is outside float32's range"),
    (["--reward", "brightness", "flat=1e-50"], "--reward: reward mix item 'flat=1e-50': the weight "
     "1e-50 is outside float32's range"),
])
def test_a_nonfinite_schedule_or_a_weight_float32_cannot_hold_stops_the_trainer(
        flags, message, tiny_model_dir, tmp_path):
    """Before these checks the run went on: NaN snapshot adapters and a run "completed" (exit 0), or
    every step skipped or the reward zeroed, with no line naming the flag."""
    result = train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 1, "--eval-every", 0,
                   *flags, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"crd.py: error: {message}"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("trainer, flags, message", [
    (crd, dict(learning_rate=-1.0), "--learning-rate -1: must be a finite number > 0"),
    (dgpo, dict(learning_rate=float("inf")), "--learning-rate inf: must be a finite number > 0"),
    (crd, dict(max_grad_norm=0.0), "--max-grad-norm 0: must be a finite number > 0"),
    (dgpo, dict(adv_clip=float("nan")), "--adv-clip nan: must be a finite number > 0"),
    (crd, dict(adam_betas=(1.5, 0.9)), "--adam-betas 1.5 0.9: each must lie in [0, 1)"),
    (crd, dict(eval_guidance=0.5), "--eval-guidance 0.5: must be a finite number >= 1"),
    (crd, dict(lora_alpha=0), "--lora-alpha 0: must be at least 1"),
    (dgpo, dict(policy_timesteps_per_forward=0), "--policy-timesteps-per-forward 0: must be at least 1"),
    (crd, dict(max_nonfinite_steps=0), "--max-nonfinite-steps 0: must be at least 1"),
    (dgpo, dict(scoring=ScoringArgs(reward_retries=-1)), "--reward-retries -1: must be at least 0"),
    (crd, dict(max_sequence_length=1000), "--max-sequence-length 1000: SD3's T5 encoder takes at most 512 tokens"),
    (crd, dict(seed=2**24), "--seed 16777216: must be below 2^23 = 8388608"),
    (dgpo, dict(scoring=ScoringArgs(reward="vllm", reward_urls=[])), "--reward-urls: the vllm reward or judge needs at least one server URL"),
    (dgpo, dict(device="meta"), "--device meta: the trainers run on cpu or cuda devices"),
    (crd, dict(crd_beta=0.0), "--crd-beta 0: must be a finite number > 0"),
    (crd, dict(kl_cfg=float("nan")), "--kl-cfg nan: must be a finite number >= 1"),
    (crd, dict(kl_floor=0.5), "--kl-floor 0.5: must not exceed --kl-beta 0.1"),
    (dgpo, dict(beta_dpo=-1.0), "--beta-dpo -1: must be a finite number > 0"),
    (dgpo, dict(clip_range=-0.1), "--clip-range -0.1: must be a finite number >= 0"),
    (crd, dict(scoring=ScoringArgs(reward="brightness flat=1e308")), "--reward: reward mix item 'flat=1e308': the "
     "weight 1e+308 is outside float32's range"),
    (dgpo, dict(scoring=ScoringArgs(reward="brightness=1e-50")), "--reward: reward mix item 'brightness=1e-50': the "
     "weight 1e-50 is outside float32's range"),
])
def test_a_setting_out_of_its_range_is_named(trainer, flags, message):
    trainer.check_args(trainer.Args(train_batch_size=6))
    with pytest.raises(SystemExit, match=re.escape(message)):
        trainer.check_args(with_settings(trainer.Args(train_batch_size=6), **flags))