"""Run directory, checkpoints, resume checks and run summaries shared by crd.py and dgpo.py (no algorithm logic).

A run directory holds one run: its TensorBoard events, `global_step_N/` checkpoints (N = iterations done) and
`summary.json`. A process owns it through an exclusive lock on `run.lock`, held for the process lifetime, so two live
processes never share one; a directory that already holds a run is only continued by `--resume-from` its checkpoint,
or replaced with `--overwrite`. `--resume-from latest` is the newest readable checkpoint of --output-dir/--run-name,
or a new run where it has none (resolve_latest). A resume refuses settings that would change the run's math
(`SAFE_TO_CHANGE_ON_RESUME` lists what may change). SIGTERM/SIGINT finish the iteration, save, and exit 128 + signal;
a failed scorer stops the run before it trains on the failed iteration, saving the one before; the summary then says
what stopped it, as it does when a checkpoint cannot be written (a full disk).
"""

import fcntl
import atexit
import hashlib
import io
import itertools
import json
import os
import pickle
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from judges import AESTHETIC_CLIP, PICKSCORE_MODEL, PICKSCORE_PROCESSOR
from lora_adapters import export_lora, load_lora_state_dict, lora_state_dict
from reward_mix import parse_mix
from settings import flat_settings

ADAPTERS = ("policy", "old", "sampling")
EVAL_SCORES = "eval_scores.jsonl"  # a run's per-prompt validation scores, a line a validation
# what makes a directory hold a run
RUN_ARTIFACTS = ("events.out.tfevents.*", "global_step_*", "summary.json", EVAL_SCORES)
# what a save writes: a global_step_N without one of them is no complete checkpoint
CHECKPOINT_FILES = ("policy_lora", "adapters.safetensors", "optimizer.pt", "trainer_state.json")
LATEST = "latest"  # --resume-from latest: the newest readable checkpoint of the run, or a new run

# Every Args field not named here defines the run: a resume that changes it is refused, so a new algorithm field is
# protected without being listed. These may change because the training continues the same trajectory with them:
SAFE_TO_CHANGE_ON_RESUME = {
    "num_iterations", "save_every", "keep_last", "max_nonfinite_steps",  # how long it runs and what it keeps
    "resume_from", "overwrite", "output_dir", "run_name", "exp_name",  # where it is (checked against the checkpoint)
    # placement, batching into forwards and kernels: the same math up to float rounding
    "device", "text_encoder_device", "reward_device", "forward_batch_size", "policy_timesteps_per_forward", "compile",
    "gradient_checkpointing", "reward_urls", "reward_timeout", "reward_retries",  # the same scorer, reached otherwise
    # validation cost: it never feeds training (the change is printed: the eval curve changes protocol there)
    "eval_every", "eval_prompts", "eval_steps", "eval_judge", "dry_run",
    "rollout_engine",  # the same Euler ODE and seeded noise, through vLLM-Omni or diffusers
    "track", "wandb_project_name", "wandb_entity",  # where the run is logged besides TensorBoard
}
# Settings added after runs had been saved: {field: the value every run before it had}. A checkpoint
# records one only where it differs (record_args), so a run at these values saves what it saved
# before and a checkpoint without it resumes as having that value.
ADDED_SETTINGS = {"reward_aggregation": "sum", "pickscore_model": PICKSCORE_MODEL,
                  "pickscore_processor": PICKSCORE_PROCESSOR, "aesthetic_model": AESTHETIC_CLIP,
                  "aesthetic_head": "", "rollout_engine": "diffusers",
                  "track": False, "wandb_project_name": "crd", "wandb_entity": ""}
# The models of a reward or judge: they define the run where the reward has that component, and
# may change otherwise (a judge's, which never feeds training)
JUDGE_MODELS = {"pickscore_model": "pickscore", "pickscore_processor": "pickscore",
                "aesthetic_model": "aesthetic", "aesthetic_head": "aesthetic"}
# Per-rank sizes define the run through their global value (x world size): a resume at another world size may change
# them as long as the prompts per iteration and the images per optimizer step stay the same.
PER_RANK = {"prompts_per_rank": "prompts per iteration", "train_batch_size": "images per optimizer step"}
# How a start finds (or replaces) its run, not settings of it: a resume continues the checkpoint's run directory, and
# run_directory refuses an --output-dir/--run-name naming another, so their values (defaults when not given) are no
# changes to report
RUN_LOCATION = ("resume_from", "overwrite", "output_dir", "run_name")
# The prompt files, whose contents a checkpoint records (sha256): a resume needs the prompts the run trained on
PROMPT_FILES = {"train_data": "--train-data", "eval_data": "--eval-data"}


def whole(value, least=0):
    """Whether a JSON value is a whole number >= least (true and false are not numbers here)."""
    return type(value) is int and value >= least


def number(value):
    return type(value) in (int, float)


def eval_entry(entry):
    """[iteration, reward (NaN: its scorer failed), the first judge's mean or null], then {judge:
    mean} where the judges were not PP-OCR alone (Validation)."""
    return (type(entry) is list and len(entry) in (3, 4) and whole(entry[0]) and number(entry[1])
            and (entry[2] is None or number(entry[2]))
            and (len(entry) == 3 or type(entry[3]) is dict and all(map(number, entry[3].values()))))


def entry_judges(entry):
    """{judge: mean} of a validation's entry: an entry of 3 had PP-OCR alone, or no judge."""
    if len(entry) == 4:
        return entry[3]
    return {} if entry[2] is None else {"paddle": entry[2]}


# What each field of trainer_state.json must hold, and how the error says it: the trainers use them unchecked, some only
# after the model loaded or an iteration ran.
STATE_FIELDS = {
    "args": (lambda v: type(v) is dict, "an object (the run's settings)"),
    "iteration": (whole, "a whole number >= 0"),
    "optimizer_steps": (whole, "a whole number >= 0"),
    "sampler": (lambda v: type(v) is dict and whole(v.get("epoch")) and whole(v.get("position")),
                'an object {"epoch": whole number >= 0, "position": whole number >= 0}'),
    "eval": (lambda v: type(v) is list and all(map(eval_entry, v)),
             "a list of [iteration, reward, judge's mean or null(, {judge: mean})] entries"),
    "iteration_s": (lambda v: type(v) is list and all(map(number, v)), "a list of numbers"),
    "start_iterations": (lambda v: type(v) is list and all(whole(i, 1) for i in v), "a list of whole numbers >= 1"),
    "peak_mem_gib": (lambda v: type(v) is dict and all(map(number, v.values())), "an object of numbers"),
    "world_size": (lambda v: whole(v, 1), "a whole number >= 1"),
    "algorithm": (lambda v: type(v) is str, "a string"),
    "data_sha256": (lambda v: type(v) is dict and all(type(h) is str for h in v.values()), "an object of strings"),
    # absent from checkpoints written before it was recorded: evaluate.py then scores "sampling"
    "validation_adapter": (lambda v: v is None or type(v) is str, "an adapter's name"),
}


class RunError(Exception):
    """A one-line error about the run directory, a checkpoint or a resume (the trainers print it and exit)."""


class RunComplete(RunError):
    """A resume of a run that has done all its --num-iterations: there is nothing to train. `exit_code`: 0 under
    --resume-from latest, which a requeued job or a restart passes with the command that started the run; 1 for a
    checkpoint named by hand (a rerun by mistake, refused like the others)."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


def resume_changes(checkpoint_state, args, world_size, algorithm):
    """(refused, allowed): "name old -> new" for each setting that differs from the checkpoint's."""
    saved, current = checkpoint_state["args"], json.loads(json.dumps(flat_settings(args)))  # tuples: lists
    saved, current = {**ADDED_SETTINGS, **saved}, {**ADDED_SETTINGS, **current}  # absent: as before it was added
    saved_world = checkpoint_state["world_size"]
    if checkpoint_state["algorithm"] != algorithm:  # its Args differ too: this says it all
        return [f"algorithm {checkpoint_state['algorithm']} -> {algorithm}"], []
    refused, allowed = [], []
    for name in sorted(saved.keys() | current.keys()):
        old, new = saved.get(name, "(absent)"), current.get(name, "(absent)")
        if name in PER_RANK and whole(old) and whole(new):  # a damaged or absent one is reported as it is
            old, new = old * saved_world, new * world_size
            name = f"{PER_RANK[name]} ({name} x ranks)"
        if old != new and name not in RUN_LOCATION:
            safe = name in SAFE_TO_CHANGE_ON_RESUME or judge_model_unused(name, saved, current)
            (allowed if safe else refused).append(f"{name} {old} -> {new}")
    return refused, allowed


def judge_model_unused(name, saved, current):
    """Whether a JUDGE_MODELS flag is one of a component neither --reward has (then only a judge
    reads it)."""
    try:
        rewards = set(parse_mix(saved.get("reward", ""))) | set(parse_mix(current.get("reward", "")))
    except (ValueError, TypeError):  # a damaged state: the setting stays refused
        return False
    return name in JUDGE_MODELS and JUDGE_MODELS[name] not in rewards


def record_args(args):
    """The Args as a checkpoint records them: ADDED_SETTINGS at their old value left out."""
    return {name: value for name, value in flat_settings(args).items()
            if not (name in ADDED_SETTINGS and value == ADDED_SETTINGS[name])}


def read_checkpoint_state(checkpoint):
    """trainer_state.json of a checkpoint directory, its fields checked (STATE_FIELDS)."""
    path = Path(checkpoint) / "trainer_state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise RunError(f"--resume-from {checkpoint}: not a checkpoint directory ({error})") from None
    if not isinstance(state, dict) or not {"args", "iteration", "sampler"} <= state.keys():
        raise RunError(f"--resume-from {checkpoint}: {path} is not a trainer state (no args, iteration and sampler)")
    for field, (valid, what) in STATE_FIELDS.items():
        if not valid(state.get(field)):
            raise RunError(f'{path}: "{field}" must be {what}')
    return state


def prepare_run(args, algorithm, world_size, main_process):
    """Before any model loads: the run directory, checked and (main process) locked, with a resume's checkpoint checked
    (its state's fields, its adapters' names and LoRA rank) and its settings and prompt files' contents compared with
    the checkpoint's. Returns (run directory, lock file to keep open or None)."""
    check_directory_name("--run-name", args.run_name, "{run_name}")  # resolve_latest reads it
    check_directory_name("--exp-name", args.exp_name, "{exp_name}__{reward}__{seed}__{unix time}")
    latest = args.resume_from == LATEST
    replace_unsaved = resolve_latest(args, main_process)  # first: all below reads args.resume_from
    resumed = read_checkpoint_state(args.resume_from) if args.resume_from else None  # first: is it a checkpoint?
    reward = args.scoring.reward.replace(" ", "+")  # a mix: qwen-vl=0.8+pickscore=0.2
    default_name = f"{args.exp_name}__{reward}__{args.seed}__{int(time.time())}"
    created = False
    if args.resume_from or args.run_name:
        run_dir = run_directory(args, default_name)
    else:
        create = main_process and not args.dry_run
        run_dir, created = unused_directory(Path(args.output_dir), default_name, create)
    if args.resume_from:
        adapters = Path(args.resume_from) / "adapters.safetensors"
        shapes = tensor_shapes(adapters)  # found before minutes of model loading
        if not (Path(args.resume_from) / "optimizer.pt").is_file():
            raise RunError(f"--resume-from {args.resume_from}: no optimizer.pt in this checkpoint")
        if args.num_iterations < resumed["iteration"]:
            raise RunError(f"--num-iterations {args.num_iterations}: {args.resume_from} has done {resumed['iteration']} "
                           "iterations already")
        refused, allowed = resume_changes(resumed, args, world_size, algorithm)
        if refused:
            raise RunError(f"--resume-from {args.resume_from}: settings that define the run differ from the "
                           f"checkpoint's: {'; '.join(refused)} (resume with the checkpoint's values or start a new "
                           "run)")
        if error := adapters_error(shapes, args.lora_rank):  # the checkpoint's rank: another one is refused above
            raise RunError(f"{adapters}: {error}")
        recorded = resumed["data_sha256"]
        for field, now in prompt_files_sha256(vars(args)).items():  # the checkpoint's paths: others are refused above
            if recorded.get(field, now) != now:
                raise RunError(f"{PROMPT_FILES[field]} {getattr(args, field)}: its contents changed since "
                               f"{Path(args.resume_from).name} (sha256 {recorded[field][:12]}... then, {now[:12]}... "
                               "now); a resume needs the same prompts (restore the file, or start a new run)")
        if resumed["iteration"] == args.num_iterations:  # before the run directory is claimed: no new events file
            raise RunComplete(f"{run_dir} is complete: its {Path(args.resume_from).name} has done all "
                              f"{args.num_iterations} iterations (--num-iterations); to train it longer, resume it with "
                              "a larger --num-iterations", 0 if latest else 1)
        if allowed and main_process:
            print(f"resuming with changed settings: {'; '.join(allowed)}", flush=True)
    if not main_process:
        return run_dir, None
    if args.dry_run:  # checked, but neither created nor locked: the real run may start in a while
        if blocked := directory_blocked(run_dir):
            raise RunError(f"cannot create the run directory {run_dir}: {blocked}")
        held_run(run_dir, bool(args.resume_from), args.overwrite or replace_unsaved)
        return run_dir, None
    replace = args.overwrite or replace_unsaved
    return run_dir, claim_run_directory(run_dir, bool(args.resume_from), replace, created)


def check_directory_name(flag, name, run_name):
    """RunError unless a given --run-name or --exp-name (`flag`) is one path component: an absolute
    one, or one with "/" or "..", would put the run outside --output-dir, where the run directory
    is {output_dir}/`run_name`."""
    if not name:  # not given: the default name
        return
    if not name.strip() or "/" in name or name in (".", ".."):
        raise RunError(f"{flag} {name!r}: not a directory name (one path component, not \".\" or "
                       f"\"..\"); the run directory is {{output_dir}}/{run_name}")


def unused_directory(parent, name, create):
    """(parent/name, or the first of parent/name__2, __3, ... that does not exist; whether this
    call made it). Two runs started in the same second (a job array) then get one default name
    each; with create, mkdir claims the name atomically, so two concurrent starts differ too."""
    for count in itertools.count(1):
        path = parent / (name if count == 1 else f"{name}__{count}")
        if not create:
            if not path.exists() and not path.is_symlink():
                return path, False
            continue
        try:
            path.mkdir(parents=True)
        except FileExistsError:
            continue
        except OSError:  # claim_run_directory names the error
            return path, False
        return path, True


def resolve_latest(args, main_process):
    """--resume-from latest, in place: the newest readable checkpoint of {output_dir}/{run_name},
    or "" (a new run) where it has none. Returns whether that new run replaces what starts that
    saved no checkpoint left there (events, a summary of 0 iterations), else refused as a run
    already there: a restart before the first checkpoint (torchrun's after a lost rank, a requeued
    job's) then starts the run again instead of failing at every attempt."""
    if args.resume_from != LATEST:
        return False
    if not args.run_name:
        raise RunError("--resume-from latest needs --run-name: without one, every start names a "
                       "new run directory (after its start time), never one with a checkpoint")
    run_dir = Path(args.output_dir) / args.run_name
    found, skipped = latest_checkpoint(run_dir)
    for path, why in skipped if main_process else []:
        print(f"--resume-from latest: skipping {path.name} of {run_dir}: {why}", flush=True)
    args.resume_from = str(found or "")
    if found:
        if main_process:
            print(f"--resume-from latest: {found}", flush=True)
        return False
    left = []
    if run_dir.is_dir():
        left = sorted(p.name for pattern in RUN_ARTIFACTS for p in run_dir.glob(pattern))
    try:
        done = json.loads((run_dir / "summary.json").read_text()).get("iterations")
    except (OSError, ValueError, AttributeError):  # none, or damaged: nothing says a run trained
        done = None
    if whole(done, 1):  # its checkpoints were removed: refused, not replaced
        raise RunError(f"--resume-from latest: {run_dir} holds a run of {done} iterations "
                       "(summary.json) but no complete checkpoint; resume from a checkpoint path, "
                       "or remove it or choose another --run-name")
    if main_process:
        replaced = f", replacing {', '.join(left)} (left by starts that saved none)" if left else ""
        print(f"--resume-from latest: no checkpoint in {run_dir}: a new run{replaced}", flush=True)
    return bool(left)


def latest_checkpoint(run_dir):
    """(The newest readable global_step_N directory of run_dir or None, [(newer one, why it is
    not)]). A save's temporary .global_step_N.* is never a checkpoint; a global_step_N that lacks a
    file a save writes was left half-removed by a kill (--keep-last, a repeated save of one
    iteration) or changed by hand, and one whose files cannot be read was damaged since (a disk
    error, a copy cut short)."""
    steps = [p for p in Path(run_dir).glob("global_step_*")
             if re.fullmatch(r"global_step_[0-9]+", p.name) and p.is_dir()]
    skipped = []
    for path in sorted(steps, key=lambda p: int(p.name.split("_")[-1]), reverse=True):
        if not (why := unreadable_checkpoint(path)):
            return path, skipped
        skipped.append((path, why))
    return None, skipped


def unreadable_checkpoint(path):
    """Why a checkpoint directory cannot be resumed from, in words, or None: a file a save writes
    is missing, or trainer_state.json, adapters.safetensors or optimizer.pt cannot be read whole.
    Reads no tensor: the headers, and the CRC of each part of optimizer.pt (a zip archive)."""
    missing = [name for name in CHECKPOINT_FILES if not (path / name).exists()]
    if missing:
        return f"incomplete (no {', '.join(missing)})"
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as error:  # UnicodeDecodeError too
        return f"its trainer_state.json cannot be read ({error})"
    try:
        with safe_open(path / "adapters.safetensors", "pt"):  # checks the header against the size
            pass
    except (SafetensorError, OSError) as error:
        return f"its adapters.safetensors cannot be read ({error})"
    try:
        with zipfile.ZipFile(path / "optimizer.pt") as archive:
            damaged = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as error:
        return f"its optimizer.pt cannot be read (truncated or damaged: {error})"
    if damaged:
        return f"its optimizer.pt cannot be read (damaged: {damaged} fails its CRC check)"
    return None


def directory_blocked(path):
    """Why a directory cannot be made (or used) at `path`: it, or its nearest existing parent, is a file or a directory
    this process cannot write into; None if nothing stands in the way. Checks only: nothing is created."""
    path = Path(path)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return "a file, not a directory" if existing == path else f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is a directory this user cannot write into"
    return None


def run_directory(args, default_name):
    """The run directory: the resumed checkpoint's parent, or {output_dir}/{run_name or default_name}. On resume, a
    --run-name or a non-default --output-dir naming another directory is an error, not silently ignored."""
    if not args.resume_from:
        return Path(args.output_dir) / (args.run_name or default_name)
    run_dir = Path(args.resume_from).resolve().parent
    named = Path(args.output_dir) / args.run_name if args.run_name else None
    if named is None and args.output_dir != type(args).output_dir:
        named = Path(args.output_dir) / run_dir.name
    if named is not None and named.resolve() != run_dir:
        raise RunError(f"--resume-from {args.resume_from} continues the run in {run_dir}, but --output-dir/--run-name "
                       f"name {named}: drop them, or name that directory")
    return run_dir


def claim_run_directory(run_dir, resuming, overwrite, created=False):
    """Lock run_dir for this process (the returned open file holds the lock until the process ends), refuse one that
    already holds a run unless resuming it or overwriting, and remove temporary checkpoints left by a killed run.
    created: the caller made run_dir for this start. A directory this start made is removed at exit
    if it then holds only run.lock (the start failed before writing anything)."""
    try:
        created = created or not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = open(run_dir / "run.lock", "a+")
    except OSError as error:
        raise RunError(f"cannot create the run directory {run_dir} ({error.strerror or error})") from None
    try:
        # the kernel drops a flock when its holder dies, by kill -9 too; torchrun restarts only
        # after every rank of the failed attempt exited: a restarted rank 0 takes the run over
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        raise RunError(f"{run_dir} is in use by another live run (pid {lock.read().strip() or '?'})") from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    if created:
        MADE_BY_THIS_START.append((run_dir, lock))
        atexit.register(remove_if_unused, run_dir, lock)
    for path in held_run(run_dir, resuming, overwrite):  # --overwrite
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    for partial in run_dir.glob(".global_step_*"):  # we hold the lock: no live process is writing these
        shutil.rmtree(partial, ignore_errors=True)
    return lock


MADE_BY_THIS_START = []  # [(run directory, its lock)] that claim_run_directory made


def remove_unused_run_directories():
    """remove_if_unused of each run directory this start made, as at exit: for an exit by
    os._exit (a distributed one), which skips atexit."""
    for run_dir, lock in MADE_BY_THIS_START:
        remove_if_unused(run_dir, lock)


def remove_if_unused(run_dir, lock):
    """At exit: remove run_dir, made by this start, if it holds only our run.lock: a start that
    failed before writing anything leaves no directory a rerun would have to name."""
    if lock.closed:  # no longer ours: another start may hold the directory now
        return
    try:
        if [p.name for p in run_dir.iterdir()] != ["run.lock"]:
            return
        (run_dir / "run.lock").unlink()
        run_dir.rmdir()
    except OSError:  # something appeared meanwhile, or it cannot be removed: left as it is
        pass


def held_run(run_dir, resuming, overwrite):
    """The files of a run already in run_dir that --overwrite replaces; RunError if it holds one and neither
    resuming nor overwriting."""
    held = [] if resuming else sorted(p for pattern in RUN_ARTIFACTS for p in run_dir.glob(pattern))
    if held and not overwrite:
        names = ", ".join(p.name for p in held[:3]) + (", ..." if len(held) > 3 else "")
        latest = checkpoints(run_dir)[-1:]
        if not latest:  # stopped before its first checkpoint: nothing to continue from
            raise RunError(f"{run_dir} already holds a run ({names}), but it has no checkpoint to "
                           "resume: replace it with --overwrite, or choose another --run-name")
        raise RunError(f"{run_dir} already holds a run ({names}): continue it with --resume-from "
                       f"{latest[0]}, replace it with --overwrite, or choose another --run-name")
    return held


class GracefulStop:
    """SIGTERM and SIGINT set `signum` (SIGUSR1, Slurm's pre-emption warning, as SIGTERM): the trainer finishes the
    iteration, saves and exits 128 + signal. The same signal again exits at once (a checkpoint being written is
    removed), except under torchrun: it forwards the signal it got to its workers, which may have had it already (Slurm
    signals every process of a job), and kills them itself --shutdown-timeout seconds later (launch.py). A copy that
    comes within a second of the first is the same request: `timeout` and `kill -TERM -PGID` signal the trainer and
    then its whole process group."""

    SAME_REQUEST_S = 1.0

    def __init__(self):
        self.signum, self.first_at = None, 0.0
        self.exit_on_repeat = "TORCHELASTIC_RUN_ID" not in os.environ
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, self.handle)

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGUSR1:  # Slurm's pre-emption warning: a stop, exit status 143
            name, signum = "SIGUSR1 (handled as SIGTERM)", signal.SIGTERM
        if signum == self.signum and time.monotonic() - self.first_at < self.SAME_REQUEST_S:
            return
        if signum == self.signum and self.exit_on_repeat:
            print(f"{name} again: exiting now, without a checkpoint", file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)
        if self.signum is None:
            self.signum, self.first_at = signum, time.monotonic()
        again = f" ({signal.Signals(self.signum).name} again to exit at once)" if self.exit_on_repeat else ""
        print(f"{name}: finishing this iteration, then saving a checkpoint{again}", flush=True)


def save_checkpoint(run_dir, iteration, transformer, optimizer, state, keep_last):
    """Write global_step_{iteration}/ atomically (a temporary directory renamed at the end), readable as the user's
    umask allows, and keep the latest keep_last (0: all). Its trainer_state.json is `state` with the sha256 of the
    prompt files its args name ("data_sha256", which a resume compares): the trainers record them at start
    (start_state), else they are taken now. A full disk or another write error: RunError naming the latest complete
    checkpoint, nothing half-written left."""
    if "data_sha256" not in state and (hashes := prompt_files_sha256(state.get("args", {}))):
        state = {**state, "data_sha256": hashes}
    try:
        partial = Path(tempfile.mkdtemp(prefix=f".global_step_{iteration}.", dir=run_dir))
        try:
            umask = os.umask(0)
            os.umask(umask)
            partial.chmod(0o777 & ~umask)  # mkdtemp makes it 0700: a team on shared storage could not read it
            export_lora(transformer, "policy", partial / "policy_lora")
            adapters = {f"{name}.{key}": value.contiguous() for name in ADAPTERS
                        for key, value in lora_state_dict(transformer, name).items()}
            save_file(adapters, partial / "adapters.safetensors")
            # torch.save reports a failed write (a full disk) as a RuntimeError without the OS's
            # reason ("unexpected pos", "basic_ios::clear"): serialized in memory, the file is
            # written here, and the OSError says why
            serialized = io.BytesIO()
            torch.save(optimizer.state_dict(), serialized)
            write_file(partial / "optimizer.pt", serialized.getbuffer())
            write_file(partial / "trainer_state.json", json.dumps(state, indent=1).encode())
            for path in partial.rglob("*"):  # safetensors writes its files 0600, whatever the umask
                path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        final = run_dir / f"global_step_{iteration}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
    except (OSError, SafetensorError) as error:  # safetensors reports a full disk as its own error
        latest = checkpoints(run_dir)[-1:]
        raise RunError(f"could not write the checkpoint global_step_{iteration} ({error}); the latest complete "
                       f"checkpoint is {latest[0] if latest else 'none'}") from None
    for old in checkpoints(run_dir)[:-keep_last] if keep_last else []:
        shutil.rmtree(old)
    return final


def write_file(path, data):
    """Bytes to a new file at `path`, created as the umask says; an OSError names the file (a
    failed write alone names none)."""
    try:
        with open(path, "wb") as file:
            file.write(data)
    except OSError as error:
        raise OSError(error.errno, error.strerror, Path(path).name) from None


def save_last_iteration(run_dir, state, transformer, optimizer, keep_last, stopped_by=None):
    """save_checkpoint of the last completed iteration, state["iteration"]. A write error (a full
    disk) ends the process with its line (the trainers' error format), naming the latest complete
    checkpoint, after a summary.json that gives it as what stopped the run (after `stopped_by`,
    what had stopped it before, if anything)."""
    try:
        return save_checkpoint(run_dir, state["iteration"], transformer, optimizer, state, keep_last)
    except RunError as error:
        failure = str(error)
    try:
        summary_of_state(run_dir, state, f"{stopped_by}; then {failure}" if stopped_by else failure)
    except OSError as error:  # the disk may still be full
        failure += f"; summary.json could not be written either ({error.strerror or error})"
    sys.exit(f"{Path(sys.argv[0]).name}: error: {failure}")


def summary_of_state(run_dir, state, stopped_by, device=None, failed_judges=None):
    """write_summary of a trainer's state (start_state's: it holds the run's Args, algorithm and
    world size), as the trainer writes it at its end; `device`: the actor's (default: its --device,
    as the trainers name it); failed_judges: {judge: why} of the judges that failed."""
    args = SimpleNamespace(**state["args"])
    world_size = state["world_size"]
    if device is None:
        device = torch.device(args.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    roles = {"reward": args.reward_device, "text encoders": args.text_encoder_device}
    images = world_size * args.prompts_per_rank * args.group_size
    return write_summary(run_dir, state, args, state["algorithm"], world_size, images, stopped_by,
                         other_gpus_memory(device, roles), failed_judges)


def prompt_files_sha256(run_args):
    """{Args field: hex sha256 of its file's contents} of the PROMPT_FILES that a run's Args (a dict) name and that can
    be read (one that cannot is the trainers' error, where they load it)."""
    hashes = {}
    for field in PROMPT_FILES:
        try:
            hashes[field] = hashlib.sha256(Path(run_args[field]).read_bytes()).hexdigest()
        except (KeyError, TypeError, OSError):
            pass
    return hashes


def checkpoints(run_dir):
    """The complete checkpoints of a run directory, oldest first."""
    return sorted(Path(run_dir).glob("global_step_*"), key=lambda p: int(p.name.split("_")[-1]))


def tensor_shapes(path):
    """{key: shape} of a safetensors file, from its header and size (no tensor is read); RunError if it is missing,
    truncated or foreign."""
    try:
        with safe_open(path, "pt") as tensors:
            return {key: tensors.get_slice(key).get_shape() for key in tensors.keys()}
    except (SafetensorError, OSError) as error:
        raise RunError(f"{path}: not a readable safetensors file ({error})") from None


def adapters_error(shapes, rank):
    """Why tensors {key: shape} are not an adapters.safetensors of LoRA rank `rank`, or None: each key is
    "{adapter}.{LoRA key}", a lora_A weight is (rank, in) and a lora_B weight (out, rank)."""
    for key, shape in shapes.items():
        if "." not in key:
            return f'the tensor "{key}" names no adapter (its keys are "<adapter>.<LoRA key>")'
        rank_dim = 0 if ".lora_A." in key else 1 if ".lora_B." in key else None
        if rank_dim is not None and (len(shape) != 2 or shape[rank_dim] != rank):
            return (f"{key} has the shape {tuple(shape)}, not a rank-{rank} LoRA's (trainer_state.json records "
                    f"lora_rank {rank})")
    return None


def read_adapters(checkpoint):
    """({adapter name: LoRA {key: tensor}}, the run's Args as saved) of a checkpoint directory, for tools that load a
    trained adapter beside the trainers (evaluate.py, the benchmarks); RunError names what is missing or does not fit
    the recorded lora_rank."""
    path = Path(checkpoint)
    if not (path / "trainer_state.json").is_file() or not (path / "adapters.safetensors").is_file():
        raise RunError(f"{path}: not a checkpoint directory (no trainer_state.json and adapters.safetensors)")
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except ValueError as error:
        raise RunError(f"{path / 'trainer_state.json'}: not JSON ({error})") from None
    trained = state.get("args") if isinstance(state, dict) else None
    if not isinstance(trained, dict) or not all(whole(trained.get(name), 1) for name in ("lora_rank", "lora_alpha")):
        raise RunError(f"{path}: its trainer_state.json records no Args (lora_rank, lora_alpha: whole numbers >= 1)")
    try:
        tensors = load_file(path / "adapters.safetensors")
    except (SafetensorError, OSError) as error:
        raise RunError(f"{path / 'adapters.safetensors'}: not a readable safetensors file ({error})") from None
    if error := adapters_error({key: value.shape for key, value in tensors.items()}, trained["lora_rank"]):
        raise RunError(f"{path / 'adapters.safetensors'}: {error}")
    adapters = {}
    for key, value in tensors.items():
        name, lora_key = key.split(".", 1)
        adapters.setdefault(name, {})[lora_key] = value
    return adapters, trained


def load_checkpoint(path, transformer, optimizer, device):
    """The checkpoint's adapters and optimizer state into transformer and optimizer; returns its trainer state."""
    adapters, _ = read_adapters(path)
    missing = [name for name in ADAPTERS if name not in adapters]
    if missing:
        raise RunError(f"{Path(path) / 'adapters.safetensors'}: no {', '.join(missing)} adapter")
    for name in ADAPTERS:
        try:
            load_lora_state_dict(transformer, name, adapters[name])
        except (KeyError, RuntimeError) as error:  # other LoRA keys or layer sizes: a checkpoint of another model
            raise RunError(f"{Path(path) / 'adapters.safetensors'}: its {name} adapter does not fit the model "
                           f"({error.args[0]})") from None
    try:
        optimizer.load_state_dict(torch.load(Path(path) / "optimizer.pt", map_location=device, weights_only=True))
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as error:
        raise RunError(f"{Path(path) / 'optimizer.pt'}: not a readable optimizer state ({error})") from None
    return read_checkpoint_state(path)


def start_state(args, transformer, optimizer, sampler, device, world_size, algorithm, prompt_sha256,
                validation_adapter=None):
    """The run's state (what trainer_state.json holds) at this start: a new run's, or --resume-from's, whose
    checkpoint also restores the adapters, the optimizer and the sampler (else a RunError names what is wrong).
    `prompt_sha256`: prompt_files_sha256 of the prompt files when the trainer read them, what every save records;
    `validation_adapter`: the adapter the trainer validates with, what evaluate.py scores by default."""
    state = {"iteration": 0, "optimizer_steps": 0, "eval": [], "iteration_s": [], "start_iterations": [],
             "peak_mem_gib": {}}
    if args.resume_from:
        state = load_checkpoint(args.resume_from, transformer, optimizer, device)
        sampler.load_state_dict(state["sampler"])
        recorded = state.get("validation_adapter")  # absent in checkpoints from before it
        if recorded and validation_adapter and recorded != validation_adapter:
            raise RunError(f"--resume-from {args.resume_from}: the run validated its {recorded} "
                           f"adapter, this trainer validates {validation_adapter}: its eval curve "
                           "would change adapters mid-run (resume with the trainer that started it, "
                           "or start a new run)")
    check_same_start(state["iteration"], args, device, world_size)
    state["start_iterations"].append(state["iteration"] + 1)  # its time carries this start's torch.compile warm-up
    state.update(sampler=sampler.state_dict(), args=record_args(args), world_size=world_size, algorithm=algorithm,
                 validation_adapter=validation_adapter)
    state["data_sha256"] = prompt_sha256  # a file edited later in the run is then a change that a resume refuses
    return state


def check_same_start(iteration, args, device, world_size):
    """RunError on a rank that starts at another iteration than rank 0 (a collective: every rank
    calls it). Under --resume-from latest each rank finds the newest checkpoint itself; a node whose
    view of the shared run directory lags (a network file system's cached listing right after a
    save) would otherwise train from other adapters than rank 0's."""
    if world_size == 1 or not dist.is_initialized():
        return
    first = torch.tensor([iteration], dtype=torch.int64, device=device)
    dist.broadcast(first, 0)
    if int(first) != iteration:
        start = args.resume_from or "a new run"
        raise RunError(f"rank {dist.get_rank()} starts at iteration {iteration} ({start}), rank 0 "
                       f"at iteration {int(first)}: every node must see the same run directory, on "
                       "storage they share")


def peak_memory_gib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # host peak RSS (KiB on Linux)


def actor_peak_memory(device, world_size):
    """{"actor rank r <device>": peak GiB} of every rank (a collective: every rank calls it)."""
    peak = torch.tensor([[peak_memory_gib(device), -1 if device.index is None else device.index]], dtype=torch.float64,
                        device=device)  # (1, 2): GiB, device index
    peaks = peak.new_empty(world_size, 2)
    if world_size > 1:
        dist.all_gather_into_tensor(peaks, peak)
    else:
        peaks.copy_(peak)
    return {f"actor rank {r} {device.type}{'' if i < 0 else f':{i:.0f}'}": p for r, (p, i) in enumerate(peaks.tolist())}


def other_gpus_memory(actor_device, roles):
    """{"<roles> cuda:i": GiB} of the CUDA devices in roles ({role: device name}) that are not the actor's: this
    process's peak, and what every process (a vLLM reward server too) holds there now."""
    devices = {}
    for role, name in roles.items():
        device = torch.device(name or "cpu")
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
            if device != actor_device:
                devices.setdefault(device, []).append(role)
    memory = {}
    for device, names in devices.items():
        memory[f"{' + '.join(names)} {device}"] = peak_memory_gib(device)
        free, total = torch.cuda.mem_get_info(device)
        memory[f"{device} in use by all processes at the end"] = (total - free) / 2**30
    return memory


def write_summary(run_dir, state, args, algorithm, world_size, images_per_iteration, stopped_by,
                  other_gpus, failed_judges=None):
    """summary.json: whether the run did all its iterations and nothing stopped it (else what did,
    `stopped_by`), validation rewards, iteration times with the first iteration of every start
    (torch.compile's warm-up) reported apart from the mean, and peak memory. failed_judges
    ({judge: why}: the judges this start went on without) only where one failed."""
    history = [entry for entry in state["eval"] if np.isfinite(entry[1])]  # NaN: its scorer failed (the run stopped)
    times = state["iteration_s"]
    warmups = set(state["start_iterations"])
    steady = [t for i, t in enumerate(times, 1) if i not in warmups]
    mean = float(np.mean(steady)) if steady else None
    best = max(history, key=lambda e: e[1], default=[None, None])
    judge = lambda entry: entry[2]  # the first --eval-judge on the same images, or None
    last = Path(run_dir) / f"global_step_{state['iteration']}"
    saved = not state["iteration"] or all((last / name).exists() for name in CHECKPOINT_FILES)
    # a full disk may have lost the last checkpoint, an error stopped the last iteration: incomplete
    completed = state["iteration"] >= args.num_iterations and saved and not stopped_by
    summary = {"algorithm": algorithm, "reward": args.reward, "completed": completed,
               "stopped_by": None if completed else stopped_by, "iterations": state["iteration"],
               "optimizer_steps": state["optimizer_steps"], "world_size": world_size,
               "initial_eval_reward": history[0][1] if history else None,
               "final_eval_reward": history[-1][1] if history else None,
               "best_eval_reward": best[1], "best_eval_iteration": best[0],
               "initial_eval_judge": judge(history[0]) if history else None,
               "final_eval_judge": judge(history[-1]) if history else None,
               "warmup_iteration_s": times[0] if times else None,
               "mean_iteration_s": mean, "mean_iteration_excludes": sorted(warmups & set(range(1, len(times) + 1))),
               "train_images_per_s": images_per_iteration / mean if mean else None,
               "peak_mem_gib": {**state["peak_mem_gib"], **other_gpus}}
    if any(len(entry) == 4 for entry in history):  # judges other than PP-OCR alone
        judged = [entry_judges(entry) for entry in history]
        names = list(dict.fromkeys(name for means in judged for name in means))
        summary["eval_judges"] = {name: {"initial": next(m[name] for m in judged if name in m),
                                         "final": next(m[name] for m in reversed(judged) if name in m)}
                                  for name in names}
    if failed_judges:
        summary["failed_judges"] = dict(failed_judges)
    partial = run_dir / ".summary.json.tmp"  # replaced at once: a kill never leaves half a summary
    partial.write_text(json.dumps(summary, indent=1, allow_nan=False))
    partial.replace(run_dir / "summary.json")
    return summary
