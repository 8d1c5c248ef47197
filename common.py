"""What the trainers share outside their algorithms: argument checks, the run (directory,
resume, logging, checkpoints, the agreed stop), the guarded optimizer step, the compile workers,
validation and the per-iteration timer. No loss, advantage, EMA schedule or optimizer choice lives
here.

    run = Run(args, "crd")                      # ranks, run directory and its lock, stop signals
    compiler = Compiler(args, run.device, run.world_size)   # before the models load
    compiler.compile(pipe)
    state = run.start(transformer, optimizer, sampler, pipe)  # a new run's state, or the resumed
    for iteration in run.iterations(state, compiler):
        ...
    run.finish()                                # summary.json and the exit status
"""

import importlib
import json
import math
import os
import resource
import signal
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import google_crc32c
import numpy as np
import torch
import torch.distributed as dist
import tyro
from tensorboard.summary.writer import record_writer
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from checkpoint import (EVAL_SCORES, PROMPT_FILES, GracefulStop, RunComplete, RunError,
                        actor_peak_memory, checkpoints, prepare_run, prompt_files_sha256,
                        remove_unused_run_directories, save_checkpoint, save_last_iteration,
                        start_state, summary_of_state)
from data import DataError, load_train_and_eval_prompts
from omni_rollout import OmniRollout, check_engine
from precompile import Precompile
from reward import (JUDGES, READERS, GuardedScorer, ScoringThread, aggregate_rewards,
                    check_reward_model, component_means, judge_names, make_judge,
                    make_guarded_judges, make_mix, normalize_reward_specs, parse_mix,
                    weighted_sum)
from rollout import (CompileCache, available_host_memory, captioned_grid, check_model_path,
                     compile_blocks, compile_decoder, encode_prompts, images_per_call,
                     nonfinite_images, predict_velocity, sample, use_adapter, warn_cut_targets)


# ---- argument checks -------------------------------------------------------------------------

# A flag of several words kept as one string, as --reward qwen-vl=0.8 pickscore=0.2 and
# --eval-judge paddle flat take them (the trainers' Args annotate those two fields with it)
WORDS = tyro.constructors.PrimitiveConstructorSpec(
    nargs="*", metavar="NAME[=WEIGHT] ...", instance_from_str=" ".join,
    is_instance=lambda value: isinstance(value, str), str_from_instance=str.split)


def fail(message):
    """Exit with status 1 and one line, `{script}: error: {message}`, as argparse does."""
    sys.exit(f"{Path(sys.argv[0]).name}: error: {message}")


def check_numbers(args, bounds):
    """One line for a float flag that is not finite, or not above ('>') or at least ('>=') its
    bound."""
    for flag, (op, bound) in bounds.items():
        value = getattr(args, flag)
        if not (math.isfinite(value) and (value > bound if op == ">" else value >= bound)):
            fail(f"--{flag.replace('_', '-')} {value:g}: must be a finite number {op} {bound:g}")


def check_finite(args):
    """One line for a flag of real numbers (one, or several as --old-decay) holding NaN or inf,
    which the range checks' comparisons would let through (any comparison with NaN is false)."""
    for name, value in asdict(args).items():
        numbers = value if isinstance(value, tuple) else (value,)
        reals = [n for n in numbers if isinstance(n, float)]
        if not all(map(math.isfinite, reals)):
            shown_value = " ".join(f"{n:g}" for n in numbers)
            fail(f"--{name.replace('_', '-')} {shown_value}: must be finite numbers")


SMALLEST = {  # the least value of each whole-number flag
    "resolution": 16, "prompts_per_rank": 1, "lora_rank": 1, "lora_alpha": 1, "num_steps": 2,
    "train_batch_size": 1, "save_every": 1, "num_iterations": 0, "eval_every": 0, "keep_last": 0,
    "eval_steps": 1, "max_sequence_length": 1, "forward_batch_size": 0,
    "policy_timesteps_per_forward": 1, "max_nonfinite_steps": 1, "reward_retries": 0, "seed": 0,
    "eval_seed": 0,
}


def check_shared_args(args, check_algorithm_args, train_timestep_grid):
    """The flags both trainers share, checked before anything loads; a trainer's own checks run at
    their place among them: `check_algorithm_args(args)`, then the trained timesteps against
    `train_timestep_grid(grid, args)`."""
    for flag, least in SMALLEST.items():
        if getattr(args, flag) < least:
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least {least}")
    check_numbers(args, {"learning_rate": (">", 0), "adam_eps": (">", 0), "weight_decay": (">=", 0),
                         "max_grad_norm": (">", 0), "adv_clip": (">", 0),
                         "reward_timeout": (">", 0), "eval_guidance": (">=", 1)})
    if not all(0 <= beta < 1 for beta in args.adam_betas):
        betas = " ".join(f"{b:g}" for b in args.adam_betas)
        fail(f"--adam-betas {betas}: each must lie in [0, 1)")
    if args.seed >= 2**23:  # image seeds (image_seed) stay below 2^63
        fail(f"--seed {args.seed}: must be below 2^23 = {2**23}")
    if args.max_sequence_length > 512:
        fail(f"--max-sequence-length {args.max_sequence_length}: SD3's T5 encoder takes at most "
             "512 tokens")
    try:  # canonical, as checkpoints and run names record them
        args.reward, args.eval_judge = normalize_reward_specs(
            args.reward, args.eval_judge, "--eval-judge", args.reward_urls, args.aesthetic_head,
            judged=bool(args.eval_every))
    except ValueError as error:
        fail(error)
    if args.eval_every and args.eval_prompts < 1:
        fail(f"--eval-prompts {args.eval_prompts}: validation needs a prompt (--eval-every 0 turns "
             "validation off)")
    if args.overwrite and args.resume_from:
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
    if args.track:
        check_tracking()
    check_algorithm_args(args)
    check_finite(args)  # NaN or inf that the range checks let through: an EMA schedule's slope
    trainable = len(train_timestep_grid(range(args.num_steps), args))
    if not 1 <= args.num_train_timesteps <= trainable:
        fail(f"--num-train-timesteps {args.num_train_timesteps} must lie in [1, {trainable}]: the "
             f"trained steps of the {args.num_steps}-step rollout grid")
    check_devices(args, "the trainers run")


def check_tracking():
    """--track needs wandb, an optional extra: one line if it is not installed."""
    try:
        importlib.import_module("wandb")
    except ImportError as error:
        fail(f"--track: wandb is not installed ({error}); install it with "
             "pip install -r requirements-track.txt")


WANDB_RUN_ID = "wandb_run_id"  # in the run directory: a resume continues the same W&B run


def start_tracking(args, run_dir, resumed):
    """--track: the run in Weights & Biases (as cleanRL does it), its TensorBoard scalars synced,
    so before the SummaryWriter is made; a resumed run continues the W&B run it had."""
    import wandb

    id_file = Path(run_dir) / WANDB_RUN_ID
    run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None  # None: new
    # the run directory as TensorBoard's root: else wandb waits 10 s for more log directories
    wandb.tensorboard.patch(root_logdir=str(run_dir))
    tracking = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity or None,
                          sync_tensorboard=True, config=vars(args), name=Path(run_dir).name,
                          id=run_id, resume="allow")
    id_file.write_text(tracking.id + "\n")
    return tracking


def scorers_of(args):
    """The names of the scorers a run loads: --reward's (its one reward, or a mix's components)
    and, when it validates, --eval-judge's."""
    judges = judge_names(args.eval_judge) if args.eval_every else []
    return set(parse_mix(args.reward)) | set(judges)


def check_judge_models(args, names):
    """A local --pickscore-model, --pickscore-processor or --aesthetic-model that holds no such
    model, or an --aesthetic-head that is no file, as a RuntimeError naming the flag, for the
    rewards and judges `names` that read them; before anything loads."""
    if "pickscore" in names:
        check_model_path(args.pickscore_model, "--pickscore-model", "config.json",
                         "a transformers model")
        check_model_path(args.pickscore_processor, "--pickscore-processor",
                         "preprocessor_config.json", "an image processor")
    if "aesthetic" in names:
        for marker, kind in (("config.json", "a transformers model"),
                             ("preprocessor_config.json", "an image processor")):
            check_model_path(args.aesthetic_model, "--aesthetic-model", marker, kind)
        if not Path(args.aesthetic_head).is_file():
            raise RuntimeError(f"--aesthetic-head {args.aesthetic_head}: no such file (the LAION "
                               "head, sac+logos+ava1-l14-linearMSE.pth)")


def check_devices(args, runs_on):
    """--device, --reward-device and --text-encoder-device (empty: the actor's) name a cpu or cuda
    device this machine has; `runs_on` says who in the error, e.g. "evaluate.py runs"."""
    for flag in ("device", "reward_device", "text_encoder_device"):
        name = getattr(args, flag)
        option = f"--{flag.replace('_', '-')}"
        try:
            index = torch.device(name).index if name else None
        except RuntimeError:
            fail(f"{option} {name}: not a torch device (cpu, cuda, cuda:1, ...)")
        if name and torch.device(name).type not in ("cpu", "cuda"):
            fail(f"{option} {name}: {runs_on} on cpu or cuda devices")
        if name.startswith("cuda") and (index or 0) >= torch.cuda.device_count():
            fail(f"{option} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")


# ---- ranks -----------------------------------------------------------------------------------


def actor_device(name, world_size):
    """This rank's device from --device; with several ranks (torchrun), it first joins their
    process group, and a CUDA rank takes cuda:LOCAL_RANK."""
    device = torch.device(name)
    if world_size > 1:
        # ranks wait for rank 0's validation and each other's first compile: past the default 10 min
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=60))
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
    elif device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # "cuda:0" in summary.json
    return device


# per node: its devices, its reward servers, and paths a node may mount elsewhere (contents count)
PER_NODE = ("device", "text_encoder_device", "reward_device", "reward_urls", "reward_timeout",
            "reward_retries", "output_dir", "resume_from", "train_data", "eval_data", "model",
            "reward_model", "pickscore_model", "pickscore_processor", "aesthetic_model",
            "aesthetic_head")


def shared_settings(args, algorithm):
    """{what: value} of what every rank must run alike: the trainer, every flag but PER_NODE's (as
    the command line spells them) and the contents of the prompt files."""
    settings = {"the trainer": algorithm}
    settings |= {f"--{name.replace('_', '-')}": value for name, value in asdict(args).items()
                 if name not in PER_NODE}
    hashes = prompt_files_sha256(vars(args))
    for field, flag in PROMPT_FILES.items():
        digest = hashes.get(field)
        settings[f"{flag} contents"] = f"sha256 {digest[:16]}" if digest else "unreadable"
    return settings


def shown(value):
    """A setting's value as the command line writes it."""
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value))
    return '""' if value == "" else str(value)


def settings_mismatch(settings, rank):
    """One line on what differs from rank 0's in `settings` (shared_settings of every rank, by
    rank), naming this rank's value where this rank differs, else the first rank that does; None
    where every rank agrees."""
    differing = [other for other, theirs in enumerate(settings) if theirs != settings[0]]
    if not differing:
        return None
    other = rank if rank in differing else differing[0]
    first, theirs = settings[0], settings[other]
    names = [name for name in first | theirs if first.get(name) != theirs.get(name)]
    if first["the trainer"] != theirs["the trainer"]:  # its flags differ too: this says it all
        names = ["the trainer"]
    differences = "; ".join(f"{name} {shown(first.get(name, '(absent)'))} on rank 0, "
                            f"{shown(theirs.get(name, '(absent)'))} on rank {other}"
                            for name in names)
    return (f"settings differ between ranks: {differences} (every rank must run the same settings: "
            "start every node with the same flags)")


def all_mean_(tensors, world_size):
    """Average tensors in place over ranks with one flat all-reduce."""
    if world_size > 1:
        flat = torch.cat([t.flatten() for t in tensors]) / world_size
        dist.all_reduce(flat)
        for t, reduced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
            t.copy_(reduced)


def gather(tensor, world_size):
    """(N, ...) on each rank -> (world_size * N, ...), rank-major, on every rank."""
    if world_size == 1:
        return tensor
    out = tensor.new_empty(world_size * len(tensor), *tensor.shape[1:])
    dist.all_gather_into_tensor(out, tensor.contiguous())
    return out


def agreed_stop(signum, nonfinite_streak, max_nonfinite_steps, scorer_failure, device, world_size):
    """(signal number or 0, what stopped the run or None), the same on every rank: a signal to any
    rank, too many consecutive non-finite gradients, or a failed scorer stops every rank (a
    collective: every rank calls it)."""
    diverged = nonfinite_streak >= max_nonfinite_steps
    stop = torch.tensor([signum or 0, diverged, bool(scorer_failure)], device=device)
    if world_size > 1:
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # a signal to any rank stops every rank
    stop_signal, diverged, failed = stop.tolist()
    if stop_signal:
        return stop_signal, signal.Signals(stop_signal).name
    if diverged:
        return stop_signal, f"{nonfinite_streak} consecutive non-finite gradients"
    if failed:
        return stop_signal, scorer_failure or "the reward failed on another rank"
    return stop_signal, None


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


def leave_process_group():
    """Tear the process group down in step with the other ranks and flush this rank's output; a
    distributed trainer then ends in os._exit, as gloo's threads now and then abort the
    interpreter's teardown ("terminate called without an active exception")."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def masked_crc32c(data):
    """TensorBoard's record checksum (CRC-32C, masked), computed in C by google-crc32c."""
    crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


# TensorBoard's own loop runs in pure Python in its writer thread: a validation grid's record held
# the GIL for ~2 s and slowed the next rollout's kernel launches by as much (benchmark/RESULTS.md)
record_writer.masked_crc32c = masked_crc32c


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


class RolloutEngine:
    """What runs the loop's rollouts: rollout.sample (--rollout-engine diffusers), or its call
    through vLLM-Omni on the one actor GPU (vllm-omni: omni_rollout.OmniRollout, started once the
    LoRA adapters exist). Made inside loading_errors_as_one_line: a run the engine cannot serve
    (several ranks, no CUDA GPU, vllm-omni missing, weights built in memory) is one line."""

    def __init__(self, args, world_size, device):
        self.args = args
        self.world_size = world_size
        self.omni = None
        self.sample = sample
        if args.rollout_engine == "vllm-omni":
            check_engine(world_size, device, args.model)  # loads nothing: before the models

    def start(self, pipe, dtype):
        """The vLLM-Omni engine, on `pipe` with its adapters; its start-up check (a non-zero adapter
        changes its output) failing is one line."""
        if self.args.rollout_engine != "vllm-omni":
            return
        with loading_errors_as_one_line():
            self.omni = OmniRollout(pipe, self.args.model, pipe.transformer.device,
                                    self.world_size, dtype, enforce_eager=not self.args.compile)
        self.sample = self.omni.sample

    def close(self):
        """Shut the engine down (its processes end before the trainer exits)."""
        if self.omni is not None:
            self.omni.close()
            self.omni = None
            self.sample = sample


def image_seed(seed, iteration, index):
    """The seed of image `index` (over all ranks) of an iteration: below 2^63 for seed < 2^23."""
    return (seed << 40) + (iteration << 20) + index


# ---- compiling -------------------------------------------------------------------------------


def policy_chunks(rows, args):
    """Slices of a micro batch's `rows`, one policy forward and backward each."""
    per_forward = args.train_batch_size * args.policy_timesteps_per_forward
    return [slice(start, min(start + per_forward, rows)) for start in range(0, rows, per_forward)]


def start_precompile(args, compile_cache, device, world_size):
    """A cold start of one rank compiles in worker processes (precompile.py) while the models load
    and the first validation runs eagerly: the first compiled call of each graph family as the first
    iteration makes it, its rows from the functions the loop's passes use. Several ranks, a compile
    cache to load, or no first validation to hide them behind: no workers."""
    if not compile_cache.cold or world_size > 1 or not args.eval_every:
        return Precompile([])
    images = args.prompts_per_rank * args.group_size
    rows = images * args.num_train_timesteps
    most = args.forward_batch_size
    rollout_images = images_per_call(images, most)
    base_rows = images_per_call(rows, most, args.kl_cfg) * (2 if args.kl_cfg > 1 else 1)
    policy = policy_chunks(args.train_batch_size * args.num_train_timesteps, args)[0]
    passes = [{"adapter": "sampling", "grad": False, "rows": rollout_images},
              {"adapter": None, "grad": False, "rows": base_rows},
              {"adapter": "policy", "grad": True, "rows": policy.stop - policy.start},
              {"decode": min(rollout_images, 8)}]  # decode_latents' chunks
    return Precompile(passes, args.model, device, torch.bfloat16, (args.lora_rank, args.lora_alpha),
                      args.gradient_checkpointing, args.resolution, 77 + args.max_sequence_length)


class Compiler:
    """torch.compile of the transformer blocks and the VAE decoder (CUDA, --compile), with its cache
    file. On a cold start, worker processes compile the graphs while the models load, and compiled
    code runs eagerly until they are done; the graphs are then found in the on-disk caches."""

    def __init__(self, args, device, world_size):
        self.cache = CompileCache(args.model, device, args.compile and device.type == "cuda")
        self.workers = start_precompile(args, self.cache, device, world_size)

    def compile(self, pipe):
        if self.cache.enabled:
            compile_blocks(pipe.transformer)
            compile_decoder(pipe.vae)
        if self.workers.passes:
            torch.compiler.set_stance("force_eager")

    def wait(self):
        """Before the first iteration: wait for the workers, then compile as usual."""
        self.workers.wait()
        if self.workers.passes:
            torch.compiler.set_stance("default")

    def save(self):
        """The cache file, once: after the first iteration every graph has compiled."""
        self.cache.save()


# ---- one iteration ---------------------------------------------------------------------------


@dataclass
class TrainingRows:
    """Training rows of an iteration, one image at one timestep each: x_t, t, the velocity target
    and the index of the row's image (for its prompt embeddings and advantage)."""

    noisy: torch.Tensor  # (N, C, h, w)
    timesteps: torch.Tensor  # (N,)
    target: torch.Tensor  # (N, C, h, w)
    image_index: torch.Tensor  # (N,)

    def __len__(self):
        return len(self.timesteps)

    def policy_chunks(self, args):
        """Slices of these rows, one policy forward and backward each."""
        return policy_chunks(len(self), args)

    def __getitem__(self, rows):
        return TrainingRows(self.noisy[rows], self.timesteps[rows], self.target[rows],
                            self.image_index[rows])

    def velocity(self, transformer, embeds, pooled, args=None, guidance=1.0, negative=(None, None),
                 wait=True):
        """The active adapter's velocity at these rows; with args: in no-grad forwards of at most
        --forward-batch-size images, the host waiting on each (`wait`) so a scorer thread runs."""
        return predict_velocity(transformer, self.noisy, self.timesteps, embeds[self.image_index],
                                pooled[self.image_index], guidance, *negative,
                                max_batch_size=args.forward_batch_size if args else None,
                                wait_each_chunk=wait and args is not None)


# Values a transformer block keeps per token and hidden unit for its backward: 34 bytes at 16 bits
# (Korthikanti et al. 2022, less the attention matrix, which fused attention does not keep). The
# tiny model's policy forward keeps 1.5 MB a row, 17 of its float32 values per token and unit.
ACTIVATIONS_PER_TOKEN = 17


def iteration_memory(args, pipe, dtype):
    """About the bytes an iteration holds at its peak for this rank's images: [(what, bytes, on
    the host)]. The model, the optimizer and the work of the no-grad forwards come on top."""
    config = pipe.transformer.config
    size = dtype.itemsize
    images = args.prompts_per_rank * args.group_size
    rows = images * args.num_train_timesteps
    side = args.resolution // pipe.vae_scale_factor
    latent = config.in_channels * side**2  # values of one image's latents
    text_tokens = pipe.tokenizer_max_length + args.max_sequence_length
    tokens = (side // config.patch_size) ** 2 + text_tokens
    hidden = config.num_attention_heads * config.attention_head_dim
    layers = config.num_layers
    kept = ACTIVATIONS_PER_TOKEN * layers
    if args.gradient_checkpointing:  # each block's input, and one block's while it is recomputed
        kept = layers + ACTIVATIONS_PER_TOKEN
    policy_rows = args.train_batch_size * min(args.policy_timesteps_per_forward,
                                              args.num_train_timesteps)
    # a copy per training row while the reference and old passes run
    return [("prompt embeddings", (images + rows) * text_tokens * config.joint_attention_dim * size,
             False),
            ("latents", images * latent * 4, False),
            ("training rows and their reference and old velocities", rows * latent * (8 + 2 * size),
             False),
            ("decoded images", images * args.resolution**2 * 3, True),
            (f"activations of a policy forward of {policy_rows} rows",
             policy_rows * tokens * hidden * kept * size, False)]


def memory_error(args, pipe, dtype, device):
    """Why an iteration's images cannot fit this rank's memory (iteration_memory's estimate against
    the memory there is), in one line, or None. Ranks on one host share its memory."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    pools = {}  # {where: [(what, bytes)]}
    for what, size, on_host in iteration_memory(args, pipe, dtype):
        where = "cpu" if on_host or device.type == "cpu" else "cuda"
        pools.setdefault(where, []).append((what, size * (ranks_here if where == "cpu" else 1)))
    for where, parts in pools.items():
        if where == "cuda":  # what this process does not hold (the models): others' use may pass
            have = torch.cuda.get_device_properties(device).total_memory
            have -= torch.cuda.memory_reserved(device)
            there = f"on {device}, which has {have / 2**30:.1f} GiB beside this process's models"
        else:
            have = available_host_memory()
            ranks = f" for {ranks_here} ranks" if ranks_here > 1 else ""
            there = f"of the CPU's memory{ranks}, which has {(have or 0) / 2**30:.1f} GiB available"
        need = sum(size for _, size in parts)
        if have is None or need <= have:
            continue
        counted = ", ".join(f"{what} {size / 2**30:.1f}" for what, size in parts)
        return (f"--prompts-per-rank {args.prompts_per_rank} x --group-size {args.group_size} = "
                f"{args.prompts_per_rank * args.group_size} images need about {need / 2**30:.1f} "
                f"GiB {there} ({counted} GiB; the model and its other work come on top): lower "
                "--group-size or --prompts-per-rank, or --policy-timesteps-per-forward, or add "
                "--gradient-checkpointing")
    return None


class PhaseTimer:
    """Seconds of an iteration by phase: lap(name) charges the time since the last lap to `name`,
    after the device has finished the work queued so far."""

    def __init__(self, device):
        self.device = device
        self.seconds = {}
        self.last = time.perf_counter()

    def lap(self, name):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now

    def perf(self, images, reward_s):
        """perf/* scalars: each phase, the scorer's own time, the iteration, images per second."""
        iteration_s = sum(self.seconds.values())
        perf = {**self.seconds, "reward_s": reward_s, "iteration_s": iteration_s,
                "images_per_s": images / iteration_s}
        return {f"perf/{name}": value for name, value in perf.items()}


class GuardedStep:
    """The optimizer step of a micro batch: gradients averaged over ranks and clipped; a non-finite
    gradient norm skips the step (counted and printed; the run stops after --max-nonfinite-steps in
    a row). Gradients are zeroed either way."""

    def __init__(self, optimizer, params, args, world_size):
        self.optimizer = optimizer
        self.params = params
        self.args = args
        self.world_size = world_size
        self.nonfinite_streak = 0
        self.iteration = None
        self.grad_norms = []
        self.skipped = 0

    def __call__(self, iteration):
        """Step (True) or skip (False) micro batch's step of `iteration` (0-based)."""
        if iteration != self.iteration:
            self.iteration = iteration
            self.grad_norms = []
            self.skipped = 0
        all_mean_([p.grad for p in self.params], self.world_size)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.args.max_grad_norm)
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
            self.nonfinite_streak = 0
        else:
            self.nonfinite_streak += 1
            self.skipped += 1
            print(f"iteration {iteration + 1}: non-finite gradient, optimizer step skipped",
                  flush=True)
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_norms.append(grad_norm)
        return finite

    @property
    def stepped_this_iteration(self):
        return self.skipped < len(self.grad_norms)

    def stats(self):
        return {"charts/lr": self.optimizer.param_groups[0]["lr"],
                "charts/grad_norm": torch.stack(self.grad_norms).mean(),
                "charts/skipped_steps": self.skipped}


def reward_stats(rewards, group_size, weights):
    """train/*: the reward (N,), or a mix's (N, K) components' weighted sum, with each component
    as train/reward_<name>."""
    components = {}
    if rewards.ndim == 2:
        components = {f"train/reward_{name}": value
                      for name, value in component_means(rewards, weights).items()}
        rewards = weighted_sum(rewards, weights.values())
    groups = rewards.view(-1, group_size)
    return {"train/reward_mean": rewards.mean(), "train/reward_std": rewards.std(unbiased=False),
            "train/zero_std_group_frac": (groups.std(1) == 0).float().mean(), **components}


def image_rewards(scores, weights):
    """One reward's scores (N,) as they are; a mix's (N, K) as their weighted sum (N,)."""
    if np.ndim(scores) == 1:
        return scores
    return weighted_sum(torch.as_tensor(scores), weights.values()).numpy()


def scorer_options(args, device):
    """make_judge's options from the flags: where the reward models run and how they are found."""
    return dict(device=args.reward_device or str(device), model_path=args.reward_model,
                urls=args.reward_urls, timeout=args.reward_timeout, max_retries=args.reward_retries,
                pickscore_model=args.pickscore_model, pickscore_processor=args.pickscore_processor,
                aesthetic_model=args.aesthetic_model,
                aesthetic_head_path=args.aesthetic_head or None)


class TrainingScorer(ScoringThread):
    """--reward, read in a thread of its own while the GPU works (reward.ScoringThread); a failure
    gives NaN scores (GuardedScorer), which stop the run on every rank before it trains on them.
    One reward (a bare name) scores each image; a mix (qwen-vl=0.8 pickscore=0.2, or any
    --reward-aggregation gdpo) gives a column per component, and aggregate() makes them one."""

    def __init__(self, args, device, batch_size):
        self.weights = parse_mix(args.reward)
        self.aggregation = args.reward_aggregation
        self.group_size = args.group_size
        self.mix = args.reward not in JUDGES or args.reward_aggregation != "sum"
        options = {**scorer_options(args, device), "batch_size": batch_size}
        make = make_mix if self.mix else make_judge
        scorer = make(args.reward, **options)
        super().__init__(GuardedScorer(scorer))

    def aggregate(self, rewards):
        """The reward that the trainer's advantages normalise, (N,): one reward as it is, a mix's
        (N, K) by --reward-aggregation, Flow-Factory's sum or gdpo (reward.aggregate_rewards)."""
        if not self.mix:
            return rewards
        return aggregate_rewards(rewards, self.weights.values(), self.group_size, self.aggregation)


def training_scorer(args, device, batch_size):
    """--reward in a thread of its own (TrainingScorer)."""
    return TrainingScorer(args, device, batch_size)


def judge_tag(name):
    """A judge's TensorBoard tag: eval/<name>; PP-OCR's keeps the eval/reward_paddle of the runs
    that had it as their one judge."""
    return "eval/reward_paddle" if name == "paddle" else f"eval/{name}"


# ---- validation ------------------------------------------------------------------------------


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


class Validation:
    """The held-out prompts rendered by `adapter`, the one the trainer names (image i from seed
    eval_seed + i) at --eval-guidance, on the main process; the run's checkpoints record it, and
    evaluate.py scores it by default. The scorer and each --eval-judge (in a thread of its own)
    read each chunk of images while the next one samples. Logs the reward (a mix's weighted sum,
    and each component as eval/reward_<name>), each judge (judge_tag), a captioned grid, the
    transcriptions and the time it took, and appends every prompt's scores to EVAL_SCORES. A
    judge that is part of --reward is not scored again.
    A judge that fails (to load, or in a validation: its server died, its model raised) is a
    second opinion lost, not the run: one warning line names it and its error, the run goes on
    without it (no eval/<judge> from then on) and summary.json's failed_judges says why."""

    def __init__(self, pipe, eval_set, args, scorer, negative, run, adapter):
        self.pipe = pipe
        self.adapter = adapter
        run.validation_adapter = adapter  # checkpoints record it: evaluate.py's default --adapter
        self.args = args
        self.scorer = scorer
        self.negative = negative
        self.run = run
        self.prompts = [r["prompt"] for r in eval_set]
        self.targets = [r["target"] for r in eval_set]
        self.weights = parse_mix(args.reward)
        self.judges = []  # ScoringThreads of reward.GuardedJudges
        self.listed_judges = []  # as listed, failed ones too: the first is the summary's judge
        if run.main_process and args.eval_every:
            names = [name for name in judge_names(args.eval_judge) if name not in self.weights]
            judges = make_guarded_judges(names, **scorer_options(args, run.device))
            self.listed_judges = names
            self.judges = [ScoringThread(judge) for judge in judges]
            self.drop_failed_judges("loading the models")

    def due(self, iteration):
        """Whether this process validates after `iteration` iterations (0: before training)."""
        every = self.args.eval_every
        last = iteration == self.args.num_iterations
        return bool(self.run.main_process and every and (iteration % every == 0 or last))

    def __call__(self, iteration):
        """Validate; returns the summary's entry [iteration, reward mean, the first judge's mean or
        None], and {judge: mean} after them unless the judges are PP-OCR's alone (or none)."""
        args = self.args
        writer = self.run.writer
        started = time.perf_counter()
        self.run.phase = f"the validation after iteration {iteration}"
        embeds, pooled = encode_prompts(self.pipe, self.prompts, args.max_sequence_length)
        seeds = [args.eval_seed + i for i in range(len(self.prompts))]
        with use_adapter(self.pipe.transformer, self.adapter), self.run.autocast:
            samples = sample(self.pipe, embeds, pooled, seeds, args.eval_steps, args.eval_guidance,
                             args.resolution, args.resolution, args.forward_batch_size,
                             negative_embeds=self.negative[0], negative_pooled=self.negative[1],
                             progress=True, on_decoded=self.score_chunk)
        images = samples["images"]
        if bad := int((~samples["finite"]).sum()):
            self.run.warn("validation images were NaN or inf", self.run.phase,
                          f"{bad} of {len(images)} validation images are NaN or inf (a diverged "
                          f"{self.adapter} adapter?): they decode black and are scored as black "
                          "images")
        components, texts = self.scorer.take()
        scores = image_rewards(components, self.weights)
        writer.add_scalar("eval/reward_mean", float(np.mean(scores)), iteration)
        if np.ndim(components) == 2:
            for name, value in component_means(torch.as_tensor(components), self.weights).items():
                writer.add_scalar(f"eval/reward_{name}", value, iteration)
        captions = [f"{s:.2f} {t}" for s, t in zip(scores, self.targets)]
        transcriptions = [f"{t} -> {x!r}" for t, x in zip(self.targets, texts)]
        judged = {}  # {name: (scores, texts)}
        if self.judges:  # they add the wait for the part of them not hidden behind the sampling
            waited = time.perf_counter()
            judged = {judge.scorer.name: judge.take() for judge in self.judges}
            judged = {name: judged[name] for name in self.drop_failed_judges(self.run.phase)}
            writer.add_scalar("perf/eval_judge_wait_s", time.perf_counter() - waited, iteration)
            for name, (judge_scores, _) in judged.items():
                writer.add_scalar(judge_tag(name), float(np.mean(judge_scores)), iteration)
            notes = [", ".join(f"{name} {judge_scores[i]:.2f}"
                               for name, (judge_scores, _) in judged.items())
                     for i in range(len(scores))]
            captions = [f"{s:.2f} ({note}) {t}" for s, note, t in zip(scores, notes, self.targets)]
            for name, (_, judge_texts) in judged.items():
                if name in READERS:
                    transcriptions = [f"{line} ({name}: {x!r})"
                                      for line, x in zip(transcriptions, judge_texts)]
        self.save_scores(iteration, scores, judged)
        grid = captioned_grid(images[:16], captions[:16])
        writer.add_image("eval/images", grid, iteration, dataformats="HWC")
        writer.add_text("eval/transcriptions", "\n\n".join(transcriptions), iteration)
        writer.add_scalar("perf/eval_s", time.perf_counter() - started, iteration)
        self.run.phase = None
        means = {name: float(np.mean(judge_scores)) for name, (judge_scores, _) in judged.items()}
        first = self.listed_judges[0] if self.listed_judges else None
        entry = [iteration, float(np.mean(scores)), means.get(first)]
        return entry + [means] if means and self.listed_judges != ["paddle"] else entry

    def save_scores(self, iteration, scores, judged):
        """One line of EVAL_SCORES: every held-out prompt's reward and judge scores in the eval
        set's order, so that runs validated on the same prompts compare prompt by prompt."""
        line = {"iteration": iteration, "targets": list(self.targets),
                "reward": [float(s) for s in scores],
                "judges": {name: [float(s) for s in judge_scores]
                           for name, (judge_scores, _) in judged.items()}}
        with open(self.run.dir / EVAL_SCORES, "a") as file:
            file.write(json.dumps(line) + "\n")  # one write: a kill leaves at most a torn last line

    def drop_failed_judges(self, where):
        """Warn once of each judge that has failed, in one line, and score with it no more; returns
        the names of the judges that go on."""
        for judge in [judge for judge in self.judges if judge.failure]:
            judge.cancel()
            self.judges.remove(judge)
            self.run.failed_judges[judge.scorer.name] = judge.failure
            print(f"{where}: warning: {judge.failure}; the run goes on without it (summary.json: "
                  "failed_judges)", flush=True)
        return [judge.scorer.name for judge in self.judges]

    def score_chunk(self, rows, images):
        self.scorer.submit(images, self.targets[rows], self.prompts[rows])
        for judge in self.judges:
            judge.submit(images, self.targets[rows], self.prompts[rows])


def out_of_memory(error):
    """Whether an exception is a failed allocation: CUDA's, or the CPU allocator's (torch's or
    Python's)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def memory_in_use(device):
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return f"{(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use on {device}"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return f"{peak:.1f} GiB peak resident memory on the CPU"


def one_line_on_out_of_memory(device, phase, remedy, keep):
    """From now on, an allocation that fails ends the program with one line on stderr:
    `{script}: error: out of memory in {phase()} ({memory in use}): {remedy}; {keep(stopped_by)}`,
    keep saving what it can and saying what is kept. Any other exception keeps its traceback."""
    excepthook = sys.excepthook

    def hook(kind, error, trace):
        if not out_of_memory(error):
            return excepthook(kind, error, trace)
        traceback.clear_frames(trace)  # the failed step's tensors go
        stopped_by = f"out of memory in {phase()} ({memory_in_use(device)})"
        kept = keep(stopped_by)
        print(f"{Path(sys.argv[0]).name}: error: {stopped_by}: {remedy}; {kept}", file=sys.stderr,
              flush=True)
        if dist.is_initialized():
            os._exit(1)  # the other ranks wait in a collective: torchrun ends them

    sys.excepthook = hook


TRAINER_MEMORY_FLAGS = ("lower --forward-batch-size or --policy-timesteps-per-forward, or add "
                        "--gradient-checkpointing or move the text encoders with "
                        "--text-encoder-device")


# ---- the run ---------------------------------------------------------------------------------


class Run:
    """One start of a training run on this rank: the ranks and device, the run directory (locked by
    the main process), stop signals, the state that checkpoints hold, TensorBoard and the progress
    bar, the stop that every rank agrees on, checkpoints, summary.json and the exit status."""

    # the trainers' loading block: `with run.loading_errors_as_one_line():`
    loading_errors_as_one_line = staticmethod(loading_errors_as_one_line)

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
        self.device = actor_device(args.device, self.world_size)  # several ranks: joins their group
        self.check_same_settings()  # the first collective: before any could hang or mix settings
        cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if cuda else torch.float32
        self.autocast = torch.autocast("cuda", torch.bfloat16) if cuda else nullcontext()
        torch.manual_seed(args.seed)  # the LoRA init; rollouts and training seed their own noise
        self.writer = None
        self.tracking = None  # the W&B run of --track (main process)
        self.bar = None
        self.stop_signal = 0
        self.stopped_by = None
        self.state = None
        self.phase = "loading the models"  # None: an iteration's, told by its timer's laps
        self.iteration_timer = None
        self.steps_when_saved = None  # the optimizer steps of the last completed iteration
        self.nonfinite_before = 0  # rollout.nonfinite_images() when the iteration began
        self.warned = {}  # {what: (where it was first, how often)} (warn)
        self.reward_weights = parse_mix(args.reward)  # {name: weight}: one reward, or a mix
        self.failed_judges = {}  # {judge: why}, of this start (Validation)
        self.validation_adapter = None  # the adapter Validation samples: checkpoints record it
        one_line_on_out_of_memory(self.device, self.current_phase, TRAINER_MEMORY_FLAGS,
                                  self.keep_after_out_of_memory)

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
        self.prompt_sha256 = prompt_files_sha256(vars(args))  # as read: a later edit is refused
        self.train_set = train_set
        self.eval_set = eval_set
        check_model_path(args.model)
        scorers = scorers_of(args)
        if "qwen-vl" in scorers:
            check_reward_model(args.reward_model)
        check_judge_models(args, scorers)
        if args.dry_run:  # how run.sh checks a run before it starts a reward server
            print(f"dry run: arguments valid, {len(train_set)} train and {len(eval_set)} eval "
                  "prompts")
            sys.exit(0)
        return train_set, eval_set

    def start(self, transformer, optimizer, sampler, pipe):
        """The run's state: a new run's, or --resume-from's (adapters, optimizer and sampler
        restored too); opens TensorBoard on the main process."""
        args = self.args
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
            if args.track:
                self.tracking = start_tracking(args, self.dir, resumed=bool(state["iteration"]))
            self.writer = SummaryWriter(self.dir, purge_step=purge)
            table = "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items())
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
        self.steps_when_saved = state["optimizer_steps"]
        self.phase = None
        return state

    def iterations(self, state, compiler):
        """The iterations left (a progress bar on the main process); the compile workers are waited
        for before the first, and the compile cache saved after it."""
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
        """The state after `iterations` iterations (a resume from here draws what follows), and the
        scalars `logged` with the rewards' in TensorBoard and the progress bar."""
        self.state.update(iteration=iterations, sampler=sampler.state_dict())
        self.state["iteration_s"].append(logged["perf/iteration_s"])
        self.steps_when_saved = self.state["optimizer_steps"]
        self.iteration_timer = None
        if bad := nonfinite_images() - self.nonfinite_before:
            images = self.args.prompts_per_rank * self.args.group_size
            self.warn("rollout images were NaN or inf", f"iteration {iterations}",
                      f"{bad} of {images} rollout images are NaN or inf (a diverged policy?): they "
                      "decode black and are scored as black images")
        if not self.main_process:
            return
        logged = {**reward_stats(rewards, self.args.group_size, self.reward_weights), **logged}
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

    def agreed_stop(self, iterations, optimizer_step, scorer):
        """Whether every rank stops now: a signal to any rank, too many non-finite gradients in a
        row, or a failed scorer (a collective). Records the peak memory of every rank first."""
        peaks = actor_peak_memory(self.device, self.world_size)  # after validation: it may peak
        state_peaks = self.state["peak_mem_gib"]
        self.state["peak_mem_gib"] = {k: max(v, state_peaks.get(k, 0.0)) for k, v in peaks.items()}
        self.stop_signal, self.stopped_by = agreed_stop(
            self.signals.signum, optimizer_step.nonfinite_streak, self.args.max_nonfinite_steps,
            scorer.failure, self.device, self.world_size)  # the scorer may fail in validation
        if self.main_process:
            self.writer.add_scalar("perf/peak_mem_gib", max(peaks.values()), iterations)
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
        due = iterations % self.args.save_every == 0 or iterations == self.args.num_iterations
        if self.main_process and due:
            save_last_iteration(self.dir, self.state, self.transformer, self.optimizer,
                                self.args.keep_last)

    def keep_after_out_of_memory(self, stopped_by):
        """After a failed allocation: the last completed iteration is saved, unless the failed one
        had already stepped the optimizer (its checkpoint on disk stands then), and summary.json
        says what stopped the run. Returns what is kept, in words."""
        self.stopped_by = stopped_by
        state = self.state
        saved = None
        if self.main_process and state and state["iteration"]:
            if state["optimizer_steps"] == self.steps_when_saved:
                try:
                    saved = save_checkpoint(self.dir, state["iteration"], self.transformer,
                                            self.optimizer, state, self.args.keep_last)
                except RunError as save_error:
                    print(f"{Path(sys.argv[0]).name}: error: {save_error}", file=sys.stderr)
            self.write_summary()
        latest = saved or (checkpoints(self.dir)[-1:] or [None])[0]
        return f"the latest checkpoint is {latest}" if latest else "no checkpoint was saved"

    def current_phase(self):
        """Loading, a validation, or the rollout or training of the iteration under way."""
        if self.phase:
            return self.phase
        laps = self.iteration_timer.seconds if self.iteration_timer else {}
        part = "training" if "rollout_s" in laps else "rollout"
        return f"the {part} of iteration {self.state['iteration'] + 1}"

    def write_summary(self):
        # a signal after the last iteration cut nothing short; an error there (a diverged step) did
        done = self.state["iteration"] >= self.args.num_iterations
        stopped_by = None if self.stop_signal and done else self.stopped_by
        summary = summary_of_state(self.dir, self.state, stopped_by, self.device,
                                   self.failed_judges)
        self.writer.close()
        return summary

    def finish(self):
        """A stopped run keeps its last completed iteration; summary.json; exit with the status."""
        state = self.state
        rank = f"rank {self.rank}: " if self.world_size > 1 else ""
        for what, (first, count) in self.warned.items():
            print(f"{rank}warning: {what} {count} time(s), first in {first}", flush=True)
        if self.main_process and self.stopped_by and state["iteration"]:
            save_last_iteration(self.dir, state, self.transformer, self.optimizer,
                                self.args.keep_last, self.stopped_by)
        if self.main_process:
            print(json.dumps(self.write_summary(), indent=1))
            # the first line named the run directory, many progress lines ago
            print(f"run {self.dir}: summary.json, TensorBoard events and checkpoints", flush=True)
        exit_code = run_exit_code(self.stop_signal, self.stopped_by, state["iteration"], self.dir)
        if self.tracking:  # before os._exit below, which skips wandb's own exit hook
            self.tracking.finish(exit_code=exit_code)
        if self.world_size > 1:
            leave_process_group()
            os._exit(exit_code)  # skips the interpreter's teardown, where gloo's threads may abort
        if exit_code:
            sys.exit(exit_code)
