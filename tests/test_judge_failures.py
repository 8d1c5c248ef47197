"""A judge that fails is one line, and the run or evaluation goes on without it (tiny model, CPU).

The judges really fail: a PickScore folder whose weights file is cut in half (an interrupted
download) fails to load, and a vllm judge's server (tests/ocr_server.py, a real HTTP server on
127.0.0.1) answers every transcription with HTTP 500, so the judge fails in the first validation.

Run: python -m pytest -q -n 0 tests/test_judge_failures.py
"""

import json
import os
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import eval_results
import tiny_models
from ocr_server import ocr_server
from tensorboard_logs import scalars
from test_trainers import DATA, ROOT, TINY_RUN
import zygote

JUDGES = ["--pickscore-model", "{clip}", "--pickscore-processor", "{clip}"]


@pytest.fixture(scope="module")
def broken_clip(tmp_path_factory):
    """A tiny PickScore folder with every file in place but its weights cut in half."""
    clip = tiny_models.build_tiny_clip(tmp_path_factory.mktemp("broken_clip"))
    weights = clip / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return clip


def run(tiny_model_dir, script, *args):
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    return zygote.run([sys.executable, script, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def warnings_of(output, judge):
    return [line for line in output.splitlines() if f"warning: the {judge} judge failed: " in line]


def test_a_training_run_goes_on_without_its_failed_judges(tiny_model_dir, broken_clip, tmp_path):
    """The run completes; each failed judge is one warning line naming it and its error, is not
    logged (nor scored) after it failed, and summary.json's failed_judges says why; flat, the
    judge that works, is logged at both validations and is the summary's only judge."""
    options = [arg.format(clip=broken_clip) for arg in JUDGES]
    with ocr_server(read=lambda image: "", fail_first=10**6) as (url, server):
        result = run(tiny_model_dir, "crd.py", *TINY_RUN, "--eval-judge", "vllm", "pickscore",
                     "flat", "--reward-urls", url, *options, "--reward-retries", 0,
                     "--num-iterations", 1, "--eval-every", 1, "--output-dir", tmp_path,
                     "--run-name", "run")
        requests = server.requests
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (vllm,) = warnings_of(result.stdout, "vllm")
    assert vllm.startswith("the validation after iteration 0: warning: the vllm judge failed: "
                           f"vLLM server {url} rejected the request: HTTP 500") or \
        vllm.startswith("the validation after iteration 0: warning: the vllm judge failed: "
                        f"vLLM server {url} failed 1 attempts")
    (pickscore,) = warnings_of(result.stdout, "pickscore")
    assert pickscore.startswith("loading the models: warning: the pickscore judge failed: "
                                "SafetensorError: ")
    assert requests <= 4  # the first validation's 4 images at most: never asked again
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] is True
    assert list(summary["failed_judges"]) == ["pickscore", "vllm"]
    assert summary["failed_judges"]["vllm"] in vllm
    assert list(summary["eval_judges"]) == ["flat"] and summary["initial_eval_judge"] is None
    assert sorted(scalars(tmp_path / "run", "eval/flat")) == [0, 1]
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert not {"eval/vllm", "eval/pickscore"} & set(events.Tags()["scalars"])


def test_evaluate_reports_a_failed_judge_and_writes_the_others(tiny_model_dir, broken_clip,
                                                                tmp_path):
    """evaluate.py: one line per failed judge on stderr, results.json with the judge that works
    and failed_judges; the failed judge's scores are null in results.jsonl, so the same command
    scores those prompts again (read_results leaves them to do)."""
    options = [arg.format(clip=broken_clip) for arg in JUDGES]
    with ocr_server(read=lambda image: "", fail_first=10**6) as (url, _):
        result = run(tiny_model_dir, "evaluate.py", "--model", "tiny", "--eval-data",
                     DATA / "test.txt", "--num-prompts", 2, "--num-steps", 2, "--resolution", 64,
                     "--max-sequence-length", 96, "--reward", "brightness", "--device", "cpu",
                     "--judge", "vllm", "pickscore", "flat", "--reward-urls", url, *options,
                     "--output-dir", tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    for judge in ("vllm", "pickscore"):
        (line,) = warnings_of(result.stderr, judge)
        assert line.startswith(f"evaluate.py: warning: the {judge} judge failed: ")
    (out,) = tmp_path.iterdir()
    results = json.loads((out / "results.json").read_text())
    assert list(results["judges"]) == ["flat"] and results["judge"]["scorer"] == "flat"
    assert list(results["failed_judges"]) == ["pickscore", "vllm"]
    assert [r["vllm_score"] for r in results["prompts"]] == [None, None]
    assert all(isinstance(r["flat_score"], float) for r in results["prompts"])
    settings = json.loads((out / "results.jsonl").read_text().splitlines()[0])["settings"]
    prompts = [r["prompt"] for r in results["prompts"]]
    assert eval_results.read_results(out / "results.jsonl", settings, prompts) == {}
