"""The benchmarks as a new user meets them on a CPU machine: one line where a GPU is needed, and
progress lines from those that run for minutes there."""

import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

import zygote

ROOT = Path(__file__).resolve().parent.parent


def run(*argv, env=None, timeout=300):
    """python SCRIPT ARGS in a process of its own, forked by tests/zygote.py's server where it can
    (the scripts import torch: ~2 s a fresh interpreter)."""
    return zygote.run([sys.executable, *map(str, argv)], cwd=ROOT, capture_output=True,
                      text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_recipe_on_a_machine_without_a_gpu_is_one_line(tmp_path):
    """No CUDA device (hidden here, as on a CPU machine): one line, exit 1, no results file."""
    out = tmp_path / "recipe.json"
    result = run("benchmark/recipe.py", "--out", out, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        "recipe.py: error: needs a CUDA GPU (torch sees none): it times crd.py's full-size recipe; "
        "on a CPU, try the README's tiny demo"]
    assert not out.exists() and not list(tmp_path.iterdir())


def test_wall_clock_on_a_machine_without_a_gpu_is_one_line(tmp_path):
    out = tmp_path / "wall_clock.json"
    result = run("benchmark/wall_clock.py", "--out", out, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "wall_clock.py: error: needs a CUDA GPU (torch sees none): it times the full-size "
        "recipe; --tiny times README's demo on the CPU"]
    assert not out.exists()


def test_wall_clock_times_readmes_demo_from_launch_to_summary_and_labels_its_commit(tmp_path):
    """wall_clock.py --tiny, one cold start of README's demo on the CPU: the split comes from the
    run's own TensorBoard events (validations at 0 and at the last iteration, one checkpoint)."""
    out = tmp_path / "wall_clock.json"
    result = run("benchmark/wall_clock.py", "--tiny", "--iterations", 2, "--starts", "cold",
                 "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or None
    assert (report["device"], report["commit"], report["iterations"]) == ("cpu", head, 2)
    cold = report["cold"]
    assert cold["returncode"] == 0 and cold["completed"] and cold["iterations"] == 2
    assert sorted(cold["validations_s"]) == ["0", "2"] and cold["checkpoints"] == 1
    assert 0 < cold["startup_s"] < cold["wall_s"] and cold["training_s"] > 0
    assert cold["whole_recipe"]["measured"] is False and cold["whole_recipe"]["iterations"] == 100


def test_peers_on_a_machine_without_a_gpu_is_one_line(tmp_path):
    out = tmp_path / "peers.json"
    result = run("benchmark/peers.py", "--flow-factory", tmp_path, "--out", out,
                 env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "peers.py: error: needs a CUDA GPU (torch sees none): it times the trainers on "
        "SD3.5-M; --tiny runs them on the tiny model on the CPU"]
    assert not out.exists()


@pytest.mark.parametrize("argv, error", [
    ([], "name at least one peer's checkout: --flow-factory, --flow-grpo or --diffusionnft"),
    (["--flow-grpo", "X", "--trainers", "diffusionnft", "ours"],
     "--trainers diffusionnft: name its checkout (--diffusionnft PATH)"),
    (["--diffusionnft", "X"], "--diffusionnft with --tiny: DiffusionNFT's train_nft_sd3.py runs "
     "on CUDA only (NCCL and cuda:LOCAL_RANK); leave it out on a CPU")])
def test_peers_without_a_peer_it_can_run_is_one_line(tmp_path, argv, error):
    result = run("benchmark/peers.py", *argv, "--tiny", "--out", tmp_path / "peers.json")
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == f"peers.py: error: {error}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag, name, needs", [
    ("--flow-factory", "Flow-Factory", "no src/flow_factory/trainers/crd.py or "
     "flow_factory/trainers/crd.py there"),
    ("--flow-grpo", "flow_grpo", "no scripts/train_sd3.py and flow_grpo/rewards.py there")])
def test_peers_with_a_folder_that_is_no_checkout_of_the_peer_is_one_line(tmp_path, flag, name,
                                                                        needs):
    """Before anything runs or is written."""
    out = tmp_path / "peers.json"
    folder = tmp_path / "checkout"
    folder.mkdir()
    result = run("benchmark/peers.py", flag, folder, "--tiny", "--out", out)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"peers.py: error: {flag} {folder}: not a {name} checkout ({needs})"]
    assert list(tmp_path.iterdir()) == [folder]


def peer_checkout(variable: str) -> Path:
    """A peer's checkout named by $variable, or the test is skipped: CI reaches only package
    registries, and gets none."""
    path = os.environ.get(variable)
    if not path or not Path(path).is_dir():
        pytest.skip(f"no checkout: set {variable} to one")
    return Path(path)


def check_trainer(trainer, entry_point, phases, images, iterations):
    assert trainer["returncode"] == 0 and entry_point in trainer["command"]
    assert len(trainer["iterations_s"]) == iterations
    assert trainer["seconds_per_iteration"] == pytest.approx(
        statistics.median(trainer["iterations_s"][1:]), abs=1e-3)  # each rounded to 1 ms
    assert trainer["train_images_per_s"] == round(images / trainer["seconds_per_iteration"], 3)
    assert set(trainer["split"]) == phases and trainer["peak_memory_gib"] > 0


OURS_PHASES = {"rollout_s", "reward_wait_s", "train_s", "reward_s"}


def test_peers_runs_flow_factory_and_crd_on_the_tiny_model_side_by_side(tmp_path, request):
    """peers.py --tiny with a Flow-Factory checkout: both trainers' steady iteration, images a
    second, split and peak memory, their commands, Flow-Factory's config on the tiny model, what
    differs."""
    checkout = peer_checkout("FLOW_FACTORY_CHECKOUT")
    missing = [name for name in ("datasets", "dill", "multiprocess", "pyarrow", "pandas",
                                 "imageio") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"Flow-Factory's packages not installed: {', '.join(missing)}")
    model = request.getfixturevalue("tiny_model_dir")  # built once for the session
    out = tmp_path / "peers.json"
    result = run("benchmark/peers.py", "--flow-factory", checkout, "--tiny", "--iterations", 2,
                 "--out", out, env={"CRD_CACHE": str(model.parent)})
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    report = json.loads(out.read_text())
    assert report["work"]["model"] == str(model) and report["work"]["images_per_iteration"] == 8
    unmatched = report["unmatched"]["flow_factory"]
    settings = [item["setting"] for item in unmatched]
    assert settings[:2] == ["rollout batch", "timesteps a forward"]
    assert "torch.compile" not in settings  # neither compiles on the CPU
    check_trainer(report["ours"], "crd.py", OURS_PHASES, 8, 2)
    check_trainer(report["flow_factory"], "flow_factory_timed.py",
                  {"rollout_s", "reward_s", "train_s"}, 8, 2)
    assert report["flow_factory"]["unmatched"] == [
        f"{item['setting']}: {item['theirs']}" for item in unmatched]
    config = (tmp_path / "peers_logs" / "flow_factory.yaml").read_text()
    assert f"model_name_or_path: {model}" in config and "resolution: 64" in config
    assert result.stdout.splitlines()[-3].split() == [
        "s/iteration", "images/s", "rollout", "s", "train", "s", "peak", "GiB"]


def test_peers_runs_flow_grpo_s_own_script_beside_crd_and_resume_keeps_what_ran(tmp_path,
                                                                              request):
    """peers.py --tiny with a flow_grpo checkout: its scripts/train_sd3.py, unchanged, runs the
    work (2 prompts x 4 images, 4 rollout steps, 3 trained timesteps) beside crd.py, each
    iteration timed from outside, in the order --trainers names; --resume then keeps both and
    runs nothing again."""
    checkout = peer_checkout("FLOW_GRPO_CHECKOUT")
    missing = [name for name in ("accelerate", "absl", "ml_collections")
               if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"flow_grpo's packages not installed: {', '.join(missing)}")
    model = request.getfixturevalue("tiny_model_dir")
    out = tmp_path / "peers.json"
    argv = ["benchmark/peers.py", "--flow-grpo", checkout, "--tiny", "--iterations", 3,
            "--trainers", "ours", "flow_grpo", "--out", out]
    result = run(*argv, env={"CRD_CACHE": str(model.parent)})
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    started = [line.split(":")[0] for line in result.stdout.splitlines()
               if line.startswith(("ours: ", "flow_grpo: "))]
    assert started == ["ours", "flow_grpo"], result.stdout
    report = json.loads(out.read_text())
    unmatched = report["unmatched"]["flow_grpo"]
    assert [item["setting"] for item in unmatched][:2] == ["algorithm", "rollout batch"]
    check_trainer(report["ours"], "crd.py", OURS_PHASES, 8, 3)
    peer = report["flow_grpo"]
    check_trainer(peer, "flow_grpo_timed.py", {"rollout_s", "reward_s", "train_s"}, 8, 3)
    assert peer["unmatched"] == [f"{item['setting']}: {item['theirs']}" for item in unmatched]
    assert peer["split"]["rollout_s"] + peer["split"]["train_s"] < peer["seconds_per_iteration"]
    log = (tmp_path / "peers_logs" / "flow_grpo.log").read_text()
    assert "Epoch 2.0: training" in log and "Epoch 3" not in log  # three iterations, then out
    assert re.search(r"Timestep: 100%\|\S+\| 3/3", log)  # 3 trained timesteps an image
    values = json.loads((tmp_path / "peers_logs" / "flow_grpo.json").read_text())["values"]
    assert values["pretrained.model"] == str(model) and values["resolution"] == 64
    assert int(values["sample.num_steps"] * values["train.timestep_fraction"]) == 3
    again = run(*argv, "--resume", env={"CRD_CACHE": str(model.parent)})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "flow_grpo: kept from" in again.stdout and "ours: kept from" in again.stdout
    assert json.loads(out.read_text()) == report


def test_judge_speed_says_what_it_is_doing_and_prints_the_times_it_reports(tmp_path):
    """At full size on a CPU, building CLIP-H and each call take minutes: a line before each phase
    and after each timed call, whose time is the one in its JSON."""
    out = tmp_path / "judge_speed.json"
    result = run("benchmark/judge_speed.py", "--tiny", "--device", "cpu", "--num-images", 2,
                 "--size", 64, "--repeats", 2, "--dtypes", "float32", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    seconds = json.loads(out.read_text())["dtypes"]["float32"]["seconds"]
    assert lines[:5] == [
        "building a random tiny CLIP on cpu and saving it",
        lines[1],
        "float32: warm-up call on 2 images",
        f"float32: timed call 1/2: {seconds[0]:.3f} s",
        f"float32: timed call 2/2: {seconds[1]:.3f} s"], result.stdout
    assert re.fullmatch(r"built [\d,]+ parameters; loading them as PickScoreScorer does", lines[1])


def test_served_recipe_on_a_machine_without_a_gpu_is_one_line(tmp_path):
    result = run("benchmark/served_recipe.py", "--out", tmp_path / "served",
                 env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "served_recipe.py: error: needs a CUDA GPU (torch sees none): it serves the full-size "
        "reward model beside the full-size trainer"]
    assert not (tmp_path / "served").exists()


def test_served_recipe_charges_the_trainer_s_process_and_every_other_to_the_server(tmp_path):
    """The trainer is run.sh's own process (exec); the server's API process and its engine core
    (whose command line does not say vllm) are the rest."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '111, 2048'\necho '222, 1024'\necho '333, 512'\n")
    smi.chmod(0o755)
    code = ("import sys, time; sys.path.insert(0, 'benchmark'); import served_recipe; "
            "s = served_recipe.MemorySampler(111, dict(os.environ)); time.sleep(1.5); "
            "print(s.stop())")
    result = run("-c", "import os; " + code, env={"PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "{'trainer': 2.0, 'reward server': 1.5}"


def test_results_md_shows_the_served_recipe_s_figures_from_its_file():
    """The served-recipe section's table is the result file's comparison, figure for figure."""
    stored = json.loads((ROOT / "benchmark" / "results" / "served_recipe_h200.json").read_text())
    served, in_process = stored["comparison"].values()
    shown = (ROOT / "benchmark" / "RESULTS.md").read_text()
    section = shown.split("## The recipe through run.sh with a real `vllm serve`, on one GPU")[1]
    section = section.split("\n## ")[0]
    rows = {line.split(" | ")[0].lstrip("| "): line.strip(" |").split(" | ")[1:]
            for line in section.splitlines() if line.startswith("| ")}
    iteration = [f"{run['mean_iteration_s']:.2f} s / {run['train_images_per_s']:.3f}"
                 for run in (served, in_process)]
    assert rows["steady iteration (eager) / training images a second"] == iteration
    assert rows["the reward's own time an iteration (24 images), median"] == [
        f"{served['reward_s_median']:.2f} s", f"{in_process['reward_s_median']:.2f} s"]
    memory = served["device_memory_gib_nvidia_smi"]
    assert rows["device memory (nvidia-smi peak)"] == [
        f"trainer {memory['trainer']:.1f} GiB, server {memory['reward server']:.1f} GiB",
        f"trainer {in_process['device_memory_gib_nvidia_smi']['trainer']:.1f} GiB"]
    assert rows["`run.sh` launch to exit"] == [f"{served['run_sh_wall_s']} s",
                                               f"{in_process['run_sh_wall_s']} s"]
    assert f"the reward server answered after {served['server_start_s']} s" in section
    assert f"the server answered {served['chat_completions']} chat" in section
    assert served["failed_requests"] == 0
    assert served["exit_status"] == in_process["exit_status"] == 0


def test_results_md_shows_the_whole_stack_s_figures_from_its_file():
    """The whole-stack section's table and lines are the result file's figures, and the file's
    summary is its raw runs' (mean, median, counts)."""
    stored = json.loads((ROOT / "benchmark" / "results" / "seed_stack_h200.json").read_text())
    stack, diffusers, runs = stored["seed_stack"], stored["beside_it"], stored["runs"]
    scalars = runs["omni"]["scalars"]
    rollout = statistics.median(value for _, value in scalars["perf/rollout_s"][1:])
    assert round(rollout, 2) == stack["rollout_s_median"]
    assert round(runs["omni"]["summary"]["mean_iteration_s"], 2) == stack["mean_iteration_s"]
    requests = runs["omni"]["server"]["chat_completions"]
    assert requests == stack["chat_completions"] == 10 * 24 + 3 * 16
    shown = (ROOT / "benchmark" / "RESULTS.md").read_text()
    section = shown.split("## The whole stack: vLLM-Omni rollouts beside a served reward")[1]
    section = section.split("\n## ")[0]
    rows = {line.split(" | ")[0].lstrip("| "): line.strip(" |").split(" | ")[1:]
            for line in section.splitlines() if line.startswith("| ")}
    assert rows["steady iteration (eager) / training images a second"] == [
        f"{run['mean_iteration_s']:.2f} s / {run['train_images_per_s']:.3f}"
        for run in (stack, diffusers)]
    assert rows["rollout, median"] == [f"{run['rollout_s_median']:.2f} s"
                                       for run in (stack, diffusers)]
    assert rows["the server answered after"] == [f"{run['server_start_s']} s"
                                                 for run in (stack, diffusers)]
    memory = stack["device_memory_gib_nvidia_smi"]
    assert rows["device memory (nvidia-smi peak)"][0] == (
        f"trainer {memory['trainer']:.1f} GiB, server {memory['reward server']:.1f} GiB, "
        f"rollout engine {memory['rollout engine']:.1f} GiB")
    flat = re.sub(r"\s+", " ", section)  # the text, its line breaks aside
    assert f"{stack['chat_completions']} chat completions" in flat
    assert f"{sum(memory.values()):.1f} GiB of the 139 GiB" in flat
    gap = stack["mean_iteration_s"] - diffusers["mean_iteration_s"]
    assert f"the {gap:.2f} s between their" in flat
    evaluate, faults = stored["evaluate"], stored["server_killed"]
    assert evaluate["while_loading"]["exit_status"] == 1
    assert evaluate["wrong_model_name"]["exit_status"] == 1
    assert evaluate["while_loading"]["server_still_loading"]
    assert evaluate["scored"]["exit_status"] == 0 and evaluate["server_requests"]["failed"] == 0
    assert evaluate["wrong_model_name"]["last_line"] in flat
    assert f"answered after {evaluate['server_start_s']} s" in flat
    compiled = (evaluate["server_torch_compile_s"], stack["server_torch_compile_s"])
    assert "torch.compile took {:.1f} s against {:.1f} s".format(*compiled) in flat
    killed, resumed = faults["killed"], faults["resumed"]
    assert killed["exit_status"] == 1 and not killed["completed"] and resumed["exit_status"] == 0
    assert f"killed {killed['server_killed_after_s']} s into the run" in flat
    assert killed["last_line"].split(" (the latest")[0] in flat
    assert resumed["completed"] and resumed["iterations"] == 4
    assert resumed["checkpoints"] == ["global_step_2", "global_step_4"]


def test_the_benchmarks_read_back_what_a_summary_writer_logged(tmp_path):
    """benchmark/events.py on a real TensorBoard events file: every tag's steps and values, the
    wall times beside them, and nothing (not an error) for a run that wrote no events."""
    from torch.utils.tensorboard import SummaryWriter

    sys.path.insert(0, str(ROOT))
    from benchmark.events import scalar_events, scalars

    writer = SummaryWriter(tmp_path / "run")
    for step, value in ((1, 0.5), (2, 0.25)):
        writer.add_scalar("perf/iteration_s", value, step)
    writer.add_scalar("train/reward_mean", 0.75, 2)
    writer.close()
    assert scalars(tmp_path / "run") == {"perf/iteration_s": {1: 0.5, 2: 0.25},
                                         "train/reward_mean": {2: 0.75}}
    assert all(event.wall_time > 0 for event in scalar_events(tmp_path / "run")["perf/iteration_s"])
    assert scalars(tmp_path / "never-started") == {} == scalar_events(tmp_path / "never-started")


def test_results_md_gives_the_wall_clock_s_figures_from_its_file():
    """The wall-clock paragraph's figures are the H200 file's, and each start's parts add up to
    its launch-to-summary time; the H100s' figures are theirs."""
    stored = json.loads((ROOT / "benchmark" / "results" / "wall_clock_h200.json").read_text())
    cold, warm = stored["cold"], stored["warm"]
    for start in (cold, warm):
        parts = start["startup_s"] + sum(start["validations_s"].values()) + start["training_s"]
        assert abs(parts + start["rest_s"] - start["wall_s"]) < 0.2
        assert start["returncode"] == 0 and start["completed"] and start["iterations"] == 10
        assert not start["whole_recipe"]["measured"]  # a projection, and said so
    shown = re.sub(r"\s+", " ", (ROOT / "benchmark" / "RESULTS.md").read_text())
    for name, start in (("cold", cold), ("warm", warm)):
        validations = sum(start["validations_s"].values())
        assert (f"{name} {start['wall_s']} s ({'start-up ' if name == 'cold' else ''}"
                f"{start['startup_s']}, {'validations ' if name == 'cold' else ''}"
                f"{validations:.1f}, "
                f"{'training ' if name == 'cold' else ''}{start['training_s']}, "
                f"{'the rest ' if name == 'cold' else ''}{start['rest_s']})") in shown
    assert (f"{warm['whole_recipe']['whole_recipe_s']:,.0f} s warm, at most "
            f"{cold['whole_recipe']['whole_recipe_s']:,.0f} s cold") in shown
    assert stored["commit"] in shown and stored["device"] == "NVIDIA H200"
    saved = cold["wall_s"] - warm["wall_s"]
    first_validation = cold["validations_s"]["0"] - warm["validations_s"]["0"]
    assert (f"Of the {saved:.1f} s that the compile cache saves, the first validation holds "
            f"{first_validation:.1f} s ({cold['validations_s']['0']} s against "
            f"{warm['validations_s']['0']} s warm) and the start-up "
            f"{cold['startup_s'] - warm['startup_s']:.1f} s") in shown
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    assert (f"10 iterations: {cold['wall_s']} s cold, {warm['wall_s']} s warm" in readme
            and f"about {warm['whole_recipe']['whole_recipe_s'] / 60:.0f} minutes warm, at most "
            f"{cold['whole_recipe']['whole_recipe_s'] / 60:.1f} cold" in readme)
    h100 = json.loads((ROOT / "benchmark/results/wall_clock_h100.json").read_text())
    earlier = json.loads((ROOT / "benchmark/results/wall_clock_h100_fef9f0e.json").read_text())
    for name, other in (("On one H100", h100), ("another H100", earlier)):
        assert other["device"].startswith("NVIDIA H100")
        assert (f"{name} ({other['commit']}") in shown
        assert f"{other['cold']['wall_s']} s cold, {other['warm']['wall_s']} s warm" in shown


def test_compile_speed_reads_each_run_s_steady_iteration_from_its_events(tmp_path):
    """compile_speed.steady: the median perf/iteration_s after the skipped iterations, from a
    real TensorBoard events file, and the count of iterations logged."""
    from torch.utils.tensorboard import SummaryWriter

    sys.path.insert(0, str(ROOT))
    from benchmark.ocr_proxy import compile_speed

    writer = SummaryWriter(str(tmp_path))
    for iteration, seconds in enumerate([30.0, 9.0, 1.5, 1.0, 1.25, 1.75], 1):
        writer.add_scalar("perf/iteration_s", seconds, iteration)
    writer.close()
    assert compile_speed.steady(tmp_path, skip=2) == {"iterations": 6, "median_iteration_s": 1.375}
    assert compile_speed.steady(tmp_path / "none", skip=2) == {"iterations": 0,
                                                               "median_iteration_s": None}


def test_results_md_gives_the_compiled_proxy_runs_figures_from_their_file():
    """The side-by-side section's compile figures are the file's (same call, same machine), and
    the target's arithmetic holds: 16 cores at 6.75 run-iterations a second leave 2.37 core-s a
    run-iteration, less than the reads alone."""
    stored = json.loads((ROOT / "benchmark/results/ocr_proxy_compile_speed_h100.json").read_text())
    warm = stored["call_2_warm_caches"]
    compiled, eager = warm["compiled"], warm["eager"]
    shown = re.sub(r"\s+", " ", (ROOT / "benchmark" / "RESULTS.md").read_text())
    history = re.sub(r"\s+", " ", (ROOT / "benchmark" / "HISTORY.md").read_text())
    cpu = {name: setting["per_run_iteration_cpu_s"] for name, setting in warm.items()}
    busy = {name: setting["usage"]["gpu_busy_percent_median"] for name, setting in warm.items()}
    reads = cpu["compiled"]["ocr_pool"]
    assert (f"{compiled['steady_run_iterations_per_s']:.2f} run-iterations/s against "
            f"{eager['steady_run_iterations_per_s']:.2f} eager, the GPU {busy['compiled']:.0f}% "
            "busy.") in shown
    docs = re.sub(r"\s+", " ", (ROOT / "docs" / "ocr-proxy.md").read_text())
    assert (f"the reads took {reads:.2f} core-seconds a run-iteration, and 10 seeds of the three "
            f"in two 10-minute calls (6.75 a second) leave {16 / 6.75:.2f} in all") in docs
    assert (f"The CPU then binds: reads take {reads:.2f} core-s, and 6.75 a second allows "
            f"{16 / 6.75:.2f} in all") in history
    assert (f"6 runs made {compiled['steady_run_iterations_per_s']:.2f} run-iterations/s (steady) "
            f"against {eager['steady_run_iterations_per_s']:.2f} eager there") in history
    assert (f"CPU fell from {cpu['eager']['trainers']:.2f} to "
            f"{cpu['compiled']['trainers']:.2f} core-s a run-iteration, the GPU from "
            f"{busy['eager']:.0f}% to {busy['compiled']:.0f}% busy") in history
    assert reads < 16 / 6.75 < reads + cpu["compiled"]["trainers"] and stored["cores"] == 16
    assert compiled["steady_run_iterations_per_s"] / eager["steady_run_iterations_per_s"] < 1.11


def test_results_md_gives_the_peers_figures_from_their_files():
    """The peers section's table is peers_h200.json's (the four trainers side by side on one
    H200), its ratios and the README's row are that file's, the H100 runs' figures are theirs, and
    what stopped flow_grpo's and DiffusionNFT's scripts on the first H100 is in its logs."""
    shown = re.sub(r"\s+", " ", (ROOT / "benchmark" / "RESULTS.md").read_text())
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    history = re.sub(r"\s+", " ", (ROOT / "benchmark" / "HISTORY.md").read_text())
    stored = json.loads((ROOT / "benchmark" / "results" / "peers_h200.json").read_text())
    assert stored["device"] == "NVIDIA H200" and stored["work"]["iterations"] == 5
    ours = stored["ours"]["seconds_per_iteration"]
    names = {"flow_grpo": "flow_grpo (Flow-GRPO)", "diffusionnft": "DiffusionNFT",
             "flow_factory": "Flow-Factory's CRD", "ours": "crd.py"}
    algorithm = {peer: stored["unmatched"][peer][0] for peer in ("flow_grpo", "diffusionnft")}
    assert {row["setting"] for row in algorithm.values()} == {"algorithm"}
    rows_in = lambda text: re.search(r"\((\d) rows?\)$", text).group(1)
    no_grad_rows = {"ours": rows_in(algorithm["flow_grpo"]["ours"]),
                    **{peer: rows_in(row["theirs"]) for peer, row in algorithm.items()}}
    no_grad_rows["flow_factory"] = no_grad_rows["ours"]  # the same algorithm
    for trainer, name in names.items():
        result = stored[trainer]
        assert result["returncode"] == 0 and len(result["iterations_s"]) == 5
        steady = result["iterations_s"][1:]
        bold = "**" if trainer == "ours" else ""
        row = (f"| {name} | {no_grad_rows[trainer]} | "
               f"{bold}{result['seconds_per_iteration']:.2f}{bold} "
               f"({min(steady):.2f}–{max(steady):.2f}) | {bold}{result['train_images_per_s']:.2f}"
               f"{bold} | {result['split']['rollout_s']:.2f} s | {result['split']['train_s']:.2f} s"
               f" | {result['peak_memory_gib']:.1f} |")
        assert row in shown, row
        if trainer != "ours":
            ratio = f"{result['seconds_per_iteration'] / ours:.1f}×"
            assert f"**{ratio}**" in shown and ratio in readme
            assert f"{result['seconds_per_iteration']:.2f} s" in readme
    for name, iterations in (("peers_h100.json", 6), ("peers_h100_three_peers_first_call.json", 5)):
        stored = json.loads((ROOT / "benchmark" / "results" / name).read_text())
        ff, ours = stored["flow_factory"], stored["ours"]
        assert stored["device"] == "NVIDIA H100 80GB HBM3"
        assert stored["work"]["iterations"] == iterations
        for trainer in (ff, ours):
            assert trainer["returncode"] == 0 and len(trainer["iterations_s"]) == iterations
            steady = trainer["iterations_s"][1:]
            assert f"{min(steady):.2f}–{max(steady):.2f} s" in history or \
                f"{min(steady):.1f}–{max(steady):.1f} s" in history
            assert f"{trainer['seconds_per_iteration']:.2f} s" in shown
        ratio = ff["seconds_per_iteration"] / ours["seconds_per_iteration"]
        assert f"**{ratio:.1f}×**" in shown and f"{ratio:.1f}×" in readme
    first_call = json.loads(
        (ROOT / "benchmark" / "results" / "peers_h100_three_peers_first_call.json").read_text())
    assert "'SD3Transformer2DModel' object has no attribute 'module'" in \
        first_call["flow_grpo"]["log_tail"]
    assert "Got unsupported ScalarType BFloat16" in first_call["diffusionnft"]["log_tail"]


def test_rec_width_reads_the_same_images_at_each_width_and_counts_what_differs(tmp_path):
    """The real PP-OCR model on one stored grid's 16 tiles and 4 renders, at today's width and the
    narrowest: today's differs from itself nowhere, and each set is read whole at each width."""
    out = tmp_path / "rec_width.json"
    result = run("benchmark/ocr_proxy/rec_width.py", "--widths", 320, 48, "--renders", 4,
                 "--grids", "benchmark/results/ocr_proxy_grid_base.png", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["images"] == {"grid_tiles": 16, "renders": 4}
    for name, count in report["images"].items():
        assert report[name]["320"]["differ"] == 0 and 0 <= report[name]["48"]["differ"] <= count
        assert all(report[name][width]["cpu_ms_per_read"] > 0 for width in ("320", "48"))
    assert len(result.stdout.splitlines()) == 4


def test_ocr_engine_reads_the_same_images_with_each_engine_and_counts_what_differs(tmp_path):
    """The real PP-OCR models on one stored grid's 16 tiles and 4 renders, with ONNX Runtime and
    OpenVINO: at float32 OpenVINO reads each as ONNX Runtime does; at its default precision it
    says which it compiled."""
    out = tmp_path / "ocr_engine.json"
    result = run("benchmark/ocr_proxy/ocr_engine.py", "--renders", 4,
                 "--grids", "benchmark/results/ocr_proxy_grid_base.png", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["images"] == {"grid_tiles": 16, "renders": 4}
    for name, count in report["images"].items():
        assert report[name]["onnxruntime"]["differ"] == report[name]["openvino-f32"]["differ"] == 0
        assert 0 <= report[name]["openvino-default"]["differ"] <= count
        assert all(report[name][engine]["cpu_ms_per_read"] > 0 for engine in report["engines"])
    precision = report["openvino-default"]["inference_precision"]
    assert precision["det"] == precision["rec"] in ("f32", "bf16", "f16")
    assert len(result.stdout.splitlines()) == 6
    bad = run("benchmark/ocr_proxy/ocr_engine.py", "--engines", "tensorrt")
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1] == (
        "ocr_engine.py: error: --engines tensorrt: one of onnxruntime, openvino-f32, "
        "openvino-default")


def test_ocr_proxy_docs_give_the_recognition_widths_figures_from_their_file():
    stored = json.loads((ROOT / "benchmark/results/ocr_proxy_rec_width_cpu.json").read_text())
    tiles, renders = stored["grid_tiles"], stored["renders"]
    assert stored["images"] == {"grid_tiles": 320, "renders": 200}
    shown = re.sub(r"\s+", " ", (ROOT / "docs" / "ocr-proxy.md").read_text())
    assert (f"halves a read ({tiles['320']['cpu_ms_per_read']} to {tiles['48']['cpu_ms_per_read']} "
            f"ms on one core of a {stored['cores']}-core Xeon") in shown
    assert "Xeon" in stored["cpu"] and stored["engine_threads"] == 1
    assert all(renders[width]["differ"] == 0 for width in renders) and "(200 of 200)" in shown
    assert f"but {tiles['48']['differ']} of the 320 tiles" in shown
    assert f"256 pixels still changes {tiles['256']['differ']} of them" in shown
    results = re.sub(r"\s+", " ", (ROOT / "benchmark" / "RESULTS.md").read_text())
    assert f"{tiles['48']['differ']} of 320 hard tiles read differently" in results
    assert tiles["320"]["cpu_ms_per_read"] / tiles["48"]["cpu_ms_per_read"] > 1.9  # "2×"


def test_ocr_proxy_docs_give_the_openvino_figures_from_their_file():
    stored = json.loads((ROOT / "benchmark/results/ocr_proxy_ocr_engine_cpu.json").read_text())
    tiles, renders = stored["grid_tiles"], stored["renders"]
    assert stored["images"] == {"grid_tiles": 320, "renders": 200} and stored["cores"] == 2
    assert "amx_bf16" in stored["cpu_flags"] and "Xeon" in stored["cpu"]
    assert stored["openvino-f32"]["inference_precision"] == {"det": "f32", "rec": "f32"}
    assert stored["openvino-default"]["inference_precision"] == {"det": "bf16", "rec": "bf16"}
    assert tiles["openvino-f32"]["differ"] == renders["openvino-f32"]["differ"] == 0
    shown = re.sub(r"\s+", " ", (ROOT / "docs" / "ocr-proxy.md").read_text())
    ms = lambda reads, engine: reads[engine]["cpu_ms_per_read"]
    assert (f"at {ms(tiles, 'openvino-f32')} and {ms(renders, 'openvino-f32')} ms a read against "
            f"{ms(tiles, 'onnxruntime')} and {ms(renders, 'onnxruntime')} (1.5× cheaper; one core "
            f"of a 2-core Xeon with AMX") in shown
    assert (f"a read took {ms(tiles, 'openvino-default')} ms but "
            f"{tiles['openvino-default']['differ']} of the 320 tiles read differently") in shown
    speedups = [ms(reads, "onnxruntime") / ms(reads, "openvino-f32") for reads in (tiles, renders)]
    assert all(1.45 < speedup < 1.55 for speedup in speedups), speedups  # "1.5×"
    gpu_machine = json.loads(
        (ROOT / "benchmark/results/ocr_proxy_engine_speed_h100.json").read_text())
    reads = gpu_machine["reads_one_core"]
    there = [ms(reads[name], "onnxruntime") / ms(reads[name], "openvino-f32")
             for name in ("grid_tiles", "renders")]
    assert all(reads[name]["openvino-f32"]["differ"] == 0 for name in ("grid_tiles", "renders"))
    assert (f"a read took {ms(reads['grid_tiles'], 'openvino-f32')} and "
            f"{ms(reads['renders'], 'openvino-f32')} ms against "
            f"{ms(reads['grid_tiles'], 'onnxruntime')} "
            f"and {ms(reads['renders'], 'onnxruntime')} ({min(there):.2f}× cheaper") in shown
    pinned, compiled = (gpu_machine["settings"][name]
                        for name in ("compiled-openvino-pinned", "compiled"))
    assert pinned["openvino_cpu_pinning"] and pinned["ocr_engine"] == "openvino"
    assert compiled["ocr_engine"] == "onnxruntime" and compiled["trainer_args"] == "--compile"
    assert (f"compiled runs made {pinned['steady_run_iterations_per_s']:.2f} run-iterations a "
            f"second against {compiled['steady_run_iterations_per_s']:.2f} on ONNX Runtime, the "
            f"GPU {pinned['usage']['gpu_busy_percent_median']}% busy") in shown
    pool = json.loads((ROOT / "benchmark/results/ocr_proxy_pool_openvino_cpu.json").read_text())
    rates = [pool["settings"]["openvino:1"][noise]["images_per_s"]
             / pool["settings"]["cpu:1"][noise]["images_per_s"] for noise in ("noise25", "noise70")]
    assert all(pool["settings"]["openvino:1"][noise]["identical_to_cpu:1"] == pool["images"]
               for noise in ("noise25", "noise70"))
    assert f"reads {min(rates):.2f}–{max(rates):.2f}× as many images a second" in shown
    results = re.sub(r"\s+", " ", (ROOT / "benchmark" / "RESULTS.md").read_text())
    assert "the same 520 reads, 1.5× cheaper" in results


def test_ocr_proxy_docs_give_the_two_pool_runtimes_side_by_side_from_their_file():
    """OpenVINO's and ONNX Runtime's pools under the same 6 eager runs in one call: the rates, the
    pool's CPU and the held-out agreement the docs state; the compiled runs of another call, and
    the 1.25x of two calls kept in HISTORY only."""
    results_dir = ROOT / "benchmark/results"
    both = json.loads((results_dir / "ocr_proxy_engine_side_by_side_h100.json").read_text())
    openvino, onnxruntime = (both["settings"][name] for name in ("eager-openvino", "eager"))
    rates = []
    for setting, engine in ((openvino, "openvino"), (onnxruntime, "onnxruntime")):
        medians = [run["median_iteration_s"] for run in setting["runs"].values()]
        assert setting["ocr_engine"] == engine and setting["trainer_args"] == ""
        assert len(medians) == 6 and not setting["failed"]
        assert math.isclose(setting["steady_run_iterations_per_s"],
                            sum(1 / median for median in medians), rel_tol=1e-12)
        pool_cpu = setting["usage"]["ocr_pool_cpu_s"] / setting["run_iterations"]
        assert round(pool_cpu, 3) == setting["per_run_iteration_cpu_s"]["ocr_pool"]
        rates.append((setting["steady_run_iterations_per_s"], pool_cpu,
                      setting["usage"]["machine_cpu_busy_percent"]))
    (ov_rate, ov_cpu, ov_busy), (ort_rate, ort_cpu, ort_busy) = rates
    assert abs(ov_rate / ort_rate - 1) < 0.01  # "did not change the runs' rate"
    shown = re.sub(r"\s+", " ", (ROOT / "docs" / "ocr-proxy.md").read_text())
    assert (f"{ov_rate:.2f} run-iterations a second on OpenVINO against {ort_rate:.2f} on ONNX "
            f"Runtime, the pool spending {ov_cpu:.2f} core-seconds a run-iteration against "
            f"{ort_cpu:.2f} while the machine's CPU was {ov_busy:.0f}% and {ort_busy:.0f}% "
            "busy") in shown
    lines = both["held_out_lines"]
    shared = 0
    for run, line in lines["eager-openvino"].items():
        other = lines["eager"][run]
        first = re.match(r"(\S+) -> (\S+) \(best (\S+) at (\d+)\), (\d+) iterations", line)
        second = re.match(r"(\S+) -> (\S+) \(best (\S+) at (\d+)\), (\d+) iterations", other)
        if first[4] == second[4]:  # the best validation at the same iteration
            assert first[3] == second[3], run
            shared += 1
        if int(first[5]) // 25 == int(second[5]) // 25:  # the same last validation
            assert first[2] == second[2], run
    assert shared == 5
    compiled = json.loads(
        (results_dir / "ocr_proxy_engine_speed_unpinned_h100.json").read_text())
    runs = compiled["settings"]["compiled-openvino"]
    medians = [run["median_iteration_s"] for run in runs["runs"].values()]
    assert runs["trainer_args"] == "--compile" and not runs["openvino_cpu_pinning"]
    assert (f"6 runs made {runs['steady_run_iterations_per_s']:.2f} on OpenVINO in another call "
            f"(steady; each run's iteration {min(medians):.2f}–{max(medians):.2f} s;") in shown
    earlier = json.loads((results_dir / "ocr_proxy_compile_speed_h100.json").read_text())
    eager_before = earlier["call_2_warm_caches"]["eager"]["steady_run_iterations_per_s"]
    assert (f"made {eager_before:.2f} (6decd17, another base) and {ort_rate:.2f} (fb80fd1) on two "
            "H100 machines") in shown
    assert "1.25×" not in shown and "near 6.2" not in shown
    results = re.sub(r"\s+", " ", (ROOT / "benchmark" / "RESULTS.md").read_text())
    assert (f"{ov_rate:.2f} run-iterations/s against {ort_rate:.2f} on ONNX Runtime "
            "(fb80fd1") in results
    assert f"the pool's CPU {ov_cpu:.2f} against {ort_cpu:.2f} core-s a run-iteration" in results
    history = re.sub(r"\s+", " ", (ROOT / "benchmark" / "HISTORY.md").read_text())
    before = json.loads((results_dir / "ocr_proxy_engine_speed_h100.json").read_text())
    ort_compiled = before["settings"]["compiled"]["steady_run_iterations_per_s"]
    assert f"1.25× ONNX Runtime's {ort_compiled:.2f} on another H100" in history
    assert f"16 / {runs['steady_run_iterations_per_s']:.2f} = 2.23 core-s" in history


def test_ocr_proxy_docs_give_the_18_runs_and_the_target_from_their_files():
    """18 eager runs on one H100: the steady rate, the waits and the CPU the docs state come from
    the runs' own figures; 10 seeds of the three at 6 runs' best rates take the training time
    said."""
    results_dir = ROOT / "benchmark/results"
    many = json.loads((results_dir / "ocr_proxy_18runs_openvino_h100.json").read_text())
    runs, throughput = many["runs_perf"], many["throughput"]
    medians = [run["median_iteration_s"] for run in runs.values()]
    waits = [run["median_reward_wait_s"] for run in runs.values()]
    assert len(runs) == 18 and set(runs) == set(many["benchmark"]["runs"])
    rate = sum(1 / median for median in medians)
    assert round(rate, 3) == throughput["steady_run_iterations_per_s"]
    assert sum(run["iterations"] for run in runs.values()) == throughput["run_iterations"]
    usage = many["benchmark"]["usage"]
    trainers = usage["trainers_cpu_s"] / throughput["run_iterations"]
    pool = usage["ocr_pool_cpu_s"] / throughput["run_iterations"]
    of_rl = throughput["run_iterations"] / many["benchmark"]["phases_s"]["rl"]
    six = json.loads((results_dir / "ocr_proxy_engine_side_by_side_h100.json").read_text())
    six_trainers = [setting["per_run_iteration_cpu_s"]["trainers"]
                    for setting in six["settings"].values()]
    assert all(run["eval"][0][1] == many["benchmark"]["runs"]["crd_default_seed0"]["eval"][0][1]
               for run in many["benchmark"]["runs"].values())
    shown = re.sub(r"\s+", " ", (ROOT / "docs" / "ocr-proxy.md").read_text())
    assert (f"made {rate:.2f} run-iterations a second at their steady iteration "
            f"({min(medians):.2f}–{max(medians):.2f} s each) and {of_rl:.2f} over the training "
            "phase") in shown
    assert (f"Every trainer waited {min(waits):.2f}–{max(waits):.2f} s of its iteration for its "
            f"rewards, the machine's CPU was {usage['machine_cpu_busy_percent']:.0f}% busy, and a "
            f"run-iteration cost the trainers {trainers:.2f} core-seconds against "
            f"{min(six_trainers):.2f}–{max(six_trainers):.2f} with 6 runs in the side-by-side "
            f"call, the pool {pool:.2f}") in shown
    compiled = json.loads(
        (results_dir / "ocr_proxy_engine_speed_unpinned_h100.json").read_text())
    best = compiled["settings"]["compiled-openvino"]["steady_run_iterations_per_s"]
    eager = six["settings"]["eager-openvino"]["steady_run_iterations_per_s"]
    work = 3 * 10 * 225
    history = re.sub(r"\s+", " ", (ROOT / "benchmark" / "HISTORY.md").read_text())
    assert (f"take {work / best:.0f}–{work / eager:.0f} s of training at 6 runs' "
            f"{eager:.2f}–{best:.2f} a second") in history
    pretrain = sorted([six["pretrain_s"], many["pretrain_s"]])
    ten = json.loads((results_dir / "ocr_proxy_three_way_10seeds_h200.json").read_text())
    per_run = sorted(call["final_scores_s"] / 5 for call in ten["calls"].values())
    least = work / best + pretrain[0] + 30 * per_run[0]
    most = work / eager + pretrain[1] + 30 * per_run[-1]
    assert least > 2 * 600  # "more than two 10-minute calls"
    assert (f"with pretraining ({pretrain[0]:.0f}–{pretrain[1]:.0f} s) and the final scores of 30 "
            f"runs ({per_run[0]:.1f}–{per_run[-1]:.1f} s a run in the 10-seed calls: "
            f"{30 * per_run[0]:.0f}–{30 * per_run[-1]:.0f} s), that is {least:,.0f}–{most:,.0f} s "
            "before any validation") in history
    assert (f"3 × 10 × 225 iterations are {work / best:.0f}–{work / eager:.0f} s of training; with "
            f"pretraining ({pretrain[0]:.0f}–{pretrain[1]:.0f} s) and 30 runs' final scores, "
            f"{least:,.0f}–{most:,.0f} s before any validation") in history
    assert f"**{rate:.2f}** run-iterations/s steady, {of_rl:.2f} over the training phase" in history
    assert (f"every trainer waited {min(waits):.2f}–{max(waits):.2f} s of its "
            f"{min(medians):.2f}–{max(medians):.2f} s iteration") in history
    results = re.sub(r"\s+", " ", (ROOT / "benchmark" / "RESULTS.md").read_text())
    assert f"18 runs made **{rate:.2f}** run-iterations/s steady" in results


def test_ocr_proxy_docs_give_blocking_sync_and_the_final_scores_speed_from_their_files():
    """The rates, CPU and percentages the docs and RESULTS.md give for CUDA's blocking
    synchronisation come from the runs' own figures, each pair from one machine and base; the final
    scores' timings and the target's arithmetic with them come from their files."""
    results_dir = ROOT / "benchmark/results"
    blocking = json.loads((results_dir / "ocr_proxy_blocking_sync_h100.json").read_text())
    rows = {}
    for name, call in blocking["calls"].items():
        for setting, measured in call["report"]["settings"].items():
            medians = [run["median_iteration_s"] for run in measured["runs"].values()]
            rate = sum(1 / median for median in medians)
            assert rate == pytest.approx(measured["steady_run_iterations_per_s"])
            usage = measured["usage"]
            rows[name, setting.endswith("blocking"), len(medians)] = (
                rate, usage["trainers_cpu_s"] / measured["run_iterations"],
                usage["machine_cpu_busy_percent"], f"{min(medians):.2f}–{max(medians):.2f} s",
                (min(medians), max(medians)))
    pairs = {6: ("call5_6runs", "call3_6runs"), 12: ("call4_12runs", "call3_12runs"),
             18: ("call2", "call2")}
    shown = re.sub(r"\s+", " ", (ROOT / "docs" / "ocr-proxy.md").read_text())
    results = re.sub(r"\s+", " ", (ROOT / "benchmark" / "RESULTS.md").read_text())
    gains, cuts = [], []
    for runs, (plain_call, blocking_call) in pairs.items():
        plain, fast = rows[plain_call, False, runs], rows[blocking_call, True, runs]
        assert (f"| {runs} | {plain[0]:.2f} → {fast[0]:.2f} | {plain[1]:.2f} → {fast[1]:.2f} | "
                f"{plain[2]:.0f}% → {fast[2]:.0f}% |") in shown
        gains.append(f"{100 * (fast[0] / plain[0] - 1):+.1f}%")
        cuts.append(100 * (1 - fast[1] / plain[1]))
    assert (f"**CUDA's blocking synchronisation in the trainers: {gains[0]}, {gains[1]} and "
            f"{gains[2]}") in results
    assert f"CPU a run-iteration {min(cuts):.0f}–{max(cuts):.0f}% lower" in results
    assert (f"at 12 runs ({rows['call3_12runs', True, 12][3]} with it, "
            f"{rows['call4_12runs', False, 12][3]} without) and at 18 "
            f"({rows['call2', True, 18][3]}, {rows['call2', False, 18][3]})") in shown
    assert (f"their median iterations apart ({rows['call1', True, 18][3]}, "
            f"{rows['call1', False, 18][3]})") in shown
    def paired(plain_call, fast_call, runs):
        """A run's median iteration without over with, less 1: mean and 95% t interval over runs."""
        plain, fast = ({run: r["median_iteration_s"] for r_name, setting in
                        blocking["calls"][call]["report"]["settings"].items()
                        if r_name.endswith("blocking") == with_it
                        for run, r in setting["runs"].items()}
                       for call, with_it in ((plain_call, False), (fast_call, True)))
        assert sorted(plain) == sorted(fast) and len(plain) == runs  # the same runs in both
        ratios = np.array([plain[run] / fast[run] - 1 for run in plain])
        half = scipy.stats.t.ppf(0.975, runs - 1) * ratios.std(ddof=1) / np.sqrt(runs)
        return (f"{100 * ratios.mean():+.1f}% [{100 * (ratios.mean() - half):+.1f}%, "
                f"{100 * (ratios.mean() + half):+.1f}%]").replace("-", "−")

    at_6, at_12, at_18 = (paired(*pairs[runs], runs) for runs in (6, 12, 18))
    assert f"took {at_6}, {at_12} and {at_18} longer at 6, 12 and 18 runs" in shown
    assert f"took {at_6}, {at_12} and {at_18} longer without it" in results
    assert f"{rows['call1', False, 18][3]}), paired {paired('call1', 'call1', 18)}." in shown
    assert f"another machine and base; {paired('call1', 'call1', 18)})" in results

    def overlap(plain, fast):
        return fast[4][1] >= plain[4][0]  # the slowest run with it against the fastest without

    assert overlap(rows["call4_12runs", False, 12], rows["call3_12runs", True, 12])
    assert overlap(rows["call2", False, 18], rows["call2", True, 18])
    assert not overlap(rows["call1", False, 18], rows["call1", True, 18])
    again = rows["call3_18runs", True, 18][0]
    other = rows["call1", False, 18], rows["call1", True, 18]
    assert f"made {again:.2f} again in the next call" in shown
    assert f"18 runs made {other[1][0]:.2f} against {other[0][0]:.2f}" in shown
    assert f"{other[1][0]:.2f} against {other[0][0]:.2f} at 18 runs in another call" in results
    speed = json.loads((results_dir / "ocr_proxy_final_scores_speed_h100.json").read_text())
    nineteen = speed["calls"]["call2"]["report"]
    timings = nineteen["timings"]
    assert nineteen["models"] == 19 and all(t["same_scores"] for t in timings.values())
    parallel, serial = timings["8"]["wall_s"], timings["0"]["wall_s"]
    assert f"19 models took {parallel:.1f} s against {serial:.1f} s in the driver's own" in shown
    assert f"19 models in {parallel:.1f} s against {serial:.1f} s" in results
    assert (f"(there {timings['0']['sample_s_sum'] / 19:.1f} s of sampling and "
            f"{timings['0']['read_s_sum'] / 19:.1f} s of reading a model)") in shown
    seven = speed["calls"]["call1"]["report"]["timings"]
    assert (f"7 models in 4 processes took {seven['4']['wall_s']:.1f} s against "
            f"{seven['0']['wall_s']:.1f} s") in shown
    six = json.loads((results_dir / "ocr_proxy_engine_side_by_side_h100.json").read_text())
    compiled = json.loads(
        (results_dir / "ocr_proxy_engine_speed_unpinned_h100.json").read_text())
    work = 3 * 10 * 225
    best = compiled["settings"]["compiled-openvino"]["steady_run_iterations_per_s"]
    eager = six["settings"]["eager-openvino"]["steady_run_iterations_per_s"]
    per_model = parallel / 19
    least, most = work / best + 31 * per_model, work / eager + 31 * per_model
    history = re.sub(r"\s+", " ", (ROOT / "benchmark" / "HISTORY.md").read_text())
    assert (f"final scores of the 31 models at {per_model:.1f} s each, it is "
            f"{least:,.0f}–{most:,.0f} s, which leaves {1200 - most:.0f}–{1200 - least:.0f} s "
            "of two calls") in history
    assert (f"{least:,.0f}–{most:,.0f} s, leaving {1200 - most:.0f}–{1200 - least:.0f} s "
            "of two calls") in history



def test_ocr_proxy_docs_give_mps_and_the_half_of_the_target_from_their_files():
    """MPS's rates, CPU and paired gains in the docs and RESULTS.md come from the runs' own
    figures (15 runs in both settings in each of two calls, in both orders); the 5-seed half's
    timings come from its file, the superseded estimate (now in HISTORY.md) from both, the half
    measured on OpenVINO's pool, its arithmetic and its runs' match with the ONNX Runtime half's
    from theirs, and the half that ran in one call from its file."""
    results_dir = ROOT / "benchmark/results"
    mps = json.loads((results_dir / "ocr_proxy_mps_h100.json").read_text())
    rows = {}
    for call, reports in mps["calls"].items():
        for report in reports.values():
            for setting, measured in report["settings"].items():
                medians = {run: r["median_iteration_s"] for run, r in measured["runs"].items()}
                rate = sum(1 / median for median in medians.values())
                assert rate == pytest.approx(measured["steady_run_iterations_per_s"])
                assert measured["mps"] == setting.endswith("-mps") and measured["blocking_sync"]
                cpu = measured["usage"]["trainers_cpu_s"] / measured["run_iterations"]
                rows[call, measured["mps"], len(medians)] = rate, cpu, medians
    shown = re.sub(r"\s+", " ", (ROOT / "docs" / "ocr-proxy.md").read_text())
    results = re.sub(r"\s+", " ", (ROOT / "benchmark" / "RESULTS.md").read_text())
    gains, with_mps = [], []
    for call, order in (("callA", "without first"), ("callB", "with first")):
        plain, fast = rows[call, False, 15], rows[call, True, 15]
        assert (f"| {call[-1]}, {order} | {plain[0]:.2f} → {fast[0]:.2f} | "
                f"{plain[1]:.2f} → {fast[1]:.2f} |") in shown
        ratios = np.array([plain[2][run] / fast[2][run] - 1 for run in plain[2]])
        assert sorted(plain[2]) == sorted(fast[2])  # the same runs in both settings
        half = scipy.stats.t.ppf(0.975, 14) * ratios.std(ddof=1) / np.sqrt(15)
        gains.append(f"{100 * ratios.mean():+.1f}% [{100 * (ratios.mean() - half):+.1f}%, "
                     f"{100 * (ratios.mean() + half):+.1f}%]")
        with_mps.append(fast[0])
    assert f"took {gains[0]} and {gains[1]} longer" in shown and gains[0] in results
    assert f"took {gains[0]} and {gains[1]} longer without it" in results
    lowest = min(float(gain.split("%")[0]) for gain in gains)
    highest = max(float(gain.split("%")[0]) for gain in gains)
    assert f"+{lowest:.0f}–{highest:.0f}% at 15 runs" in results
    others = [rows["callB", True, 12][0], rows["callB", True, 18][0], rows["callA", True, 21][0]]
    assert max(others) < min(with_mps)  # "15 at once is the best measured"
    assert (f"12 runs made {others[0]:.2f}, 18 runs {others[1]:.2f} and 21 runs (call A) "
            f"{others[2]:.2f}, one window each and so without an interval: 15 at once made the "
            "most of those measured") in shown
    assert (f"12, 18 and 21 runs made {others[0]:.2f}, {others[1]:.2f} and {others[2]:.2f}, one "
            "window each: 15 at once made the most of those measured") in results
    half = json.loads((results_dir / "ocr_proxy_defaults_5seeds_mps_h100.json").read_text())
    bench = half["benchmark"]
    assert bench["args"]["mps"] and bench["args"]["ocr_engine"] == "onnxruntime"
    assert all(run["completed"] and run["iterations"] == 225 for run in bench["runs"].values())
    rl = half["calls"]["first"]["rl_s_limit"] + bench["phases_s"]["rl"]
    iteration = sum(run["mean_iteration_s"] for run in bench["runs"].values()) / 15
    other = rl - 225 * iteration
    tail = bench["phases_s"]["final_scores"] + bench["phases_s"]["report"]
    calls = half["calls"]["first"]["wall_s"] + half["calls"]["second"]["wall_s"]
    assert calls > 600  # half of the target did not fit one call
    assert (f"took two calls, {calls:.1f} s: the first stopped at its 540 s limit, the second "
            f"resumed the runs (`--resume`) for {bench['phases_s']['rl']:.1f} s of RL, then "
            f"{bench['phases_s']['final_scores']:.1f} s of final scores and "
            f"{bench['phases_s']['report']:.1f} s of report") in shown
    rates = (f"That is {3375 / rl:.2f} run-iterations a second over the RL, {15 / iteration:.2f} "
             f"in the iterations themselves (15 runs at {iteration:.3f} s); the other "
             f"{other:.1f} s")
    assert rates in shown
    history = re.sub(r"\s+", " ", (ROOT / "benchmark" / "HISTORY.md").read_text())
    least, most = 3375 / max(with_mps), 3375 / min(with_mps)
    per_call = least + other + tail, most + other + tail
    assert (f"a half would take {least:.0f}–{most:.0f} s of iterations, plus that half's "
            f"{other:.1f} s of validations, start-ups and first iterations (its reads on ONNX "
            f"Runtime) and {tail:.1f} s of final scores and report: {per_call[0]:.0f}–"
            f"{per_call[1]:.0f} s a call, {2 * per_call[0]:,.0f}–"
            f"{2 * per_call[1]:,.0f} s for the two") in history
    assert (f"took {calls:.1f} s of two calls (890973d, 2026-12-06, one H100, "
            f"`ocr_proxy_defaults_5seeds_mps_h100.json`): {3375 / rl:.2f} run-iterations/s over "
            f"the RL, {15 / iteration:.2f} in the iterations, {other:.1f} s of validations, "
            f"start-ups and first iterations, then {tail:.1f} s of final scores and "
            "report") in results
    assert (f"{per_call[0]:.0f}–{per_call[1]:.0f} s a call, {2 * per_call[0]:,.0f}–"
            f"{2 * per_call[1]:,.0f} s for the two") in history
    measured = json.loads((results_dir / "ocr_proxy_half_openvino_mps_h100.json").read_text())
    part, call = measured["benchmark"], measured["call"]
    assert part["args"]["mps"] and part["args"]["ocr_engine"] == "openvino"
    assert part["args"]["eval_every"] == 75 and not part["args"]["final_scores"]
    runs = list(part["runs"].values())
    done = [run["iterations"] for run in runs]
    assert len(runs) == 15 and all(run["stopped_by"] == "SIGTERM" for run in runs)
    rl = part["phases_s"]["rl"]
    mean = sum(run["mean_iteration_s"] for run in runs) / 15
    first = sum(run["warmup_iteration_s"] for run in runs) / 15
    rest = rl - sum(run["warmup_iteration_s"] + (run["iterations"] - 1) * run["mean_iteration_s"]
                    for run in runs) / 15
    driver = call["wall_s"] - call["benchmark_started_after_s"] - rl - part["phases_s"]["report"]
    iterations = first + 224 * mean
    whole = iterations + rest + driver + tail + call["setup_s"]
    usage = part["usage"]
    cost = {who: usage[f"{who}_cpu_s"] / sum(done) for who in ("trainers", "ocr_pool", "driver")}
    assert f"stopped at {min(done)}–{max(done)} of their 225 iterations" in shown
    assert (f"They made {sum(done) / rl:.2f} run-iterations a second over the RL and "
            f"{15 / mean:.2f} in the iterations (15 runs at {mean:.3f} s, their first {first:.2f} "
            f"s); the other {rest:.1f} s of RL") in shown
    busy = usage["machine_cpu_busy_percent"]
    assert (f"A run-iteration cost {sum(cost.values()):.2f} core-seconds of the 16 cores, "
            f"start-ups and validations included (the trainers {cost['trainers']:.2f}, the pool "
            f"{cost['ocr_pool']:.2f}, the driver {cost['driver']:.2f}), the CPU {busy:.0f}% "
            "busy") in shown
    assert (f"a whole half's iterations take {iterations:.1f} s; with that {rest:.1f} s, the "
            f"driver's {driver:.1f} s of start and exit, the ONNX Runtime half's {tail:.1f} s of "
            f"final scores and report and {call['setup_s']} s of set-up, a call takes "
            f"{whole:.1f} s before its validations at 150 and 225, which leaves them and any "
            f"slower iteration {600 - whole:.1f} s of the 600") in shown
    assert 0 < 600 - whole < 10
    windows = [report["settings"]["eager-openvino-blocking-mps"]
               for reports in mps["calls"].values() for report in reports.values()
               if len(report["args"]["bench"]["seeds"]) == 5]
    medians = [run["median_iteration_s"] for window in windows for run in window["runs"].values()]
    (skipped,) = {report["args"]["skip"] for reports in mps["calls"].values()
                  for report in reports.values()}  # one --skip for every window
    reached = max(run["iterations"] for window in windows for run in window["runs"].values())
    assert (f"median iterations of {min(medians):.2f}–{max(medians):.2f} s over iterations "
            f"{skipped + 1}–{reached} on another H100 machine; these are means over "
            f"iterations 2 to {min(done)}–{max(done)}") in shown
    for name, run in part["runs"].items():  # the same runs on either pool runtime
        assert sorted(run["per_prompt"]) == ["0", "75"]
        for step in ("0", "75"):
            assert len(run["per_prompt"][step]) == 128
            assert run["per_prompt"][step] == bench["runs"][name]["per_prompt"][step]
    assert ("Every run's 128 per-prompt validation scores at iterations 0 and 75 equal those of "
            "the ONNX Runtime half") in shown
    assert (f"the same 15 runs made {15 / mean:.2f} run-iterations/s in their iterations "
            f"2 to {min(done)}–{max(done)}, a run-iteration costing {sum(cost.values()):.2f} "
            f"core-s of 16 cores, the CPU {busy:.0f}% busy; at those rates a whole half with "
            f"validations every 75 was estimated at {whole:.1f} s of a 600 s call") in results
    assert f"a half's 15 runs with MPS, mean iterations: {15 / mean:.2f};" in results
    # the other half, seeds 5-9, in one call: its phases and rates as the file holds them
    one_call = json.loads((results_dir / "ocr_proxy_defaults_10seeds_mps_h100.json").read_text())
    phases, call = one_call["call"]["phases_s"], one_call["call"]
    (part,) = [p for p in one_call["benchmark"]["parts"] if p["seeds"] == [5, 6, 7, 8, 9]]
    assert part["phases_s"] == phases and part["ocr_engine"] == "openvino"
    runs = one_call["benchmark"]["runs"]
    means = [np.mean([s for step, s in runs[f"{algo}_seed{seed}"]["iteration_s"] if step > 1])
             for algo in ("crd", "dgpo", "nft") for seed in part["seeds"]]  # each start's first left out
    mean = np.mean(means)
    assert call["wall_s"] < 600 and phases["rl"] + phases["final_scores"] < call["wall_s"]
    assert (f"in a call of {call['wall_s']:.1f} s on a fresh H100 with the base carried in (5136a7e, "
            "2026-12-06, `ocr_proxy_defaults_10seeds_mps_h100.json`): "
            f"{phases['rl']:.1f} s of RL ({3375 / phases['rl']:.2f} run-iterations/s; "
            f"{15 / mean:.2f} in the iterations, 15 runs at {min(means):.3f}–{max(means):.3f} s), "
            f"{phases['final_scores']:.1f} s of final scores, {phases['report']:.1f} s of "
            "report") in results
    assert (f"ran in one call of {call['wall_s']:.1f} s on a fresh H100 with the base carried in: "
            f"every run reached iteration 225, and the call ended with their final scores "
            f"({call['setup_s']} s of set-up, {phases['rl']:.1f} s of RL, "
            f"{phases['final_scores']:.1f} s of final scores, {phases['report']:.1f} s of report). "
            f"That is {3375 / phases['rl']:.2f} run-iterations a second over the RL and "
            f"{15 / mean:.2f} in the iterations (15 runs at {min(means):.3f}–{max(means):.3f} s, "
            f"mean {mean:.3f} s)") in shown


def test_the_pretrained_base_repeats_on_one_gpu_kind_and_not_across_two():
    """The H100 file's hashes (two runs alike) against the H200 file's: only the autoencoder's
    match, as the file, pretrain.py's docstring and the docs say; the full bases' scores too."""
    results_dir = ROOT / "benchmark/results"
    h100 = json.loads((results_dir / "ocr_proxy_pretrain_determinism_h100.json").read_text())
    h200 = json.loads((results_dir / "ocr_proxy_pretrain_determinism_h200.json").read_text())
    same = {}
    for part, digest in h100["sha256"].items():
        assert digest.endswith("(both runs)") and h200["sha256"][part].endswith("(both runs)")
        same[part] = digest.split()[0] == h200["sha256"][part].split()[0]
    assert same == h100["same_as_h200"] == {"transformer": False, "vae": True,
                                            "text_encoder": False}
    bases = h100["full_base"]
    scores = [round(bases[kind]["test_base"]["cfg1_40steps"], 3) for kind in ("h100", "h200")]
    doc = re.sub(r"\s+", " ", (ROOT / "benchmark/ocr_proxy/pretrain.py").read_text())
    assert f"(the base then scores {scores[0]:.3f} against {scores[1]:.3f})" in doc
    many = json.loads((results_dir / "ocr_proxy_18runs_openvino_h100.json").read_text())
    ten = json.loads((results_dir / "ocr_proxy_defaults_10seeds_h200.json").read_text())
    first = [run["eval"][0][1] for run in (many["benchmark"]["runs"]["crd_default_seed0"],
                                           ten["benchmark"]["runs"]["crd_default_seed0"])]
    shown = re.sub(r"\s+", " ", (ROOT / "docs" / "ocr-proxy.md").read_text())
    assert (f"an H100 and an H200 give other transformer and text-encoder weights "
            f"({first[0]:.3f} against {first[1]:.3f} on the test words below;") in shown
    results = re.sub(r"\s+", " ", (ROOT / "benchmark" / "RESULTS.md").read_text())
    assert f"({first[0]:.3f} against {first[1]:.3f} on the 128 test words at CFG 1)" in results


@pytest.mark.parametrize("script", ["benchmark/peers.py", "benchmark/wall_clock.py"])
def test_help_gives_the_docstring_s_whole_first_paragraph(script):
    """The docstrings' first sentences run over two lines: --help shows them whole."""
    result = run(script, "--help", env={"COLUMNS": "400"})  # no line breaks inside a word
    assert result.returncode == 0, result.stderr[-2000:]
    doc = (ROOT / script).read_text().split('"""')[1]
    paragraph = " ".join(doc.split("\n\n")[0].split())
    assert paragraph.endswith(".") and paragraph in " ".join(result.stdout.split())


def test_same_numbers_gives_the_second_tree_its_flags_and_leaves_out_their_record(tmp_path):
    """--flags-b reaches only the second run: a learning rate that changes the math shows in the
    adapters and the losses, while trainer_state.json's record of the flag itself is left out."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "benchmark/same_numbers.py", ".", ".", "--trainers", "crd",
                           "--flags=--num-iterations 1 --save-every 1 --eval-every 0",
                           "--flags-b=--learning-rate 2e-4",
                           "--out", str(report)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    differences = json.loads(report.read_text())["differences"]
    assert "crd global_step_1/adapters.safetensors" in differences
    assert "crd scalar losses/loss" in differences
    assert "/args/learning_rate" not in differences.get("crd global_step_1/trainer_state.json", [])
