"""precompile.py: worker processes compile the trainer's graphs into torch.compile's on-disk caches, where the trainer's
own compile then finds them; a failed worker is named; a Ctrl-C is the trainer's; a killed trainer leaves no worker."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import precompile
import rollout
import sd3
import zygote

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("model", [sd3.RANDOM_MEDIUM, sd3.TINY])
def test_the_smallest_transformer_has_every_block_kind_of_the_model(model):
    """block_kinds reads diffusers' blocks right, and smallest_config keeps one block of each kind, in order: SD3.5-M's
    24 blocks (13 with dual attention, 10 plain, the last) become 3; SD3's (no dual attention) would become 2."""
    from diffusers import SD3Transformer2DModel

    def kinds_of_blocks(config):
        with torch.device("meta"):
            blocks = SD3Transformer2DModel.from_config(config).transformer_blocks
        return [(block.use_dual_attention, block.context_pre_only) for block in blocks]

    config, _ = precompile.model_configs(model)
    assert kinds_of_blocks(config) == precompile.block_kinds(config)
    smallest = precompile.smallest_config(config)
    assert kinds_of_blocks(smallest) == list(dict.fromkeys(precompile.block_kinds(config)))
    assert smallest["num_layers"] == {sd3.RANDOM_MEDIUM: 3, sd3.TINY: 2}[model]
    no_dual = precompile.smallest_config({**config, "dual_attention_layers": ()})
    assert kinds_of_blocks(no_dual) == [(False, False), (False, True)]


def test_only_a_cold_start_of_one_rank_that_validates_first_starts_workers(tmp_path, monkeypatch):
    """Workers pay off only behind model loading and the first validation of a start that compiles everything."""
    import compiling
    import crd
    from settings import ValidationArgs

    monkeypatch.setenv("CRD_CACHE", str(tmp_path))
    cold = rollout.CompileCache("tiny", torch.device("cpu"), enabled=True)  # no file to load
    off = rollout.CompileCache("tiny", torch.device("cpu"), enabled=False)  # --no-compile, or the CPU
    assert cold.cold and not off.cold
    no_validation = crd.Args(validation=ValidationArgs(eval_every=0))
    for args, cache, world_size in [(no_validation, cold, 1), (crd.Args(), cold, 2), (crd.Args(), off, 1)]:
        workers = compiling.start_precompile(args, cache, "cpu", world_size)
        assert workers.passes == [] and workers.workers == []


@pytest.mark.long
def test_workers_compile_the_graphs_that_the_trainer_then_finds_in_the_caches(tmp_path, monkeypatch):
    """A worker makes the policy's grad pass on the smallest model of a 3-block tiny SD3 (two dual-attention blocks,
    the last) into an empty inductor cache; while it runs, eager() keeps compiled code from compiling. A fresh process
    then loads the whole model as the trainer does and makes the same call: every graph (each block kind's forward
    and backward) is a cache hit, none compiles."""
    from diffusers import StableDiffusion3Pipeline

    config = {**sd3.TINY_CONFIG, "transformer": {**sd3.TINY_CONFIG["transformer"], "num_layers": 3,
                                                     "dual_attention_layers": (0, 1)}}
    StableDiffusion3Pipeline(**sd3._build_components(config)).save_pretrained(tmp_path / "model")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the worker inherits it
    job = {"adapter": "policy", "grad": True, "rows": 3}
    workers = precompile.Precompile([job], str(tmp_path / "model"), "cpu", torch.float32, lora=(4, 8), resolution=64)
    graphs, add_one = torch._dynamo.utils.counters["stats"]["unique_graphs"], torch.compile(lambda x: x + 1)
    with workers.eager():
        assert all(process.poll() is None for _, process, _ in workers.workers)
        add_one(torch.ones(2))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    workers.wait()

    trainer = f"""
import json, torch, lora_adapters, rollout, sd3
from torch._dynamo.utils import counters
transformer = sd3.load_pipeline({str(tmp_path / "model")!r}).transformer
lora_adapters.add_lora_adapters(transformer, 4, 8)
rollout.compile_blocks(transformer)
rows, config = 3, transformer.config
latents, embeds = torch.randn(rows, 16, 8, 8), torch.randn(rows, 333, config.joint_attention_dim)
with lora_adapters.use_adapter(transformer, "policy"):
    v = rollout.predict_velocity(transformer, latents, torch.full((rows,), 500.0), embeds,
                                 torch.randn(rows, config.pooled_projection_dim))
v.square().mean().backward()
print(json.dumps({{**counters["aot_autograd"], **counters["inductor"]}}))
"""
    run = zygote.run([sys.executable, "-c", trainer], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.splitlines()[-1])
    assert counts.get("autograd_cache_hit") == 2 and "autograd_cache_miss" not in counts, counts  # 2 block kinds
    assert counts.get("fxgraph_cache_hit") == 4 and "fxgraph_cache_miss" not in counts, counts  # forward, backward


def test_a_failed_worker_is_named_in_one_line(tiny_model_dir, tmp_path, capsys):
    """A worker that fails exits 1, and wait() names its pass and the reason in one line: peft refuses LoRA rank 0;
    a directory without a model has no config to read."""
    sampling, decode = {"adapter": "sampling", "grad": False, "rows": 2}, {"decode": 2}
    precompile.Precompile([sampling], str(tiny_model_dir), "cpu", torch.float32, lora=(0, 8)).wait()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "cold start: compiling in 1 worker process while the models load"
    assert lines[1].startswith(f"compile worker {json.dumps(sampling)} failed (exit 1: ValueError: ")
    assert "positive integer" in lines[1] and lines[1].endswith("; the trainer compiles its graphs itself")
    assert re.fullmatch(r"compile workers done after \d+ s \(sampling \d+ s\)", lines[2]) and len(lines) == 3

    precompile.Precompile([decode], str(tmp_path), "cpu", torch.float32).wait()
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(f"compile worker {json.dumps(decode)} failed (exit 1: OSError: ")
    assert f"config.json found in directory {tmp_path}" in lines[1]
    assert re.fullmatch(r"compile workers done after \d+ s \(decoder \d+ s\)", lines[2])


def test_workers_miss_the_terminals_ctrl_c_and_end_with_a_killed_trainer(tmp_path, tiny_model_dir):
    """A Ctrl-C (SIGINT to the terminal's process group) is the trainer's to handle, and it finishes its iteration,
    which needs the graphs: the workers, in a session of their own, do not get it. SIGKILL gives the trainer no chance
    to stop its workers: each sees that its parent is gone and exits."""
    trainer = f"""
import signal, torch, precompile, time
signal.signal(signal.SIGINT, lambda *_: None)  # a handler, as the trainers' GracefulStop (children get the default)
workers = precompile.Precompile([{{"decode": 2}}], {str(tiny_model_dir)!r}, "cpu", torch.float32, resolution=64)
print(*(process.pid for _, process, _ in workers.workers), flush=True)
time.sleep(600)
"""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    parent = subprocess.Popen([sys.executable, "-c", trainer], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # a process group of its own, as a terminal gives
    assert parent.stdout.readline().startswith("cold start: compiling in 1 worker process")
    worker = int(parent.stdout.readline())

    def alive(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False

    os.killpg(parent.pid, signal.SIGINT)
    time.sleep(1)
    assert alive(worker)
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    deadline = time.monotonic() + 30
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(worker)


@pytest.mark.parametrize("argv, code, first", [
    (["--help"], 0, "usage: precompile.py [-h] spec"),
    (["not json"], 2, "precompile.py: error: spec: not a JSON object of Precompile's"),
    (['["a list"]'], 2, "precompile.py: error: spec: not a JSON object of Precompile's"),
])
def test_the_worker_script_run_by_hand_gives_help_or_one_line(argv, code, first):
    """python precompile.py --help (a new user's first try) prints the help; a spec that is not
    Precompile's is one line, never a traceback."""
    result = zygote.run([sys.executable, "precompile.py", *argv], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == code and "Traceback" not in result.stdout + result.stderr
    output = result.stdout if code == 0 else result.stderr
    assert output.startswith(first), output
    if code:
        assert len(result.stderr.splitlines()) == 1, result.stderr
