"""Benchmark crd.py's recipe at full size on one or more GPUs, with random weights (no downloads).

    python benchmark/recipe.py --variants baseline batched --out results.json
    python benchmark/recipe.py --variants compiled --actor-gpus 2 --out two_actors.json     # torchrun, 2 ranks
    python benchmark/recipe.py --variants compiled --reward-gpu --out reward_gpu.json     # scorer on the next GPU

SD3.5-M (`--model random-sd3.5-medium`) and a Qwen2.5-VL-3B-sized scorer (`random-qwen2.5-vl-3b`, 32 new tokens)
on each actor GPU, or with --reward-gpu on the GPU after the actors; 4 prompts x 6 images per actor GPU at 512x512,
10 rollout steps, T = 9, LoRA r32. Each variant runs crd.py for
`--iterations` iterations (the first is a warm-up and is not counted) plus a validation pass (32 prompts, 40 steps,
CFG 4.5), then reads its TensorBoard perf scalars. FLOPs of one transformer forward come from torch's FLOP counter;
MFU is the recipe's 1536 image-forwards per iteration (24 x 10 rollout + 24 x 9 x 6 training) over the measured
bf16 matmul rate. The finer rollout breakdown (encode, sampling, decode, EMA) and the FLOP count come from
benchmark/sample_speed.py (pass its JSON with --components). "reward" is the scorer's own time, spent in a thread
beside the base model's passes; "waited" is the part of it training waited for (in s / iteration).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import sd3  # noqa: E402
from ocr_reward import RANDOM_QWEN  # noqa: E402
from benchmark.events import scalars  # noqa: E402
from benchmark.sample_speed import median_seconds  # noqa: E402

PROMPTS = ROOT / "tests" / "data" / "ocr" / "train.txt"
RECIPE = ["--model", sd3.RANDOM_MEDIUM, "--reward", "qwen-vl", "--reward-model", RANDOM_QWEN,
          "--train-data", str(PROMPTS), "--eval-data", str(PROMPTS), "--save-every", "1000"]
VARIANTS = {  # extra crd.py arguments
    "baseline": ["--forward-batch-size", "12", "--policy-timesteps-per-forward", "1", "--no-compile"],  # ~1 timestep a call
    "batched": ["--forward-batch-size", "48", "--policy-timesteps-per-forward", "3", "--no-compile"],
    "compiled": ["--forward-batch-size", "48", "--policy-timesteps-per-forward", "3", "--compile"],
    "compiled-1t": ["--forward-batch-size", "48", "--policy-timesteps-per-forward", "1", "--compile"],
    "compiled-2t": ["--forward-batch-size", "48", "--policy-timesteps-per-forward", "2", "--compile"],
    "compiled-ckpt": ["--forward-batch-size", "48", "--policy-timesteps-per-forward", "3", "--compile",
                      "--gradient-checkpointing"],
}


def matmul_tflops():
    """Measured dense bf16 matmul rate: the ceiling MFU is taken against."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 20 * 2 * 8192**3 / median_seconds(lambda: [a @ b for _ in range(20)], torch.cuda.synchronize, 5) / 1e12


def run_variant(variant, name, iterations, workdir, log_dir, actor_gpus=1, reward_gpu=False, validate=True):
    launcher = [sys.executable]
    if actor_gpus > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={actor_gpus}"]
    cmd = [*launcher, str(ROOT / "crd.py"), *RECIPE, "--num-iterations", str(iterations), "--eval-every",
           str(iterations if validate else 0), "--output-dir", str(workdir), "--run-name", name,
           *VARIANTS[variant]]
    if reward_gpu:
        cmd += ["--reward-device", f"cuda:{actor_gpus}", "--text-encoder-device", f"cuda:{actor_gpus}"]  # as run.sh
    started = time.perf_counter()
    print(f"{name}: {' '.join(cmd[1:])} (log: {log_dir / f'{name}.log'})", flush=True)
    with open(log_dir / f"{name}.log", "w") as log:
        # In a session of its own, killed outright if this script ends first: crd.py answers SIGTERM by finishing its
        # iteration (minutes while it compiles), and a trainer left running skews every later measurement on its GPU.
        trainer = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            returncode = trainer.wait()
        finally:
            if trainer.poll() is None:
                os.killpg(trainer.pid, signal.SIGKILL)
    if returncode:
        return {"error": (log_dir / f"{name}.log").read_text()[-3000:]}
    perf = scalars(workdir / name)
    timed_steps = range(2, iterations + 1)  # iteration 1 is the warm-up
    mean = lambda tag: sum(perf[tag][s] for s in timed_steps) / len(timed_steps)
    summary = json.loads((workdir / name / "summary.json").read_text())
    return {"wall_s": time.perf_counter() - started, "actor_gpus": actor_gpus, "reward_gpu": reward_gpu,
            "iteration_s": mean("perf/iteration_s"), "rollout_s": mean("perf/rollout_s"),
            "reward_s": mean("perf/reward_s"), "train_s": mean("perf/train_s"),
            **({"reward_wait_s": mean("perf/reward_wait_s")} if "perf/reward_wait_s" in perf else {}),
            "images_per_s": actor_gpus * 24 / mean("perf/iteration_s"), "images_per_s_per_actor_gpu": 24 / mean("perf/iteration_s"),
            "first_iteration_s": perf["perf/iteration_s"][1], "peak_mem_gib": max(perf["perf/peak_mem_gib"].values()),
            "peak_mem_gib_per_device": summary["peak_mem_gib"],
            **({"eval_s_cold": perf["perf/eval_s"][0], "eval_s": perf["perf/eval_s"][iterations]} if validate else {}),
            "loss_iteration_1": perf["losses/loss"][1], "grad_norm_iteration_1": perf["charts/grad_norm"][1]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["baseline", "batched"], choices=list(VARIANTS))
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--actor-gpus", type=int, default=1, help="actor processes (torchrun), one GPU each")
    parser.add_argument("--reward-gpu", action="store_true", help="the in-process scorer on GPU --actor-gpus")
    parser.add_argument("--skip-validation", action="store_true", help="time training iterations only")
    parser.add_argument("--components", type=Path, help="sample_speed.py's JSON: FLOPs of one forward, rollout parts")
    parser.add_argument("--out", type=Path, default=Path("recipe.json"), help="results (JSON); the crd.py logs go beside it")
    cli = parser.parse_args()
    if not torch.cuda.is_available():  # before the matmul rate below, which needs one
        parser.exit(1, "recipe.py: error: needs a CUDA GPU (torch sees none): it times crd.py's "
                       "full-size recipe; on a CPU, try the README's tiny demo\n")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # `timeout`: stop the trainer too
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "matmul_tflops": matmul_tflops()}
    if cli.components:
        report["components"] = json.loads(cli.components.read_text())
    tflop_per_image = report["components"]["forward_tflop"] / report["components"]["images"] if cli.components else 2.44
    with tempfile.TemporaryDirectory() as workdir:
        layout = "" if cli.actor_gpus == 1 and not cli.reward_gpu else f"_{cli.actor_gpus}actor" + "_reward_gpu" * cli.reward_gpu
        names = [variant + layout for variant in cli.variants]
        for variant, name in zip(cli.variants, names):
            result = report[name] = run_variant(variant, name, cli.iterations, Path(workdir), cli.out.parent, cli.actor_gpus,
                                                cli.reward_gpu, not cli.skip_validation)
            if "error" not in result:
                result["mfu"] = 1536 * tflop_per_image / result["iteration_s"] / report["matmul_tflops"]
            print(name, json.dumps(result, indent=1), flush=True)
            cli.out.write_text(json.dumps(report, indent=1))  # after each variant: a run cut short keeps its numbers
    print(json.dumps({k: v for k, v in report.items() if k not in names}, indent=1))
    print(f"{'variant':24} {'s/iter':>7} {'img/s':>6} {'rollout':>7} {'reward':>6} {'waited':>6} {'train':>6} {'MFU':>5} "
          f"{'peak GiB':>8} {'eval s':>6}")
    for name in names:
        r = report[name]
        if "error" in r:
            print(f"{name:24} failed: {r['error'][-500:]}")
            continue
        print(f"{name:24} {r['iteration_s']:7.2f} {r['images_per_s']:6.2f} {r['rollout_s']:7.2f} {r['reward_s']:6.2f} "
              f"{r.get('reward_wait_s', r['reward_s']):6.2f} {r['train_s']:6.2f} {r['mfu']:5.1%} {r['peak_mem_gib']:8.1f} {r.get('eval_s', float('nan')):6.1f}")
