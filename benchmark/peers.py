"""Flow-Factory's CRD trainer and ours side by side in one call, on the same work.

Each one's seconds an iteration, training images a second, split into rollout and training, and
peak device memory, with the settings that could not be matched.

    python benchmark/peers.py --flow-factory ~/Flow-Factory --iterations 6 --out peers.json
    python benchmark/peers.py --flow-factory ~/Flow-Factory --tiny --iterations 2   # on a CPU

--flow-factory is the user's own checkout of X-GenGroup/Flow-Factory (its root, which holds
src/flow_factory; a folder holding flow_factory itself works too). Nothing of it is copied here:
its trainer runs from the checkout as its CLI runs one process (`python -m flow_factory.train
CONFIG`), through benchmark/peers/flow_factory_timed.py, which times its iterations from outside,
with PYTHONPATH=CHECKOUT/src:benchmark/peers. It needs what Flow-Factory imports beyond ours:
datasets 5.0.0 (later ones fail to pickle pyarrow's MonthDayNano) with dill and multiprocess,
pyarrow, pandas and imageio; a missing one is a one-line error.

The work, for both: SD3.5-M with random weights (sd3.RANDOM_MEDIUM) saved as a local diffusers
folder that both load (~15 GiB; --model-dir keeps it for the next call); LoRA r32, alpha 64 on the
same 8 attention projections; 512x512; 4 prompts x 6 images an iteration (tests/data/ocr's 40
training prompts); a 10-step ODE rollout at CFG 1; 9 trained timesteps an image; one prompt group
an optimizer step; crd.py's learning rate, CRD loss, KL anchor, advantages and snapshot schedules;
the brightness reward (benchmark/peers/flow_factory_reward.py scores as crd.py --reward brightness
does); no validation and no checkpoint while it runs. Ours is crd.py as a user runs it (on a GPU it
compiles); Flow-Factory's config is benchmark/peers/flow_factory_crd.yaml, its blanks filled in.
What the two do differently is the report's `unmatched`: each setting, each side, and what it
affects. Flow-Factory runs first, so that a package it lacks stops the call before ours runs.

Each trainer runs --iterations iterations. Seconds an iteration are the median over all but the
first (warm-up, compile); training images a second are the images of an iteration over it; the
split is the median of each phase (ours: its TensorBoard perf/ scalars; Flow-Factory: the wrapper's
lines); peak memory is torch.cuda.max_memory_allocated of the trainer's process (on the CPU its
peak RSS). The JSON goes to --out after each trainer; the logs and Flow-Factory's config go to
{out's stem}_logs beside it. --tiny: the tiny model (sd3.TINY, saved in $CRD_CACHE) at 64x64 with
2 prompts x 4 images and 4 rollout steps, 3 trained timesteps, on the CPU: a check of the
machinery, not of speed.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import crd  # noqa: E402
import sd3  # noqa: E402
from benchmark.events import scalars  # noqa: E402

PEERS = ROOT / "benchmark" / "peers"
PROMPTS = ROOT / "tests" / "data" / "ocr" / "train.txt"
WORK = dict(resolution=512, prompts=4, group_size=6, num_steps=10, timesteps=9)
TINY_WORK = dict(resolution=64, prompts=2, group_size=4, num_steps=4, timesteps=3)
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
SAVE_RANDOM_MEDIUM = ("import sys, torch, sd3; torch.manual_seed(0); "
                      "sd3.load_pipeline(sd3.RANDOM_MEDIUM, 'cuda', torch.bfloat16)"
                      ".save_pretrained(sys.argv[1])")
DEVICE_NAME = "import torch; print(torch.cuda.get_device_name())"
PACKAGE_HINTS = {"datasets": "datasets==5.0.0 (later ones fail to pickle pyarrow's MonthDayNano), "
                             "with dill and multiprocess"}


def fail(message):
    sys.exit(f"peers.py: error: {message}")


def flow_factory_path(checkout: Path) -> Path:
    """The folder to put on PYTHONPATH: CHECKOUT/src, or CHECKOUT where it holds flow_factory."""
    for path in (checkout / "src", checkout):
        if (path / "flow_factory" / "trainers" / "crd.py").is_file():
            return path
    fail(f"--flow-factory {checkout}: not a Flow-Factory checkout (no src/flow_factory/trainers/"
         "crd.py or flow_factory/trainers/crd.py there)")


def missing_package(log: str, checkout: Path) -> str | None:
    """The one-line error for a run or import check that stopped on a module not installed."""
    missing = re.findall(r"ModuleNotFoundError: No module named '([\w.]+)'", log)
    if not missing:
        return None
    name = missing[-1].split(".")[0]
    return (f"Flow-Factory ({checkout}) imports {name}, which is not installed here: install "
            f"{PACKAGE_HINTS.get(name, name)}")


def peer_env(source: Path) -> dict:
    path = [str(source), str(PEERS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join(path)}


def check_imports(checkout: Path, process: subprocess.Popen) -> None:
    """A one-line error unless Flow-Factory's trainer imported in `process`."""
    if process.wait():
        stderr = process.stderr.read()
        fail(missing_package(stderr, checkout) or f"Flow-Factory ({checkout}) cannot be imported: "
             f"{stderr.strip().splitlines()[-1]}")


def prepare_model(cli, workdir: Path, checkout: Path, source: Path) -> Path:
    """The diffusers folder both trainers load: the tiny model, or random SD3.5-M saved once.
    While it is saved (minutes), Flow-Factory's imports are checked in another process; without
    a save, Flow-Factory's run, the first, is the check."""
    if cli.tiny:
        path = sd3.cache_root() / sd3.TINY_DIR_NAME
        if not (path / "model_index.json").is_file():
            sd3.load_pipeline(sd3.TINY)  # builds and saves it
        return path
    path = cli.model_dir or workdir / "sd3.5-medium-random"
    if (path / "model_index.json").is_file():
        print(f"reusing the random SD3.5-M in {path}", flush=True)
        return path
    print(f"saving SD3.5-M with random weights to {path} (~15 GiB)", flush=True)
    imports = subprocess.Popen(
        [sys.executable, "-c", "import flow_factory.trainers.crd, flow_factory.train, "
         "flow_factory_reward"], env=peer_env(source), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True) if "flow_factory" in cli.trainers else None
    started = time.perf_counter()
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    # in a process of its own, so that this one holds no memory on the GPU the trainers are timed on
    save = subprocess.run([sys.executable, "-c", SAVE_RANDOM_MEDIUM, str(partial)], cwd=ROOT,
                          capture_output=True, text=True)
    if save.returncode:
        fail(f"saving the random SD3.5-M to {path} failed: "
             f"{(save.stderr.strip().splitlines() or ['no output'])[-1]}")
    partial.rename(path)
    print(f"saved in {time.perf_counter() - started:.0f} s", flush=True)
    if imports:
        check_imports(checkout, imports)
    return path


def schedule_factor(work, defaults) -> float:
    """How many times as fast Flow-Factory's k of the snapshot schedules counts as crd.py's: its k
    counts optimizer steps (one a prompt group), crd.py's 2 an iteration, unless
    --ema-counts-optimizer-steps."""
    return 1 if defaults.ema_counts_optimizer_steps else work["prompts"] / 2


def decay_string(schedule, factor) -> str:
    """crd.py's (start k, initial, slope, max) as Flow-Factory's "start-initial-slope-max",
    its k counted `factor` times as fast; plain decimals, since "-" separates the fields."""
    start, initial, slope, top = schedule
    fields = (start * factor, initial, slope / factor, top)
    return "-".join(f"{x:.10f}".rstrip("0").rstrip(".") for x in fields)


def flow_factory_config(work, defaults, model, workdir, iterations, tiny) -> dict:
    """benchmark/peers/flow_factory_crd.yaml with its blanks filled: the work and crd.py's own
    defaults."""
    config = yaml.safe_load((PEERS / "flow_factory_crd.yaml").read_text())
    images = work["prompts"] * work["group_size"]
    factor = schedule_factor(work, defaults)
    config["data"].update(dataset_dir=str(workdir / "prompts"), cache_dir=str(workdir / "cache"),
                          max_dataset_size=len(PROMPTS.read_text().splitlines()))
    config["model"].update(model_name_or_path=str(model), lora_rank=defaults.lora_rank,
                           lora_alpha=defaults.lora_alpha)
    config["log"]["save_dir"] = str(workdir / "flow_factory_saves")
    config["train"].update(
        seed=defaults.seed, max_epochs=iterations, resolution=work["resolution"],
        num_inference_steps=work["num_steps"], group_size=work["group_size"],
        unique_sample_num_per_epoch=work["prompts"], per_device_batch_size=work["group_size"],
        gradient_step_per_epoch=work["prompts"], num_train_timesteps=work["timesteps"],
        learning_rate=defaults.learning_rate, adam_betas=list(defaults.adam_betas),
        adam_weight_decay=defaults.weight_decay, adam_epsilon=defaults.adam_eps,
        max_grad_norm=defaults.max_grad_norm, crd_beta=defaults.crd_beta,
        global_std=defaults.global_std, adv_clip_range=defaults.adv_clip,
        kl_beta=defaults.kl_beta, kl_cfg=defaults.kl_cfg,
        old_model_decay=decay_string(defaults.old_decay, factor),
        sampling_model_decay=decay_string(defaults.sampling_decay, factor))
    config["eval"]["resolution"] = work["resolution"]
    config["rewards"][0]["batch_size"] = images
    if tiny:  # the CPU, in float32 as crd.py runs there
        config["mixed_precision"] = "no"
        config["train"].update(ref_param_device="cpu", latent_storage_dtype="fp32")
        config["data"]["dataloader_num_workers"] = 0
        config["rewards"][0]["device"] = "cpu"
    return config


def unmatched(work, defaults, cuda) -> list[dict]:
    """What crd.py and Flow-Factory's CRD trainer do differently on this work."""
    images = work["prompts"] * work["group_size"]
    group = work["group_size"]
    batch = min(images, defaults.forward_batch_size or images)
    rollout = f"all {images} images in one batch" if batch == images else f"batches of {batch}"
    per_forward = defaults.machine.policy_timesteps_per_forward
    steps = work["prompts"]
    ours_k = "optimizer steps" if defaults.ema_counts_optimizer_steps else "2 an iteration"
    factor = schedule_factor(work, defaults)
    schedules = lambda factor: (f"{decay_string(defaults.old_decay, factor)} (old), "
                                f"{decay_string(defaults.sampling_decay, factor)} (sampling)")
    items = [
        ("rollout batch", f"{rollout} (--forward-batch-size {defaults.forward_batch_size})",
         f"{work['prompts']} batches of {group}: per_device_batch_size is both the rollout batch "
         f"and the training micro-batch, and one group a micro-batch is what centres over a "
         f"group and gives {steps} optimizer steps an iteration", "rollout_s"),
        ("timesteps a forward", f"policy: {per_forward} timesteps of a group ({per_forward * group}"
         f" rows) a forward and backward; the old and CFG reference passes: up to "
         f"{defaults.forward_batch_size or 'all'} rows a no-grad forward (a CFG image is two)",
         f"one timestep of a group ({group} rows; the CFG reference {2 * group}) a forward, in "
         "the policy's, the old snapshot's and the reference's passes alike", "train_s, memory"),
        ("prompt encoding", f"the iteration's {work['prompts']} prompts encoded in each rollout; "
         "the text encoders stay on the device",
         "every prompt encoded once before training; the text encoders then go to the CPU",
         "rollout_s (a little), peak memory (the CLIP and T5 weights)"),
        ("reward", "scored in a thread beside the reference and old passes (reward_wait_s is the "
         "part training waited for)", "scored after the rollout, before training",
         "reward_s (brightness is cheap)"),
        ("snapshot schedules", f"k counts {ours_k}: {schedules(1)}",
         f"k counts optimizer steps ({steps} an iteration): {schedules(factor)}, the same decay "
         "each iteration", "nothing (the same decays)"),
        ("random numbers", "crd.py's seeds for the rollout and training noise",
         "Flow-Factory's own: the images, rewards and losses differ one to one",
         "nothing of speed"),
    ]
    if cuda:
        compiled = defaults.machine.compile
        items[1:1] = [("torch.compile", "the transformer's blocks and the VAE decoder compiled"
                       if compiled else "none (--no-compile)",
                       "none (no such setting)", "every phase" if compiled else "nothing")]
        items.append(("stored latents", "float32, as the rollout returns them",
                      "float16 (latent_storage_dtype, its default)", "little"))
    if defaults.kl_floor != 1e-4:
        items.append(("KL floor", f"--kl-floor {defaults.kl_floor}", "1e-4, fixed",
                      "the loss, not speed"))
    return [dict(zip(("setting", "ours", "flow_factory", "affects"), item)) for item in items
            if item[1] != item[2]]


def launch(command, env, cwd, log_path):
    """Run command to its end, its output to log_path; killed with this script (its own
    session, so that a trainer left running cannot skew a later measurement)."""
    started = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            returncode = process.wait()
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    return returncode, time.perf_counter() - started


def steady(rows: list[dict], images: int) -> dict:
    """The median over all iterations but the first of each phase (rows: one dict an iteration)."""
    median = lambda key: statistics.median(row[key] for row in rows[1:])
    split = {key: round(median(key), 3) for key in rows[0] if key.endswith("_s")}
    iteration_s = split.pop("iteration_s")
    return {"seconds_per_iteration": iteration_s,
            "train_images_per_s": round(images / iteration_s, 3), "split": split,
            "iterations_s": [round(row["iteration_s"], 3) for row in rows]}


def run_ours(model, work, workdir, logs, iterations, tiny) -> dict:
    command = [sys.executable, "crd.py", "--model", str(model), "--reward", "brightness",
               "--eval-judge", "none", "--eval-every", "0", "--save-every", str(iterations + 1),
               "--train-data", str(PROMPTS), "--eval-data", str(PROMPTS),
               "--resolution", str(work["resolution"]), "--prompts-per-rank", str(work["prompts"]),
               "--group-size", str(work["group_size"]), "--num-steps", str(work["num_steps"]),
               "--num-train-timesteps", str(work["timesteps"]), "--num-iterations", str(iterations),
               "--output-dir", str(workdir), "--run-name", "ours", *(["--device", "cpu"] * tiny)]
    env = {**os.environ, **OFFLINE}
    print(f"ours: {shlex.join(command)} (log: {logs / 'ours.log'})", flush=True)
    returncode, wall_s = launch(command, env, ROOT, logs / "ours.log")
    result = {"command": f"cd {ROOT} && {shlex.join(command)}", "returncode": returncode,
              "wall_s": round(wall_s, 1)}
    if returncode:
        return {**result, "log_tail": (logs / "ours.log").read_text(errors="replace")[-3000:]}
    perf = scalars(workdir / "ours")
    keys = ("iteration_s", "rollout_s", "reward_wait_s", "train_s", "reward_s")
    rows = [{key: perf[f"perf/{key}"][step] for key in keys} for step in range(1, iterations + 1)]
    summary = json.loads((workdir / "ours" / "summary.json").read_text())
    peak = max(v for k, v in summary["peak_mem_gib"].items() if k.startswith("actor"))
    result.update(steady(rows, work["prompts"] * work["group_size"]))
    result["split_note"] = ("rollout_s + reward_wait_s + train_s (+ logging) = the iteration; "
                            "reward_s is the scorer's own time, beside the passes")
    return {**result, "peak_memory_gib": round(peak, 3)}


def checkout_commit(checkout: Path) -> str | None:
    """The commit of a git checkout whose root is `checkout` (None for a copy of the source)."""
    git = lambda *args: subprocess.run(["git", "-C", str(checkout), *args], capture_output=True,
                                       text=True).stdout.strip()
    root = git("rev-parse", "--show-toplevel")
    return git("rev-parse", "HEAD") if root == str(checkout) else None


def run_flow_factory(source, checkout, model, work, defaults, workdir, logs, iterations,
                     tiny) -> dict:
    config = flow_factory_config(work, defaults, model, workdir, iterations, tiny)
    (workdir / "prompts").mkdir()
    shutil.copy(PROMPTS, workdir / "prompts" / "train.txt")
    config_path = logs / "flow_factory.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    timing = workdir / "flow_factory_timing.jsonl"
    # bfloat16 from the start, where Flow-Factory casts to it (start-up only; not on the CPU)
    bf16 = {} if tiny else {"PEERS_BF16_LOAD": "1"}
    env = {**peer_env(source), "PEERS_TIMING": str(timing), **bf16}
    command = [sys.executable, str(PEERS / "flow_factory_timed.py"), str(config_path)]
    shown = " ".join(f"{k}={shlex.quote(env[k])}" for k in ("PYTHONPATH", "PEERS_TIMING", *bf16,
                                                            *OFFLINE))
    print(f"flow_factory: {shlex.join(command)} (log: {logs / 'flow_factory.log'})", flush=True)
    returncode, wall_s = launch(command, env, workdir, logs / "flow_factory.log")
    result = {"checkout": str(checkout), "commit": checkout_commit(checkout),
              "command": f"cd {workdir} && {shown} {shlex.join(command)}",
              "config": str(config_path), "returncode": returncode, "wall_s": round(wall_s, 1)}
    log = (logs / "flow_factory.log").read_text(errors="replace")
    if returncode:
        if error := missing_package(log, checkout):
            fail(error)
        return {**result, "log_tail": log[-3000:]}
    rows = [json.loads(line) for line in timing.read_text().splitlines()]
    result.update(steady(rows, rows[-1]["images"]))
    result["split_note"] = ("rollout_s + reward_s + train_s + the blends and logging between = "
                            "the iteration")
    if bf16:
        result["start_up"] = "the pipeline loaded in bfloat16 (Flow-Factory: float32, then cast)"
    return {**result, "peak_memory_gib": round(max(row["peak_mem_gib"] for row in rows), 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flow-factory", type=Path, required=True, metavar="PATH",
                        help="your checkout of X-GenGroup/Flow-Factory (its root)")
    parser.add_argument("--iterations", type=int, default=6,
                        help="iterations of each trainer; the first is not counted (at least 2)")
    parser.add_argument("--trainers", nargs="+", default=["flow_factory", "ours"],
                        choices=["flow_factory", "ours"], help="which to run (both: side by side)")
    parser.add_argument("--model-dir", type=Path, help="where the random SD3.5-M is saved and "
                        "reused from (default: a temporary folder, removed at the end)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU instead")
    parser.add_argument("--out", type=Path, default=Path("peers.json"), help="results (JSON)")
    cli = parser.parse_args()
    if cli.iterations < 2:
        parser.error("--iterations: at least 2 (the first is a warm-up, not counted)")
    if not cli.tiny and not torch.cuda.is_available():
        parser.exit(1, "peers.py: error: needs a CUDA GPU (torch sees none): it times both "
                       "trainers on SD3.5-M; --tiny runs them on the tiny model on the CPU\n")
    checkout = cli.flow_factory.expanduser().resolve()
    source = flow_factory_path(checkout)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    work = TINY_WORK if cli.tiny else WORK
    cuda = not cli.tiny
    logs = cli.out.parent / f"{cli.out.stem}_logs"
    logs.mkdir(parents=True, exist_ok=True)
    images = work["prompts"] * work["group_size"]
    defaults = crd.Args()  # crd.py's settings where the work leaves them to it
    device = "cpu" if cli.tiny else subprocess.run([sys.executable, "-c", DEVICE_NAME],
                                                   capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as workdir:
        workdir = Path(workdir)
        model = prepare_model(cli, workdir, checkout, source)
        report = {"device": device, "torch": torch.__version__,
                  "work": {"model": str(model), "tiny": cli.tiny, **work,
                           "images_per_iteration": images,
                           "optimizer_steps_per_iteration": work["prompts"],
                           "lora": {"rank": defaults.lora_rank, "alpha": defaults.lora_alpha},
                           "reward": "brightness", "prompts_file": str(PROMPTS.relative_to(ROOT)),
                           "iterations": cli.iterations},
                  "unmatched": unmatched(work, defaults, cuda)}
        for trainer in ("flow_factory", "ours"):
            if trainer not in cli.trainers:
                continue
            if trainer == "ours":
                result = run_ours(model, work, workdir, logs, cli.iterations, cli.tiny)
            else:
                result = run_flow_factory(source, checkout, model, work, defaults, workdir,
                                          logs, cli.iterations, cli.tiny)
            result["unmatched"] = [f"{item['setting']}: {item[trainer]}"
                                   for item in report["unmatched"]]
            report[trainer] = result
            cli.out.write_text(json.dumps(report, indent=1))  # a call cut short keeps each trainer
            print(trainer, json.dumps({k: v for k, v in result.items() if k != "unmatched"}),
                  flush=True)
    print(f"{'':13} {'s/iteration':>11} {'images/s':>8} {'rollout s':>9} {'train s':>7} "
          f"{'peak GiB':>8}")
    for trainer in cli.trainers:
        r = report[trainer]
        if r["returncode"]:
            print(f"{trainer:13} failed (exit {r['returncode']}): see {logs}")
            continue
        print(f"{trainer:13} {r['seconds_per_iteration']:11.2f} {r['train_images_per_s']:8.2f} "
              f"{r['split']['rollout_s']:9.2f} {r['split']['train_s']:7.2f} "
              f"{r['peak_memory_gib']:8.2f}")
    if any(report[trainer]["returncode"] for trainer in cli.trainers):
        sys.exit(1)


if __name__ == "__main__":
    main()
