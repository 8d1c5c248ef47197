"""Benchmark crd.py's start-up on the GPU: the first validation and the first iterations, cold and warm.

    python benchmark/startup.py --out startup.json                                   # the trainers' compile, cold, warm
    python benchmark/startup.py --variants batch batch-one-process --starts cold --out a.json  # workers or not, cold

Each start runs crd.py on SD3.5-M with random weights (one GPU, 512², 4 prompts x 6 images, the cheap brightness
reward, so that only the transformer and the VAE decoder compile) for `--iterations` iterations, validating before
training and after the last, in a process of its own with its own caches:
    cold           CRD_CACHE, TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR new and empty
    warm-file      new inductor and Triton directories, and the cold start's CRD_CACHE, so only its compile-cache file
                   (rollout.CompileCache) carries over: a resume on another machine
    warm-machine   every cache of the cold start kept: a second run or a resume on the same machine
A variant is a way of compiling the blocks (VARIANTS): `batch` is the trainers', whose cold start compiles in worker
processes (precompile.py) while the models load and the first validation runs eagerly; with "-one-process" appended
(`batch-one-process`; the only form of the others) a cold start compiles in the trainer alone, as before. The child
process reports torch.compile's own account at exit: the graphs compiled, the seconds of each and the cache hits
(torch._dynamo.utils). Besides each phase's own time (TensorBoard's perf/ scalars), the report gives when it ended,
counted from the launch (*_done_s): waiting for the workers falls between the first validation and the first iteration.
"""

import argparse
import atexit
import functools
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "tests" / "data" / "ocr"
TRAINER = ["--model", "random-sd3.5-medium", "--reward", "brightness", "--eval-judge", "none",
           "--train-data", str(PROMPTS / "train.txt"), "--eval-data", str(PROMPTS / "test.txt"), "--save-every", "1000"]
STARTS = ("cold", "warm-file", "warm-machine")


# ways of compiling the blocks: rollout.compile_blocks's `dynamic` (batch: only the batch dimension symbolic, the
# trainers' default; dynamic: every dimension symbolic, their default before batch; auto: a dimension symbolic
# only once it changes, so the policy's grad pass, always 18 rows, stays static)
VARIANTS = {"batch": "batch", "dynamic": True, "auto": None}
ONE_PROCESS = "-one-process"  # a variant's name with it: a cold start compiles in the trainer alone, without workers


def child(variant: str, report: Path, trainer_args: list[str]) -> None:
    """Run crd.py in this process with `variant`'s compiling; write torch.compile's account at exit."""
    sys.path.insert(0, str(ROOT))
    import compiling
    import precompile
    import rollout

    # the trainer's Compiler calls them by these names when crd.py runs below
    dynamic = VARIANTS[variant.removesuffix(ONE_PROCESS)]
    compiling.compile_blocks = functools.partial(rollout.compile_blocks, dynamic=dynamic)  # Compiler's
    if variant.endswith(ONE_PROCESS):
        compiling.start_precompile = lambda *args: precompile.Precompile([])
    started = time.perf_counter()

    @atexit.register
    def write_report():
        from torch._dynamo.utils import compilation_time_metrics, counters

        per_graph = {phase: list(seconds) for phase, seconds in compilation_time_metrics.items()}  # one entry a graph
        report.write_text(json.dumps({"process_s": time.perf_counter() - started,
                                      "unique_graphs": counters["stats"]["unique_graphs"],
                                      "cache": {**counters["aot_autograd"], **counters["inductor"]},
                                      "graph_compile_s": per_graph.get("_compile.compile_inner", []),
                                      "compile_s": per_graph}, indent=1))

    sys.argv = [str(ROOT / "crd.py"), *trainer_args]
    runpy.run_path(str(ROOT / "crd.py"), run_name="__main__")


def run_start(variant, start, caches, workdir, log_dir, iterations, time_limit_s):
    name = f"{variant}_{start}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CRD_CACHE": str(caches[start]["crd"]),
           "TORCHINDUCTOR_CACHE_DIR": str(caches[start]["inductor"]), "TRITON_CACHE_DIR": str(caches[start]["triton"])}
    report = workdir / f"{name}.json"
    cmd = [sys.executable, __file__, "--child", variant, str(report), "--", *TRAINER, "--num-iterations",
           str(iterations), "--eval-every", str(iterations), "--output-dir", str(workdir), "--run-name", name]
    print(f"{name}: {' '.join(cmd[1:])} (log: {log_dir / f'{name}.log'})", flush=True)
    started, launched = time.perf_counter(), time.time()
    with open(log_dir / f"{name}.log", "w") as log:
        trainer = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        stopped = False
        try:
            trainer.wait(time_limit_s)
        except subprocess.TimeoutExpired:  # one signal: the trainer finishes its iteration, saves and reports
            trainer.send_signal(signal.SIGINT)
            stopped = True
            trainer.wait()
        finally:
            if trainer.poll() is None:
                os.killpg(trainer.pid, signal.SIGKILL)
    result = {"wall_s": time.perf_counter() - started, "returncode": trainer.returncode, "stopped_by_time_limit": stopped}
    if report.is_file():
        result.update(json.loads(report.read_text()))
    if (workdir / name).is_dir():
        from benchmark.events import scalar_events

        logged = scalar_events(workdir / name)
        tags = [t for t in ("perf/eval_s", "perf/rollout_s", "perf/train_s", "perf/iteration_s") if t in logged]
        perf = {tag: {s.step: round(s.value, 2) for s in logged[tag]} for tag in tags}
        done = {tag: {s.step: round(s.wall_time - launched, 1) for s in logged[tag]} for tag in tags}
        result["perf"] = perf
        result["first_validation_done_s"] = done.get("perf/eval_s", {}).get(0)
        result["first_iteration_done_s"] = done.get("perf/iteration_s", {}).get(1)
        result["first_validation_s"] = perf.get("perf/eval_s", {}).get(0)
        result["first_iteration_s"] = perf.get("perf/iteration_s", {}).get(1)
        result["steady_iteration_s"] = perf.get("perf/iteration_s", {}).get(iterations)
        result["last_validation_s"] = perf.get("perf/eval_s", {}).get(iterations)
    if trainer.returncode and not stopped:
        result["log_tail"] = (log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["batch"],
                        choices=["batch", *(f"{variant}{ONE_PROCESS}" for variant in VARIANTS)])
    parser.add_argument("--starts", nargs="+", default=list(STARTS), choices=STARTS,
                        help="warm starts reuse the caches of the cold start before them")
    parser.add_argument("--iterations", type=int, default=2, help="the last is the steady state")
    parser.add_argument("--time-limit-s", type=float, default=600.0,
                        help="per start: then SIGINT, and the trainer stops after its iteration")
    parser.add_argument("--out", type=Path, default=Path("startup.json"), help="results (JSON); the logs go beside it")
    cli = parser.parse_args()
    if cli.starts[0] != "cold":
        parser.error("--starts: a warm start needs the cold start's caches, so cold comes first")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"trainer": TRAINER, "iterations": cli.iterations}
    with tempfile.TemporaryDirectory() as workdir:
        workdir = Path(workdir)
        for variant in cli.variants:
            cold = {kind: workdir / variant / f"cold_{kind}" for kind in ("crd", "inductor", "triton")}
            caches = {"cold": cold, "warm-machine": cold,
                      "warm-file": {**cold, "inductor": workdir / variant / "warm_inductor",
                                    "triton": workdir / variant / "warm_triton"}}
            for start in cli.starts:
                result = report[f"{variant}_{start}"] = run_start(variant, start, caches, workdir, cli.out.parent,
                                                                  cli.iterations, cli.time_limit_s)
                print(f"{variant}_{start}", json.dumps({k: v for k, v in result.items() if k != "compile_s"}), flush=True)
                cli.out.write_text(json.dumps(report, indent=1))  # after each start: a call cut short keeps its numbers
            shutil.rmtree(workdir / variant, ignore_errors=True)
    nan = float("nan")
    print(f"{'start':24} {'1st validation':>14} {'ended':>6} {'1st iteration':>13} {'ended':>6} {'steady':>7} "
          f"{'graphs':>6} {'compile s':>9} {'cache hits':>10}")
    for name, r in report.items():
        if isinstance(r, dict):
            print(f"{name:24} {r.get('first_validation_s') or nan:14.1f} "
                  f"{r.get('first_validation_done_s') or nan:6.1f} "
                  f"{r.get('first_iteration_s') or nan:13.1f} {r.get('first_iteration_done_s') or nan:6.1f} "
                  f"{r.get('steady_iteration_s') or nan:7.2f} {r.get('unique_graphs', 0):6d} "
                  f"{sum(r.get('graph_compile_s', [])):9.1f} {r.get('cache', {}).get('autograd_cache_hit', 0):10d}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], Path(sys.argv[3]), sys.argv[5:])
    else:
        main()
