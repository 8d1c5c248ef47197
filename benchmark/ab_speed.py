"""A/B speed of crd.py from two source trees on one GPU: the recipe's compiled setting, runs alternated A, B, A, B.

    python benchmark/ab_speed.py .oldmain . --out $OUT                     # A cold, B cold (about 8.5 minutes)
    python benchmark/ab_speed.py .oldmain . --out $OUT --repeat 0 --probe  # B's probes alone: 2 fit (below)
    python benchmark/ab_speed.py .oldmain /tmp/copy --out /tmp/ab --cpu-smoke   # the tool itself, on a CPU

Each run is `crd.py` of its tree (cwd = the tree) with benchmark/recipe.py's RECIPE and its "compiled" variant,
written out here so that both trees get the same command (random SD3.5-M and a random Qwen2.5-VL-3B-sized scorer on
the GPU, 4 prompts x 6 images at 512², no downloads), plus `--num-iterations 7 --eval-every 3 --eval-prompts 32`:
validations at iterations 0, 3, 6 and 7. Each tree has its own compile caches (CRD_CACHE, TORCHINDUCTOR_CACHE_DIR,
TRITON_CACHE_DIR), shared by its runs: **run 1 of each tree is cold** (compile workers, 1-2 minutes of compiling),
later runs are warm. By benchmark/RESULTS.md (cold first iteration done ~125 s after the launch, warm first iteration
22-24 s, 9.3 s an iteration and 20 s a 32-prompt validation with the scorer on the GPU) a cold run takes about 250 s,
a warm one about 215 s, so 9 minutes hold two runs. **Warm runs are what is compared** where a tree has one; with
one run per tree (the default) the cold runs are: their later iterations run the same kernels (RESULTS.md: warm and
cold within 1%), only the first iteration and validation differ. Per run, from its TensorBoard perf/ scalars:
    steady         median of the iterations that do not follow a validation, iteration 1 excluded (2, 3, 5, 6)
    after_val      the iterations right after a mid-run validation (4, 7): their rollout has been ~2 s slower
    validation     perf/eval_s of the mid-run validations (3, 6)
A vs B: the medians over the compared runs of each tree, B's difference from A in %.

--probe [NAME ...] adds runs of ROOT_B (warm after its first run) that each change one thing, to find why the
iteration after a validation is slower (no names: PROBES' first four, as many as --budget-s leaves room for):
    no-image             validation logs no image grid (SummaryWriter.add_image does nothing): the grid of 16 noise
                         images is a 12.6 MB record whose CRC TensorBoard's writer thread computes in pure Python
                         (1-3 s, holding the GIL) while the next rollout launches its kernels
    image-flush          the writer is flushed after the grid, so that the CRC runs inside validation (eval_s grows by
                         it, the next rollout should not)
    judge-none           --eval-judge none: no PP-OCR reads on the CPU (onnxruntime threads) beside or after sampling
    expandable-segments  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: validation's larger batches fragment the
                         CUDA caching allocator, the next rollout allocates anew
    no-gc                Python's garbage collector off (gc.disable()): a collection of validation's objects
Every run also has TORCH_LOGS=recompiles: a recompile (of the sampling pass after validation's CFG batch, say) is
logged, and counted in the JSON. A run starts only if 90% of its estimate (the tree's last run, else the longest run
so far, else --first-estimate-s) fits before --budget-s: its last 10% is the final validation, which the summary does
not need. A run still going at --budget-s is stopped (SIGINT: it finishes its step and exits; killed 15 s later).
Everything goes to two files in --out: ab_speed.json (per run: command, every scalar per iteration, summary; then A
vs B) and ab_speed.log (each run's output, tqdm's redraws dropped, under a header). The table at the end, in
seconds: "roll@val" is the after_val rollout, "+roll" that minus the steady rollout.
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark.events import scalars  # noqa: E402


RECIPE = {"--model": "random-sd3.5-medium", "--reward": "qwen-vl", "--reward-model": "random-qwen2.5-vl-3b",
          "--train-data": "tests/data/ocr/train.txt", "--eval-data": "tests/data/ocr/train.txt",
          "--save-every": "1000",  # benchmark/recipe.py's RECIPE, then its "compiled" variant
          "--forward-batch-size": "48", "--policy-timesteps-per-forward": "3", "--compile": None}
SMOKE = {"--model": "tiny", "--reward": "brightness", "--eval-judge": "none", "--device": "cpu",
         "--no-compile": None, "--resolution": "64", "--prompts-per-rank": "2", "--group-size": "4",
         "--eval-steps": "10"}
PROBES = {  # name: (extra crd.py arguments, extra environment, patch applied before crd.py runs)
    "no-image": ({}, {}, "no-image"),
    "image-flush": ({}, {}, "image-flush"),
    "judge-none": ({"--eval-judge": "none"}, {}, None),
    "expandable-segments": ({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, None),
    "no-gc": ({}, {}, "no-gc"),
}
PATCHED = """import os, runpy, sys
from torch.utils.tensorboard import SummaryWriter
patch, add_image = sys.argv[1], SummaryWriter.add_image
def add_image_and_flush(self, *args, **kwargs):
    add_image(self, *args, **kwargs)
    self.flush()
if patch == "no-image":
    SummaryWriter.add_image = lambda self, *args, **kwargs: None
if patch == "image-flush":
    SummaryWriter.add_image = add_image_and_flush
if patch == "no-gc":
    import gc; gc.disable()
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
TQDM = re.compile(r"\d+/\d+ \[[^]]*(it/s|s/it)")  # a progress bar's redraw
METRICS = ("steady_iteration_s", "steady_rollout_s", "steady_train_s", "steady_reward_wait_s", "after_val_rollout_s",
           "after_val_iteration_s", "after_val_extra_rollout_s", "validation_s", "first_validation_s",
           "first_iteration_s", "wall_s")


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(scalars, iterations, eval_every):
    """The steady, after-validation and validation numbers of one run's perf scalars ({tag: {step: value}})."""
    validated = {0, iterations} | set(range(eval_every, iterations + 1, eval_every)) if eval_every else set()
    after = sorted(v + 1 for v in validated if 1 < v + 1 <= iterations)
    steady = [i for i in range(2, iterations + 1) if i - 1 not in validated]
    mid = sorted(validated - {0, iterations}) or sorted(validated - {0})
    get = lambda tag, steps: [scalars.get(f"perf/{tag}", {}).get(i) for i in steps]
    out = {"steady_iterations": steady, "after_val_iterations": after, "validations": mid,
           "steady_iteration_s": median(get("iteration_s", steady)),
           "steady_rollout_s": median(get("rollout_s", steady)), "steady_train_s": median(get("train_s", steady)),
           "steady_reward_wait_s": median(get("reward_wait_s", steady)),
           "after_val_rollout_s": median(get("rollout_s", after)),
           "after_val_iteration_s": median(get("iteration_s", after)), "validation_s": median(get("eval_s", mid)),
           "first_validation_s": scalars.get("perf/eval_s", {}).get(0),
           "first_iteration_s": scalars.get("perf/iteration_s", {}).get(1)}
    if out["after_val_rollout_s"] is not None and out["steady_rollout_s"] is not None:
        out["after_val_extra_rollout_s"] = out["after_val_rollout_s"] - out["steady_rollout_s"]
    return out


def run(name, root, args, env, patch, workdir, log, deadline):
    """One crd.py run in `root`; its output appended to `log`; its scalars and summary."""
    out_dir = workdir / "runs"
    cmd = [*(["-c", PATCHED, patch] if patch else []), "crd.py", *args, "--output-dir", str(out_dir),
           "--run-name", name]
    print(f"{name}: {root}: {' '.join(cmd if not patch else ['<patch ' + patch + '>', *cmd[3:]])}", flush=True)
    started, own_log = time.perf_counter(), workdir / f"{name}.log"
    with open(own_log, "w") as output:
        # its own session, killed if this script ends first: a trainer left running skews the next measurement
        trainer = subprocess.Popen([sys.executable, *cmd], cwd=root, stdout=output, stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True)
        stopped = False
        try:
            trainer.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:  # past the budget: the trainer finishes its iteration and exits
            stopped = True
            trainer.send_signal(signal.SIGINT)
            try:
                trainer.wait(15)
            except subprocess.TimeoutExpired:
                pass
        finally:
            if trainer.poll() is None:
                os.killpg(trainer.pid, signal.SIGKILL)
                trainer.wait()
    text = own_log.read_text(errors="replace")
    lines = [line.rsplit("\r", 1)[-1].replace("\x1b[A", "") for line in text.split("\n")]
    lines = [line for line in lines if line.strip() and (not TQDM.search(line) or "100%|" in line)]  # finished bars
    with open(log, "a") as combined:
        combined.write(f"\n===== {name}: {root} (exit {trainer.returncode}) =====\n" + "\n".join(lines) + "\n")
    result = {"root": str(root), "command": [Path(sys.executable).name, *cmd[3 if patch else 0:]], "patch": patch,
              "env": {k: v for k, v in env.items() if k not in os.environ or os.environ[k] != v},
              "returncode": trainer.returncode, "stopped_by_budget": stopped,
              "wall_s": time.perf_counter() - started,
              "recompiles": sum("Recompiling function" in line for line in lines)}
    if trainer.returncode and not stopped:
        result["log_tail"] = "\n".join(lines[-40:])
    if (out_dir / name).is_dir():
        result["scalars"] = scalars(out_dir / name)
    if (out_dir / name / "summary.json").is_file():
        result["trainer_summary"] = json.loads((out_dir / name / "summary.json").read_text())
    return result


def compare(report):
    """A vs B: medians over each tree's warm runs (its cold ones where it has no warm run), B's difference in %."""
    basis = {}
    for side in ("A", "B"):
        runs = [r for r in report["runs"].values() if r["side"] == side and not r.get("probe") and "summary" in r]
        warm = [r for r in runs if not r["cold"]]
        basis[side] = (warm or runs, "warm" if warm else "cold")
    if not (basis["A"][0] and basis["B"][0]):
        return {}
    out = {"basis": {side: f"{len(runs)} {kind} run(s)" for side, (runs, kind) in basis.items()}}
    for metric in METRICS:
        a, b = (median([{**r["summary"], "wall_s": r["wall_s"]}.get(metric) for r in basis[side][0]])
                for side in ("A", "B"))
        pct = 100 * (b - a) / a if a and b is not None else None
        out[metric] = {"A": a, "B": b, "B_vs_A_pct": pct}
    return out


def table(report):
    cols = ("steady_iteration_s", "steady_rollout_s", "after_val_rollout_s", "after_val_extra_rollout_s",
            "after_val_iteration_s", "validation_s", "first_iteration_s", "wall_s")
    heads = ("steady", "roll", "roll@val", "+roll", "it@val", "val", "first it", "wall")
    fmt = lambda v: f"{v:8.2f}" if isinstance(v, (int, float)) else f"{'-':>8}"
    print(f"{'run':26} {'start':5} " + " ".join(f"{h:>8}" for h in heads) + f" {'recomp':>6} exit")
    for name, r in report["runs"].items():
        s = {**r.get("summary", {}), "wall_s": r.get("wall_s")}
        print(f"{name:26} {'cold' if r['cold'] else 'warm':5} " + " ".join(fmt(s.get(c)) for c in cols)
              + f" {r.get('recompiles', 0):6d} {r.get('returncode', 'skipped')}")
    for metric, v in report.get("a_vs_b", {}).items():
        if metric != "basis" and v["A"] is not None and v["B"] is not None:
            pct = f"{v['B_vs_A_pct']:+.1f}%" if v["B_vs_A_pct"] is not None else ""
            print(f"A vs B {metric:26} {v['A']:8.2f} {v['B']:8.2f} {pct}")
    if "basis" in report.get("a_vs_b", {}):
        print(f"A vs B on: {report['a_vs_b']['basis']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root_a", type=Path)
    parser.add_argument("root_b", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="folder for ab_speed.json and ab_speed.log")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each tree, alternated A, B, A, B")
    parser.add_argument("--probe", nargs="*", choices=list(PROBES), help="ROOT_B's probe runs (none named: 4)")
    parser.add_argument("--iterations", type=int, help="--num-iterations (default 7; --cpu-smoke 3)")
    parser.add_argument("--eval-every", type=int, help="default 3; --cpu-smoke 1")
    parser.add_argument("--eval-prompts", type=int, help="default 32; --cpu-smoke 8")
    parser.add_argument("--budget-s", type=float, default=515, help="seconds for all runs (9 minutes in all)")
    parser.add_argument("--first-estimate-s", type=float, default=250, help="a cold run's length, for the budget")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU, eager, brightness reward")
    parser.add_argument("--cache-dir", type=Path, help="compile caches kept for a later call (default: temporary)")
    cli = parser.parse_args()
    iterations = cli.iterations or (3 if cli.cpu_smoke else 7)
    eval_every = cli.eval_every if cli.eval_every is not None else (1 if cli.cpu_smoke else 3)
    base = {k: v for k, v in RECIPE.items() if not (cli.cpu_smoke and k in ("--compile", "--reward-model"))}
    eval_prompts = cli.eval_prompts or (8 if cli.cpu_smoke else 32)
    base.update({**(SMOKE if cli.cpu_smoke else {}), "--num-iterations": str(iterations),
                 "--eval-every": str(eval_every), "--eval-prompts": str(eval_prompts)})
    roots = {"A": cli.root_a.resolve(), "B": cli.root_b.resolve()}
    plan = [(f"{side}{i + 1}", side, None) for i in range(cli.repeat) for side in "AB"]
    probes = list(PROBES)[:4] if cli.probe == [] else cli.probe or []
    plan += [(f"B-{probe}", "B", probe) for probe in probes]
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # `timeout`: stop the trainer too
    cli.out.mkdir(parents=True, exist_ok=True)
    json_path, log = cli.out / "ab_speed.json", cli.out / "ab_speed.log"
    log.write_text("")
    started = time.time()
    deadline = started + cli.budget_s
    report = {"roots": {k: str(v) for k, v in roots.items()}, "iterations": iterations, "eval_every": eval_every,
              "budget_s": cli.budget_s, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="ab_speed_") as tmp:
        workdir, walls = Path(tmp), {}
        for name, side, probe in plan:
            args, extra_env, patch = PROBES[probe] if probe else ({}, {}, None)
            cache_root = (cli.cache_dir or workdir) / side
            caches = {var: str(cache_root / var.lower()) for var in
                      ("CRD_CACHE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_LOGS": "recompiles", **caches, **extra_env}
            flat = [x for k, v in {**base, **args}.items() for x in ([k] if v is None else [k, v])]
            estimate = walls[side][-1] if side in walls else max((w[-1] for w in walls.values()),
                                                                 default=cli.first_estimate_s)
            warm_cache = cli.cache_dir is not None and (cache_root / "crd_cache" / "compile").is_dir()
            entry = {"side": side, "probe": probe, "cold": side not in walls and not warm_cache}
            if time.time() + 0.9 * estimate > deadline:
                print(f"{name}: skipped, {estimate:.0f} s would end past --budget-s {cli.budget_s:.0f}", flush=True)
                report["runs"][name] = {**entry, "skipped": True}
                continue
            result = run(name, roots[side], flat, env, patch, workdir, log, deadline)
            walls.setdefault(side, []).append(result["wall_s"])
            if "scalars" in result:
                perf = {t: v for t, v in result["scalars"].items() if t.startswith("perf/")}
                result["summary"] = summarize(perf, iterations, eval_every)
            report["runs"][name] = {**entry, **result}
            report["a_vs_b"] = compare(report)
            report["elapsed_s"] = time.time() - started
            json_path.write_text(json.dumps(report, indent=1))  # after each run: a call cut short keeps its numbers
            print(f"{name}: exit {result['returncode']}, {result['wall_s']:.0f} s, "
                  f"{json.dumps(result.get('summary', {}).get('steady_iteration_s'))} s steady", flush=True)
    json_path.write_text(json.dumps(report, indent=1))
    table(report)


if __name__ == "__main__":
    main()
