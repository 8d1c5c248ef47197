"""Run directories (issue 32 point 9): a --run-name stays inside --output-dir, default names of
starts in the same second differ, a refusal says what is possible, a failed start leaves no
directory."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import crd
import run_dirs
from settings import ScoringArgs, with_settings
from test_trainers import train
import zygote

ROOT = Path(__file__).resolve().parent.parent


def prepare(**settings):
    """prepare_run of a crd run on one rank, as its main process."""
    return run_dirs.prepare_run(with_settings(crd.Args(), **settings), "crd", 1, True)


@pytest.mark.parametrize("name", ["ABSOLUTE", "../up", "a/b", "..", ".", "  "])
def test_a_run_name_is_one_path_component(tmp_path, name):
    name = str(tmp_path / "elsewhere") if name == "ABSOLUTE" else name
    for dry_run in (False, True):
        with pytest.raises(checkpoint.RunError) as error:
            prepare(output_dir=str(tmp_path / "runs"), run_name=name, dry_run=dry_run)
        assert str(error.value).startswith(f"--run-name {name!r}: ")
        assert "\n" not in str(error.value)
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "elsewhere").exists()
    assert not (tmp_path / "up").exists()


@pytest.mark.parametrize("name", ["ABSOLUTE", "../../up", "a/b", "..", ".", "  "])
def test_an_exp_name_is_one_path_component(tmp_path, name):
    """The default run directory is {output_dir}/{exp_name}__{reward}__{seed}__{unix time}: a
    --exp-name with "/" put it elsewhere, unchecked, where --run-name was refused."""
    name = str(tmp_path / "elsewhere") if name == "ABSOLUTE" else name
    for dry_run in (False, True):
        with pytest.raises(checkpoint.RunError) as error:
            prepare(output_dir=str(tmp_path / "runs" / "out"), exp_name=name, dry_run=dry_run)
        assert str(error.value).startswith(f"--exp-name {name!r}: not a directory name ")
        assert "\n" not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_exp_name_outside_the_output_dir_stops_the_trainer_in_one_line(tmp_path):
    result = zygote.run(
        [sys.executable, str(ROOT / "crd.py"), "--exp-name", "../../up", "--output-dir",
         str(tmp_path / "runs" / "out"), "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        "crd.py: error: --exp-name '../../up': not a directory name (one path component, not "
        '"." or ".."); the run directory is {output_dir}/{exp_name}__{reward}__{seed}__{unix time}']
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["run_name", "exp_name"])
def test_a_name_longer_than_a_file_system_allows_is_one_line(tmp_path, flag):
    """With --output-dir there, a dry run's checks of a 300-character --run-name (or an --exp-name
    whose default run directory would be over 255 bytes) raised OSError "File name too long"."""
    out = tmp_path / "runs"
    out.mkdir()
    name = "x" * (300 if flag == "run_name" else 240)
    for dry_run in (True, False):
        for resume_from in ("", "latest") if flag == "run_name" else ("",):
            with pytest.raises(checkpoint.RunError) as error:
                prepare(output_dir=str(out), dry_run=dry_run, resume_from=resume_from,
                        **{flag: name})
            assert str(error.value).startswith(f"--{flag.replace('_', '-')} 'xxxx")
            assert "more than the 255 a file system allows a name" in str(error.value)
    assert list(out.iterdir()) == []


def test_a_name_of_255_bytes_is_a_run_directory(tmp_path):
    run_dir, lock = prepare(output_dir=str(tmp_path), run_name="é" * 127 + "x")
    lock.close()
    assert run_dir.name == "é" * 127 + "x" and (run_dir / "run.lock").is_file()


def test_default_names_of_starts_in_the_same_second_differ(tmp_path, monkeypatch):
    monkeypatch.setattr(run_dirs.time, "time", lambda: 1700000000.5)
    args = {"output_dir": str(tmp_path), "exp_name": "crd", "scoring": ScoringArgs(reward="ocr"),
            "seed": 3}
    taken = tmp_path / "crd__ocr__3__1700000000"
    taken.mkdir()
    (taken / "events.out.tfevents.1").write_text("")
    run_dir, lock = prepare(**args)
    assert run_dir == tmp_path / "crd__ocr__3__1700000000__2"
    assert (run_dir / "run.lock").is_file()
    lock.close()
    dry_dir, _ = prepare(**args, dry_run=True)
    assert dry_dir == tmp_path / "crd__ocr__3__1700000000__3"
    assert not dry_dir.exists()
    assert sorted(p.name for p in taken.iterdir()) == ["events.out.tfevents.1"]


def test_a_run_without_a_checkpoint_is_not_told_to_resume(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.out.tfevents.1").write_text("")
    (run_dir / "summary.json").write_text(json.dumps({"iterations": 0}))
    for dry_run in (False, True):
        with pytest.raises(checkpoint.RunError) as error:
            prepare(output_dir=str(tmp_path), run_name="run", dry_run=dry_run)
        message = str(error.value)
        assert "--resume-from" not in message
        assert message.endswith("it has no checkpoint to resume: replace it with --overwrite, "
                                "or choose another --run-name")


def start_with_too_few_prompts(tmp_path):
    """crd.py into --output-dir tmp_path/runs, --run-name run, with a train file of 1 prompt for 4
    per rank: it must fail in one line before it trains."""
    (tmp_path / "few.txt").write_text('A sign that reads "Open"\n')
    result = zygote.run(
        [sys.executable, str(ROOT / "crd.py"), "--train-data", str(tmp_path / "few.txt"),
         "--eval-data", str(ROOT / "tests/data/ocr/test.txt"), "--prompts-per-rank", "4",
         "--output-dir", str(tmp_path / "runs"), "--run-name", "run", "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert re.search(r"--train-data .*few\.txt: 1 prompt\(s\), fewer than", result.stderr)


def test_a_failed_start_leaves_no_run_directory(tmp_path):
    run_dir = tmp_path / "runs" / "run"
    start_with_too_few_prompts(tmp_path)
    assert not run_dir.exists()
    # a directory that was there before the start is left, lock and all
    run_dir.mkdir(parents=True)
    (run_dir / "notes.txt").write_text("mine")
    start_with_too_few_prompts(tmp_path)
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt", "run.lock"]


@pytest.fixture(scope="module")
def saved_twice(tiny_model_dir, tmp_path_factory):
    """A real crd.py run of 2 iterations on the tiny model, saving both: its run directory."""
    out = tmp_path_factory.mktemp("saved_twice")
    train("crd.py", tiny_model_dir, out, "--num-iterations", 2, "--save-every", 1,
          "--eval-every", 0)
    return out / "run"


def cut(path):
    """A copy cut short: the first half of the file's bytes."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def json_error(path):
    """json's own message for a file it cannot read."""
    try:
        json.loads(path.read_text())
    except ValueError as error:
        return str(error)
    raise AssertionError(f"{path} is whole JSON")


def contents(run_dir):
    """{relative path: bytes} of every file of a run directory."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file()}


DAMAGE = {  # what happened to the newest checkpoint, and the line that says why it is skipped
    "optimizer.pt cut": (lambda step: cut(step / "optimizer.pt"),
                         "its optimizer.pt cannot be read (truncated or damaged: File is not a zip "
                         "file)"),
    "adapters.safetensors cut": (lambda step: cut(step / "adapters.safetensors"),
                                 "its adapters.safetensors cannot be read (Error while "
                                 "deserializing header: incomplete metadata, file not fully "
                                 "covered)"),
    # where the half ends (in a key's string, or not) decides json's message
    "trainer_state.json cut": (lambda step: cut(step / "trainer_state.json"),
                               lambda step: "its trainer_state.json cannot be read "
                                            f"({json_error(step / 'trainer_state.json')})"),
    "trainer_state.json lost": (lambda step: (step / "trainer_state.json").unlink(),
                                "incomplete (no trainer_state.json)"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_latest_skips_a_damaged_newest_checkpoint_in_one_line(saved_twice, tiny_model_dir,
                                                              tmp_path, damage):
    """--resume-from latest (a --dry-run start: the run's checks, nothing written) takes
    global_step_1 when global_step_2 cannot be read, says so in one line naming it and why, and
    leaves every file as it was."""
    shutil.copytree(saved_twice, tmp_path / "run")
    corrupt, why = DAMAGE[damage]
    corrupt(tmp_path / "run" / "global_step_2")
    why = why(tmp_path / "run" / "global_step_2") if callable(why) else why
    before = contents(tmp_path / "run")
    result = train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 2, "--resume-from",
                   "latest", "--dry-run", check=False)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("--resume-from")]
    skipped = f"--resume-from latest: skipping global_step_2 of {tmp_path / 'run'}: {why}"
    assert len(lines) == 2 and lines[0].startswith(skipped), result.stdout
    assert lines[1] == f"--resume-from latest: {tmp_path / 'run' / 'global_step_1'}"
    assert contents(tmp_path / "run") == before


def test_latest_resumes_from_the_checkpoint_before_a_cut_optimizer_state(saved_twice,
                                                                         tiny_model_dir, tmp_path):
    """The real resume: from global_step_1 it trains iteration 2 again, to the adapters the
    uninterrupted run saved, and global_step_2 is whole again; global_step_1 is kept."""
    shutil.copytree(saved_twice, tmp_path / "run")
    cut(tmp_path / "run" / "global_step_2" / "optimizer.pt")
    first = contents(tmp_path / "run" / "global_step_1")
    result = train("crd.py", tiny_model_dir, tmp_path, "--num-iterations", 2, "--save-every", 1,
                   "--eval-every", 0, "--resume-from", "latest")
    assert (f"--resume-from latest: skipping global_step_2 of {tmp_path / 'run'}: its optimizer.pt "
            "cannot be read") in result.stdout
    assert contents(tmp_path / "run" / "global_step_1") == first
    resumed, straight = (load_file(run / "global_step_2" / "adapters.safetensors")
                         for run in (tmp_path / "run", saved_twice))
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[key], straight[key]) for key in straight)
    assert run_dirs.unreadable_checkpoint(tmp_path / "run" / "global_step_2") is None
