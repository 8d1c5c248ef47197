"""The reward mix and the judges list in the trainers, end to end on the tiny model (CPU): two crd.py
runs whose mixes differ only in the sign of brightness's weight learn brightness in opposite
directions; each component and judge is logged, reported by summary.json, run.sh compare and
evaluate.py; a resume refuses a changed mix or aggregation; bad specs are one line before anything
loads. The mix and aggregation math: tests/test_reward_mix.py.

Run: python -m pytest -q -n 0 tests/test_reward_mix_runs.py
"""

import dataclasses
import json
import os
import sys

import pytest
import tyro

import checkpoint
import crd
import dgpo
import evaluate
import nft
from settings import flat_settings
from tensorboard_logs import scalars
from test_trainers import DATA, ROOT, TINY_RUN, train
import zygote

# 3 iterations at lr 1e-2 under gdpo (each reward counts by its weight alone): validation, the same
# seeds before and after, shows brightness risen with weight +1 and fallen with weight -1 (seeds
# 42, 1, 2, and under sum at 42: +0.0033 to +0.0059 against -0.0005 to -0.0033, the training
# reward's within-batch std being about 0.005)
MIX_RUN = ["--num-iterations", 3, "--eval-every", 3, "--save-every", 3, "--learning-rate", 1e-2,
           "--reward-aggregation", "gdpo"]
BRIGHTER = "brightness=1 compressibility=1"
DARKER = "brightness=-1 compressibility=1"


@pytest.fixture(scope="module")
def mix_runs(tiny_model_dir, tmp_path_factory):
    """{"brighter": run directory, "darker": run directory}; the brighter run validates with the
    judges flat and paddle (in that order), the darker one with none."""
    out = tmp_path_factory.mktemp("mix")
    train("crd.py", tiny_model_dir, out, *MIX_RUN, "--reward", *BRIGHTER.split(), "--eval-judge",
          "flat", "paddle", "--run-name", "brighter")
    train("crd.py", tiny_model_dir, out, *MIX_RUN, "--reward", *DARKER.split(), "--run-name",
          "darker")
    return {"brighter": out / "brighter", "darker": out / "darker"}


def test_the_weights_decide_what_is_learned(mix_runs):
    """The runs differ in the sign of one weight: the same images at iteration 0, then brightness
    moves the way its weight says (validation: the same prompts and seeds in both runs)."""
    brighter = scalars(mix_runs["brighter"], "eval/reward_brightness")
    darker = scalars(mix_runs["darker"], "eval/reward_brightness")
    assert brighter[0] == darker[0]
    print(f"brightness {brighter[0]:.4f} -> {brighter[3]:.4f} (weight +1), {darker[3]:.4f} (-1)")
    assert brighter[3] > brighter[0] > darker[3]
    trained = [scalars(mix_runs[name], "train/reward_brightness") for name in ("brighter", "darker")]
    assert trained[0][1] == trained[1][1] and trained[0][3] > trained[1][3]  # the rollouts too


@pytest.mark.parametrize("name, weights", [("brighter", (1, 1)), ("darker", (-1, 1))])
def test_each_component_is_logged_and_the_reward_is_their_weighted_sum(mix_runs, name, weights):
    run = mix_runs[name]
    for split, steps in (("train", [1, 2, 3]), ("eval", [0, 3])):
        parts = [scalars(run, f"{split}/reward_{c}") for c in ("brightness", "compressibility")]
        mean = scalars(run, f"{split}/reward_mean")
        assert list(mean) == steps and all(list(part) == steps for part in parts)
        for step in steps:
            expected = sum(w * part[step] for w, part in zip(weights, parts))
            assert mean[step] == pytest.approx(expected, rel=1e-5, abs=1e-6), (split, step)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["reward"] == (BRIGHTER if name == "brighter" else DARKER)
    assert summary["final_eval_reward"] == pytest.approx(scalars(run, "eval/reward_mean")[3])
    recorded = json.loads((run / "global_step_3" / "trainer_state.json").read_text())["args"]
    assert recorded["reward"] == summary["reward"] and recorded["reward_aggregation"] == "gdpo"
    assert "pickscore_model" not in recorded  # settings added later are recorded where they differ
    assert run.name == name and (run / "global_step_3").is_dir()


def test_judges_are_logged_summarised_and_compared(mix_runs):
    """eval/<judge> (PP-OCR keeps eval/reward_paddle); summary.json's initial_eval_judge and
    final_eval_judge are the first judge's, eval_judges has each; run.sh compare a row each."""
    run = mix_runs["brighter"]
    flat, paddle = scalars(run, "eval/flat"), scalars(run, "eval/reward_paddle")
    assert list(flat) == list(paddle) == [0, 3]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["initial_eval_judge"] == pytest.approx(flat[0])
    assert summary["final_eval_judge"] == pytest.approx(flat[3])
    assert summary["eval_judges"] == {"flat": {"initial": pytest.approx(flat[0]),
                                               "final": pytest.approx(flat[3])},
                                      "paddle": {"initial": pytest.approx(paddle[0]),
                                                 "final": pytest.approx(paddle[3])}}
    darker = json.loads((mix_runs["darker"] / "summary.json").read_text())
    assert "eval_judges" not in darker and darker["initial_eval_judge"] is None
    assert not {"eval/flat", "eval/reward_paddle"} & set(tags(mix_runs["darker"]))
    result = zygote.run(["bash", "run.sh", "compare", run, mix_runs["darker"]], cwd=ROOT,
                            env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                            text=True, check=True)
    rows = {cells[0]: cells[1:] for cells in
            ([c.strip() for c in line.split("|")[1:-1]] for line in result.stdout.splitlines()[2:])}
    assert rows["Reward"] == [BRIGHTER, DARKER]
    assert rows["Initial / final held-out flat judge"] == [f"{flat[0]:.4f} / {flat[3]:.4f}",
                                                           "n/a / n/a"]
    assert rows["Initial / final held-out PP-OCR judge"] == [
        f"{paddle[0]:.4f} / {paddle[3]:.4f}", "n/a / n/a"]


def tags(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    return events.Tags()["scalars"]


def test_evaluate_scores_the_mix_and_the_judges_as_the_trainer_validated(mix_runs, tiny_model_dir,
                                                                         tmp_path):
    run = mix_runs["brighter"]
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    cmd = [sys.executable, "evaluate.py", "--checkpoint", run / "global_step_3", "--reward",
           *BRIGHTER.split(), "--judge", "flat", "paddle", "brightness", "--eval-data",
           DATA / "test.txt", "--num-prompts", 4, "--device", "cpu", "--output-dir", tmp_path]
    zygote.run(list(map(str, cmd)), cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=600)
    (path,) = tmp_path.glob("*/results.json")
    results = json.loads(path.read_text())
    assert path.parent.name.startswith("brighter__global_step_3__sampling__brightness=1+"
                                       "compressibility=1__")
    assert results["mean"] == pytest.approx(scalars(run, "eval/reward_mean")[3], rel=1e-6)
    for component in ("brightness", "compressibility"):
        logged = scalars(run, f"eval/reward_{component}")[3]
        assert results["components"][component]["mean"] == pytest.approx(logged, rel=1e-6)
    # brightness is part of the reward: not scored again as a judge
    assert list(results["judges"]) == ["flat", "paddle"] and results["judge"]["scorer"] == "flat"
    assert results["judges"]["flat"]["mean"] == pytest.approx(scalars(run, "eval/flat")[3])
    assert results["judges"]["paddle"]["mean"] == pytest.approx(
        scalars(run, "eval/reward_paddle")[3])
    record = results["prompts"][0]
    assert record["score"] == pytest.approx(sum(record["components"].values()), rel=1e-6)
    assert {"flat_score", "paddle_score", "paddle_transcription"} <= record.keys()


def test_resume_refuses_a_changed_mix_or_aggregation(mix_runs, tiny_model_dir):
    run = mix_runs["brighter"]
    resume = ["--num-iterations", 4, "--resume-from", run / "global_step_3", "--run-name",
              "brighter"]
    changed = train("crd.py", tiny_model_dir, run.parent, *MIX_RUN, *resume, "--reward",
                    "brightness=1", "compressibility=-1", "--reward-aggregation", "sum", check=False)
    (line,) = [line for line in changed.stderr.splitlines() if "error" in line]
    assert changed.returncode == 1 and "Traceback" not in changed.stderr
    assert "settings that define the run differ from the checkpoint's" in line
    assert f"reward {BRIGHTER} -> brightness=1 compressibility=-1" in line
    assert "reward_aggregation gdpo -> sum" in line
    # the same mix, written otherwise, and another judge (which never feeds training) resume
    same = train("crd.py", tiny_model_dir, run.parent, *MIX_RUN, *resume, "--reward",
                 "brightness=1.0,compressibility", "--eval-judge", "flat", "--pickscore-model",
                 "elsewhere/pickscore", "--dry-run")
    assert "dry run: arguments valid" in same.stdout
    assert "eval_judge flat paddle -> flat" in same.stdout
    assert "pickscore_model yuvalkirstain/PickScore_v1 -> elsewhere/pickscore" in same.stdout


def test_a_checkpoint_from_before_the_added_settings_resumes_and_a_default_run_records_none():
    """A trainer_state.json written before --reward-aggregation and the judges' model flags
    existed resumes as having their values then; a run at those values records none of them, so
    its checkpoint reads as before (an older trainer resumes it too)."""
    args = crd.Args(train_batch_size=6)
    crd.check_args(args)
    before = {k: v for k, v in flat_settings(args).items() if k not in checkpoint.ADDED_SETTINGS}
    assert checkpoint.record_args(args) == before
    old = {"args": json.loads(json.dumps(before)), "world_size": 1, "algorithm": "crd"}  # as read
    assert checkpoint.resume_changes(old, args, 1, "crd") == ([], [])
    gdpo_args = dataclasses.replace(args, reward_aggregation="gdpo")
    assert checkpoint.resume_changes(old, gdpo_args, 1, "crd")[0] == ["reward_aggregation sum -> gdpo"]
    for trainer in (crd, dgpo, nft):  # their defaults are the values before
        assert {k: flat_settings(trainer.Args())[k] for k in checkpoint.ADDED_SETTINGS} == \
            checkpoint.ADDED_SETTINGS
    judge_models = {k: v for k, v in checkpoint.ADDED_SETTINGS.items() if k in checkpoint.JUDGE_MODELS}
    assert {k: getattr(evaluate.Args().scoring, k) for k in judge_models} == judge_models


@pytest.mark.parametrize("extra, message", [
    (["--reward", "qwen=0.8", "pickscore=0.2"],
     "--reward: reward mix item 'qwen=0.8': unknown reward 'qwen'; choose from paddle, qwen-vl"),
    (["--reward", "qwen-vl=0.8", "pickscore=high"],
     "--reward: reward mix item 'pickscore=high': the weight must be a finite number other than 0"),
    (["--reward", "paddle", "paddle=2"], "--reward: reward mix item 'paddle=2': paddle is listed"),
    (["--reward"], "--reward: empty reward mix"),
    (["--reward-aggregation", "mean"], None),  # tyro's own choice error
    (["--eval-judge", "paddle", "clip"], "--eval-judge: unknown judge 'clip'; choose from paddle"),
    (["--eval-judge", "flat", "flat"], "--eval-judge: judge 'flat' is listed twice"),
    (["--eval-judge", "none", "flat"], "--eval-judge: unknown judge 'none'"),
    (["--reward", "brightness=1", "aesthetic=0.5"], "--aesthetic-head: the aesthetic reward or "
                                                    "judge needs the LAION head's file"),
    (["--eval-every", 1, "--eval-judge", "vllm", "--reward-urls"],
     "--reward-urls: the vllm reward or judge needs at least one server URL"),
])
def test_a_bad_mix_or_judge_list_is_one_line_naming_it(extra, message):
    if message is None:
        with pytest.raises(SystemExit):
            tyro.cli(crd.Args, args=[*TINY_RUN, *map(str, extra)])
        return
    args = tyro.cli(crd.Args, args=[*TINY_RUN, *map(str, extra)])
    args.train_batch_size = args.train_batch_size or args.group_size
    with pytest.raises(SystemExit) as exit_:
        crd.check_args(args)
    assert f": error: {message}" in str(exit_.value.code) and "\n" not in str(exit_.value.code)


def test_a_local_judge_model_that_is_missing_is_named_by_its_flag(tiny_model_dir, tmp_path):
    result = train("crd.py", tiny_model_dir, tmp_path, "--eval-every", 1, "--eval-judge",
                   "pickscore", "--pickscore-model", tmp_path / "nothing", "--dry-run", check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (f"crd.py: error: --pickscore-model {tmp_path / 'nothing'}: "
                                              "no such directory")
