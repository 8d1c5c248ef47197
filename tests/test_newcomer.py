"""The newcomer's path as README.md writes it: the CPU demo, the evaluate command and run.sh compare
right after it, and the snippet that loads the demo's LoRA in diffusers (docs/outputs.md, which
README links to).

The commands are read out of README.md and run as subprocesses, word for word but for `python`,
which becomes this interpreter, in a working copy of the repository: a folder of links to its
files without `runs/` or `evals/`, so that the relative paths README gives are where the outputs
land, as in a fresh clone, and the repository's own folders are left alone.
"""

import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

import zygote

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
OUTPUTS = (ROOT / "docs" / "outputs.md").read_text()

# the LoRA snippet as README writes it, then a check that the trained weights were taken in
LORA_CHECK = """
from safetensors.torch import load_file
saved = load_file("runs/demo/global_step_6/policy_lora/pytorch_lora_weights.safetensors")
loaded = [v for k, v in pipe.transformer.state_dict().items() if ".lora_" in k]
assert len(loaded) == len(saved) > 0, (len(loaded), len(saved))
totals = sorted(float(v.abs().sum()) for v in loaded)
assert totals == sorted(float(v.abs().sum()) for v in saved.values())
assert totals[-1] > 0  # trained: a fresh LoRA's B is zero, but not after 6 iterations
"""


def readme_blocks(language, text=README):
    """The fenced code blocks of README.md (or of `text`) in `language`, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def readme_command(start):
    """The one line of README's bash blocks that starts with `start`, as argv (comments dropped)."""
    lines = [line for block in readme_blocks("bash") for line in block.splitlines()
             if line.startswith(start)]
    assert len(lines) == 1, f"README.md has {len(lines)} bash lines starting {start!r}"
    return shlex.split(lines[0], comments=True)


def flag(argv, name):
    """The value of `name` in argv; README's command must have it."""
    assert name in argv, f"{name} not in README's {shlex.join(argv)}"
    return argv[argv.index(name) + 1]


def working_copy(tmp_path):
    """A folder of links to the repository's entries, without its runs/ and evals/."""
    work = tmp_path / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name.startswith(".") or entry.name in ("runs", "evals"):
            continue
        (work / entry.name).symlink_to(entry)
    return work


def run(argv, work, env, timeout):
    """argv run in `work`, README's `python` being this interpreter; a failure shows its output.

    A `python SCRIPT.py` (the demo, evaluate.py) runs in a process of its own forked by
    tests/zygote.py's server, which has imported torch, diffusers and transformers once (the two
    scripts would each import them again); the script itself runs in `work`, as README's command.
    """
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    result = zygote.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"{shlex.join(argv)}: exit {result.returncode}\n{output}"
    return result


@pytest.mark.long
def test_readme_demo_then_evaluate_compare_and_lora_snippet_work_as_written(
        tiny_model_dir, tmp_path):
    demo = readme_command("python crd.py --model tiny")
    evaluate = readme_command("python evaluate.py --checkpoint runs/demo/")
    compare = readme_command("bash run.sh compare runs/demo")
    (snippet,) = [b for b in readme_blocks("python", OUTPUTS) if "load_lora_weights(\"runs/demo/" in b]
    run_dir = Path(flag(demo, "--output-dir") if "--output-dir" in demo else "runs")
    run_dir = run_dir / flag(demo, "--run-name")
    checkpoint = Path(flag(evaluate, "--checkpoint"))
    assert checkpoint.parent == run_dir  # the evaluate command scores the demo's run
    work = working_copy(tmp_path)
    # the tiny model the test session's fixture built (its parent is a CRD_CACHE); PYTHON: run.sh's interpreter
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent), "PYTHON": sys.executable}
    trained = run(demo, work, env, timeout=400)
    last = trained.stdout.strip().splitlines()[-1]  # the run directory, named again at the end
    assert last == f"run {run_dir}: summary.json, TensorBoard events and checkpoints"
    summary = json.loads((work / run_dir / "summary.json").read_text())
    assert summary["completed"] and (work / checkpoint / "policy_lora").is_dir()
    assert list((work / run_dir).glob("events.out.tfevents.*"))  # the TensorBoard logs README promises

    scored = run(evaluate, work, env, timeout=200)
    (results,) = (work / "evals").glob("*/results.json")
    results = json.loads(results.read_text())
    assert results["settings"]["checkpoint"] == str(work / checkpoint)
    # the run's own protocol and prompts: the run's last validation again
    assert results["num_prompts"] == 8
    assert results["mean"] == pytest.approx(summary["final_eval_reward"], abs=1e-5)
    assert f"{results['mean']:.4f}" in scored.stdout

    table = run(compare, work, env, timeout=60).stdout.splitlines()
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table[2:]}
    assert table[0].split("|")[2].strip() == run_dir.name
    assert rows["Final held-out reward"] == f"{summary['final_eval_reward']:.4f}"

    run([sys.executable, "-c", snippet + LORA_CHECK], work, env, timeout=120)
