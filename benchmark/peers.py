"""Peers' trainers and ours side by side in one call, on the same work: Flow-Factory's CRD trainer,
flow_grpo's and DiffusionNFT's SD3.5 trainers, each from a checkout you name.

Each one's seconds an iteration, training images a second, split into rollout and training, and
peak device memory, with the settings that could not be matched.

    python benchmark/peers.py --flow-factory ~/Flow-Factory --flow-grpo ~/flow_grpo \
        --diffusionnft ~/DiffusionNFT --iterations 6 --out peers.json
    python benchmark/peers.py --flow-factory ~/Flow-Factory --flow-grpo ~/flow_grpo --tiny \
        --iterations 2   # on a CPU (DiffusionNFT's script runs on CUDA only)

Each checkout is the user's own, named by its root; nothing of it is copied here, and no file of it
is changed. --flow-factory is X-GenGroup/Flow-Factory (a folder holding flow_factory itself works
too): its trainer runs as its CLI runs one process (`python -m flow_factory.train CONFIG`), through
benchmark/peers/flow_factory_timed.py, with PYTHONPATH=CHECKOUT/src:benchmark/peers. It needs
datasets 5.0.0 (later ones fail to pickle pyarrow's MonthDayNano) with dill and multiprocess,
pyarrow, pandas and imageio. --flow-grpo is yifan123/flow_grpo and --diffusionnft is
NVlabs/DiffusionNFT: their scripts/train_sd3.py and scripts/train_nft_sd3.py run through
benchmark/peers/flow_grpo_timed.py (as `python SCRIPT --config=...`, one process; DiffusionNFT's
as one torchrun rank), with PYTHONPATH=CHECKOUT:benchmark/peers and their config/base.py given the
work's values (benchmark/peers/flow_grpo_config.py). They need absl-py and ml_collections, and
flow_grpo the accelerate its setup.py pins (1.4.0: later ones leave one process unwrapped by DDP,
and its KL reaches the transformer through .module); where wandb is not installed, a no-op
stand-in takes its place (they only log to it, and run with WANDB_MODE=disabled). A missing
package is a one-line error.

The work, for all: SD3.5-M with random weights (sd3.RANDOM_MEDIUM) saved as a local diffusers
folder that all load (~15 GiB; --model-dir keeps it for the next call); LoRA r32, alpha 64 on the
same 8 attention projections; 512x512; 4 prompts x 6 images an iteration (tests/data/ocr's 40
training prompts); a 10-step rollout at CFG 1; 9 trained timesteps an image; one prompt group's
worth of images an optimizer step; the brightness reward (benchmark/peers/brightness.py scores as
crd.py --reward brightness does); no validation and no checkpoint while it runs. Ours is crd.py as
a user runs it (on a GPU it compiles). Flow-Factory runs crd.py's loss, KL anchor, advantages,
learning rate and snapshot schedules (benchmark/peers/flow_factory_crd.yaml, its blanks filled
in); flow_grpo and DiffusionNFT run their own algorithms with their OCR recipes' settings
(config/grpo.py's general_ocr_sd3_1gpu, config/nft.py's sd3_ocr). What each does differently from
ours is the report's `unmatched` (each setting, each side, and what it affects); where the work
departs from a peer's recipe, its `changed_from_recipe` says so. The trainers run in --trainers'
order; by default the peers first, so that a package one lacks stops the call before ours runs.

Each trainer runs --iterations iterations. Seconds an iteration are the median over all but the
first (warm-up, compile); training images a second are the images of an iteration over it; the
split is the median of each phase (ours: its TensorBoard perf/ scalars; the peers: their
wrappers' lines); peak memory is torch.cuda.max_memory_allocated of the trainer's process (on the
CPU its peak RSS). The JSON goes to --out after each trainer; the logs and the peers' configs go to
{out's stem}_logs beside it. --tiny: the tiny model (sd3.TINY, saved in $CRD_CACHE) at 64x64 with
2 prompts x 4 images and 4 rollout steps, 3 trained timesteps, on the CPU: a check of the
machinery, not of speed.
"""

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
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
                             "with dill and multiprocess",
                 "ml_collections": "ml_collections", "absl": "absl-py"}
NAMES = {"flow_factory": "Flow-Factory", "flow_grpo": "flow_grpo", "diffusionnft": "DiffusionNFT"}
SCRIPTS = {"flow_grpo": "scripts/train_sd3.py", "diffusionnft": "scripts/train_nft_sd3.py"}
# the script's own names, imported as flow_grpo_timed.py loads it: what a run would need
IMPORT_CHECKS = {
    "flow_factory": "import flow_factory.trainers.crd, flow_factory.train, flow_factory_reward",
    "flow_grpo": "import sys, flow_grpo_timed; flow_grpo_timed.load(sys.argv[1], 1)"}
IMPORT_CHECKS["diffusionnft"] = IMPORT_CHECKS["flow_grpo"]


def fail(message):
    sys.exit(f"peers.py: error: {message}")


def peer_source(peer: str, checkout: Path) -> Path:
    """The folder to put on PYTHONPATH: for Flow-Factory CHECKOUT/src, or CHECKOUT where it holds
    flow_factory; for flow_grpo and DiffusionNFT their root, which holds the flow_grpo package."""
    flag = "--" + peer.replace("_", "-")
    if peer == "flow_factory":
        for path in (checkout / "src", checkout):
            if (path / "flow_factory" / "trainers" / "crd.py").is_file():
                return path
        fail(f"{flag} {checkout}: not a Flow-Factory checkout (no src/flow_factory/trainers/"
             "crd.py or flow_factory/trainers/crd.py there)")
    if not all((checkout / path).is_file() for path in (SCRIPTS[peer], "flow_grpo/rewards.py")):
        fail(f"{flag} {checkout}: not a {NAMES[peer]} checkout (no {SCRIPTS[peer]} and "
             "flow_grpo/rewards.py there)")
    return checkout


def missing_package(log: str, peer: str, checkout: Path) -> str | None:
    """The one-line error for a run or import check that stopped on a module not installed."""
    missing = re.findall(r"ModuleNotFoundError: No module named '([\w.]+)'", log)
    if not missing:
        return None
    name = missing[-1].split(".")[0]
    return (f"{NAMES[peer]} ({checkout}) imports {name}, which is not installed here: install "
            f"{PACKAGE_HINTS.get(name, name)}")


def without_wandb() -> bool:
    return importlib.util.find_spec("wandb") is None


def peer_env(peer: str, source: Path) -> dict:
    stand_in = [str(PEERS / "no_wandb")] if peer != "flow_factory" and without_wandb() else []
    path = [str(source), str(PEERS), *stand_in, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join(path)}


def check_imports(peers: dict) -> None:
    """A one-line error unless each peer's trainer imported in its process."""
    for peer, (checkout, process) in peers.items():
        if process.wait():
            stderr = process.stderr.read()
            fail(missing_package(stderr, peer, checkout) or f"{NAMES[peer]} ({checkout}) cannot "
                 f"be imported: {stderr.strip().splitlines()[-1]}")


def prepare_model(cli, workdir: Path, peers: dict) -> Path:
    """The diffusers folder all trainers load: the tiny model, or random SD3.5-M saved once.
    While it is saved (minutes), each peer's imports are checked in another process; without a
    save, the peers' runs, the first, are the check."""
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
    imports = {peer: (checkout, subprocess.Popen(
        [sys.executable, "-c", IMPORT_CHECKS[peer], *([str(checkout / SCRIPTS[peer])]
                                                      if peer in SCRIPTS else [])],
        env=peer_env(peer, source), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for peer, (checkout, source) in peers.items() if peer in cli.trainers}
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
    check_imports(imports)
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


def flow_grpo_values(peer, work, model, workdir, iterations, tiny) -> dict:
    """The values flow_grpo_config.py sets in the peer's config/base.py: the work, and otherwise
    its OCR recipe's settings. flow_grpo ac4c86e: config/grpo.py general_ocr_sd3_1gpu (lines
    221-258: beta 0.04 at 244, ema at 247) on config/base.py (noise level 0.7 at 54, global std
    at 52, fp16 at 21). DiffusionNFT 24af555: config/nft.py sd3_ocr (lines 70-79: beta 0.1,
    decay_type 2) on _get_config (KL beta 1e-4 and noise level 0.7 at 24-25, adv_mode, the
    deterministic dpm2 sampler and CFG 1 at 62-66) and config/base.py (ema at 92, fp16 at 23)."""
    group = work["group_size"]
    values = {
        "run_name": peer, "seed": 42, "logdir": str(workdir / f"{peer}_logs"),
        "save_dir": str(workdir / f"{peer}_saves"), "save_freq": iterations + 1,
        # their recipes' fp16: DiffusionNFT's image logging cannot take bf16 images to numpy
        "mixed_precision": "no" if tiny else "fp16", "use_lora": True,
        "pretrained.model": str(model), "dataset": str(workdir / "prompts_flow_grpo"),
        "prompt_fn": "general_ocr", "reward_fn": {"brightness": 1.0},
        "per_prompt_stat_tracking": True, "resolution": work["resolution"],
        "sample.num_steps": work["num_steps"], "sample.guidance_scale": 1.0,
        "sample.noise_level": 0.7, "sample.global_std": True,
        # one prompt group a rollout batch and a training batch; one batch an optimizer step
        "sample.train_batch_size": group, "sample.num_image_per_prompt": group,
        "sample.num_batches_per_epoch": work["prompts"], "train.batch_size": group,
        "train.gradient_accumulation_steps": 1, "train.num_inner_epochs": 1,
        # int(num_steps * fraction) timesteps are trained
        "train.timestep_fraction": (work["timesteps"] + 0.5) / work["num_steps"],
        "train.ema": True}
    if peer == "flow_grpo":  # its eval, called at each epoch's top, is flow_grpo_timed's mark
        values.update({"eval_freq": 1, "train.cfg": False, "train.beta": 0.04})
    else:  # debug: their switch that skips the validation and the checkpoints
        values.update({"num_epochs": iterations, "debug": True, "train.beta": 0.0001,
                       "beta": 0.1, "decay_type": 2, "train.adv_mode": "all",
                       "sample.deterministic": True, "sample.solver": "dpm2"})
    return values


def changed_from_recipe(peer, work, tiny) -> list[str]:
    """Where the work departs from the peer's own OCR recipe (its config file, for one GPU)."""
    recipe = {"flow_grpo": "8 x 8 on one GPU", "diffusionnft": "48 x 24 on 8 GPUs"}[peer]
    changes = [f"{work['prompts']} prompts x {work['group_size']} images an iteration (recipe: "
               f"{recipe})",
               "one batch of one group an optimizer step (recipe: two optimizer steps an "
               "iteration)",
               "the brightness reward (recipe: PP-OCR)", "no validation, no checkpoints"]
    if tiny:
        changes.append("no mixed precision, on the CPU (recipe: fp16)")
    if peer == "flow_grpo":
        changes.insert(2, "CFG 1 in the rollout and training (recipe: 4.5, two rows an image)")
    return changes


def rows_a_timestep(peer, defaults) -> str:
    """What one trained timestep of an image costs in transformer rows, by algorithm."""
    reference = "the CFG reference" if defaults.kl_cfg > 1 else "the reference"
    reference_rows = 2 if defaults.kl_cfg > 1 else 1
    return {
        "ours": f"CRD: the policy's forward and backward, then the old snapshot's and {reference}'s"
                f" no-grad passes ({1 + reference_rows} rows)",
        "flow_factory": "CRD: as crd.py",
        "flow_grpo": "Flow-GRPO: an SDE rollout (noise level 0.7) keeps log-probabilities; the "
                     "policy's forward and backward, the reference's no-grad pass for the KL "
                     "(1 row)",
        "diffusionnft": "DiffusionNFT: the old adapter's no-grad pass, the policy's forward and "
                        "backward, the reference's no-grad pass for the KL (2 rows)"}[peer]


def unmatched(peer, work, defaults, cuda) -> list[dict]:
    """What crd.py and the peer's trainer do differently on this work."""
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
    ours_timesteps = (f"policy: {per_forward} timesteps of a group ({per_forward * group} rows) a "
                      f"forward and backward; the old and CFG reference passes: up to "
                      f"{defaults.forward_batch_size or 'all'} rows a no-grad forward (a CFG "
                      "image is two)")
    ours_rollout = f"{rollout} (--forward-batch-size {defaults.forward_batch_size})"
    ours_reward = ("scored in a thread beside the reference and old passes (reward_wait_s is the "
                   "part training waited for)")
    ours_random = "crd.py's seeds for the rollout and training noise"
    theirs_random = f"{NAMES[peer]}'s own: the images, rewards and losses differ one to one"
    if peer == "flow_factory":
        items = [
            ("rollout batch", ours_rollout,
             f"{work['prompts']} batches of {group}: per_device_batch_size is both the rollout "
             f"batch and the training micro-batch, and one group a micro-batch is what centres "
             f"over a group and gives {steps} optimizer steps an iteration", "rollout_s"),
            ("timesteps a forward", ours_timesteps,
             f"one timestep of a group ({group} rows; the CFG reference {2 * group}) a forward, "
             "in the policy's, the old snapshot's and the reference's passes alike",
             "train_s, memory"),
            ("prompt encoding", f"the iteration's {work['prompts']} prompts encoded in each "
             "rollout; the text encoders stay on the device",
             "every prompt encoded once before training; the text encoders then go to the CPU",
             "rollout_s (a little), peak memory (the CLIP and T5 weights)"),
            ("reward", ours_reward, "scored after the rollout, before training",
             "reward_s (brightness is cheap)"),
            ("snapshot schedules", f"k counts {ours_k}: {schedules(1)}",
             f"k counts optimizer steps ({steps} an iteration): {schedules(factor)}, the same "
             "decay each iteration", "nothing (the same decays)"),
            ("random numbers", ours_random, theirs_random, "nothing of speed")]
        stored = "float16 (latent_storage_dtype, its default)"
    else:
        items = [
            ("algorithm", rows_a_timestep("ours", defaults), rows_a_timestep(peer, defaults),
             "train_s (the rows a trained timestep)"),
            ("rollout batch", ours_rollout, f"{work['prompts']} batches of {group} (one prompt "
             "group a batch, the recipe's layout)", "rollout_s"),
            ("timesteps a forward", ours_timesteps, f"one timestep of a batch of {group} (groups "
             "mixed by a shuffle) a forward, in every pass", "train_s, memory"),
            ("transformer weights", "bfloat16", "float32, run under float16 autocast (the "
             "script moves the transformer to the GPU without a dtype; fp16 is the recipe's)",
             "every phase, memory"),
            ("reward", ours_reward, "scored in a thread pool as each rollout batch ends; "
             "training waits for all", "reward_s (brightness is cheap)"),
            ("EMA", "none: the old and sampling snapshots blend once an iteration",
             "an EMA of the LoRA weights (the recipe's train.ema) after each training batch",
             "train_s (a little)"),
            ("random numbers", ours_random, theirs_random, "nothing of speed")]
        stored = ("every step's latents and log-probabilities (11 latents an image)"
                  if peer == "flow_grpo" else "the clean latent only")
    if cuda:
        compiled = defaults.machine.compile
        items.insert(2, ("torch.compile", "the transformer's blocks and the VAE decoder compiled"
                         if compiled else "none (--no-compile)", "none (no such setting)",
                         "every phase" if compiled else "nothing"))
        items.append(("stored latents", "float32, as the rollout returns them", stored, "little"))
    if defaults.kl_floor != 1e-4 and peer == "flow_factory":
        items.append(("KL floor", f"--kl-floor {defaults.kl_floor}", "1e-4, fixed",
                      "the loss, not speed"))
    return [dict(zip(("setting", "ours", "theirs", "affects"), item)) for item in items
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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_peer(peer, source, checkout, model, work, defaults, workdir, logs, iterations,
             tiny) -> dict:
    """One peer's own script through its wrapper, which writes a JSON line an iteration."""
    timing = workdir / f"{peer}_timing.jsonl"
    env = {**peer_env(peer, source), "PEERS_TIMING": str(timing)}
    shown_keys = ["PYTHONPATH", "PEERS_TIMING"]
    if peer == "flow_factory":
        config = flow_factory_config(work, defaults, model, workdir, iterations, tiny)
        (workdir / "prompts").mkdir()
        shutil.copy(PROMPTS, workdir / "prompts" / "train.txt")
        config_path = logs / "flow_factory.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        if not tiny:  # bfloat16 from the start, where Flow-Factory casts to it (start-up only)
            env["PEERS_BF16_LOAD"] = "1"
            shown_keys.append("PEERS_BF16_LOAD")
        command = [sys.executable, str(PEERS / "flow_factory_timed.py"), str(config_path)]
    else:
        prompts = workdir / "prompts_flow_grpo"  # their datasets read train.txt and test.txt
        prompts.mkdir(exist_ok=True)
        for split in ("train", "test"):
            shutil.copy(PROMPTS, prompts / f"{split}.txt")
        config_path = logs / f"{peer}.json"
        values = flow_grpo_values(peer, work, model, workdir, iterations, tiny)
        config_path.write_text(json.dumps({"checkout": str(checkout), "values": values},
                                          indent=1))
        # one rank, as their launchers start one GPU (flow_grpo: accelerate launch
        # --num_processes=1 with its multi_gpu.yaml; DiffusionNFT: torchrun): the script wraps
        # the transformer in DDP then, and flow_grpo's KL reaches it through .module
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
        shown_keys += ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]
        command = [sys.executable, str(PEERS / "flow_grpo_timed.py"), str(checkout / SCRIPTS[peer]),
                   str(iterations), f"--config={PEERS / 'flow_grpo_config.py'}:{config_path}"]
    shown = " ".join(f"{k}={shlex.quote(env[k])}" for k in (*shown_keys, *OFFLINE))
    log_path = logs / f"{peer}.log"
    print(f"{peer}: {shlex.join(command)} (log: {log_path})", flush=True)
    returncode, wall_s = launch(command, env, workdir, log_path)
    result = {"checkout": str(checkout), "commit": checkout_commit(checkout),
              "command": f"cd {workdir} && {shown} {shlex.join(command)}",
              "config": str(config_path), "returncode": returncode, "wall_s": round(wall_s, 1)}
    if peer != "flow_factory":
        result["wandb"] = ("not installed here: benchmark/peers/no_wandb stood in"
                           if without_wandb() else "installed, WANDB_MODE=disabled")
        result["changed_from_recipe"] = changed_from_recipe(peer, work, tiny)
    log = log_path.read_text(errors="replace")
    if returncode:
        if error := missing_package(log, peer, checkout):
            fail(error)
        if peer == "flow_grpo" and "no attribute 'module'" in log:
            fail(f"flow_grpo ({checkout}) needs the accelerate its setup.py pins (1.4.0): later "
                 "ones leave one process unwrapped by DDP, and its KL reaches the transformer "
                 "through .module")
        return {**result, "log_tail": log[-3000:]}
    rows = [json.loads(line) for line in timing.read_text().splitlines()]
    result.update(steady(rows, rows[-1]["images"]))
    result["split_note"] = ({"flow_factory": "rollout_s + reward_s + train_s + the blends and "
                                             "logging between = the iteration"}.get(peer) or
                            "rollout_s (the rollout batches) + reward_s (the wait for the reward "
                            "threads, the advantages) + train_s + the prompts' encoding = the "
                            "iteration")
    if peer == "flow_factory" and not tiny:
        result["start_up"] = "the pipeline loaded in bfloat16 (Flow-Factory: float32, then cast)"
    return {**result, "peak_memory_gib": round(max(row["peak_mem_gib"] for row in rows), 3)}


def kept_results(cli, report) -> dict:
    """With --resume, the trainers of --out that ran to their end on this device, torch and work
    (the model's folder included: --model-dir keeps it between calls)."""
    if not cli.resume or not cli.out.is_file():
        return {}
    held = json.loads(cli.out.read_text())
    same = [held.get(key) == report[key] for key in ("device", "torch", "work")]
    if not all(same):
        print(f"--resume: {cli.out} holds another device, torch or work; every trainer runs",
              flush=True)
        return {}
    return {trainer: held[trainer] for trainer in cli.trainers
            if trainer in held and held[trainer]["returncode"] == 0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    for peer, repository in (("flow_factory", "X-GenGroup/Flow-Factory"),
                             ("flow_grpo", "yifan123/flow_grpo"),
                             ("diffusionnft", "NVlabs/DiffusionNFT")):
        parser.add_argument("--" + peer.replace("_", "-"), type=Path, metavar="PATH",
                            help=f"your checkout of {repository} (its root)")
    parser.add_argument("--iterations", type=int, default=6,
                        help="iterations of each trainer; the first is not counted (at least 2)")
    parser.add_argument("--trainers", nargs="+", choices=[*NAMES, "ours"],
                        help="which to run, in this order (default: each peer named, then ours)")
    parser.add_argument("--model-dir", type=Path, help="where the random SD3.5-M is saved and "
                        "reused from (default: a temporary folder, removed at the end)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU instead")
    parser.add_argument("--out", type=Path, default=Path("peers.json"), help="results (JSON)")
    parser.add_argument("--resume", action="store_true", help="keep the trainers --out holds "
                        "that ran to their end on the same device, torch and work (each says its "
                        "host and when it finished); run the rest")
    cli = parser.parse_args()
    named = [peer for peer in NAMES if getattr(cli, peer)]
    if not named:
        parser.error("name at least one peer's checkout: --flow-factory, --flow-grpo or "
                     "--diffusionnft")
    cli.trainers = list(dict.fromkeys(cli.trainers or [*named, "ours"]))
    if unnamed := [peer for peer in cli.trainers if peer in NAMES and peer not in named]:
        parser.error(f"--trainers {unnamed[0]}: name its checkout (--"
                     f"{unnamed[0].replace('_', '-')} PATH)")
    if cli.iterations < 2:
        parser.error("--iterations: at least 2 (the first is a warm-up, not counted)")
    if cli.tiny and "diffusionnft" in cli.trainers:
        parser.error("--diffusionnft with --tiny: DiffusionNFT's train_nft_sd3.py runs on CUDA "
                     "only (NCCL and cuda:LOCAL_RANK); leave it out on a CPU")
    if not cli.tiny and not torch.cuda.is_available():
        parser.exit(1, "peers.py: error: needs a CUDA GPU (torch sees none): it times the "
                       "trainers on SD3.5-M; --tiny runs them on the tiny model on the CPU\n")
    peers = {}
    for peer in named:
        checkout = getattr(cli, peer).expanduser().resolve()
        peers[peer] = (checkout, peer_source(peer, checkout))
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
        model = prepare_model(cli, workdir, peers)
        report = {"device": device, "torch": torch.__version__,
                  "work": {"model": str(model), "tiny": cli.tiny, **work,
                           "images_per_iteration": images,
                           "optimizer_steps_per_iteration": work["prompts"],
                           "lora": {"rank": defaults.lora_rank, "alpha": defaults.lora_alpha},
                           "reward": "brightness", "prompts_file": str(PROMPTS.relative_to(ROOT)),
                           "iterations": cli.iterations},
                  "unmatched": {peer: unmatched(peer, work, defaults, cuda)
                                for peer in NAMES if peer in cli.trainers}}
        for trainer, result in kept_results(cli, report).items():
            report[trainer] = result
            print(f"{trainer}: kept from {cli.out}", flush=True)
        for trainer in cli.trainers:
            if trainer in report:
                continue
            if trainer == "ours":
                result = run_ours(model, work, workdir, logs, cli.iterations, cli.tiny)
            else:
                result = run_peer(trainer, peers[trainer][1], peers[trainer][0], model, work,
                                  defaults, workdir, logs, cli.iterations, cli.tiny)
                result["unmatched"] = [f"{item['setting']}: {item['theirs']}"
                                       for item in report["unmatched"][trainer]]
            result.update(host=socket.gethostname(),
                          finished=datetime.now(timezone.utc).isoformat(timespec="seconds"))
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
