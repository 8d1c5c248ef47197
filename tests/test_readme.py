"""README.md's commands and the documentation's links, as a fresh clone has them.

Every line of README's bash blocks is one of: run by tests/test_newcomer.py (the demo, the evaluate
command and run.sh compare after it, in a working copy), the test suite itself, or a command that
needs what a CPU test cannot have (a GPU, the hub, the network, the Flow-GRPO dataset), listed by
name below. A command added to README that is none of these fails here. Every entry point README
names has a `--help` that runs; every relative link of README.md, docs/ and benchmark/'s pages
(RESULTS.md, HISTORY.md, README.md) names a file of the repository (and a heading of it, for
#anchors); every result file that those pages name is in benchmark/results/.
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import zygote

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *(ROOT / "benchmark" / page for page in ("RESULTS.md", "HISTORY.md", "README.md"))]
DOCS = "".join(page.read_text() for page in PAGES[1:])

# README's commands that tests/test_newcomer.py runs word for word (by how the line starts)
RUN_BY_TEST_NEWCOMER = ("python crd.py --model tiny ", "python evaluate.py --checkpoint runs/demo/",
                        "bash run.sh compare runs/demo")
THE_TESTS = "python -m pytest -q"  # CI's command (.ci/run): the suite this test is part of
# README's commands that a CPU test cannot run, each with the reason
NOT_ON_A_CPU = {
    "pip install -r requirements.txt": "the network (CI runs it: .ci/run)",
    "pip install -r requirements-vllm.txt": "the network; GPU machines",
    "pip install -r requirements-track.txt": "the network",
    "python data.py --input path/to/flow_grpo/dataset/ocr --output-dir data/ocr": "the Flow-GRPO dataset",
    "hf auth login": "the hub",
    "bash run.sh crd": "GPUs and the hub",
    "bash run.sh dgpo": "GPUs and the hub",
    "bash run.sh nft": "GPUs and the hub",
    "bash run.sh compare runs/crd/<run> runs/dgpo/<run>": "a recipe run's output",
    "tensorboard --logdir runs": "a server that does not end",
    "python evaluate.py --checkpoint runs/crd/<run>/global_step_100": "a recipe run's checkpoint, GPUs and the hub",
}
# the entry points whose --help README names as the flags' reference
ENTRY_POINTS = ["crd.py", "dgpo.py", "nft.py", "evaluate.py", "data.py", "benchmark/ocr_proxy/run_benchmark.py"]


def bash_lines(text):
    """The commands of the fenced bash blocks of `text`: each non-empty line, its comment dropped."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def slug(heading):
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path):
    found = set()
    for heading in re.findall(r"^#{1,6} (.*)$", path.read_text(), re.M):
        name = slug(heading)
        found.add(name if name not in found else next(f"{name}-{i}" for i in range(1, 99)
                                                      if f"{name}-{i}" not in found))
    return found


def test_every_readme_command_is_run_by_a_test_or_named_as_not_cpu_runnable():
    lines = bash_lines(README)
    assert lines, "README.md has no bash block"
    for line in lines:
        shlex.split(line)  # a command a shell can read
        kinds = [line.startswith(RUN_BY_TEST_NEWCOMER), line == THE_TESTS, line in NOT_ON_A_CPU]
        assert sum(kinds) == 1, f"README command {line!r}: not run by a test and not listed in NOT_ON_A_CPU"
    for start in RUN_BY_TEST_NEWCOMER:
        assert sum(line.startswith(start) for line in lines) == 1, start
    assert THE_TESTS in lines
    assert THE_TESTS in (ROOT / ".ci" / "run").read_text().replace("python3", "python")
    assert not set(NOT_ON_A_CPU) - set(lines), "NOT_ON_A_CPU lists commands README no longer has"


def test_the_entry_points_help_and_run_sh_usage_run():
    for script in ENTRY_POINTS:
        assert f"`{script}`" in README or f"{script} --help" in README, script
    for script in ENTRY_POINTS:  # forked by tests/zygote.py's server: torch imported once
        process = zygote.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        output = process.stdout + process.stderr
        assert process.returncode == 0 and "usage:" in output, f"{script} --help:\n{output[-2000:]}"
    usage = subprocess.run(["bash", "run.sh"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and "bash run.sh crd|dgpo|nft" in usage.stderr


def test_every_relative_link_names_a_file_and_heading_of_the_repository():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
            assert file.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
            if anchor:
                assert anchor in anchors(file), f"{page.relative_to(ROOT)}: {target}: no such heading"


def test_every_result_file_named_in_the_documentation_exists():
    results = ROOT / "benchmark" / "results"
    for page in PAGES:
        for name in re.findall(r"results/([\w.{},-]+\.(?:json|png))", page.read_text()):
            braces = re.search(r"\{([^}]*)\}", name)
            names = ([name.replace(braces.group(0), part) for part in braces.group(1).split(",")]
                     if braces else [name])
            for one in names:
                assert (results / one).is_file(), f"{page.relative_to(ROOT)}: results/{one} is not stored"


def test_the_output_folders_the_documentation_names_are_ignored_by_git():
    """runs/ (the trainers), data/ (data.py in README), evals/ (evaluate.py) and wandb/ (--track's
    local files) stay out of `git status`; the test prompts under tests/data/ do not."""
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git working copy")
    outputs = ["runs/demo/summary.json", "data/ocr/train.jsonl",
               "evals/base__tiny/results.json", "wandb/offline-run-1/run-1.wandb"]
    for path in outputs:
        assert "runs/" in path or path.split("/")[0] + "/" in README + DOCS, path
    kept = ["tests/data/ocr/train.txt", "tests/data/new.txt", "benchmark/results/new.json"]
    checked = subprocess.run(["git", "check-ignore", "--no-index", *outputs, *kept], cwd=ROOT,
                             capture_output=True, text=True)
    assert checked.stdout.splitlines() == outputs, checked.stdout + checked.stderr
