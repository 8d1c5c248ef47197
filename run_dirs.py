"""Run directories: where a start's run lives, and what it may do with a directory that holds a run.

A run directory holds one run: its TensorBoard events, `global_step_N/` checkpoints (N = iterations done) and
`summary.json`. A process owns it through an exclusive lock on `run.lock`, held for the process lifetime, so two live
processes never share one; a directory that already holds a run is only continued by `--resume-from` its checkpoint,
or replaced with `--overwrite`. `--resume-from latest` is the newest readable checkpoint of --output-dir/--run-name,
or a new run where it has none (resolve_latest). prepare_run checks all this before any model loads.
"""

import atexit
import fcntl
import itertools
import json
import os
import re
import shutil
import time
import zipfile
from pathlib import Path

from safetensors import SafetensorError, safe_open

from checkpoint import (CHECKPOINT_FILES, EVAL_SCORES, PROMPT_FILES, RunComplete, RunError, adapters_error, checkpoints,
                        prompt_files_sha256, read_checkpoint_state, resume_changes, tensor_shapes, whole)
from settings import flat_settings


# what makes a directory hold a run
RUN_ARTIFACTS = ("events.out.tfevents.*", "global_step_*", "summary.json", EVAL_SCORES)
NAME_MAX = 255  # bytes of one file or directory name on Linux's and macOS's file systems
LATEST = "latest"  # --resume-from latest: the newest readable checkpoint of the run, or a new run


def prepare_run(args, algorithm, world_size, main_process):
    """Before any model loads: the run directory, checked and (main process) locked, with a resume's checkpoint checked
    (its state's fields, its adapters' names and LoRA rank) and its settings and prompt files' contents compared with
    the checkpoint's. Returns (run directory, lock file to keep open or None)."""
    output = args.output  # --output-dir, --run-name, --resume-from, ...
    reward = args.scoring.reward.replace(" ", "+")  # a mix: qwen-vl=0.8+pickscore=0.2
    default_name = f"{args.exp_name}__{reward}__{args.seed}__{int(time.time())}"
    check_directory_name("--run-name", output.run_name, "{run_name}")  # resolve_latest reads it
    check_directory_name("--exp-name", args.exp_name, "{exp_name}__{reward}__{seed}__{unix time}",
                         default_name)
    latest = output.resume_from == LATEST
    replace_unsaved = resolve_latest(output, main_process)  # first: all below reads output.resume_from
    resumed = read_checkpoint_state(output.resume_from) if output.resume_from else None  # first: is it a checkpoint?
    created = False
    if output.resume_from or output.run_name:
        run_dir = run_directory(output, default_name)
    else:
        create = main_process and not output.dry_run
        run_dir, created = unused_directory(Path(output.output_dir), default_name, create)
    if output.resume_from:
        adapters = Path(output.resume_from) / "adapters.safetensors"
        shapes = tensor_shapes(adapters)  # found before minutes of model loading
        if not (Path(output.resume_from) / "optimizer.pt").is_file():
            raise RunError(f"--resume-from {output.resume_from}: no optimizer.pt in this checkpoint")
        if args.num_iterations < resumed["iteration"]:
            raise RunError(f"--num-iterations {args.num_iterations}: {output.resume_from} has done "
                           f"{resumed['iteration']} iterations already")
        refused, allowed = resume_changes(resumed, args, world_size, algorithm)
        if refused:
            raise RunError(f"--resume-from {output.resume_from}: settings that define the run differ from the "
                           f"checkpoint's: {'; '.join(refused)} (resume with the checkpoint's values or start a new "
                           "run)")
        if error := adapters_error(shapes, args.lora_rank):  # the checkpoint's rank: another one is refused above
            raise RunError(f"{adapters}: {error}")
        recorded, settings = resumed["data_sha256"], flat_settings(args)
        for field, now in prompt_files_sha256(settings).items():  # the checkpoint's paths: others are refused above
            if recorded.get(field, now) != now:
                raise RunError(f"{PROMPT_FILES[field]} {settings[field]}: its contents changed since "
                               f"{Path(output.resume_from).name} (sha256 {recorded[field][:12]}... then, "
                               f"{now[:12]}... now); a resume needs the same prompts (restore the file, or start a "
                               "new run)")
        if resumed["iteration"] == args.num_iterations:  # before the run directory is claimed: no new events file
            raise RunComplete(f"{run_dir} is complete: its {Path(output.resume_from).name} has done all "
                              f"{args.num_iterations} iterations (--num-iterations); to train it longer, resume it with "
                              "a larger --num-iterations", 0 if latest else 1)
        if allowed and main_process:
            print(f"resuming with changed settings: {'; '.join(allowed)}", flush=True)
    if not main_process:
        return run_dir, None
    if output.dry_run:  # checked, but neither created nor locked: the real run may start in a while
        if blocked := directory_blocked(run_dir):
            raise RunError(f"cannot create the run directory {run_dir}: {blocked}")
        held_run(run_dir, bool(output.resume_from), output.overwrite or replace_unsaved)
        return run_dir, None
    replace = output.overwrite or replace_unsaved
    return run_dir, claim_run_directory(run_dir, bool(output.resume_from), replace, created)


def check_directory_name(flag, name, run_name, directory_name=None):
    """RunError unless a given --run-name or --exp-name (`flag`) is one path component: an absolute
    one, or one with "/" or "..", would put the run outside --output-dir, where the run directory
    is {output_dir}/`run_name`; and unless the directory's name (`directory_name`, else `name`)
    fits a file system's name."""
    if not name:  # not given: the default name
        return
    if not name.strip() or "/" in name or name in (".", ".."):
        raise RunError(f"{flag} {name!r}: not a directory name (one path component, not \".\" or "
                       f"\"..\"); the run directory is {{output_dir}}/{run_name}")
    size = len(os.fsencode(directory_name or name))
    if size > NAME_MAX:
        raise RunError(f"{flag} {name[:40]!r}... ({len(name)} characters): the run "
                       f"directory's name {{output_dir}}/{run_name} would be {size} bytes, more "
                       f"than the {NAME_MAX} a file system allows a name; choose a shorter one")


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


def resolve_latest(output, main_process):
    """--resume-from latest, in place: the newest readable checkpoint of {output_dir}/{run_name},
    or "" (a new run) where it has none. Returns whether that new run replaces what starts that
    saved no checkpoint left there (events, a summary of 0 iterations), else refused as a run
    already there: a restart before the first checkpoint (torchrun's after a lost rank, a requeued
    job's) then starts the run again instead of failing at every attempt."""
    if output.resume_from != LATEST:
        return False
    if not output.run_name:
        raise RunError("--resume-from latest needs --run-name: without one, every start names a "
                       "new run directory (after its start time), never one with a checkpoint")
    run_dir = Path(output.output_dir) / output.run_name
    found, skipped = latest_checkpoint(run_dir)
    for path, why in skipped if main_process else []:
        print(f"--resume-from latest: skipping {path.name} of {run_dir}: {why}", flush=True)
    output.resume_from = str(found or "")
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


def run_directory(output, default_name):
    """The run directory: the resumed checkpoint's parent, or {output_dir}/{run_name or default_name}. On resume, a
    --run-name or a non-default --output-dir naming another directory is an error, not silently ignored."""
    if not output.resume_from:
        return Path(output.output_dir) / (output.run_name or default_name)
    run_dir = Path(output.resume_from).resolve().parent
    named = Path(output.output_dir) / output.run_name if output.run_name else None
    if named is None and output.output_dir != type(output).output_dir:
        named = Path(output.output_dir) / run_dir.name
    if named is not None and named.resolve() != run_dir:
        raise RunError(f"--resume-from {output.resume_from} continues the run in {run_dir}, but "
                       f"--output-dir/--run-name name {named}: drop them, or name that directory")
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
