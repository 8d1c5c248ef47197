"""--rollout-engine vllm-omni in the trainers, on the tiny model (CPU), against the stand-in
vllm_omni of tests/test_omni_rollout.py: rollouts through the engine train bitwise as the
diffusers ones, a resume may change the engine (a checkpoint that predates the flag too), and what
the engine cannot serve is one line.

Run: python -m pytest -q -n 0 tests/test_omni_runs.py
"""

import json
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import checks
import crd
import omni_rollout
import rollout
import sd3
from settings import with_settings
from tensorboard_logs import scalars
from test_omni_rollout import write_stand_in
from test_omni_rollout import lora_pipe, on_cpu, stand_in, stand_in_dir  # noqa: F401, F811
from test_trainers import ROOT, TINY_RUN, train
import zygote

# A trainer under the stand-in: its folder first on sys.path, the CPU accepted as the on_cpu
# fixture accepts it in process (the real vLLM-Omni has no CPU path); at the end it prints the
# adapter id of each request the engine got
ON_STAND_IN = """
import runpy, sys
sys.path.insert(0, sys.argv.pop(1))
import omni_rollout
omni_rollout.ENGINE_DEVICE_TYPES = ("cuda", "cpu")
sent, generate = [], omni_rollout.OmniRollout._generate
def counted(self, prompt, params):
    sent.append(params.lora_request and params.lora_request.lora_int_id)
    return generate(self, prompt, params)
omni_rollout.OmniRollout._generate = counted
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
print("engine requests' adapter ids:", sent)
"""
THREE_ITERATIONS = ["--num-iterations", 3, "--eval-every", 0, "--save-every", 1,
                    "--keep-last", 0]
LOGGED = ("train/reward_mean", "train/reward_std", "losses/loss", "losses/policy_loss",
          "losses/kl_loss", "charts/grad_norm")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """A 3-iteration crd.py run with the diffusers engine, and a copy of it resumed from its first
    checkpoint with --rollout-engine vllm-omni (the stand-in as vllm_omni): {"diffusers": run
    directory, "vllm-omni": run directory, "stdout": the resumed run's}."""
    stand_in_root = write_stand_in(tmp_path_factory.mktemp("stand_in_runs"))
    out = tmp_path_factory.mktemp("omni_runs")
    train("crd.py", tiny_model_dir, out / "diffusers", *THREE_ITERATIONS)
    run = {"diffusers": out / "diffusers" / "run", "vllm-omni": out / "vllm-omni" / "run"}
    shutil.copytree(run["diffusers"], run["vllm-omni"], ignore=shutil.ignore_patterns(
        "global_step_[23]", "events.*", "summary.json"))
    cmd = [sys.executable, "-c", ON_STAND_IN, stand_in_root, "crd.py", *TINY_RUN, "--output-dir",
           out / "vllm-omni", "--run-name", "run", "--rollout-engine", "vllm-omni",
           *THREE_ITERATIONS, "--resume-from", run["vllm-omni"] / "global_step_1"]
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    result = zygote.run(list(map(str, cmd)), cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return {**run, "stdout": result.stdout}


def test_the_engines_rollouts_train_bitwise_as_the_diffusers_ones(runs):
    """Iterations 2 and 3 rolled out through the engine (its Euler loop, the trained sampling
    adapter sent under a new id each time): the rewards of their decoded images, the losses on
    their latents and the adapters trained are the diffusers run's, to the bit."""
    # the start-up check (base model, then a random adapter), then one rollout an iteration
    assert "engine requests' adapter ids: [None, 1, 2, 3]" in runs["stdout"]
    for tag in LOGGED:
        engine, plain = scalars(runs["vllm-omni"], tag), scalars(runs["diffusers"], tag)
        assert list(engine) == [2, 3] and engine == {k: plain[k] for k in engine}, tag
    for step in (2, 3):
        a, b = (load_file(runs[name] / f"global_step_{step}" / "adapters.safetensors")
                for name in ("diffusers", "vllm-omni"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_may_change_the_engine_and_a_checkpoint_before_the_flag_resumes(runs):
    """The diffusers run's checkpoints record no rollout_engine, as those written before the flag
    existed (a default run saves what it saved before); the engine's record it."""
    assert "resuming with changed settings: rollout_engine diffusers -> vllm-omni" in \
        runs["stdout"]
    states = {name: json.loads((runs[name] / "global_step_3" / "trainer_state.json").read_text())
              for name in ("diffusers", "vllm-omni")}
    assert "rollout_engine" not in states["diffusers"]["args"]
    assert states["vllm-omni"]["args"]["rollout_engine"] == "vllm-omni"
    args = crd.Args(train_batch_size=6)
    crd.check_args(args)
    saved = {"args": json.loads(json.dumps(checkpoint.record_args(args))), "world_size": 1,
             "algorithm": "crd"}
    engine_args = with_settings(args, rollout_engine="vllm-omni")
    assert checkpoint.resume_changes(saved, engine_args, 1, "crd") == \
        ([], ["rollout_engine diffusers -> vllm-omni"])


# ---- one-line refusals, as the trainers make and start the engine --------------------------


def engine_args(model="tiny", **machine):
    return SimpleNamespace(model=model, machine=SimpleNamespace(
        **{"rollout_engine": "vllm-omni", "compile": False, **machine}))


def one_line_exit(call):
    """What `call` exits with inside the trainers' loading_errors_as_one_line block."""
    with pytest.raises(SystemExit) as exit_:
        with checks.loading_errors_as_one_line():
            call()
    message = str(exit_.value.code)
    assert "\n" not in message and ": error: --rollout-engine vllm-omni" in message, message
    return message


def test_what_the_engine_cannot_serve_is_one_line_before_anything_loads(monkeypatch, stand_in):
    says = one_line_exit(lambda: omni_rollout.RolloutEngine(engine_args(), 2, "cuda"))
    assert "runs on one actor rank; this run has 2" in says
    says = one_line_exit(lambda: omni_rollout.RolloutEngine(engine_args(), 1, "cpu"))
    assert "needs a CUDA GPU (vLLM-Omni has no CPU diffusion path)" in says
    args = engine_args(model=sd3.RANDOM_MEDIUM)
    assert "built in memory" in one_line_exit(lambda: omni_rollout.RolloutEngine(args, 1, "cuda"))
    monkeypatch.setattr(omni_rollout.importlib.util, "find_spec", lambda name, *a: None)
    says = one_line_exit(lambda: omni_rollout.RolloutEngine(engine_args(), 1, "cuda"))
    assert "vllm-omni is not installed" in says


def test_an_adapter_that_binds_nothing_stops_the_trainer_with_one_line(stand_in, on_cpu, lora_pipe,
                                                                       tiny_model_dir, monkeypatch):
    from vllm_omni.diffusion.lora import manager

    monkeypatch.setattr(manager, "BIND", False)
    engine = omni_rollout.RolloutEngine(engine_args(model=str(tiny_model_dir)), 1, "cpu")
    says = one_line_exit(lambda: engine.start(lora_pipe, torch.float32))
    assert "the adapter bound no module" in says and engine.sample is rollout.sample


def test_the_engine_starts_on_the_adapters_and_closes(stand_in, on_cpu, lora_pipe, tiny_model_dir):
    engine = omni_rollout.RolloutEngine(engine_args(model=str(tiny_model_dir), compile=True), 1, "cpu")
    engine.start(lora_pipe, torch.float32)
    omni = engine.omni
    assert engine.sample == omni.sample and omni.omni.kwargs["enforce_eager"] is False
    engine.close()
    assert omni.omni.closed and engine.sample is rollout.sample


def test_the_diffusers_engine_is_rollout_sample_and_starts_nothing(lora_pipe):
    engine = omni_rollout.RolloutEngine(engine_args(rollout_engine="diffusers"), 4, "cpu")
    engine.start(lora_pipe, torch.float32)
    assert engine.sample is rollout.sample and engine.omni is None
    engine.close()


# ---- benchmark/omni_check.py ------------------------------------------------------------------


def test_omni_check_runs_its_tiny_smoke_against_the_stand_in(stand_in, on_cpu, tiny_model_dir,
                                                            tmp_path, monkeypatch, capsys):
    """Its --help, and its first phase on the CPU: the stand-in's latents are diffusers's to the
    bit, and its sampling adapter moved them; omni_check.json holds what ran."""
    from benchmark import omni_check

    monkeypatch.setattr(sys, "argv", ["omni_check.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        omni_check.main()
    assert exit_.value.code == 0 and "--time-budget-s" in capsys.readouterr().out
    monkeypatch.setenv("CRD_CACHE", str(tiny_model_dir.parent))
    monkeypatch.setattr(sys, "argv", ["omni_check.py", "--out", str(tmp_path), "--device", "cpu",
                                      "--phases", "smoke", "--num-steps", "4"])
    omni_check.main()
    results = json.loads((tmp_path / "omni_check.json").read_text())
    smoke = results["phases"]["smoke"]
    assert smoke["status"] == "ok", smoke
    assert smoke["bitwise_equal"] and smoke["max_abs_diff"] == 0 and smoke["images"] == 4
    assert smoke["engine_lora_moved_mean"] > 0 and list(results["phases"]) == ["smoke"]
