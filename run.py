"""One start of a training run on this rank (Run): the ranks and device, the run directory
(locked by the main process) and its resume, stop signals, the state that checkpoints hold (Run
alone writes it), TensorBoard (and Weights & Biases with --track), the progress bar, the stop that
every rank agrees on, checkpoints, summary.json and the exit status.

    run = Run(args, "crd")                      # ranks, run directory and its lock, stop signals
    compiler = Compiler(args, run.device, run.world_size)   # before the models load
    compiler.compile(pipe)
    run.start(transformer, optimizer_step, sampler, pipe)  # a new run's state, or the resumed
    for iteration in run.iterations(compiler):
        ...
        run.end_iteration(iteration + 1, sampler, rewards, logged)  # the state, TensorBoard
        if run.agreed_stop(scorer):
            break
        run.save_if_due()
    run.finish()                                # summary.json and the exit status
"""

import json
import os
import sys
import threading
from contextlib import nullcontext
from pathlib import Path

import google_crc32c
import torch
import torch.distributed as dist
from tensorboard.summary.writer import record_writer
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from checkpoint import (EVAL_SCORES, RunComplete, RunError, checkpoints, prompt_files_sha256,
                        save_checkpoint, start_state)
from checks import check_judge_models, errors_end_in_one_line, fail, scorers_of
from data import load_train_and_eval_prompts
from distributed import (GracefulStop, actor_device, agreed_stop, all_mean_, gather,
                         leave_process_group, lost_peer_line, settings_mismatch, shared_settings,
                         signalled_ranks)
from iteration import PhaseTimer
from lora_adapters import SnapshotError
from memory import TRAINER_MEMORY_FLAGS, memory_error, model_shape, out_of_memory_line
from ocr_reward import check_reward_model
from reward_mix import parse_mix
from rollout import nonfinite_images
from run_dirs import prepare_run, remove_unused_run_directories
from run_summary import actor_peak_memory, save_last_iteration, summary_of_state
from scoring import reward_stats
from sd3 import check_model_path, warn_cut_targets
from settings import flat_settings


WANDB_RUN_ID = "wandb_run_id"  # in the run directory: a resume continues the same W&B run


def start_tracking(args, run_dir, resumed):
    """--track: the run in Weights & Biases (as cleanRL does it), its TensorBoard scalars synced,
    so before the SummaryWriter is made; a resumed run continues the W&B run it had."""
    import wandb

    id_file = Path(run_dir) / WANDB_RUN_ID
    run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None  # None: new
    # the run directory as TensorBoard's root: else wandb waits 10 s for more log directories
    wandb.tensorboard.patch(root_logdir=str(run_dir))
    try:
        output = args.output
        tracking = wandb.init(project=output.wandb_project_name, entity=output.wandb_entity or None,
                              sync_tensorboard=True, config=flat_settings(args),
                              name=Path(run_dir).name, id=run_id, resume="allow")
    except wandb.errors.Error as error:  # no login, a refused key, no server: wandb's own words
        why = " ".join(str(error).split())
        fail(f"--track: W&B could not start the run ({why}); log in with `wandb login`, or set "
             "WANDB_MODE=offline to keep it in the run directory and `wandb sync` it later")
    id_file.write_text(tracking.id + "\n")
    return tracking


def masked_crc32c(data):
    """TensorBoard's record checksum (CRC-32C, masked), computed in C by google-crc32c."""
    crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


# TensorBoard's own loop runs in pure Python in its writer thread: a validation grid's record held
# the GIL for ~2 s and slowed the next rollout's kernel launches by as much (benchmark/RESULTS.md)
record_writer.masked_crc32c = masked_crc32c


class EventsFileError(Exception):
    """A write to the run's TensorBoard events file failed (a full disk): the run stops."""


class EventsFile:
    """TensorBoard's SummaryWriter for the run directory, whose write errors (its writer thread's,
    raised by the next call) come as one EventsFileError; that thread prints no traceback."""

    def __init__(self, run_dir, purge_step):
        before = set(threading.enumerate())
        self.writer = SummaryWriter(run_dir, purge_step=purge_step)
        writer_threads = set(threading.enumerate()) - before
        excepthook = threading.excepthook

        def hook(failed):  # the next call raises the same error, in one line
            if failed.thread not in writer_threads or not isinstance(failed.exc_value, OSError):
                excepthook(failed)

        threading.excepthook = hook

    def __getattr__(self, name):
        method = getattr(self.writer, name)
        if not callable(method):  # log_dir and the like: read as they are
            return method

        def guarded(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except OSError as error:
                raise EventsFileError("could not write the TensorBoard events file "
                                      f"({error.strerror or error})") from None

        return guarded


def keep_eval_scores_until(run_dir, iteration):
    """A resumed run's EVAL_SCORES keeps the validations of its first `iteration` iterations (a
    stop after a validation and before its checkpoint validates that iteration again); a torn last
    line goes too. Replaced at once, never left half written."""
    path = Path(run_dir) / EVAL_SCORES
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["iteration"] <= iteration:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            pass
    partial = path.with_name(f".{EVAL_SCORES}.tmp")
    partial.write_text("".join(kept))
    partial.replace(path)


def run_exit_code(stop_signal, stopped_by, iterations_done, run_dir):
    """The run's exit status: 128 + the signal that stopped it (the shell's convention); 1 for any
    other stop (non-finite gradients, a failed scorer), said in one line on stderr; else 0."""
    if stop_signal:
        return 128 + stop_signal
    if stopped_by:
        print(f"{Path(sys.argv[0]).name}: error: {stopped_by}: stopped after iteration "
              f"{iterations_done} (the latest checkpoint is in {run_dir})", file=sys.stderr)
        return 1
    return 0


class Run:
    """One start of a training run on this rank: the ranks and device, the run directory (locked by
    the main process), stop signals, the state that checkpoints hold, TensorBoard and the progress
    bar, the stop that every rank agrees on, checkpoints, summary.json and the exit status."""

    def __init__(self, args, algorithm):
        self.args = args
        self.algorithm = algorithm
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.main_process = self.rank == 0
        try:
            self.dir, self.lock = prepare_run(args, algorithm, self.world_size, self.main_process)
        except RunComplete as complete:
            if complete.exit_code:
                fail(complete)
            if self.main_process:
                print(f"{Path(sys.argv[0]).name}: {complete}", flush=True)
            sys.exit(0)  # --resume-from latest: a requeued job or a restart found nothing left
        except RunError as error:
            fail(error)
        self.signals = GracefulStop()  # on every rank, before the models load
        self.device = actor_device(args.machine.device, self.world_size)  # joins the ranks' group
        self.check_same_settings()  # the first collective: before any could hang or mix settings
        cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if cuda else torch.float32
        self.autocast = torch.autocast("cuda", torch.bfloat16) if cuda else nullcontext()
        self.writer = None
        self.tracking = None  # the W&B run of --track (main process)
        self.bar = None
        self.stop_signal = 0
        self.signalled = ""  # which ranks, on which hosts, a stop signal reached (several ranks)
        self.stopped_by = None
        self.state = None
        self.phase = "loading the models"  # None: an iteration's, told by its timer's laps
        self.iteration_timer = None
        self.steps_when_saved = None  # the optimizer steps of the last completed iteration
        self.nonfinite_before = 0  # rollout.nonfinite_images() when the iteration began
        self.warned = {}  # {what: (where it was first, how often)} (warn)
        self.reward_weights = parse_mix(args.scoring.reward)  # {name: weight}: one reward, or a mix
        self.failed_judges = {}  # {judge: why}, of this start (Validation)
        self.validation_adapter = None  # the adapter Validation samples: checkpoints record it
        errors_end_in_one_line(self.error_line, self.keep_after_error)

    def check_same_settings(self):
        """Every rank's shared_settings against rank 0's: where any differs, every rank prints the
        same line naming the settings and their values, and all exit 1 together."""
        if self.world_size == 1:
            return
        settings = [None] * self.world_size
        dist.all_gather_object(settings, shared_settings(self.args, self.algorithm))
        if mismatch := settings_mismatch(settings, self.rank):
            print(f"{Path(sys.argv[0]).name}: error: {mismatch}", file=sys.stderr, flush=True)
            remove_unused_run_directories()  # a directory this start made: os._exit skips atexit
            leave_process_group()
            os._exit(1)

    def read_inputs(self):
        """(train prompts, eval prompts), the model paths checked; --dry-run exits here."""
        args = self.args
        train_set, eval_set = load_train_and_eval_prompts(args, self.world_size, self.main_process)
        self.prompt_sha256 = prompt_files_sha256(flat_settings(args))  # as read: edits are refused
        self.train_set = train_set
        self.eval_set = eval_set
        shape = model_shape(args.model) if args.output.dry_run else None  # a run: once loaded
        if shape and (error := memory_error(args, shape, self.dtype, self.device)):
            fail(error)
        check_model_path(args.model)
        scorers = scorers_of(args)
        if "qwen-vl" in scorers:
            check_reward_model(args.scoring.reward_model)
        check_judge_models(args.scoring, scorers)
        if args.output.dry_run:  # how run.sh checks a run before it starts a reward server
            print(f"dry run: arguments valid, {len(train_set)} train and {len(eval_set)} eval "
                  "prompts")
            sys.exit(0)
        return train_set, eval_set

    def start(self, transformer, optimizer_step, sampler, pipe):
        """The run's state, which Run alone writes: a new run's, or --resume-from's (the adapters,
        the optimizer, its step count and the sampler restored too); opens TensorBoard on the main
        process."""
        args = self.args
        optimizer = optimizer_step.optimizer
        if error := memory_error(args, pipe, self.dtype, self.device):  # before minutes of work
            fail(error)
        try:
            state = start_state(args, transformer, optimizer, sampler, self.device, self.world_size,
                                self.algorithm, self.prompt_sha256, self.validation_adapter)
        except RunError as error:
            fail(error)
        if self.main_process:
            purge = state["iteration"] + 1 if state["iteration"] else None
            keep_eval_scores_until(self.dir, state["iteration"])
            if args.output.track:
                self.tracking = start_tracking(args, self.dir, resumed=bool(state["iteration"]))
            self.writer = EventsFile(self.dir, purge)
            table = "\n".join(f"|{k}|{v}|" for k, v in flat_settings(args).items())
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
            images = args.prompts_per_rank * args.group_size
            print(f"run {self.dir}: {self.world_size} rank(s) x {args.prompts_per_rank} prompts x "
                  f"{args.group_size} images = {self.world_size * images} images per iteration, "
                  f"{images // args.train_batch_size} optimizer step(s) per rank, "
                  f"T={args.num_train_timesteps}; {len(self.train_set)} train prompts, "
                  f"{len(self.eval_set)} eval prompts")
            warn_cut_targets(self.train_set + self.eval_set, pipe, args.max_sequence_length)
        self.state = state
        self.transformer = transformer
        self.optimizer = optimizer
        self.optimizer_step = optimizer_step
        optimizer_step.steps = state["optimizer_steps"]
        self.steps_when_saved = state["optimizer_steps"]
        self.phase = None

    def iterations(self, compiler):
        """The iterations left (a progress bar on the main process); the compile workers are waited
        for before the first, and the compile cache saved after it."""
        state = self.state
        compiler.wait()
        remaining = range(state["iteration"], self.args.num_iterations)
        self.bar = tqdm(remaining, initial=state["iteration"], total=self.args.num_iterations,
                        disable=not self.main_process, desc="iterations")
        for done, iteration in enumerate(self.bar):
            self.nonfinite_before = nonfinite_images()
            yield iteration
            if done == 0:
                compiler.save()

    def progress(self, iterable, desc):
        """A progress bar on the main process for what takes long (shown after 5 s)."""
        return tqdm(iterable, desc=desc, disable=not self.main_process, delay=5.0, leave=False)

    def timer(self):
        self.iteration_timer = PhaseTimer(self.device)
        return self.iteration_timer

    def gather(self, tensor):
        """(N, ...) on each rank -> (world_size * N, ...), rank-major, on every rank."""
        return gather(tensor, self.world_size)

    def average(self, tensors):
        """Average tensors in place over the ranks."""
        all_mean_(tensors, self.world_size)

    def reward_failed(self, rewards, scorer):
        """A NaN reward, on any rank: its scorer failed, and every rank stops before training."""
        if not rewards.isnan().any():
            return False
        self.stopped_by = scorer.failure or "the reward failed on another rank"
        return True

    def end_iteration(self, iterations, sampler, rewards, logged):
        """The state after `iterations` iterations (a resume from here draws what follows), and in
        TensorBoard and the progress bar: the scalars `logged`, the rewards' train/reward_mean and
        the like (scoring.reward_stats), and the peak memory of every rank so far."""
        steps = self.optimizer_step.steps
        self.state.update(iteration=iterations, sampler=sampler.state_dict(), optimizer_steps=steps)
        self.state["iteration_s"].append(logged["perf/iteration_s"])
        self.steps_when_saved = steps
        self.iteration_timer = None
        peaks = self.record_peak_memory()  # so far: an earlier validation's too
        if bad := nonfinite_images() - self.nonfinite_before:
            images = self.args.prompts_per_rank * self.args.group_size
            self.warn("rollout images were NaN or inf", f"iteration {iterations}",
                      f"{bad} of {images} rollout images are NaN or inf (a diverged policy?): they "
                      "decode black and are scored as black images")
        if not self.main_process:
            return
        logged = {**reward_stats(rewards, self.args.group_size, self.reward_weights), **logged,
                  "perf/peak_mem_gib": max(peaks.values())}
        if float(logged["train/zero_std_group_frac"]) == 1:
            self.warn("every prompt group's reward had std 0", f"iteration {iterations}",
                      f"every prompt group's images got the same reward (std 0 in all "
                      f"{len(rewards) // self.args.group_size} groups): the advantages are 0, so "
                      "the reward gives no learning signal (a constant reward?)")
        for tag, value in logged.items():
            self.writer.add_scalar(tag, float(value), iterations)
        self.bar.set_postfix(reward=f"{float(logged['train/reward_mean']):.3f}",
                             loss=f"{float(logged['losses/loss']):.4f}",
                             s=f"{logged['perf/iteration_s']:.1f}")

    def record_validation(self, entry):
        """A validation's summary entry (Validation), kept in the state that checkpoints hold."""
        self.state["eval"].append(entry)

    def record_peak_memory(self):
        """{"actor rank r <device>": GiB}, the peak memory of every rank so far, kept in the state
        as each one's largest (a collective: every rank calls it)."""
        peaks = actor_peak_memory(self.device, self.world_size)
        state_peaks = self.state["peak_mem_gib"]
        self.state["peak_mem_gib"] = {k: max(v, state_peaks.get(k, 0.0)) for k, v in peaks.items()}
        return peaks

    def agreed_stop(self, scorer):
        """Whether every rank stops now: a signal to any rank, too many non-finite gradients in a
        row, or a failed scorer (a collective); records which ranks a stop signal reached."""
        signum = self.signals.signum
        self.stop_signal, self.stopped_by = agreed_stop(
            signum, self.optimizer_step.nonfinite_streak, self.args.max_nonfinite_steps,
            scorer.failure, self.device, self.world_size)  # the scorer may fail in validation
        if self.stop_signal and self.world_size > 1:
            self.signalled = signalled_ranks(signum, self.world_size)
        return bool(self.stopped_by)

    def warn(self, what, where, message):
        """A warning of what spoils training without stopping it, printed the first time (naming
        `where`); later ones are counted, and the end of the run prints the count."""
        first, count = self.warned.get(what, (where, 0))
        self.warned[what] = (first, count + 1)
        if not count:
            rank = f"rank {self.rank}: " if self.world_size > 1 else ""
            print(f"{rank}{where}: warning: {message} (warned once: the end of the run counts "
                  "them)", flush=True)

    def save_if_due(self):
        """A checkpoint every --save-every iterations and at the end (main process)."""
        iterations = self.state["iteration"]
        every = self.args.output.save_every
        due = iterations % every == 0 or iterations == self.args.num_iterations
        if self.main_process and due:
            save_last_iteration(self.dir, self.state, self.transformer, self.optimizer,
                                self.args.output.keep_last)

    def error_line(self, error):
        """What ends the run in one line (checks.errors_end_in_one_line), with what to do: a failed
        allocation, an EventsFileError (a full disk), a SnapshotError (a schedule's NaN) or a
        collective that failed when another rank went away."""
        if isinstance(error, (EventsFileError, SnapshotError)):
            return str(error), None
        if line := lost_peer_line(error):
            return line
        return out_of_memory_line(error, self.current_phase, self.device, TRAINER_MEMORY_FLAGS)

    def keep_after_error(self, stopped_by):
        """After a failed allocation, events file or snapshot: the last completed iteration is
        saved, unless the failed one had already stepped the optimizer (its checkpoint on disk
        stands then), and summary.json says what stopped the run. Returns what is kept, in words."""
        self.stopped_by = stopped_by
        state = self.state
        latest = (checkpoints(self.dir)[-1:] or [None])[0]
        kept = f"the latest checkpoint is {latest}" if latest else "no checkpoint was saved"
        if self.main_process and state:  # in iteration 1 too: summary.json says why it stopped
            if state["iteration"] and self.optimizer_step.steps == self.steps_when_saved:
                try:
                    saved = save_checkpoint(self.dir, state["iteration"], self.transformer,
                                            self.optimizer, state, self.args.output.keep_last)
                    kept = f"the latest checkpoint is {saved}"
                except RunError as save_error:  # it names the latest complete checkpoint
                    kept = str(save_error)
            try:
                self.write_summary()
            except OSError as error:  # the disk may be full
                kept += f"; summary.json could not be written either ({error.strerror or error})"
        return kept

    def current_phase(self):
        """Loading, a validation, or the rollout or training of the iteration under way."""
        if self.phase:
            return self.phase
        laps = self.iteration_timer.seconds if self.iteration_timer else {}
        part = "training" if "rollout_s" in laps else "rollout"
        return f"the {part} of iteration {self.state['iteration'] + 1}"

    def write_summary(self):
        # a signal after the last iteration cut nothing short; an error there (a diverged step) did
        try:
            self.writer.close()
        except EventsFileError as error:  # what stopped the run, or its last write on a full disk
            self.stopped_by = self.stopped_by or str(error)
        done = self.state["iteration"] >= self.args.num_iterations
        stopped_by = None if self.stop_signal and done else self.stopped_by
        return summary_of_state(self.dir, self.state, stopped_by, self.device, self.failed_judges)

    def finish(self):
        """A stopped run keeps its last completed iteration; summary.json; exit with the status."""
        state = self.state
        self.record_peak_memory()  # the last validation's too
        rank = f"rank {self.rank}: " if self.world_size > 1 else ""
        for what, (first, count) in self.warned.items():
            print(f"{rank}warning: {what} {count} time(s), first in {first}", flush=True)
        if self.main_process and self.stopped_by and state["iteration"]:
            save_last_iteration(self.dir, state, self.transformer, self.optimizer,
                                self.args.output.keep_last, self.stopped_by)
        if self.main_process:
            print(json.dumps(self.write_summary(), indent=1))
            # the first line named the run directory, many progress lines ago
            print(f"run {self.dir}: summary.json, TensorBoard events and checkpoints", flush=True)
            if self.signalled:  # several ranks, maybe on several nodes: whose signal it was
                print(f"{Path(sys.argv[0]).name}: {self.stopped_by} reached {self.signalled}: "
                      f"every rank stopped after iteration {state['iteration']}; --resume-from "
                      "latest continues", file=sys.stderr, flush=True)
        exit_code = run_exit_code(self.stop_signal, self.stopped_by, state["iteration"], self.dir)
        if self.tracking:  # before os._exit below, which skips wandb's own exit hook
            self.tracking.finish(exit_code=exit_code)
        if self.world_size > 1:
            leave_process_group()
            os._exit(exit_code)  # skips the interpreter's teardown, where gloo's threads may abort
        if exit_code:
            sys.exit(exit_code)
