"""docs/fork.md's forks, applied as a researcher would: copy crd.py, replace the end of crd_loss
with the worked example's lines (or its module-level names with the on-policy fork's), and train
the fork on the tiny model."""

import ast
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from benchmark.ocr_proxy import final_scores
from tensorboard_logs import scalars
import zygote

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "ocr"


def forked_crd(page, crd):
    """crd.py with docs/fork.md's replacement for the body of crd_loss from its group views on."""
    section = page[page.index("## A worked example"):]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    start = crd.index('    groups_r = rearrange(implicit_reward, "(g i) -> g i", i=group_size)\n')
    end = crd.index("\n", crd.index("    return policy_loss + kl_loss", start)) + 1
    return crd[:start] + example + crd[end:]


def module_level_fork(page, crd, heading):
    """crd.py with each module-level name and function that the python block under `heading` of
    docs/fork.md defines in place of crd.py's own (a name crd.py lacks: KeyError); nothing else."""
    section = page[page.index(heading):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    name = lambda node: node.name if isinstance(node, ast.FunctionDef) else node.targets[0].id
    ours = {name(node): node for node in ast.parse(crd).body
            if isinstance(node, (ast.FunctionDef, ast.Assign))}
    lines, replacements = crd.splitlines(keepends=True), block.splitlines(keepends=True)
    for node in sorted(ast.parse(block).body, key=lambda n: -ours[name(n)].lineno):  # bottom up
        old = ours[name(node)]
        lines[old.lineno - 1 : old.end_lineno] = replacements[node.lineno - 1 : node.end_lineno]
    return "".join(lines)


def train_fork(script, tiny_model_dir, tmp_path, *extra):
    """The fork `script` on the tiny model (brightness reward, CPU) as run `fork` in tmp_path/runs,
    its sibling modules found on PYTHONPATH: the finished process."""
    cmd = [sys.executable, str(script), "--model", "tiny", "--reward", "brightness", "--device",
           "cpu", "--train-data", str(DATA / "train.txt"), "--eval-data", str(DATA / "test.txt"),
           "--resolution", "64", "--prompts-per-rank", "2", "--group-size", "4",
           "--max-sequence-length", "96", *map(str, extra),
           "--output-dir", str(tmp_path / "runs"), "--run-name", "fork"]
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent), "PYTHONPATH": str(ROOT)}
    return zygote.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_the_docs_fork_example_trains(tiny_model_dir, tmp_path):
    fork = forked_crd((ROOT / "docs" / "fork.md").read_text(), (ROOT / "crd.py").read_text())
    assert fork != (ROOT / "crd.py").read_text() and "# no centering" in fork
    script = tmp_path / "myalgo.py"
    script.write_text(fork)
    result = train_fork(script, tiny_model_dir, tmp_path, "--num-iterations", 1, "--eval-every", 0)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "fork"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["algorithm"] == "myalgo" and summary["completed"]
    events = EventAccumulator(str(run))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "losses/kl_loss" in tags and "losses/implicit_reward_std" not in tags  # the fork's info
    assert scalars(run, "losses/kl_loss")[1] > 0 and scalars(run, "losses/policy_loss")[1] > 0


@pytest.mark.long
def test_an_on_policy_fork_validates_and_evaluates_its_policy(tiny_model_dir, tmp_path):
    """docs/fork.md's on-policy fork changes module-level names alone (the loop is crd.py's): its
    validation samples the policy, whose scores move from the base's as it trains, its checkpoint
    records that adapter, and evaluate.py scores it by default, reproducing the validation."""
    crd = (ROOT / "crd.py").read_text()
    fork = module_level_fork((ROOT / "docs" / "fork.md").read_text(), crd, "## An on-policy fork")
    assert 'VALIDATION_ADAPTER = "policy"' in fork and 'OLD_ADAPTER = "policy"' in fork
    assert fork[fork.index('if __name__ == "__main__":'):] == crd[crd.index('if __name__ == "__main__":'):]
    script = tmp_path / "onpolicy.py"
    script.write_text(fork)
    settings = ("--learning-rate", "3e-3", "--eval-every", 2, "--eval-prompts", 4, "--eval-steps", 4,
                "--eval-judge", "none", "--save-every", 2)
    result = train_fork(script, tiny_model_dir, tmp_path, *settings, "--num-iterations", 2)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "fork"
    evals = {line["iteration"]: line["reward"]
             for line in map(json.loads, (run / "eval_scores.jsonl").read_text().splitlines())}
    assert sorted(evals) == [0, 2]
    assert all(before != after for before, after in zip(evals[0], evals[2])), evals  # it moved
    state = json.loads((run / "global_step_2" / "trainer_state.json").read_text())
    assert state["validation_adapter"] == "policy"
    # the OCR proxy's final scores take the adapter the checkpoint's run validated
    assert final_scores.validated_adapter(run / "global_step_2") == "policy"
    # the fork edited back to validate its sampling adapter (crd.py's code under the fork's name)
    # does not go on with the run: its eval curve would switch adapters without a word
    edited = tmp_path / "edited" / script.name
    edited.parent.mkdir()
    edited.write_text(crd)
    resumed = train_fork(edited, tiny_model_dir, tmp_path, *settings, "--num-iterations", 3,
                         "--resume-from", run / "global_step_2")
    assert resumed.returncode == 1
    assert resumed.stderr.strip().splitlines()[-1] == (
        f"onpolicy.py: error: --resume-from {run / 'global_step_2'}: the run validated its policy adapter, "
        "this trainer validates sampling: its eval curve would change adapters mid-run (resume with "
        "the trainer that started it, or start a new run)")

    cmd = [sys.executable, str(ROOT / "evaluate.py"), "--checkpoint", str(run / "global_step_2"),
           "--eval-data", str(DATA / "test.txt"), "--num-prompts", "4", "--reward", "brightness",
           "--judge", "none", "--device", "cpu", "--output-dir", str(tmp_path / "evals")]
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    result = zygote.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--adapter policy" in result.stdout  # the validation protocol it took from the checkpoint
    (evaluated,) = (tmp_path / "evals").glob("*/results.json")
    evaluated = json.loads(evaluated.read_text())
    assert evaluated["settings"]["adapter"] == "policy"
    scores = [record["score"] for record in evaluated["prompts"]]
    assert scores == pytest.approx(evals[2], rel=1e-6)


def test_a_fork_whose_schedule_gives_nan_stops_in_one_line_with_its_snapshots_finite(
        tiny_model_dir, tmp_path):
    """A fork's ema_decay that turns NaN at k = 6 (the third iteration): the snapshots are not
    touched; the run stops in one line naming the adapter and the checkpoint of iteration 2, whose
    adapters are all finite, and summary.json says why."""
    crd = (ROOT / "crd.py").read_text()
    original = ('    return initial if step < start else min(initial + slope * (step - start), '
                'maximum)\n')
    assert crd.count(original) == 1
    script = tmp_path / "nanfork.py"
    script.write_text(crd.replace(original, '    return float("nan") if step >= 6 else '
                                            '(initial if step < start else maximum)\n'))
    result = train_fork(script, tiny_model_dir, tmp_path, "--num-iterations", 4, "--eval-every", 0,
                        "--save-every", 1)
    run = tmp_path / "runs" / "fork"
    why = ("the old adapter's EMA decay is nan, outside [0, 1]: its schedule (ema_decay and its "
           "flag) gave it; the adapter is unchanged")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"nanfork.py: error: {why}; the latest checkpoint is {run / 'global_step_2'}")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] is False and summary["stopped_by"] == why
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_1", "global_step_2"]
    adapters = load_file(run / "global_step_2" / "adapters.safetensors")
    assert adapters and all(torch.isfinite(tensor).all() for tensor in adapters.values())
