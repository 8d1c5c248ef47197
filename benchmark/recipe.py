"""Benchmark crd.py's recipe at full size on one GPU, with random weights (no downloads).

    python benchmark/recipe.py --variants baseline batched --out results.json

SD3.5-M (`--model random-sd3.5-medium`) and a Qwen2.5-VL-3B-sized scorer (`random-qwen2.5-vl-3b`, 32 new tokens)
on the same GPU; 4 prompts x 6 images at 512x512, 10 rollout steps, T = 9, LoRA r32. Each variant runs crd.py for
`--iterations` iterations (the first is a warm-up and is not counted) plus a validation pass (32 prompts, 40 steps,
CFG 4.5), then reads its TensorBoard perf scalars. FLOPs of one transformer forward come from torch's FLOP counter;
MFU is the recipe's 1536 image-forwards per iteration (24 x 10 rollout + 24 x 9 x 6 training) over the measured
bf16 matmul rate. The finer rollout breakdown (encode, sampling, decode, EMA) and the FLOP count come from
benchmark/sample_speed.py (pass its JSON with --components).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import rollout  # noqa: E402
from reward import RANDOM_QWEN  # noqa: E402
from benchmark.sample_speed import median_seconds  # noqa: E402

PROMPTS = ROOT / "tests" / "data" / "ocr" / "train.txt"
RECIPE = ["--model", rollout.RANDOM_MEDIUM, "--reward", "qwen-vl", "--reward-model", RANDOM_QWEN,
          "--train-data", str(PROMPTS), "--eval-data", str(PROMPTS), "--save-every", "1000"]
VARIANTS = {  # extra crd.py arguments
    "baseline": ["--forward-batch-size", "12", "--policy-timesteps-per-forward", "1"],  # about one timestep per call
    "batched": ["--forward-batch-size", "48", "--policy-timesteps-per-forward", "3"],
}


def matmul_tflops():
    """Measured dense bf16 matmul rate: the ceiling MFU is taken against."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 20 * 2 * 8192**3 / median_seconds(lambda: [a @ b for _ in range(20)], torch.cuda.synchronize, 5) / 1e12


def run_variant(name, iterations, workdir, log_dir):
    cmd = [sys.executable, str(ROOT / "crd.py"), *RECIPE, "--num-iterations", str(iterations), "--eval-every",
           str(iterations), "--output-dir", str(workdir), "--run-name", name, *VARIANTS[name]]
    started = time.perf_counter()
    print(f"{name}: {' '.join(cmd[1:])} (log: {log_dir / f'{name}.log'})", flush=True)
    with open(log_dir / f"{name}.log", "w") as log:
        result = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if result.returncode:
        return {"error": (log_dir / f"{name}.log").read_text()[-3000:]}
    events = EventAccumulator(str(workdir / name), size_guidance={"scalars": 0})
    events.Reload()
    perf = {tag: {s.step: s.value for s in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    timed_steps = range(2, iterations + 1)  # iteration 1 is the warm-up
    mean = lambda tag: sum(perf[tag][s] for s in timed_steps) / len(timed_steps)
    return {"wall_s": time.perf_counter() - started, "iteration_s": mean("perf/iteration_s"),
            "rollout_s": mean("perf/rollout_s"), "reward_s": mean("perf/reward_s"), "train_s": mean("perf/train_s"),
            "images_per_s": 24 / mean("perf/iteration_s"), "peak_mem_gib": max(perf["perf/peak_mem_gib"].values()),
            "eval_s_cold": perf["perf/eval_s"][0], "eval_s": perf["perf/eval_s"][iterations],
            "loss_iteration_1": perf["losses/loss"][1], "grad_norm_iteration_1": perf["charts/grad_norm"][1]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["baseline", "batched"], choices=list(VARIANTS))
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--components", type=Path, help="sample_speed.py's JSON: FLOPs of one forward, rollout parts")
    parser.add_argument("--out", type=Path, default=Path("recipe.json"), help="results (JSON); the crd.py logs go beside it")
    cli = parser.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "matmul_tflops": matmul_tflops()}
    if cli.components:
        report["components"] = json.loads(cli.components.read_text())
    tflop_per_image = report["components"]["forward_tflop"] / report["components"]["images"] if cli.components else 2.44
    with tempfile.TemporaryDirectory() as workdir:
        for name in cli.variants:
            result = report[name] = run_variant(name, cli.iterations, Path(workdir), cli.out.parent)
            if "error" not in result:
                result["mfu"] = 1536 * tflop_per_image / result["iteration_s"] / report["matmul_tflops"]
            print(name, json.dumps(result, indent=1), flush=True)
            cli.out.write_text(json.dumps(report, indent=1))  # after each variant: a run cut short keeps its numbers
    print(json.dumps({k: v for k, v in report.items() if k not in VARIANTS}, indent=1))
    print(f"{'variant':10} {'s/iter':>7} {'img/s':>6} {'rollout':>7} {'reward':>6} {'train':>6} {'MFU':>5} {'peak GiB':>8} {'eval s':>6}")
    for name in cli.variants:
        r = report[name]
        if "error" in r:
            print(f"{name:10} failed: {r['error'][-500:]}")
            continue
        print(f"{name:10} {r['iteration_s']:7.2f} {r['images_per_s']:6.2f} {r['rollout_s']:7.2f} {r['reward_s']:6.2f} "
              f"{r['train_s']:6.2f} {r['mfu']:5.1%} {r['peak_mem_gib']:8.1f} {r['eval_s']:6.1f}")
