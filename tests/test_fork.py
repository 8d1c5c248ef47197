"""The worked example of docs/fork.md, applied as a researcher would: copy crd.py, replace the end
of crd_loss with the example's lines, and train one iteration of the fork on the tiny model."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tensorboard_logs import scalars

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "ocr"


def forked_crd(page, crd):
    """crd.py with docs/fork.md's replacement for the body of crd_loss from its group views on."""
    section = page[page.index("## A worked example"):]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    start = crd.index('    groups_r = rearrange(implicit_reward, "(g i) -> g i", i=group_size)\n')
    end = crd.index("\n", crd.index("    return policy_loss + kl_loss", start)) + 1
    return crd[:start] + example + crd[end:]


def test_the_docs_fork_example_trains(tiny_model_dir, tmp_path):
    fork = forked_crd((ROOT / "docs" / "fork.md").read_text(), (ROOT / "crd.py").read_text())
    assert fork != (ROOT / "crd.py").read_text() and "# no centering" in fork
    script = tmp_path / "myalgo.py"
    script.write_text(fork)
    cmd = [sys.executable, str(script), "--model", "tiny", "--reward", "brightness", "--device",
           "cpu", "--train-data", str(DATA / "train.txt"), "--eval-data", str(DATA / "test.txt"),
           "--resolution", "64", "--prompts-per-rank", "2", "--group-size", "4",
           "--num-iterations", "1", "--eval-every", "0", "--max-sequence-length", "96",
           "--output-dir", str(tmp_path / "runs"), "--run-name", "fork"]
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent), "PYTHONPATH": str(ROOT)}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "fork"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["algorithm"] == "myalgo" and summary["completed"]
    events = EventAccumulator(str(run))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "losses/kl_loss" in tags and "losses/implicit_reward_std" not in tags  # the fork's info
    assert scalars(run, "losses/kl_loss")[1] > 0 and scalars(run, "losses/policy_loss")[1] > 0
