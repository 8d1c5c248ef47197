"""End-to-end runs of crd.py, dgpo.py and nft.py on the tiny model (CPU): outputs, resume, signals, errors, learning."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tyro
from diffusers import StableDiffusion3Pipeline
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import checkpoint
import crd
from data import load_prompts
import dgpo
import lora_adapters
import nft
from ocr_server import ocr_server
import rollout
import sd3
import zygote
from tensorboard_logs import scalars

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data" / "ocr"
SCRIPTS = ["crd.py", "dgpo.py", "nft.py"]
# no PP-OCR judge (about 0.5 s an image of CPU here): tests/test_evaluate.py runs a trainer with it. 96 T5 tokens hold
# the longest test prompt (80 characters, a token each in the tiny tokenizer) at half the forward time of 256.
TINY_RUN = ["--model", "tiny", "--reward", "brightness", "--device", "cpu", "--train-data", str(DATA / "train.txt"),
            "--eval-data", str(DATA / "test.txt"), "--resolution", "64", "--prompts-per-rank", "2", "--group-size", "4",
            "--eval-prompts", "4", "--eval-steps", "4", "--learning-rate", "3e-3", "--eval-judge", "none",
            "--max-sequence-length", "96"]
SPEC_TAGS = {"train/reward_mean", "train/reward_std", "train/zero_std_group_frac", "eval/reward_mean", "losses/loss",
             "losses/policy_loss", "losses/kl_loss", "charts/lr", "charts/grad_norm", "charts/decay_old",
             "charts/decay_sampling", "perf/iteration_s", "perf/images_per_s", "perf/rollout_s", "perf/reward_s",
             "perf/train_s", "perf/eval_s", "perf/peak_mem_gib"}


def train(script, tiny_model_dir, out_dir, *extra, check=True, timeout=600):
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    cmd = [sys.executable, script, *TINY_RUN, "--output-dir", str(out_dir), "--run-name", "run", *map(str, extra)]
    result = zygote.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="module")
def three_iteration_runs(tiny_model_dir, tmp_path_factory):
    """{script: run directory} of each trainer run for 3 iterations, validating and saving every iteration."""
    runs = {}
    for script in SCRIPTS:
        out = tmp_path_factory.mktemp(Path(script).stem)
        train(script, tiny_model_dir, out, "--num-iterations", 3, "--eval-every", 1, "--save-every", 1)
        runs[script] = out / "run"
    return runs


@pytest.fixture(params=SCRIPTS)
def three_iterations(request, three_iteration_runs):
    return request.param, three_iteration_runs[request.param]


def test_smoke_run_writes_logs_checkpoints_and_summary(three_iterations):
    script, run = three_iterations
    events = EventAccumulator(str(run))
    events.Reload()
    assert SPEC_TAGS <= set(events.Tags()["scalars"]), SPEC_TAGS - set(events.Tags()["scalars"])
    assert {"eval/images"} <= set(events.Tags()["images"])
    assert [s.step for s in events.Scalars("train/reward_mean")] == [1, 2, 3]
    assert [s.step for s in events.Scalars("eval/reward_mean")] == [0, 1, 2, 3]
    perf = {tag: np.array([s.value for s in events.Scalars(f"perf/{tag}")]) for tag in
            ("iteration_s", "rollout_s", "reward_s", "reward_wait_s", "train_s")}
    # the scorer runs beside the base model's passes: an iteration counts only the part of it that training waited for
    np.testing.assert_allclose(perf["iteration_s"], perf["rollout_s"] + perf["reward_wait_s"] + perf["train_s"], rtol=1e-5)
    assert (perf["reward_s"] > 0).all() and (perf["reward_wait_s"] >= 0).all()
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("global_step")) == ["global_step_2", "global_step_3"]
    assert not list(run.glob(".global_step_*"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 3 and summary["optimizer_steps"] == 6  # 2 groups per iteration, a step each
    assert summary["completed"] is True and summary["stopped_by"] is None
    assert summary["algorithm"] == Path(script).stem and summary["reward"] == "brightness"
    state = json.loads((run / "global_step_3" / "trainer_state.json").read_text())
    assert state["iteration"] == 3 and state["args"]["num_iterations"] == 3 and state["sampler"]["position"] == 6
    assert state["optimizer_steps"] == 6 and "global_step" not in state  # global_step_N counts iterations


def test_summary_matches_the_tensorboard_scalars(three_iterations):
    """The summary is what the run logged: the first iteration (torch.compile's warm-up on CUDA) apart from the mean
    of the others, the validation rewards, and the largest actor peak memory."""
    script, run = three_iterations
    summary = json.loads((run / "summary.json").read_text())
    iteration_s = scalars(run, "perf/iteration_s")
    assert summary["warmup_iteration_s"] == pytest.approx(iteration_s[1], rel=1e-6)
    assert summary["mean_iteration_s"] == pytest.approx(np.mean([iteration_s[2], iteration_s[3]]), rel=1e-6)
    assert summary["mean_iteration_excludes"] == [1]
    assert summary["train_images_per_s"] == pytest.approx(8 / summary["mean_iteration_s"], rel=1e-6)
    rewards = scalars(run, "eval/reward_mean")
    assert summary["initial_eval_reward"] == pytest.approx(rewards[0], rel=1e-6)
    assert summary["final_eval_reward"] == pytest.approx(rewards[3], rel=1e-6)
    best = max(rewards, key=rewards.get)
    assert summary["best_eval_iteration"] == best and summary["best_eval_reward"] == pytest.approx(rewards[best], rel=1e-6)
    assert summary["initial_eval_judge"] is None and summary["final_eval_judge"] is None  # --eval-judge none
    assert list(summary["peak_mem_gib"]) == ["actor rank 0 cpu"]
    peaks = scalars(run, "perf/peak_mem_gib")  # each iteration's: the peak so far
    assert list(peaks) == [1, 2, 3] and list(peaks.values()) == sorted(peaks.values())
    assert summary["peak_mem_gib"]["actor rank 0 cpu"] >= max(peaks.values())  # the last validation's too


def test_each_validation_keeps_every_prompts_score_in_the_eval_sets_order(three_iterations):
    """eval_scores.jsonl: a line a validation, each held-out prompt's reward in the eval file's order, whose mean is the
    logged eval/reward_mean (so that runs on the same prompts compare prompt by prompt)."""
    script, run = three_iterations
    lines = [json.loads(line) for line in (run / checkpoint.EVAL_SCORES).read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [0, 1, 2, 3]
    targets = [row["target"] for row in load_prompts(str(DATA / "test.txt"))[0][:4]]
    rewards = scalars(run, "eval/reward_mean")
    for line in lines:
        assert line["targets"] == targets and line["judges"] == {}  # --eval-judge none
        assert len(line["reward"]) == 4 and len(set(line["reward"])) > 1  # each prompt's own score
        assert np.mean(line["reward"], dtype=np.float32) == pytest.approx(rewards[line["iteration"]], rel=1e-6)


def test_logged_decays_follow_each_algorithms_schedule(three_iteration_runs):
    """2 optimizer steps per iteration here. CRD: both schedules at k = 2 x iterations done. DGPO: the old EMA's
    decay after the last step of iteration n reads the 2n - 1 steps taken before it; the sampling adapter copies.
    DiffusionNFT: old at the 2n steps taken; the sampling EMA's decay after the last of them."""
    logged = {(script, name): scalars(run, f"charts/decay_{name}") for script, run in three_iteration_runs.items()
              for name in ("old", "sampling")}
    args = crd.Args()
    for n in (1, 2, 3):
        assert logged["crd.py", "old"][n] == pytest.approx(crd.ema_decay(2 * n, *args.old_decay))
        assert logged["crd.py", "sampling"][n] == pytest.approx(crd.ema_decay(2 * n, *args.sampling_decay))
        assert logged["dgpo.py", "old"][n] == pytest.approx(dgpo.ema_decay(2 * n - 1, *dgpo.Args().old_decay))
        assert logged["dgpo.py", "sampling"][n] == 0.0
        assert logged["nft.py", "old"][n] == nft.ema_decay(2 * n, *nft.Args().old_decay) == 0.0
        assert logged["nft.py", "sampling"][n] == pytest.approx(nft.eval_ema_decay(2 * n, 0.9))


def test_exported_lora_loads_in_diffusers_and_matches_the_trainer(three_iterations, tiny_model_dir):
    _, run = three_iterations
    checkpoint = run / "global_step_3"
    trainer = sd3.load_pipeline(str(tiny_model_dir))
    lora_adapters.add_lora_adapters(trainer.transformer)
    adapters = load_file(checkpoint / "adapters.safetensors")
    policy = {k.removeprefix("policy."): v for k, v in adapters.items() if k.startswith("policy.")}
    assert any(v.abs().max() > 0 for k, v in policy.items() if "lora_B" in k)  # it trained
    lora_adapters.load_lora_state_dict(trainer.transformer, "policy", policy)
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_model_dir)
    pipe.load_lora_weights(checkpoint / "policy_lora")
    embeds, pooled = sd3.encode_prompts(pipe, ['a sign that reads "Hello"'] * 2)
    latents, t = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor(700.0)
    with torch.no_grad(), lora_adapters.use_adapter(trainer.transformer, "policy"):
        ours = rollout.predict_velocity(trainer.transformer, latents, t, embeds, pooled)
    with torch.no_grad():
        theirs = rollout.predict_velocity(pipe.transformer, latents, t, embeds, pooled)
        pipe.disable_lora()
        base = rollout.predict_velocity(pipe.transformer, latents, t, embeds, pooled)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    assert (theirs - base).abs().max() > 1e-3


def test_resume_continues_exactly(three_iterations, tiny_model_dir, tmp_path):
    """1 iteration, then a resume for 1 more: the same adapters and logs as the uninterrupted run at iteration 2."""
    script, straight = three_iterations
    train(script, tiny_model_dir, tmp_path, "--num-iterations", 1, "--eval-every", 1, "--save-every", 1)
    resumed = tmp_path / "run"
    # as a stop after a validation and before its checkpoint leaves it, and a kill mid-line: both go at the resume
    with open(resumed / checkpoint.EVAL_SCORES, "a") as file:
        file.write(json.dumps({"iteration": 2, "targets": [], "reward": [], "judges": {}}) + '\n{"iterat')
    train(script, tiny_model_dir, tmp_path, "--num-iterations", 2, "--eval-every", 1, "--save-every", 1,
          "--resume-from", resumed / "global_step_1")
    a, b = load_file(straight / "global_step_2" / "adapters.safetensors"), load_file(resumed / "global_step_2" / "adapters.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for tag in ("train/reward_mean", "eval/reward_mean", "losses/loss"):
        logged, expected = scalars(resumed, tag), scalars(straight, tag)
        assert logged == {step: expected[step] for step in logged} and max(logged) == 2, tag
    state = json.loads((resumed / "global_step_2" / "trainer_state.json").read_text())
    assert state["eval"] == json.loads((straight / "global_step_2" / "trainer_state.json").read_text())["eval"]
    # every prompt's score of the validations 0, 1 and 2, once each, bitwise the uninterrupted run's
    straight_lines = (straight / checkpoint.EVAL_SCORES).read_text().splitlines()
    assert (resumed / checkpoint.EVAL_SCORES).read_text().splitlines() == straight_lines[:3]


def test_a_resume_that_turns_validation_on_validates_no_iteration_0(tiny_model_dir, tmp_path):
    """A run started with --eval-every 0 and resumed with validation: its first validation is at an iteration it
    trained, not one labelled 0 of an adapter that has trained already."""
    train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 1, "--eval-every", 0)
    run = tmp_path / "run"
    train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 2, "--eval-every", 1,
          "--resume-from", run / "global_step_1")
    assert list(scalars(run, "eval/reward_mean")) == [2]
    state = json.loads((run / "global_step_2" / "trainer_state.json").read_text())
    assert [entry[0] for entry in state["eval"]] == [2]


def test_resume_refuses_settings_that_define_the_run(three_iteration_runs, tiny_model_dir, tmp_path):
    """One line lists every difference, before any model loads; the run directory is left as it was."""
    run = three_iteration_runs["crd.py"]
    before = sorted(p.name for p in run.iterdir())
    changed = train("crd.py", tiny_model_dir, run.parent, "--num-iterations", 4, "--seed", 7, "--lora-alpha", 8,
                    "--prompts-per-rank", 1, "--resume-from", run / "global_step_3", check=False)
    (line,) = [line for line in changed.stderr.splitlines() if "error" in line]
    assert changed.returncode != 0 and "Traceback" not in changed.stderr
    assert line.startswith(f"crd.py: error: --resume-from {run / 'global_step_3'}: settings that define the run differ")
    for difference in ("lora_alpha 64 -> 8", "seed 42 -> 7", "prompts per iteration (prompts_per_rank x ranks) 2 -> 1"):
        assert difference in line
    assert "num_iterations" not in line  # allowed to change
    other_algorithm = train("dgpo.py", tiny_model_dir, run.parent, "--resume-from", run / "global_step_3", check=False)
    assert other_algorithm.returncode != 0
    assert "settings that define the run differ from the checkpoint's: algorithm crd -> dgpo" in other_algorithm.stderr
    elsewhere = train("crd.py", tiny_model_dir, tmp_path, "--resume-from", run / "global_step_3", check=False)
    assert elsewhere.returncode != 0
    assert f"continues the run in {run}, but --output-dir/--run-name name {tmp_path / 'run'}" in elsewhere.stderr
    assert sorted(p.name for p in run.iterdir()) == before


def test_resume_with_safe_changes_prints_them_and_continues(three_iteration_runs, tiny_model_dir, tmp_path):
    """Safe changes are printed; the temporary directory of a checkpoint killed mid-write is removed; --keep-last 0
    keeps every checkpoint; the resumed start's first iteration is left out of the mean iteration time too."""
    run = tmp_path / "run"
    shutil.copytree(three_iteration_runs["crd.py"], run)
    (run / ".global_step_4.k1ll3d").mkdir()  # what `kill -9` during a save leaves
    result = train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 4, "--eval-every", 0, "--keep-last", 0,
                   "--forward-batch-size", 16, "--eval-judge", "paddle", "--resume-from", run / "global_step_3")
    assert ("resuming with changed settings: eval_every 1 -> 0; eval_judge none -> paddle; forward_batch_size 48 -> 16; "
            "keep_last 2 -> 0; num_iterations 3 -> 4") in result.stdout
    assert sorted(p.name for p in run.glob("*global_step_*")) == ["global_step_2", "global_step_3", "global_step_4"]
    summary, iteration_s = json.loads((run / "summary.json").read_text()), scalars(run, "perf/iteration_s")
    assert summary["completed"] and summary["iterations"] == 4 and summary["mean_iteration_excludes"] == [1, 4]
    assert summary["mean_iteration_s"] == pytest.approx(np.mean([iteration_s[2], iteration_s[3]]), rel=1e-6)


def test_interrupted_checkpoint_is_never_picked_up(tmp_path, tiny_model_dir, monkeypatch):
    pipe = sd3.load_pipeline(str(tiny_model_dir))
    lora_adapters.add_lora_adapters(pipe.transformer, 4, 4)
    optimizer = torch.optim.AdamW(lora_adapters.lora_parameters(pipe.transformer))
    checkpoint.save_checkpoint(tmp_path, 1, pipe.transformer, optimizer, {"iteration": 1}, keep_last=2)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(tmp_path, 2, pipe.transformer, optimizer, {"iteration": 2}, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1"]  # intact, nothing half-written left
    # forked from tests/zygote.py's server, which the module's runs started: no second import
    resume = ["--resume-from", str(tmp_path / "global_step_2")]
    result = zygote.run([sys.executable, "crd.py", *resume], cwd=ROOT, capture_output=True,
                        text=True)
    assert result.returncode != 0 and "not a checkpoint directory" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.long
@pytest.mark.parametrize("signum, exit_code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_finishes_the_iteration_saves_and_says_the_run_stopped(signum, exit_code, tmp_path, tiny_model_dir):
    """While the run lives, a second process naming its directory is refused (the lock); after the signal the run
    directory holds a run, which only a resume (or --overwrite) may touch."""
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    cmd = [sys.executable, "crd.py", *TINY_RUN, "--output-dir", str(tmp_path), "--run-name", "run",
           "--num-iterations", "1000", "--eval-every", "0", "--save-every", "1000"]
    process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(tmp_path.glob("run/events.*")) and time.time() < deadline:
        time.sleep(0.2)
    second = train("crd.py", tiny_model_dir, tmp_path, "--overwrite", check=False)
    assert second.returncode != 0 and f"{tmp_path / 'run'} is in use by another live run (pid {process.pid})" in second.stderr
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == exit_code and "Traceback" not in stderr, stderr[-2000:]
    (checkpoint_dir,) = (tmp_path / "run").glob("global_step_*")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == int(checkpoint_dir.name.split("_")[-1]) >= 1
    assert summary["completed"] is False and summary["stopped_by"] == signal.Signals(signum).name
    assert f"{signal.Signals(signum).name}: finishing this iteration, then saving a checkpoint" in stdout
    compare = subprocess.run(["bash", "run.sh", "compare", tmp_path / "run", tmp_path / "run"], cwd=ROOT,
                             env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, check=True)
    assert "| Completed " in compare.stdout and f"no: stopped by {signal.Signals(signum).name}" in compare.stdout
    again = train("crd.py", tiny_model_dir, tmp_path, check=False)
    assert again.returncode != 0 and "Traceback" not in again.stderr
    assert "already holds a run" in again.stderr and f"continue it with --resume-from {checkpoint_dir}" in again.stderr


@pytest.mark.parametrize("extra, message", [
    (["--train-batch-size", "6"], "--train-batch-size 6 must be a multiple of --group-size 4"),
    (["--resolution", "60"], "not a multiple of 16"),
    (["--resolution", "0"], "--resolution 0: must be at least 16"),
    (["--prompts-per-rank", "0"], "--prompts-per-rank 0: must be at least 1"),
    (["--eval-prompts", "0"], "--eval-prompts 0: validation needs a prompt (--eval-every 0 turns validation off)"),
    (["--save-every", "0"], "--save-every 0: must be at least 1"),
    (["--lora-rank", "0"], "--lora-rank 0: must be at least 1"),
    (["--num-train-timesteps", "10"], "--num-train-timesteps 10 must lie in [1, 9]: the trained steps of the 10-step"),
    (["--reward", "ocr"], "--reward: reward mix item 'ocr': unknown reward 'ocr'; choose from"),
    (["--reward-device", "gpu7"], "--reward-device gpu7: not a torch device"),
    (["--text-encoder-device", "cuda:1"], "--text-encoder-device cuda:1: this machine has 0 CUDA device(s)"),
])
def test_bad_settings_are_named_by_check_args(extra, message):
    """The trainers' check_args, in process (the command line's path to it runs below, once per kind of check)."""
    args = tyro.cli(crd.Args, args=[*TINY_RUN, *extra])
    args.train_batch_size = args.train_batch_size or args.group_size
    with pytest.raises(SystemExit) as exit_:
        crd.check_args(args)
    assert message in str(exit_.value.code)


@pytest.mark.parametrize("extra, message", [
    (["--group-size", "1"], "centering needs at least 2"),  # check_args
    (["--resolution", "1040"], "--resolution 1040: this model generates at most 1024 px (pos_embed_max_size 64 x patch 2"),
    (["--prompts-per-rank", "41"], f"--train-data {DATA / 'train.txt'}: 40 prompt(s), fewer than the --prompts-per-rank 41"),
    (["--reward", "qwen-vl", "--reward-model", "/nonexistent/qwen"], "--reward-model /nonexistent/qwen: no such directory"),
    (["--train-data", "missing/train.jsonl"], "missing/train.jsonl: prompt file not found"),
    (["--model", "/nonexistent/sd35"], "--model /nonexistent/sd35: no such directory"),
])
def test_bad_input_gives_a_clear_error(extra, message, tiny_model_dir, tmp_path):
    result = train("crd.py", tiny_model_dir, tmp_path, *extra, check=False)
    assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_an_empty_target_is_named_before_anything_loads(tiny_model_dir, tmp_path):
    """data.load_prompts' checks (tests/test_data.py) hold in the trainers: one line with the file and line."""
    (tmp_path / "train.txt").write_text('A sign "One"\nA sign that reads ""\n')
    result = train("crd.py", tiny_model_dir, tmp_path, "--train-data", tmp_path / "train.txt", check=False)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"crd.py: error: {tmp_path / 'train.txt'}:2: an empty target text in prompt 'A sign that reads \"\"'"]


def test_dry_run_checks_and_exits_without_a_run(tiny_model_dir, tmp_path):
    result = train("crd.py", tiny_model_dir, tmp_path, "--dry-run")
    assert "dry run: arguments valid, 40 train and 4 eval prompts" in result.stdout and not list(tmp_path.iterdir())
    assert "not held-out" not in result.stdout
    same = train("crd.py", tiny_model_dir, tmp_path, "--dry-run", "--eval-data", DATA / "train.txt")
    assert f"--eval-data {DATA / 'train.txt'} is --train-data: validation scores training prompts" in same.stdout


def test_reward_server_is_checked_before_the_model_loads(tiny_model_dir, tmp_path):
    with ocr_server(read=None, silent=True) as (url, _):
        started = time.monotonic()
        result = train("crd.py", tiny_model_dir, tmp_path, "--reward", "vllm", "--reward-urls", url,
                       "--reward-timeout", 0.5, check=False)
    assert result.returncode == 1 and f"vLLM server {url} did not answer GET /v1/models within 0.5 s" in result.stderr
    assert "Loading pipeline components" not in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 60


def test_nonfinite_gradients_skip_steps_then_stop_with_a_checkpoint(tiny_model_dir, tmp_path):
    """At lr 1e30 the first step is taken and every later gradient is non-finite. A skipped step moves no adapter
    and, with the schedules counting optimizer steps, does not count; after the second iteration, whose two steps
    were both skipped, the run stops with all three adapters as the first iteration left them."""
    result = train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 20, "--eval-every", 0, "--save-every", 1,
                   "--learning-rate", 1e30, "--max-nonfinite-steps", 3, "--ema-counts-optimizer-steps", check=False)
    run = tmp_path / "run"
    assert result.returncode != 0 and "3 consecutive non-finite gradients" in result.stderr
    assert "non-finite gradient, optimizer step skipped" in result.stdout
    assert scalars(run, "charts/skipped_steps") == {1: 1, 2: 2}  # of 2 steps per iteration
    assert scalars(run, "charts/decay_old") == {1: pytest.approx(crd.ema_decay(1, *crd.Args().old_decay))}  # k = 1
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_1", "global_step_2"]
    first, last = (load_file(run / f"global_step_{n}" / "adapters.safetensors") for n in (1, 2))
    assert first.keys() == last.keys() and [k for k in first if not torch.equal(first[k], last[k])] == []
    assert any(not torch.equal(v, first["policy." + k[4:]]) for k, v in first.items() if k.startswith("old."))  # it lags


def test_nonfinite_gradients_in_the_last_iteration_leave_a_summary_saying_so(tiny_model_dir,
                                                                            tmp_path):
    """At lr 1e30 the second step of iteration 1, the last, is non-finite: the run stops there
    with its error line and exit 1, and summary.json says what stopped it (it said
    "completed": true, "stopped_by": null)."""
    result = train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 1, "--eval-every", 0,
                   "--learning-rate", 1e30, "--max-nonfinite-steps", 1, check=False)
    run = tmp_path / "run"
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (f"crd.py: error: 1 consecutive non-finite gradients: stopped after iteration 1 (the "
            f"latest checkpoint is in {run})") in result.stderr.splitlines()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 1 and summary["completed"] is False
    assert summary["stopped_by"] == "1 consecutive non-finite gradients"
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_1"]


@pytest.mark.long
@pytest.mark.parametrize("script", SCRIPTS)
def test_learning_raises_a_cheap_reward(script, tiny_model_dir, tmp_path):
    """Brightness on the tiny model: the training reward must rise clearly above its start within ~20 CPU seconds.
    20 iterations clear both bars by 2x or more (seeds 42, 1, 2: training 2.6-2.9x the spread for crd.py, 2.0x for
    dgpo.py at seed 42; validation 4.9-5.7x the spread, over the 2x asked). nft.py's trust region around the old
    adapter starts slower: flat for 10 iterations, then rising (seeds 42, 1, 2 at 20 iterations: training
    1.0-1.3x the spread, validation 3.9-4.5x), so it gets 26."""
    iterations = 26 if script == "nft.py" else 20
    train(script, tiny_model_dir, tmp_path, "--num-iterations", iterations, "--group-size", 8, "--eval-every",
          iterations, "--eval-prompts", 8, "--eval-steps", 10)
    rewards = np.array(list(scalars(tmp_path / "run", "train/reward_mean").values()))
    spread = np.mean(list(scalars(tmp_path / "run", "train/reward_std").values()))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print(f"{script}: train reward {rewards[:5].mean():.4f} -> {rewards[-10:].mean():.4f} (within-batch std {spread:.4f}); "
          f"eval {summary['initial_eval_reward']:.4f} -> {summary['final_eval_reward']:.4f}")
    assert rewards[-10:].mean() - rewards[:5].mean() > spread
    assert summary["final_eval_reward"] - summary["initial_eval_reward"] > 2 * spread


def test_compare_prints_the_anchor_table_side_by_side(three_iteration_runs, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", "run.sh", "compare", *map(str, three_iteration_runs.values())], cwd=ROOT, env=env,
                            capture_output=True, text=True, check=True)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in result.stdout.splitlines()[2:]}
    for i, script in enumerate(SCRIPTS):
        summary = json.loads((three_iteration_runs[script] / "summary.json").read_text())
        assert rows["Initial held-out reward"][i] == f"{summary['initial_eval_reward']:.4f}"
        assert rows["Final held-out reward"][i] == f"{summary['final_eval_reward']:.4f}"
        assert rows["Mean training iteration, excluding evaluation and warm-up"][i] == f"{summary['mean_iteration_s']:.1f} s"
        assert rows["First iteration (including torch.compile's warm-up, if any)"][i] == \
            f"{summary['warmup_iteration_s']:.1f} s"
    assert rows["Algorithm"] == ["crd", "dgpo", "nft"] and rows["Reward"] == ["brightness"] * 3
    assert rows["Completed"] == ["yes"] * 3 and rows["Iterations / optimizer updates"] == ["3 / 6"] * 3
    missing = subprocess.run(["bash", "run.sh", "compare", "runs/none", "runs/none"], cwd=ROOT, env=env,
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "runs/none/summary.json not found" in missing.stderr
    for broken, message in (('{"iterations": 3', "is not JSON"), ("[]", "is not a trainer's summary")):
        (tmp_path / "broken").mkdir(exist_ok=True)
        (tmp_path / "broken" / "summary.json").write_text(broken)
        result = subprocess.run(["bash", "run.sh", "compare", three_iteration_runs["crd.py"], tmp_path / "broken"],
                                cwd=ROOT, env=env, capture_output=True, text=True)
        (line,) = result.stderr.splitlines()
        assert result.returncode == 1 and line.startswith(f"run.sh compare: {tmp_path / 'broken' / 'summary.json'} {message}")


def assert_trains_like(run, plain_run):
    """`run`'s first 2 iterations give `plain_run`'s adapters, losses, gradient norms and rewards (to float noise)."""
    plain = load_file(plain_run / "global_step_2" / "adapters.safetensors")
    trained = load_file(run / "global_step_2" / "adapters.safetensors")
    for key in plain:
        torch.testing.assert_close(trained[key], plain[key], rtol=1e-3, atol=1e-4)  # Adam magnifies float noise
    for tag in ("losses/loss", "charts/grad_norm", "train/reward_mean"):
        logged, expected = scalars(run, tag), scalars(plain_run, tag)
        assert logged == pytest.approx({k: expected[k] for k in logged}, rel=1e-4), tag


def test_batched_timesteps_give_the_plain_paths_result(three_iteration_runs, tiny_model_dir, tmp_path):
    """All T timesteps in one policy forward, reference passes in big chunks: the same training as one at a time."""
    train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 2, "--eval-every", 0, "--save-every", 1,
          "--policy-timesteps-per-forward", 9, "--forward-batch-size", 64)
    assert_trains_like(tmp_path / "run", three_iteration_runs["crd.py"])


def test_validation_scored_chunk_by_chunk_gives_the_plain_paths_result(three_iteration_runs, tiny_model_dir, tmp_path):
    """--forward-batch-size 2: validation samples its 4 prompts one per call (CFG: 2 rows) and scores each while the
    next samples; every image is scored, as when all 4 sample in one call."""
    train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 1, "--eval-every", 1, "--forward-batch-size", 2)
    chunked, plain = scalars(tmp_path / "run", "eval/reward_mean"), scalars(three_iteration_runs["crd.py"], "eval/reward_mean")
    assert list(chunked) == [0, 1] and chunked == pytest.approx({k: plain[k] for k in chunked}, rel=1e-4)


def test_gradient_checkpointing_gives_the_plain_paths_result(three_iteration_runs, tiny_model_dir, tmp_path):
    """--gradient-checkpointing (the policy backward recomputes each block's activations) changes no number."""
    train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 2, "--eval-every", 0, "--save-every", 1,
          "--gradient-checkpointing")
    assert_trains_like(tmp_path / "run", three_iteration_runs["crd.py"])
