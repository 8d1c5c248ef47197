"""The checks of what a trainer or evaluate.py is given, before anything loads, each failing one
told in one line, `{script}: error: ...`, as argparse tells it: the flags, the local model folders
that the rewards and judges read, the devices, and a prompt file, model or reward server that
cannot be read while the models load (loading_errors_as_one_line); and, from then on, the errors
that end the program in one line, after it keeps what it can (errors_end_in_one_line)."""

import importlib
import math
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from data import DataError
from judges import judge_names
from memory import out_of_memory
from reward_mix import normalize_reward_specs, parse_mix
from sd3 import check_model_path
from settings import flat_settings


def fail(message):
    """Exit with status 1 and one line, `{script}: error: {message}`, as argparse does."""
    sys.exit(f"{Path(sys.argv[0]).name}: error: {message}")


def check_numbers(args, bounds):
    """One line for a float flag that is not finite, or not above ('>') or at least ('>=') its
    bound; the flags named as flat_settings names them."""
    settings = flat_settings(args)
    for flag, (op, bound) in bounds.items():
        value = settings[flag]
        if not (math.isfinite(value) and (value > bound if op == ">" else value >= bound)):
            fail(f"--{flag.replace('_', '-')} {value:g}: must be a finite number {op} {bound:g}")


def check_finite(args):
    """One line for a flag of real numbers (one, or several as --old-decay) holding NaN or inf,
    which the range checks' comparisons would let through (any comparison with NaN is false)."""
    for name, value in flat_settings(args).items():
        numbers = value if isinstance(value, tuple) else (value,)
        reals = [n for n in numbers if isinstance(n, float)]
        if not all(map(math.isfinite, reals)):
            shown_value = " ".join(f"{n:g}" for n in numbers)
            fail(f"--{name.replace('_', '-')} {shown_value}: must be finite numbers")


SMALLEST = {  # the least value of each whole-number flag
    "resolution": 16, "prompts_per_rank": 1, "lora_rank": 1, "lora_alpha": 1, "num_steps": 2,
    "train_batch_size": 1, "save_every": 1, "num_iterations": 0, "eval_every": 0, "keep_last": 0,
    "eval_steps": 1, "max_sequence_length": 1, "forward_batch_size": 0,
    "policy_timesteps_per_forward": 1, "max_nonfinite_steps": 1, "seed": 0,
    "eval_seed": 0,
}


def check_shared_args(args, check_algorithm_args, train_timestep_grid):
    """The flags both trainers share, checked before anything loads; a trainer's own checks run at
    their place among them: `check_algorithm_args(args)`, then the trained timesteps against
    `train_timestep_grid(grid, args)`."""
    settings = flat_settings(args)
    for flag, least in SMALLEST.items():
        if settings[flag] < least:
            fail(f"--{flag.replace('_', '-')} {settings[flag]}: must be at least {least}")
    check_numbers(args, {"learning_rate": (">", 0), "adam_eps": (">", 0), "weight_decay": (">=", 0),
                         "max_grad_norm": (">", 0), "adv_clip": (">", 0),
                         "eval_guidance": (">=", 1)})
    if not all(0 <= beta < 1 for beta in args.adam_betas):
        betas = " ".join(f"{b:g}" for b in args.adam_betas)
        fail(f"--adam-betas {betas}: each must lie in [0, 1)")
    if args.seed >= 2**23:  # image seeds (image_seed) stay below 2^63
        fail(f"--seed {args.seed}: must be below 2^23 = {2**23}")
    if args.max_sequence_length > 512:
        fail(f"--max-sequence-length {args.max_sequence_length}: SD3's T5 encoder takes at most "
             "512 tokens")
    validation = args.validation
    validation.eval_judge = check_scoring_args(args.scoring, validation.eval_judge, "--eval-judge",
                                               judged=bool(validation.eval_every))
    if validation.eval_every and validation.eval_prompts < 1:
        fail(f"--eval-prompts {validation.eval_prompts}: validation needs a prompt (--eval-every 0 "
             "turns validation off)")
    if args.output.overwrite and args.output.resume_from:
        fail("--overwrite with --resume-from: a resume continues the run, it never replaces it")
    if args.group_size < 2:
        fail(f"--group-size {args.group_size}: centering needs at least 2 images per prompt")
    images = args.prompts_per_rank * args.group_size
    if args.train_batch_size % args.group_size or images % args.train_batch_size:
        fail(f"--train-batch-size {args.train_batch_size} must be a multiple of --group-size "
             f"{args.group_size} that divides the {images} images per rank: whole prompt groups "
             "per micro batch")
    if args.resolution % 16:
        fail(f"--resolution {args.resolution} is not a multiple of 16 (VAE factor 8 x patch size "
             "2)")
    if args.output.track:
        check_tracking()
    check_algorithm_args(args)
    check_finite(args)  # NaN or inf that the range checks let through: an EMA schedule's slope
    trainable = len(train_timestep_grid(range(args.num_steps), args))
    if not 1 <= args.num_train_timesteps <= trainable:
        fail(f"--num-train-timesteps {args.num_train_timesteps} must lie in [1, {trainable}]: the "
             f"trained steps of the {args.num_steps}-step rollout grid")
    check_devices(args, "the trainers run")


def check_scoring_args(scoring, judge, judge_flag, judged=True):
    """--reward's block (settings.ScoringArgs) beside the judges `judge` of `judge_flag`: a bad
    one in one line; --reward made canonical, as checkpoints and run names record it. Returns the
    judges, canonical too."""
    if scoring.reward_retries < 0:
        fail(f"--reward-retries {scoring.reward_retries}: must be at least 0")
    check_numbers(scoring, {"reward_timeout": (">", 0)})
    try:
        scoring.reward, judge = normalize_reward_specs(
            scoring.reward, judge, judge_flag, scoring.reward_urls, scoring.aesthetic_head,
            judged=judged)
    except ValueError as error:
        fail(error)
    return judge


def check_tracking():
    """--track needs wandb, an optional extra: one line if it is not installed."""
    try:
        importlib.import_module("wandb")
    except ImportError as error:
        fail(f"--track: wandb is not installed ({error}); install it with "
             "pip install -r requirements-track.txt")


def scorers_of(args):
    """The names of the scorers a run loads: --reward's (its one reward, or a mix's components)
    and, when it validates, --eval-judge's."""
    validation = args.validation
    judges = judge_names(validation.eval_judge) if validation.eval_every else []
    return set(parse_mix(args.scoring.reward)) | set(judges)


def check_judge_models(scoring, names):
    """A local --pickscore-model, --pickscore-processor or --aesthetic-model that holds no such
    model, or an --aesthetic-head that is no file, as a RuntimeError naming the flag, for the
    rewards and judges `names` that read them; before anything loads."""
    if "pickscore" in names:
        check_model_path(scoring.pickscore_model, "--pickscore-model", "config.json",
                         "a transformers model")
        check_model_path(scoring.pickscore_processor, "--pickscore-processor",
                         "preprocessor_config.json", "an image processor")
    if "aesthetic" in names:
        for marker, kind in (("config.json", "a transformers model"),
                             ("preprocessor_config.json", "an image processor")):
            check_model_path(scoring.aesthetic_model, "--aesthetic-model", marker, kind)
        if not Path(scoring.aesthetic_head).is_file():
            raise RuntimeError(f"--aesthetic-head {scoring.aesthetic_head}: no such file (the "
                               "LAION head, sac+logos+ava1-l14-linearMSE.pth)")


def check_devices(args, runs_on):
    """--device, --reward-device and --text-encoder-device (empty: the actor's) name a cpu or cuda
    device this machine has; `runs_on` says who in the error, e.g. "evaluate.py runs"."""
    settings = flat_settings(args)
    for flag in ("device", "reward_device", "text_encoder_device"):
        name = settings[flag]
        option = f"--{flag.replace('_', '-')}"
        try:
            index = torch.device(name).index if name else None
        except RuntimeError:
            fail(f"{option} {name}: not a torch device (cpu, cuda, cuda:1, ...)")
        if name and torch.device(name).type not in ("cpu", "cuda"):
            fail(f"{option} {name}: {runs_on} on cpu or cuda devices")
        if name.startswith("cuda") and (index or 0) >= torch.cuda.device_count():
            fail(f"{option} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def errors_end_in_one_line(line_of, keep):
    """From now on, an uncaught exception that `line_of` names (it returns (what stopped the
    program, what to do or None), else None) ends the program with one line on stderr,
    `{script}: error: {what}: {to do}; {keep(what)}`, keep saving what it can and saying what is
    kept. Any other exception keeps its traceback."""
    excepthook = sys.excepthook

    def hook(kind, error, trace):
        line = line_of(error)
        if line is None:
            return excepthook(kind, error, trace)
        traceback.clear_frames(trace)  # a failed step's tensors go
        stopped_by, remedy = line
        kept = keep(stopped_by)
        told = f"{stopped_by}: {remedy}" if remedy else stopped_by
        print(f"{Path(sys.argv[0]).name}: error: {told}; {kept}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            os._exit(1)  # the other ranks wait in a collective: torchrun ends them

    sys.excepthook = hook


@contextmanager
def loading_errors_as_one_line():
    """A prompt file, model or reward server that cannot be read ends the program with one line;
    a failed allocation goes on to Run's line, which names the phase and the flags."""
    try:
        yield
    except (DataError, OSError, RuntimeError) as error:
        if out_of_memory(error):
            raise
        fail(error)
