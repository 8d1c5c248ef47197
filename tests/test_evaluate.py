"""evaluate.py on the tiny model (CPU), and the trainers' PP-OCR judge: a checkpoint's adapter, a diffusers LoRA and the
base model reproduce a trainer's own validation; stop and resume; bad inputs."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from ocr_reward import compressibility, make_scorer
from settings import ScoringArgs
from tensorboard_logs import scalars
import zygote

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data" / "ocr"
# the trainers' validation protocol in test_trainers.py's runs: 4 prompts, 4 steps, CFG 4.5, seeds 0.., 64 pixels,
# 96 T5 tokens
PROTOCOL = ["--eval-data", str(DATA / "test.txt"), "--num-prompts", "4", "--num-steps", "4", "--resolution", "64",
            "--max-sequence-length", "96", "--reward", "brightness", "--device", "cpu"]


def run(tiny_model_dir, *args, check=True, background=False):
    """evaluate.py with `args`: its CompletedProcess, or with `background` its Popen (output piped)."""
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    cmd = [sys.executable, "evaluate.py", *map(str, args)]
    if background:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    result = zygote.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    return result


def results(out_dir):
    (path,) = Path(out_dir).glob("*/results.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A crd.py run of 2 iterations on the tiny model, validating (with its default PP-OCR judge) and saving each."""
    out = tmp_path_factory.mktemp("crd")
    cmd = [sys.executable, "crd.py", "--model", "tiny", "--reward", "brightness", "--device", "cpu", "--train-data",
           str(DATA / "train.txt"), "--eval-data", str(DATA / "test.txt"), "--resolution", "64", "--prompts-per-rank", "2",
           "--group-size", "4", "--eval-prompts", "4", "--eval-steps", "4", "--learning-rate", "3e-3", "--num-iterations",
           "2", "--eval-every", "1", "--save-every", "1", "--max-sequence-length", "96", "--output-dir", str(out),
           "--run-name", "run"]
    zygote.run(cmd, cwd=ROOT, env={**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}, check=True,
                   capture_output=True, timeout=600)
    return out / "run"


def test_a_checkpoint_and_its_lora_reproduce_the_trainers_validation(trained, tiny_model_dir, tmp_path):
    """The sampling adapter of global_step_2 under the trainer's protocol scores what the trainer logged at iteration
    2, reward and PP-OCR judge alike; so does the exported LoRA (CRD's sampling adapter is still a copy of the policy)."""
    run(tiny_model_dir, "--checkpoint", trained / "global_step_2", *PROTOCOL, "--output-dir", tmp_path / "checkpoint")
    run(tiny_model_dir, "--lora", trained / "global_step_2" / "policy_lora", "--model", "tiny", *PROTOCOL,
        "--output-dir", tmp_path / "lora")
    logged, paddle = scalars(trained, "eval/reward_mean"), scalars(trained, "eval/reward_paddle")
    assert sorted(paddle) == [0, 1, 2]
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["initial_eval_judge"] == pytest.approx(paddle[0]) and summary["final_eval_judge"] == pytest.approx(paddle[2])
    for name in ("checkpoint", "lora"):
        evaluated = results(tmp_path / name)
        assert evaluated["num_prompts"] == 4 and [r["index"] for r in evaluated["prompts"]] == [0, 1, 2, 3]
        assert evaluated["mean"] == pytest.approx(logged[2], rel=1e-6), name
        assert evaluated["judge"]["scorer"] == "paddle" and evaluated["judge"]["mean"] == pytest.approx(paddle[2], abs=1e-6)
        scores = [r["score"] for r in evaluated["prompts"]]
        assert evaluated["stderr"] == pytest.approx(np.std(scores, ddof=1) / 2)
    assert results(tmp_path / "checkpoint")["settings"]["lora_rank"] == 32  # read from trainer_state.json
    # the judge's line is PP-OCR on the very images: read them back and score them here
    (out,) = (tmp_path / "checkpoint").iterdir()
    images = [Image.open(out / "images" / f"{i:05d}.png") for i in range(4)]
    evaluated = results(tmp_path / "checkpoint")
    expected, texts = make_scorer("paddle")(images, [r["target"] for r in evaluated["prompts"]])
    assert [r["paddle_score"] for r in evaluated["prompts"]] == pytest.approx(expected.tolist())
    assert [r["paddle_transcription"] for r in evaluated["prompts"]] == texts
    grid = np.asarray(Image.open(out / "grid.png"))
    assert grid.shape[1] == 4 * 64 and grid.shape[0] > 64


def test_stopped_runs_resume_without_rescoring(trained, tiny_model_dir, tmp_path):
    """2 prompts, then all 8 stopped by SIGTERM after a chunk, then the same command again: prompts already in
    results.jsonl are never scored again, and every score is what one uninterrupted run gives. The base model is what
    the trainer validated before training (every adapter equals it then)."""
    base = ["--model", "tiny", *PROTOCOL, "--num-prompts", 0, "--judge", "compressibility", "--batch-size", 1,
            "--save-images"]
    run(tiny_model_dir, *base, "--output-dir", tmp_path / "straight")
    straight = results(tmp_path / "straight")
    scores = [r["score"] for r in straight["prompts"]]
    assert np.mean(scores[:4]) == pytest.approx(scalars(trained, "eval/reward_mean")[0], rel=1e-6)
    assert np.mean(scores[:4]) != pytest.approx(scalars(trained, "eval/reward_mean")[2], rel=1e-6)  # it trained
    images = [Image.open(p) for p in sorted(next((tmp_path / "straight").iterdir()).glob("images/*.png"))]
    assert len(images) == 8 and [r["compressibility_score"] for r in straight["prompts"]] == pytest.approx(
        compressibility(images)[0].tolist())  # the judge's scores are those of the images kept

    out = tmp_path / "resumed"
    first = run(tiny_model_dir, *base, "--num-prompts", 2, "--output-dir", out)
    assert "0 of 2 prompts already scored" in first.stdout
    (lines,) = out.glob("*/results.jsonl")
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    records[1]["transcription"] = "scored before"  # a mark that survives only if prompt 0 is not scored again
    lines.write_text("".join(json.dumps(r) + "\n" for r in records))

    process = run(tiny_model_dir, *base, "--output-dir", out, background=True)
    deadline = time.time() + 300
    while len(lines.read_text().splitlines()) < 1 + 3 and time.time() < deadline:  # settings line, 2 + 1 prompts
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM and "the same command continues" in stderr, stderr[-2000:]
    stopped_at = len(lines.read_text().splitlines()) - 1
    assert 3 <= stopped_at < 8 and "Traceback" not in stderr

    last = run(tiny_model_dir, *base, "--output-dir", out)
    assert f"{stopped_at} of 8 prompts already scored" in last.stdout
    resumed = results(out)
    assert resumed["this_run"]["prompts"] == 8 - stopped_at
    assert resumed["prompts"][0]["transcription"] == "scored before"
    for key in ("score", "compressibility_score"):
        assert [r[key] for r in resumed["prompts"]] == pytest.approx([r[key] for r in straight["prompts"]], rel=1e-6)
    assert resumed["mean"] == pytest.approx(straight["mean"], rel=1e-6)

    other = run(tiny_model_dir, *base, "--output-dir", out, "--num-steps", 5, "--name", resumed["name"], check=False)
    assert other.returncode != 0 and "was written with other settings (num_steps 4 -> 5)" in other.stderr


@pytest.fixture(scope="module")
def rank_8_lora(tmp_path_factory, tiny_model_dir):
    """A diffusers LoRA directory of rank 8, alpha 8 (export_lora's format)."""
    import lora_adapters
    import sd3

    pipe = sd3.load_pipeline(str(tiny_model_dir))
    lora_adapters.add_lora_adapters(pipe.transformer, 8, 8, names=("policy",))
    path = tmp_path_factory.mktemp("lora") / "rank_8"
    lora_adapters.export_lora(pipe.transformer, "policy", path)
    return path


@pytest.mark.parametrize("extra, message", [
    (["--checkpoint", "runs/none/global_step_3"], "--checkpoint runs/none/global_step_3: not a checkpoint directory"),
    (["--checkpoint", "TRAINED", "--adapter", "ema"], "--adapter ema: "),
    (["--lora", "LORA"], "a LoRA of rank 8, but --lora-rank 32"),
    (["--lora", "LORA", "--lora-rank", "8"], "a LoRA of alpha 8, but --lora-alpha 64"),
    (["--model", "/nonexistent/sd35"], "--model /nonexistent/sd35: no such directory"),
    (["--eval-data", "missing/test.jsonl"], "missing/test.jsonl: prompt file not found"),
])
def test_bad_input_gives_one_clear_line(extra, message, trained, rank_8_lora, tiny_model_dir, tmp_path):
    extra = [{"TRAINED": trained / "global_step_2", "LORA": rank_8_lora}.get(arg, arg) for arg in extra]
    result = run(tiny_model_dir, "--model", "tiny", *PROTOCOL, *extra,
                 "--output-dir", tmp_path, check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and message in lines[-1] and "Traceback" not in result.stderr, result.stderr[-2000:]
    if "--adapter" in extra:
        assert lines[-1].endswith("holds the adapters old, policy, sampling")


@pytest.mark.parametrize("flags, message", [
    (dict(guidance=0.5), "--guidance 0.5: must be a finite number >= 1 (1: no guidance)"),
    (dict(guidance=float("nan")), "--guidance nan: must be a finite number >= 1"),
    (dict(max_sequence_length=0), "--max-sequence-length 0: must lie in [1, 512]"),
    (dict(seed=2**70), f"--seed {2**70}: must lie in [0, 2^62)"),
    (dict(device="meta"), "--device meta: evaluate.py runs on cpu or cuda devices"),
    (dict(scoring=ScoringArgs(reward_device="mps")), "--reward-device mps: evaluate.py runs on cpu or cuda devices"),
])
def test_a_setting_out_of_its_range_is_named(flags, message):
    import evaluate

    evaluate.check_args(evaluate.Args())
    with pytest.raises(SystemExit, match=re.escape(message)):
        evaluate.check_args(evaluate.Args(**flags))


SETTINGS = {"model": "tiny", "judge": None}
RECORD = {"index": 0, "prompt": "A sign that says \"0\"", "target": "0", "transcription": "", "score": 0.5}


@pytest.mark.parametrize("lines, judge, message", [
    ([{"settings": []}], None, 'line 1: not the settings line of a results file of evaluate.py ("settings" missing'),
    ([{"settings": SETTINGS}, {k: v for k, v in RECORD.items() if k != "prompt"}], None,
     'line 2: not a prompt\'s record of evaluate.py ("prompt" missing or of another type)'),
    ([{"settings": {**SETTINGS, "judge": "paddle"}}, RECORD], "paddle", 'line 2: not a prompt\'s record of evaluate.py '
     '("paddle_score" missing or of another type)'),
    ([{"settings": SETTINGS}, RECORD, [1]], None, "line 3: not a prompt's record of evaluate.py (not a JSON object)"),
])
def test_a_damaged_results_file_is_named_with_its_line(lines, judge, message, tmp_path):
    import eval_results

    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(SystemExit, match=re.escape(f"{path}, {message}")):
        eval_results.read_results(path, {**SETTINGS, "judge": judge}, [RECORD["prompt"]])


def test_a_lora_naming_layers_the_model_lacks_is_named(tiny_pipe):
    import evaluated_lora

    fitting = ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_k"]
    evaluated_lora.check_lora_fits(tiny_pipe.transformer, fitting, "--lora DIR")
    lacking = [f"transformer_blocks.99.attn.{name}" for name in ("to_k", "to_q", "to_v", "to_out.0")]
    with pytest.raises(SystemExit, match=re.escape(
            "--lora DIR: the LoRA does not fit the model: its keys name layers the model lacks: "
            "transformer_blocks.99.attn.to_k, transformer_blocks.99.attn.to_out.0, transformer_blocks.99.attn.to_q, "
            "(1 more)")):
        evaluated_lora.check_lora_fits(tiny_pipe.transformer, fitting + lacking, "--lora DIR")


def test_a_lora_with_other_layer_sizes_is_named(tiny_model_dir):
    """The same layer names with other sizes (a LoRA of a wider model) is one line naming the layer and both shapes,
    not torch's size-mismatch traceback; a LoRA of the right sizes loads."""
    import evaluated_lora
    import lora_adapters
    import sd3

    trained = sd3.load_pipeline(str(tiny_model_dir)).transformer
    lora_adapters.add_lora_adapters(trained, 4, 4, names=("policy",))
    lora = {key: value.clone() for key, value in lora_adapters.lora_state_dict(trained, "policy").items()}
    evaluated_lora.load_lora(sd3.load_pipeline(str(tiny_model_dir)).transformer, lora, 4, 4, "--lora DIR")
    key = next(k for k in lora if ".lora_A." in k)
    rank, width = lora[key].shape
    lora[key] = torch.zeros(rank, width + 8)
    with pytest.raises(SystemExit, match=re.escape(
            f"--lora DIR: the LoRA does not fit the model: {key} has shape ({rank}, {width + 8}), the model's layer "
            f"takes ({rank}, {width})")):
        evaluated_lora.load_lora(sd3.load_pipeline(str(tiny_model_dir)).transformer, lora, 4, 4, "--lora DIR")


def with_sampling_adapter(trained, tmp_path, change):
    """A copy of the run's global_step_2 whose sampling adapter `change` ({key: tensor}, in place)
    has altered."""
    copy = tmp_path / "global_step_2"
    shutil.copytree(trained / "global_step_2", copy)
    tensors = load_file(copy / "adapters.safetensors")
    change({key: value for key, value in tensors.items() if key.startswith("sampling.")})
    save_file(tensors, copy / "adapters.safetensors")
    return copy


def test_an_adapter_with_nan_weights_is_refused_in_one_line(trained, tiny_model_dir, tmp_path):
    """A diverged run's adapter: every image would be NaN, scored as a black image."""
    def one_nan(adapter):
        next(value for key, value in adapter.items() if ".lora_B." in key)[0, 0] = float("nan")

    copy = with_sampling_adapter(trained, tmp_path, one_nan)
    total = sum(v.numel() for k, v in load_file(copy / "adapters.safetensors").items()
                if k.startswith("sampling."))
    result = run(tiny_model_dir, "--checkpoint", copy, "--adapter", "sampling", *PROTOCOL,
                 "--output-dir", tmp_path / "evals", check=False)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"evaluate.py: error: --checkpoint {copy}: its sampling adapter holds 1 NaN or inf weights "
        f"of {total} (a diverged run?): its images would be NaN; score an earlier checkpoint"]
    assert not (tmp_path / "evals").exists()


def test_nan_images_are_warned_of_and_scored_as_black(trained, tiny_model_dir, tmp_path):
    """Finite weights so large that the transformer's activations overflow: the images are NaN,
    and a line on stderr says how many (the trainers' warning), not a quiet score."""
    def huge(adapter):
        for value in adapter.values():
            value.fill_(1e20)

    copy = with_sampling_adapter(trained, tmp_path, huge)
    result = run(tiny_model_dir, "--checkpoint", copy, "--adapter", "sampling", *PROTOCOL,
                 "--judge", "none", "--output-dir", tmp_path / "evals")
    warning = ("evaluate.py: warning: 4 of 4 images of prompts 0-3 are NaN or inf (a diverged "
               "adapter?): they decode black and are scored as black images")
    assert warning in result.stderr.splitlines(), result.stderr[-2000:]
    images = [np.asarray(Image.open(p)) for p in (tmp_path / "evals").glob("*/images/*.png")]
    assert len(images) == 4 and not any(image.any() for image in images)  # black
    assert results(tmp_path / "evals")["num_prompts"] == 4
