"""What crd.py and dgpo.py share outside their algorithms: the argument checks, the process group with its collectives
and the agreed stop, the run's exit status, the compile workers of a cold start, and validation (no loss, advantage,
EMA schedule or optimizer lives here).

    check_shared_args(args, check_algorithm_args, train_timestep_grid)  # each bad flag: one line and exit status 1
    device = actor_device(args.device, world_size)                        # joins the process group of several ranks
    precompile = start_precompile(args, compile_cache, device, world_size)  # a cold start compiles in workers
    state["eval"].append(validate(pipe, eval_set, args, ..., iteration))  # sample, score and log the held-out prompts
"""

import math
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from precompile import Precompile
from reward import SCORERS
from rollout import captioned_grid, encode_prompts, images_per_call, sample, use_adapter


# ---- argument checks -------------------------------------------------------------------------------------------------


def fail(message):
    """Exit with status 1 and one line, `{script}: error: {message}`, as argparse does."""
    sys.exit(f"{Path(sys.argv[0]).name}: error: {message}")


def check_numbers(args, bounds):
    """One line for a float flag that is not finite or not above ('>') or at least ('>=') its bound."""
    for flag, (op, bound) in bounds.items():
        value = getattr(args, flag)
        if not (math.isfinite(value) and (value > bound if op == ">" else value >= bound)):
            fail(f"--{flag.replace('_', '-')} {value:g}: must be a finite number {op} {bound:g}")


def check_shared_args(args, check_algorithm_args, train_timestep_grid):
    """The flags both trainers share, checked before anything loads; a trainer's own checks run at their place among
    them: `check_algorithm_args(args)`, then the trained timesteps against `train_timestep_grid(grid, args)`."""
    for flag, least in {"resolution": 16, "prompts_per_rank": 1, "lora_rank": 1, "lora_alpha": 1, "num_steps": 2,
                        "train_batch_size": 1, "save_every": 1, "num_iterations": 0, "eval_every": 0, "keep_last": 0,
                        "eval_steps": 1, "max_sequence_length": 1, "forward_batch_size": 0,
                        "policy_timesteps_per_forward": 1, "max_nonfinite_steps": 1, "reward_retries": 0, "seed": 0,
                        "eval_seed": 0}.items():
        if getattr(args, flag) < least:
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least {least}")
    check_numbers(args, {"learning_rate": (">", 0), "adam_eps": (">", 0), "weight_decay": (">=", 0),
                         "max_grad_norm": (">", 0), "adv_clip": (">", 0), "reward_timeout": (">", 0),
                         "eval_guidance": (">=", 1)})
    if not all(0 <= beta < 1 for beta in args.adam_betas):
        fail(f"--adam-betas {' '.join(f'{b:g}' for b in args.adam_betas)}: each must lie in [0, 1)")
    if args.seed >= 2**23:  # image seeds are seed * 2^40 + iteration * 2^20 + image, below 2^63
        fail(f"--seed {args.seed}: must be below 2^23 = {2**23}")
    if args.max_sequence_length > 512:
        fail(f"--max-sequence-length {args.max_sequence_length}: SD3's T5 encoder takes at most 512 tokens")
    if args.reward == "vllm" and not args.reward_urls:
        fail("--reward-urls: --reward vllm needs at least one server URL")
    if args.eval_every and args.eval_prompts < 1:
        fail(f"--eval-prompts {args.eval_prompts}: validation needs a prompt (--eval-every 0 turns validation off)")
    if args.overwrite and args.resume_from:
        fail("--overwrite with --resume-from: a resume continues the run, it never replaces it")
    if args.group_size < 2:
        fail(f"--group-size {args.group_size}: centering needs at least 2 images per prompt")
    if args.train_batch_size % args.group_size or (args.prompts_per_rank * args.group_size) % args.train_batch_size:
        fail(f"--train-batch-size {args.train_batch_size} must be a multiple of --group-size {args.group_size} that "
             f"divides the {args.prompts_per_rank * args.group_size} images per rank: whole prompt groups per micro batch")
    if args.resolution % 16:
        fail(f"--resolution {args.resolution} is not a multiple of 16 (VAE factor 8 x patch size 2)")
    check_algorithm_args(args)
    trainable = len(train_timestep_grid(range(args.num_steps), args))
    if not 1 <= args.num_train_timesteps <= trainable:
        fail(f"--num-train-timesteps {args.num_train_timesteps} must lie in [1, {trainable}]: the trained steps of the "
             f"{args.num_steps}-step rollout grid")
    if args.reward not in SCORERS:
        fail(f"--reward {args.reward}: choose one of {', '.join(SCORERS)}")
    check_devices(args, "the trainers run")


def check_devices(args, runs_on):
    """--device, --reward-device and --text-encoder-device (empty: the actor's) name a cpu or cuda device this machine
    has; `runs_on` says who in the error, e.g. "evaluate.py runs"."""
    for flag in ("device", "reward_device", "text_encoder_device"):
        name = getattr(args, flag)
        try:
            index = torch.device(name).index if name else None
        except RuntimeError:
            fail(f"--{flag.replace('_', '-')} {name}: not a torch device (cpu, cuda, cuda:1, ...)")
        if name and torch.device(name).type not in ("cpu", "cuda"):
            fail(f"--{flag.replace('_', '-')} {name}: {runs_on} on cpu or cuda devices")
        if name.startswith("cuda") and (index or 0) >= torch.cuda.device_count():
            fail(f"--{flag.replace('_', '-')} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")


# ---- ranks -----------------------------------------------------------------------------------------------------------


def actor_device(name, world_size):
    """This rank's device from --device; with several ranks (torchrun), it first joins their process group, and a CUDA
    rank takes cuda:LOCAL_RANK."""
    device = torch.device(name)
    if world_size > 1:
        # ranks wait for rank 0's validation, and for each other's first compile: minutes, past the 10-minute default
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=60))
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
    elif device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # named "cuda:0" in summary.json
    return device


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
    """(signal number or 0, what stopped the run or None), the same on every rank: a signal to any rank, too many
    consecutive non-finite gradients, or a failed scorer stops every rank (a collective: every rank calls it)."""
    stop = torch.tensor([signum or 0, nonfinite_streak >= max_nonfinite_steps, bool(scorer_failure)], device=device)
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
    """The run's exit status: 128 + the signal that stopped it (the shell's convention for a process ended by that
    signal); 1 for any other stop (non-finite gradients, a failed scorer), said in one line on stderr; else 0."""
    if stop_signal:
        return 128 + stop_signal
    if stopped_by:
        print(f"{Path(sys.argv[0]).name}: error: {stopped_by}: stopped after iteration {iterations_done} (the latest "
              f"checkpoint is in {run_dir})", file=sys.stderr)
        return 1
    return 0


def leave_process_group():
    """Tear the process group down in step with the other ranks and flush this rank's output: a distributed trainer
    then ends in os._exit, as gloo's threads now and then abort the interpreter's teardown ("terminate called without
    an active exception")."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


# ---- compiling -------------------------------------------------------------------------------------------------------


def start_precompile(args, compile_cache, device, world_size):
    """A cold start of one rank compiles in worker processes (precompile.py) while the models load and the first
    validation runs eagerly: the first compiled call of each graph family as the first iteration makes it. Several
    ranks, a compile cache to load, or no validation to hide them behind (the first iteration would wait longer for
    the workers than it takes to compile alone): no workers."""
    if not compile_cache.cold or world_size > 1 or not args.eval_every:
        return Precompile([])
    B, T, b, most = args.prompts_per_rank * args.group_size, args.num_train_timesteps, args.train_batch_size, \
        args.forward_batch_size
    rollout_images = images_per_call(B, most)
    base_rows = images_per_call(B * T, most, args.kl_cfg) * (2 if args.kl_cfg > 1 else 1)  # CFG: two rows an image
    passes = [{"adapter": "sampling", "grad": False, "rows": rollout_images},
              {"adapter": None, "grad": False, "rows": base_rows},
              {"adapter": "policy", "grad": True, "rows": min(b * args.policy_timesteps_per_forward, T * b)},
              {"decode": min(rollout_images, 8)}]  # decode_latents' chunks
    return Precompile(passes, args.model, device, torch.bfloat16, (args.lora_rank, args.lora_alpha),
                      args.gradient_checkpointing, args.resolution, 77 + args.max_sequence_length)


# ---- scoring and validation ------------------------------------------------------------------------------------------


def timed(fn, *args):
    """fn(*args) and the seconds it took."""
    started = time.perf_counter()
    return fn(*args), time.perf_counter() - started


def collect(futures):
    """Scores (N,) and the N transcriptions from the futures of a scorer's chunks, in order."""
    chunks = [future.result() for future in futures]
    return np.concatenate([chunk[0] for chunk in chunks]), [text for chunk in chunks for text in chunk[1]]


def validate(pipe, eval_set, args, scorer, judge, scoring, judging, negative, autocast, writer, iteration):
    """Validation at `iteration`: the sampling adapter renders every prompt of eval_set (image i from seed
    eval_seed + i) at --eval-guidance; scorer (and judge, if any) read each chunk of images in their executors
    (scoring, judging) while the next one samples. Logs the rewards, a captioned grid, the transcriptions and the time
    it took; returns the summary's entry [iteration, reward mean, judge mean or None]."""
    started = time.perf_counter()
    prompts, targets = [r["prompt"] for r in eval_set], [r["target"] for r in eval_set]
    embeds, pooled = encode_prompts(pipe, prompts, args.max_sequence_length)
    scored, judged = [], []  # futures of (scores, texts)

    def score_chunk(rows, chunk):  # the scorers read each chunk of images while the next one samples
        scored.append(scoring.submit(scorer, chunk, targets[rows]))
        if judge:
            judged.append(judging.submit(judge, chunk, targets[rows]))

    with use_adapter(pipe.transformer, "sampling"), autocast:
        images = sample(pipe, embeds, pooled, [args.eval_seed + i for i in range(len(prompts))], args.eval_steps,
                        args.eval_guidance, args.resolution, args.resolution, args.forward_batch_size,
                        negative_embeds=negative[0], negative_pooled=negative[1], progress=True,
                        on_decoded=score_chunk)["images"]  # (N, H, W, 3) uint8
    scores, texts = collect(scored)
    writer.add_scalar("eval/reward_mean", float(np.mean(scores)), iteration)
    captions = [f"{s:.2f} {t}" for s, t in zip(scores, targets)]
    transcriptions = [f"{t} -> {x!r}" for t, x in zip(targets, texts)]
    judge_mean = None
    if judge:  # what the judge adds to a validation: the wait for the part of it not hidden behind the sampling
        waited = time.perf_counter()
        judge_scores, judge_texts = collect(judged)
        writer.add_scalar("perf/eval_judge_wait_s", time.perf_counter() - waited, iteration)
        judge_mean = float(np.mean(judge_scores))
        writer.add_scalar(f"eval/reward_{args.eval_judge}", judge_mean, iteration)
        captions = [f"{s:.2f} ({args.eval_judge} {j:.2f}) {t}" for s, j, t in zip(scores, judge_scores, targets)]
        transcriptions = [f"{line} ({args.eval_judge}: {x!r})" for line, x in zip(transcriptions, judge_texts)]
    writer.add_image("eval/images", captioned_grid(images[:16], captions[:16]), iteration, dataformats="HWC")
    writer.add_text("eval/transcriptions", "\n\n".join(transcriptions), iteration)
    writer.add_scalar("perf/eval_s", time.perf_counter() - started, iteration)
    return [iteration, float(np.mean(scores)), judge_mean]
