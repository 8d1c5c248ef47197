"""--track: a real tiny-model crd.py run logged to Weights & Biases offline (WANDB_MODE=offline, its
files under tmp_path), with TensorBoard's scalars synced and nothing sent; without wandb, or without
a W&B login, one line.

Run: python -m pytest -q -n 0 tests/test_track.py
"""

import json
import os
import re
import socket
import sys
import threading

import pytest

from test_trainers import ROOT, TINY_RUN
import zygote

BLOCK_WANDB = """import sys


class BlockWandb:  # as if wandb were not installed
    def find_spec(self, name, path=None, target=None):
        if name == "wandb" or name.startswith("wandb."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, BlockWandb())
"""


def clean_env(**extra):
    """This interpreter's environment without any WANDB_ setting of the shell, plus `extra`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    return {**env, **extra}


def train(env, out_dir, *extra):
    cmd = [sys.executable, "crd.py", *TINY_RUN, "--output-dir", str(out_dir), *map(str, extra)]
    return zygote.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_track_logs_the_run_offline_with_its_tensorboard_scalars(tiny_model_dir, tmp_path):
    """The offline W&B run is the run directory's (its id in wandb_run_id), holds the run's
    TensorBoard file and its scalars, and its config names the run; the W&B server address, a
    real socket here, is never connected to."""
    pytest.importorskip("wandb", reason="the optional requirements-track.txt (CI installs it)")
    listener = socket.create_server(("127.0.0.1", 0))
    connections = []
    threading.Thread(target=lambda: connections.append(listener.accept()), daemon=True).start()
    env = clean_env(CRD_CACHE=str(tiny_model_dir.parent), WANDB_MODE="offline",
                    WANDB_DIR=str(tmp_path / "wandb"), WANDB_SILENT="true",
                    WANDB_BASE_URL=f"http://127.0.0.1:{listener.getsockname()[1]}")
    result = train(env, tmp_path / "runs", "--num-iterations", 1, "--eval-every", 0, "--track",
                   "--run-name", "tracked")
    listener.close()
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tracked"
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    (offline,) = (tmp_path / "wandb" / "wandb").glob("offline-run-*")
    assert offline.name.endswith(f"-{run_id}")
    (events,) = run_dir.glob("events.out.tfevents.*")
    assert (offline / "files" / events.name).read_bytes() == events.read_bytes()
    log = (offline / f"run-{run_id}.wandb").read_bytes()
    for tag in (b"train/reward_mean", b"losses/loss", b"perf/iteration_s"):
        assert tag in log
    assert re.search(rb"run_name.{1,4}" + re.escape(json.dumps("tracked").encode()), log)
    assert not connections  # offline: nothing sent


def test_track_without_wandb_is_one_line(tmp_path):
    """wandb made unimportable (a meta path blocker in a sitecustomize on PYTHONPATH): --track
    stops before anything loads, in one line that says what to install."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_WANDB)
    env = clean_env(PYTHONPATH=str(tmp_path))
    result = train(env, tmp_path / "runs", "--track")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "crd.py: error: --track: wandb is not installed (No module named 'wandb'); install it "
        "with pip install -r requirements-track.txt"]
    assert not (tmp_path / "runs").exists()


def test_track_without_a_login_is_one_line(tiny_model_dir, tmp_path):
    """wandb installed, no API key anywhere (an empty HOME, no WANDB_API_KEY) and not offline:
    one line that says how to log in or go offline, and the new run directory is not left."""
    pytest.importorskip("wandb", reason="the optional requirements-track.txt (CI installs it)")
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(CRD_CACHE=str(tiny_model_dir.parent), HOME=str(home),
                    NETRC=str(home / ".netrc"), WANDB_DIR=str(tmp_path / "wandb"))
    result = train(env, tmp_path / "runs", "--num-iterations", 1, "--eval-every", 0, "--track",
                   "--run-name", "tracked")
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1:] == [
        "crd.py: error: --track: W&B could not start the run (No API key configured. Use `wandb "
        "login` to log in.); log in with `wandb login`, or set WANDB_MODE=offline to keep it in "
        "the run directory and `wandb sync` it later"]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs" / "tracked").exists()
