"""The wall clock a user feels: crd.py from its launch to summary.json, cold and warm, split into
start-up, validation, training and checkpoints.

    python benchmark/wall_clock.py --iterations 20 --out wall_clock.json     # one GPU, ~9 minutes
    python benchmark/wall_clock.py --tiny --iterations 3 --starts cold      # README's tiny demo, CPU

Each start runs the recipe as `python crd.py` runs it by default (validation every 10 iterations
on 32 prompts at 40 steps, a checkpoint every 10, the in-process scorer), with random full-size
weights (SD3.5-M and a Qwen2.5-VL-3B-sized scorer, no downloads) on one GPU, for --iterations:
    cold   CRD_CACHE, TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR new and empty
    warm   the cold start's caches kept (a second run on the same machine)
The split comes from the run's TensorBoard scalars and their wall times: start-up is the launch
to the first validation's start, validation the sum of perf/eval_s, training the sum of
perf/iteration_s; the rest (checkpoints, logging, the exit) is what remains of the wall clock.
`whole_recipe_s` adds them up for the recipe's 100 iterations (11 validations, 10 checkpoints) at
this run's steady iteration, validation and remainder a checkpoint (the exit counted in each, so
an upper bound): a projection where --iterations is below 100, labelled so.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import sd3  # noqa: E402
from benchmark.events import scalar_events  # noqa: E402
from ocr_reward import RANDOM_QWEN  # noqa: E402

PROMPTS = ROOT / "tests" / "data" / "ocr" / "train.txt"
TRAINER = ["--model", sd3.RANDOM_MEDIUM, "--reward", "qwen-vl", "--reward-model", RANDOM_QWEN,
           "--train-data", str(PROMPTS), "--eval-data", str(PROMPTS)]
TINY = ["--model", "tiny", "--reward", "brightness", "--train-data", str(PROMPTS),
        "--eval-data", str(PROMPTS.with_name("test.txt")), "--resolution", "64",
        "--prompts-per-rank", "2", "--group-size", "4", "--eval-prompts", "8", "--eval-steps", "10",
        "--device", "cpu"]  # README's demo, at the recipe's validation and checkpoint cadence
RECIPE_ITERATIONS = 100
EVERY = 10  # crd.py's --eval-every and --save-every


def run_start(name, caches, workdir, iterations, trainer):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CRD_CACHE": str(caches / "crd"),
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
           "TRITON_CACHE_DIR": str(caches / "triton")}
    command = [sys.executable, str(ROOT / "crd.py"), *trainer, "--num-iterations", str(iterations),
               "--output-dir", str(workdir), "--run-name", name]
    launched = time.time()
    with open(workdir / f"{name}.log", "w") as log:
        code = subprocess.call(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall_s = time.time() - launched
    run = workdir / name
    result = {"returncode": code, "wall_s": round(wall_s, 1)}
    if code:
        result["log_tail"] = (workdir / f"{name}.log").read_text(errors="replace")[-2000:]
        return result
    summary = json.loads((run / "summary.json").read_text())
    logged = scalar_events(run)
    evals = {e.step: e for e in logged["perf/eval_s"]}
    iterations_s = [e.value for e in logged["perf/iteration_s"]]
    startup_s = evals[0].wall_time - evals[0].value - launched
    validation_s = sum(e.value for e in evals.values())
    rest_s = wall_s - startup_s - validation_s - sum(iterations_s)
    steady_s = statistics.median(iterations_s[1:])
    later_evals = [e.value for step, e in evals.items() if step]
    checkpoints = iterations // EVERY + (iterations % EVERY > 0)
    projected = {"iterations": RECIPE_ITERATIONS,
                 "measured": iterations >= RECIPE_ITERATIONS,
                 "startup_s": startup_s,
                 "validation_s": evals[0].value + (RECIPE_ITERATIONS // EVERY) * statistics.median(
                     later_evals),
                 "training_s": iterations_s[0] + (RECIPE_ITERATIONS - 1) * steady_s,
                 "rest_s": rest_s / checkpoints * (RECIPE_ITERATIONS // EVERY)}
    projected["whole_recipe_s"] = sum(v for k, v in projected.items() if k.endswith("_s"))
    result.update({"iterations": len(iterations_s), "completed": summary["completed"],
                   "startup_s": round(startup_s, 1),
                   "validations_s": {step: round(e.value, 1) for step, e in evals.items()},
                   "first_iteration_s": round(iterations_s[0], 2),
                   "steady_iteration_s": round(steady_s, 2),
                   "training_s": round(sum(iterations_s), 1),
                   "rest_s": round(rest_s, 1), "checkpoints": checkpoints,
                   "share": {k: round(v / wall_s, 3) for k, v in
                             (("startup", startup_s), ("validation", validation_s),
                              ("training", sum(iterations_s)), ("rest", rest_s))},
                   "whole_recipe": {k: round(v, 1) if isinstance(v, float) else v
                                    for k, v in projected.items()}})
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--iterations", type=int, default=RECIPE_ITERATIONS,
                        help="iterations of each start (the recipe's: 100)")
    parser.add_argument("--starts", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    parser.add_argument("--tiny", action="store_true", help="README's tiny demo on the CPU instead")
    parser.add_argument("--out", type=Path, default=Path("wall_clock.json"), help="results (JSON)")
    cli = parser.parse_args()
    if not cli.tiny and not torch.cuda.is_available():
        parser.exit(1, "wall_clock.py: error: needs a CUDA GPU (torch sees none): it times the "
                       "full-size recipe; --tiny times README's demo on the CPU\n")
    trainer = TINY if cli.tiny else TRAINER
    device = "cpu" if cli.tiny else torch.cuda.get_device_name()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or None
    report = {"device": device, "commit": commit, "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__, "trainer": trainer, "iterations": cli.iterations}
    with tempfile.TemporaryDirectory() as workdir:
        workdir = Path(workdir)
        for start in cli.starts:
            report[start] = run_start(start, workdir / "caches", workdir, cli.iterations, trainer)
            print(start, json.dumps(report[start]), flush=True)
            cli.out.write_text(json.dumps(report, indent=1))  # a call cut short keeps each start


if __name__ == "__main__":
    main()
