"""CRD: Centered Reward Distillation for text rendering with Stable Diffusion 3.5 Medium and LoRA.

CRD (Zhu et al., arXiv 2603.14128) trains a diffusion model toward the KL-regularised optimum
p_ref(x|c) exp(r(x,c)/beta) / Z(c) by regressing the model's implicit reward, a likelihood ratio read off
flow-matching errors, onto the task reward. How it differs from GRPO/DDPO-style diffusion RL:
1. Rollouts are a deterministic 10-step ODE; no per-step log-probabilities: the log-ratio against an "old"
   snapshot is estimated from denoising errors at re-noised timesteps.
2. Within-prompt centering: implicit and task rewards are both centred over the images of one prompt, which
   cancels the intractable log Z(c) exactly; the loss is their squared mismatch.
3. The sampler ("sampling" EMA adapter) is decoupled from the ratio reference ("old" EMA adapter), each with
   its own decay schedule, against ratio-signal collapse.
4. A KL anchor to the CFG-guided base model, with a per-sample strength that grows with the advantage.

    python crd.py --group-size 6        # the recipe: SD3.5-M + LoRA, Qwen2.5-VL-3B OCR reward
    bash run.sh crd                     # the recipe with its GPU layout (README)
    tensorboard --logdir runs
"""

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import tyro
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from checkpoint import (GracefulStop, RunError, actor_peak_memory, other_gpus_memory, prepare_run, prompt_files_sha256,
                        save_last_iteration, start_state, write_summary)
from common import (actor_device, agreed_stop, all_mean_, check_numbers, check_shared_args, fail, gather,
                    leave_process_group, run_exit_code, start_precompile, timed, validate)
from data import DataError, GroupSampler, load_train_and_eval_prompts
from reward import GuardedScorer, check_reward_model, make_scorer
from rollout import (CompileCache, add_lora_adapters, check_model_path, compile_blocks, compile_decoder, ema_update_,
                     encode_prompts, load_pipeline, lora_parameters, negative_embeddings, predict_velocity,
                     resolution_error, sample, use_adapter, warn_cut_targets)


@dataclass
class Args:
    """Train SD3.5 with LoRA by reinforcement learning on the OCR text-rendering task."""

    # Experiment
    exp_name: str = Path(__file__).stem
    """name of this experiment: the prefix of the run directory"""
    seed: int = 42
    """seed of the prompt order, rollout noise and training noise"""
    output_dir: str = "runs"
    """runs are written to {output_dir}/{run_name}/"""
    run_name: str = ""
    """run directory name; empty: {exp_name}__{reward}__{seed}__{unix time}"""
    overwrite: bool = False
    """replace the run already in the run directory (else a directory holding a run is refused, unless resumed)"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """actor device; under torchrun each rank takes cuda:LOCAL_RANK"""
    dry_run: bool = False
    """check the arguments, the prompt files and a local --model directory, then exit without loading any model"""

    # Model, data and rollout
    model: str = "stabilityai/stable-diffusion-3.5-medium"
    """hub id or local directory of SD3.5, `tiny` (random tiny SD3, CPU demo) or `random-sd3.5-medium` (random full-size)"""
    train_data: str = "data/ocr/train.jsonl"
    """training prompts (.jsonl from data.py, or Flow-GRPO's raw .txt)"""
    eval_data: str = "data/ocr/test.jsonl"
    """held-out validation prompts"""
    resolution: int = 512
    """image height and width in pixels (multiple of 16)"""
    prompts_per_rank: int = 4
    """prompts per iteration on each actor GPU"""
    group_size: int = 6
    """images per prompt: the group that advantages and centering run over"""
    num_steps: int = 10
    """rollout ODE steps (CFG 1, the sampling adapter)"""
    max_sequence_length: int = 256
    """T5 prompt tokens"""
    text_encoder_device: str = ""
    """device of the CLIP and T5 text encoders; empty: the actor device. A reward GPU takes their 10 GiB off the actor"""
    lora_rank: int = 32
    """LoRA rank"""
    lora_alpha: int = 64
    """LoRA alpha"""
    forward_batch_size: int = 48
    """most images in one no-grad transformer forward (rollout, validation, old and reference passes; 0: all)"""
    policy_timesteps_per_forward: int = 3
    """timesteps of a micro batch in one policy forward and backward (more: faster, more memory)"""
    gradient_checkpointing: bool = False
    """recompute each block's activations in the policy backward: the recipe fits 40 GiB (30, not 52), 16% slower"""
    compile: bool = True
    """torch.compile the transformer blocks on CUDA: 2x faster forwards after 3-4 minutes of compiling (CPU: eager)"""

    # Reward
    reward: str = "qwen-vl"
    """scorer: qwen-vl (in process), vllm (OpenAI server), paddle (PP-OCR), brightness or compressibility (cheap checks)"""
    reward_model: str = "Qwen/Qwen2.5-VL-3B-Instruct"
    """hub id or local directory of the OCR model (qwen-vl, vllm)"""
    reward_device: str = ""
    """device of the in-process reward model; empty: the actor device"""
    reward_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """base URLs of `vllm serve` reward servers (reward vllm)"""
    reward_timeout: float = 60.0
    """seconds a reward server may take to answer one request: the check at start, or one image (reward vllm)"""
    reward_retries: int = 3
    """attempts after the first for an image whose request failed or timed out, with backoff (reward vllm)"""

    # Optimisation
    num_iterations: int = 100
    """training iterations (rollout, score, update)"""
    train_batch_size: int = 0
    """images per optimizer step, a multiple of group_size (0: one prompt group per step)"""
    num_train_timesteps: int = 9
    """timesteps trained per image and step, drawn from the rollout grid without its last step"""
    learning_rate: float = 3e-4
    """AdamW learning rate (constant)"""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    adam_eps: float = 1e-8
    """AdamW epsilon"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    max_nonfinite_steps: int = 3
    """stop (with a checkpoint) after this many consecutive non-finite gradients; each one skips its step"""
    global_std: bool = True
    """normalise advantages by the std over all images of the iteration (else per group)"""
    adv_clip: float = 5.0
    """advantages are clipped to [-adv_clip, adv_clip]"""

    # Validation, logging and checkpoints
    eval_every: int = 10
    """validate before training and every N iterations (0: never)"""
    eval_prompts: int = 32
    """held-out prompts validated (the first N of eval_data)"""
    eval_steps: int = 40
    """validation ODE steps"""
    eval_guidance: float = 4.5
    """validation CFG scale (negative prompt ""): the recipe's 4.5. The anchors validate their CFG-free policies at 1
    (Flow-Factory examples/crd/lora/sd3_5/default.yaml:109; DGPO scripts/train_sd3_dgpo.py:427 with
    config/dgpo_wocfg.py:101); 4.5 guides a policy that learned guidance a second time"""
    eval_seed: int = 0
    """image i of validation always uses seed eval_seed + i"""
    eval_judge: Literal["paddle", "brightness", "compressibility", "none"] = "paddle"
    """a second scorer of the validation images on the CPU, beside --reward (which the policy learns to please):
    paddle (PP-OCR, logged as eval/reward_paddle), a cheap check, or none; skipped when it is --reward"""
    save_every: int = 10
    """checkpoint every N iterations and at the end"""
    keep_last: int = 2
    """latest checkpoints kept (0: keep all)"""
    resume_from: str = ""
    """continue a run from its runs/.../global_step_N directory; settings that define the run must stay the same"""

    # Algorithm: CRD
    crd_beta: float = 1.0
    """beta of the implicit reward beta * log(p_theta / p_old)"""
    kl_beta: float = 0.1
    """KL weight to the CFG-guided base model of an image with the highest advantage"""
    kl_floor: float = 1e-4
    """KL weight of an image with the lowest advantage"""
    kl_cfg: float = 4.5
    """CFG scale of the base model in the KL anchor"""
    shared_group_noise: bool = False
    """use one training noise per group and timestep (else one per image)"""
    # Flow-Factory's OCR example (examples/crd/lora/sd3_5/default.yaml:55-56, 85): README "EMA snapshots"
    old_decay: tuple[float, float, float, float] = (0, 0.25, 0.005, 0.999)
    """EMA of the old adapter after each iteration: (start k, initial decay, slope per k, max decay);
    k counts 2 per iteration (see --ema-counts-optimizer-steps)"""
    sampling_decay: tuple[float, float, float, float] = (75, 0.0, 0.0075, 0.999)
    """EMA of the sampling adapter after each iteration, as --old-decay (initial decay 0: a copy of the policy)"""
    ema_counts_optimizer_steps: bool = False
    """k of both EMA schedules counts the optimizer steps taken (4 per iteration in the recipe), as in a port that
    counts steps; default: the paper's 2 optimizer steps per rollout round, which the constants were calibrated for,
    so k = 2 x iterations done for any --train-batch-size and world size"""


# ALGO LOGIC: the loss of one training timestep
def crd_loss(v_theta, v_old, v_ref, target, advantages, group_size, adv_clip=5.0, beta=1.0, kl_beta=0.1, kl_floor=1e-4):
    """CRD loss for whole prompt groups at one timestep (SPEC §4).

    v_theta (B,C,H,W) policy velocity (with grad); v_old, v_ref (B,C,H,W) old adapter and CFG-guided base velocities;
    target (B,C,H,W) flow-matching velocity noise - x0; advantages (B,) clipped; groups are contiguous.
        r_i  = mean[-(v_theta - u)^2 / w_theta + (v_old - u)^2 / w_old],  w = max(mean|v - u|, 1e-5)  (w_theta detached)
        L    = (c / beta) mean_i (beta (r_i - sg(mean_g r)) - (a_i - mean_g a))^2 + mean_i coef_i mean (v_theta - v_ref)^2
    with a = clip(A)/(2c) + 1/2 in [0, 1] and coef_i = kl_floor + a_i (kl_beta - kl_floor).
    """
    dims = tuple(range(1, v_theta.ndim))
    error, old_error = v_theta.float() - target.float(), v_old.float() - target.float()
    weight = error.abs().mean(dims, keepdim=True).clamp_min(1e-5).detach()
    old_weight = old_error.abs().mean(dims, keepdim=True).clamp_min(1e-5)
    implicit_reward = (-error.square() / weight + old_error.square() / old_weight).mean(dims)  # (B,)
    scaled_adv = advantages.float().clamp(-adv_clip, adv_clip) / (2 * adv_clip) + 0.5  # (B,) in [0, 1]
    groups_r, groups_a = implicit_reward.view(-1, group_size), scaled_adv.view(-1, group_size)
    centred_r = groups_r - groups_r.mean(1, keepdim=True).detach()
    centred_a = groups_a - groups_a.mean(1, keepdim=True)
    policy_loss = (adv_clip / beta) * (beta * centred_r - centred_a).square().mean()
    kl = (v_theta.float() - v_ref.float()).square().mean(dims)  # (B,)
    kl_loss = ((kl_floor + scaled_adv * (kl_beta - kl_floor)) * kl).mean()
    info = {"policy_loss": policy_loss, "kl_loss": kl_loss, "kl": kl.mean(), "implicit_reward_std": centred_r.std()}
    return policy_loss + kl_loss, {k: v.detach() for k, v in info.items()}


def ema_decay(step, start, initial, slope, maximum):
    """decay(step) = initial before `start`, then initial + slope * (step - start), capped at `maximum`
    (Flow-Factory's compute_decay, src/flow_factory/trainers/crd.py:100-102)."""
    return initial if step < start else min(initial + slope * (step - start), maximum)


SNAPSHOT_EVENT = "iteration"  # the old adapter stays fixed through an iteration: no old pass waits for the reward


def update_snapshots(transformer, args, event, iterations, steps):
    """CRD: after every iteration, the old and sampling adapters move toward the policy by their own schedules at
    k = 2 x iterations done (Flow-Factory's step count after 2 steps per round) or the optimizer steps taken."""
    if event != SNAPSHOT_EVENT:
        return {}
    k = steps if args.ema_counts_optimizer_steps else 2 * iterations
    decays = {"old": ema_decay(k, *args.old_decay), "sampling": ema_decay(k, *args.sampling_decay)}
    for name, decay in decays.items():
        ema_update_(transformer, name, "policy", decay)
    return decays


def check_algorithm_args(args):
    """A CRD setting out of its range, or an EMA schedule whose decay could leave [0, 1], is named before anything
    loads."""
    check_numbers(args, {"crd_beta": (">", 0), "kl_beta": (">=", 0), "kl_floor": (">=", 0), "kl_cfg": (">=", 1)})
    if args.kl_floor > args.kl_beta:
        fail(f"--kl-floor {args.kl_floor:g}: must not exceed --kl-beta {args.kl_beta:g} (the KL weight of an image rises "
             "from floor to beta with its advantage)")
    for flag in ("old_decay", "sampling_decay"):
        _, initial, slope, maximum = getattr(args, flag)  # any start k is fine
        if slope < 0 or not (0 <= initial <= 1 and 0 <= maximum <= 1):
            fail(f"--{flag.replace('_', '-')} {' '.join(f'{v:g}' for v in getattr(args, flag))}: needs an initial "
                 "decay in [0, 1], a slope >= 0 and a max decay in [0, 1]")


def train_timestep_grid(grid, args):
    """The steps of the rollout grid that training draws from: all but the last, near-zero one."""
    return grid[:-1]


def group_advantages(rewards, group_size, global_std=True, clip=5.0):
    """A_i = (r_i - mean_group r) / (std + 1e-4), clipped to +-clip; std over every reward given, or per group."""
    groups = rewards.view(-1, group_size)
    std = rewards.std(unbiased=False) if global_std else groups.std(1, unbiased=False, keepdim=True)
    return ((groups - groups.mean(1, keepdim=True)) / (std + 1e-4)).clamp(-clip, clip).flatten()


def micro_batch_rows(per_image, micro_batch):
    """(T, B, ...) -> (B*T, ...): micro batches of T * micro_batch rows, each timestep-major, so that row
    (m*T + k) * micro_batch + j holds image m * micro_batch + j at its k-th timestep."""
    return per_image.unflatten(1, (-1, micro_batch)).transpose(0, 1).flatten(0, 2)


def check_args(args):
    """Every flag before anything loads, each bad one as one line: the flags both trainers share (common.py), with
    this algorithm's checks and its trained timesteps at their place among them."""
    check_shared_args(args, check_algorithm_args, train_timestep_grid)


if __name__ == "__main__":
    args = tyro.cli(Args)
    args.train_batch_size = args.train_batch_size or args.group_size
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    check_args(args)
    try:
        run_dir, run_lock = prepare_run(args, Path(__file__).stem, world_size, rank == 0)  # locked until exit
    except RunError as error:
        fail(error)
    signals = GracefulStop()  # before the models load, on every rank: a signal then stops after the first iteration
    device = actor_device(args.device, world_size)  # several ranks: it joins their process group
    main_process = rank == 0
    torch.manual_seed(args.seed)  # the LoRA init; rollout and training noise have their own seeded generators
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else nullcontext()
    G, B, T = args.group_size, args.prompts_per_rank * args.group_size, args.num_train_timesteps

    try:
        train_set, eval_set = load_train_and_eval_prompts(args, world_size, verbose=main_process)
        prompt_sha256 = prompt_files_sha256(vars(args))  # as just read: a later edit is refused at resume
        sampler = GroupSampler(len(train_set), args.prompts_per_rank, G, args.seed, rank, world_size)
        check_model_path(args.model)
        if args.reward == "qwen-vl":
            check_reward_model(args.reward_model)
        if args.dry_run:  # how run.sh checks a run before it starts a reward server
            print(f"dry run: arguments valid, {len(train_set)} train and {len(eval_set)} eval prompts")
            sys.exit(0)
        compile_cache = CompileCache(args.model, device, enabled=args.compile and device.type == "cuda")
        precompile = start_precompile(args, compile_cache, device, world_size)  # workers, beside model loading
        # the scorer before the pipeline: a reward server is checked before minutes of model loading
        scorer = GuardedScorer(make_scorer(args.reward, device=args.reward_device or str(device), urls=args.reward_urls,
                                           model_path=args.reward_model, batch_size=B, timeout=args.reward_timeout,
                                           max_retries=args.reward_retries))  # a failure: NaN scores, see below
        pipe = load_pipeline(args.model, device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                             text_encoder_device=args.text_encoder_device or None)
        if error := resolution_error(pipe, args.resolution):
            fail(error)
        judge = None
        if main_process and args.eval_every and args.eval_judge not in ("none", args.reward):
            judge = make_scorer(args.eval_judge)
    except (DataError, OSError, RuntimeError) as error:
        fail(error)
    scoring = ThreadPoolExecutor(1)  # one worker: scorer calls (training and validation) never overlap each other
    judging = ThreadPoolExecutor(1)  # the CPU judge reads validation images beside the scorer
    transformer = pipe.transformer
    add_lora_adapters(transformer, args.lora_rank, args.lora_alpha)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if compile_cache.enabled:
        compile_blocks(transformer)
        compile_decoder(pipe.vae)
    params = lora_parameters(transformer, "policy")
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=args.adam_betas, weight_decay=args.weight_decay,
                                  eps=args.adam_eps)
    negative = negative_embeddings(pipe, args.max_sequence_length)

    # TRY NOT TO MODIFY: run directory, resume, logging
    try:
        state = start_state(args, transformer, optimizer, sampler, device, world_size, Path(__file__).stem,
                            prompt_sha256)
    except RunError as error:
        fail(error)
    writer = None
    if main_process:
        writer = SummaryWriter(run_dir, purge_step=state["iteration"] + 1 if state["iteration"] else None)
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))
        print(f"run {run_dir}: {world_size} rank(s) x {args.prompts_per_rank} prompts x {G} images = {world_size * B} "
              f"images per iteration, {B // args.train_batch_size} optimizer step(s) per rank, T={T}; "
              f"{len(train_set)} train prompts, {len(eval_set)} eval prompts")
        warn_cut_targets(train_set + eval_set, pipe, args.max_sequence_length)

    if main_process and args.eval_every and not state["eval"]:
        with precompile.eager():  # while the workers compile
            state["eval"].append(validate(pipe, eval_set, args, scorer, judge, scoring, judging, negative, autocast,
                                          writer, 0))
    precompile.wait()
    nonfinite_streak, stop_signal, stopped_by = 0, 0, None
    iterations = tqdm(range(state["iteration"], args.num_iterations), initial=state["iteration"],
                      total=args.num_iterations, disable=not main_process, desc="iterations")
    for iteration in iterations:
        # ROLLOUT: whole prompt groups with the sampling adapter, deterministic ODE, CFG 1
        timer, perf = time.perf_counter(), {}
        indices = sampler.next_indices()
        prompts, targets = [train_set[i]["prompt"] for i in indices], [train_set[i]["target"] for i in indices]
        embeds, pooled = encode_prompts(pipe, prompts, args.max_sequence_length)  # (B,333,4096), (B,2048)
        seeds = [(args.seed << 40) + (iteration << 20) + rank * B + j for j in range(B)]
        with use_adapter(transformer, "sampling"), autocast:
            rollout = sample(pipe, embeds, pooled, seeds, args.num_steps, 1.0, args.resolution, args.resolution,
                             args.forward_batch_size)
        perf["rollout_s"], timer = time.perf_counter() - timer, time.perf_counter()
        pending_scores = scoring.submit(timed, scorer, rollout["images"], targets)  # beside the passes below

        # ALGO LOGIC: one optimizer step per micro batch of whole groups. Each group trains on T timesteps of the rollout
        # grid in random order; its timesteps and noise are seeded by its global index, so any world size agrees.
        x0 = rollout["latents"].to(device)  # (B,C,h,w) float32
        grid = train_timestep_grid(rollout["timesteps"], args).to(device)  # (trainable steps,)
        generator, b, timesteps, noise = torch.Generator(device), args.train_batch_size, [], []
        for first in range(0, B, G):
            generator.manual_seed((args.seed << 40) + (iteration << 20) + rank * B + first)
            timesteps.append(grid[torch.randperm(len(grid), generator=generator, device=device)[:T]])  # (T,)
            shape = (T, 1 if args.shared_group_noise else G, *x0.shape[1:])
            noise.append(torch.randn(shape, generator=generator, device=device).expand(T, G, *x0.shape[1:]))
        timesteps = micro_batch_rows(torch.stack(timesteps, 1).repeat_interleave(G, 1), b)  # (B*T,)
        noise = micro_batch_rows(torch.cat(noise, 1), b)  # (B*T,C,h,w)
        image = micro_batch_rows(torch.arange(B, device=device).expand(T, B), b)  # (B*T,) the image of each row
        sigma = (timesteps / 1000).view(-1, 1, 1, 1)
        noisy, velocity_target = (1 - sigma) * x0[image] + sigma * noise, noise - x0[image]  # (B*T,C,h,w)
        # What needs no reward runs while the scorer reads: the base model's passes, and the old adapter's until it moves
        early = (B // b if SNAPSHOT_EVENT == "iteration" else 1) * T * b
        with torch.no_grad(), autocast:
            with use_adapter(transformer, None):
                v_ref = predict_velocity(transformer, noisy, timesteps, embeds[image], pooled[image], args.kl_cfg,
                                         *negative, max_batch_size=args.forward_batch_size, wait_each_chunk=True)
            with use_adapter(transformer, "old"):
                v_old = list(predict_velocity(transformer, noisy[:early], timesteps[:early], embeds[image[:early]],
                                              pooled[image[:early]], max_batch_size=args.forward_batch_size,
                                              wait_each_chunk=True).split(T * b))  # [(T*b,C,h,w)] * micro batches
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # from here on, training waits
        waiting = time.perf_counter()
        (scores, _), perf["reward_s"] = pending_scores.result()
        rewards = gather(torch.as_tensor(scores, dtype=torch.float32, device=device), world_size)  # (world * B,)
        if rewards.isnan().any():  # a scorer failed, on any rank: every rank stops before training on this iteration
            stopped_by = scorer.failure or "the reward failed on another rank"
            break
        advantages = group_advantages(rewards, G, args.global_std, args.adv_clip)[rank * B : (rank + 1) * B]
        perf["reward_wait_s"] = time.perf_counter() - waiting
        losses, decays, grad_norms, skipped_steps = {}, {}, [], 0
        for m in range(B // b):
            rows = slice(m * T * b, (m + 1) * T * b)
            mb_noisy, mb_timesteps, mb_target, mb_ref = noisy[rows], timesteps[rows], velocity_target[rows], v_ref[rows]
            mb_embeds, mb_pooled, mb_adv = embeds[image[rows]], pooled[image[rows]], advantages[image[rows]]  # (T*b,...)
            if m == len(v_old):  # the old adapter moved after the last optimizer step
                with torch.no_grad(), autocast, use_adapter(transformer, "old"):
                    v_old.append(predict_velocity(transformer, mb_noisy, mb_timesteps, mb_embeds, mb_pooled,
                                                  max_batch_size=args.forward_batch_size))
            per_forward = b * args.policy_timesteps_per_forward
            for chunk in (slice(i, i + per_forward) for i in range(0, T * b, per_forward)):
                with use_adapter(transformer, "policy"), autocast:
                    v_theta = predict_velocity(transformer, mb_noisy[chunk], mb_timesteps[chunk], mb_embeds[chunk],
                                               mb_pooled[chunk])
                loss, info = crd_loss(v_theta, v_old[m][chunk], mb_ref[chunk], mb_target[chunk], mb_adv[chunk], G,
                                      args.adv_clip, args.crd_beta, args.kl_beta, args.kl_floor)
                share = len(v_theta) / (T * b)  # the loss is the mean over the T timesteps
                (loss * share).backward()
                for key, value in {"loss": loss.detach(), **info}.items():
                    losses[key] = losses.get(key, 0.0) + value * share
            all_mean_([p.grad for p in params], world_size)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            if torch.isfinite(grad_norm):
                optimizer.step()
                state["optimizer_steps"] += 1
                nonfinite_streak = 0
                decays.update(update_snapshots(transformer, args, "optimizer_step", iteration + 1, state["optimizer_steps"]))
            else:  # a skipped step moves no snapshot
                nonfinite_streak, skipped_steps = nonfinite_streak + 1, skipped_steps + 1
                print(f"iteration {iteration + 1}: non-finite gradient, optimizer step skipped", flush=True)
            optimizer.zero_grad(set_to_none=True)
            grad_norms.append(grad_norm)
        if skipped_steps < B // b:  # nor does an iteration whose every step was skipped
            decays.update(update_snapshots(transformer, args, "iteration", iteration + 1, state["optimizer_steps"]))
        all_mean_(list(losses.values()), world_size)  # log the losses of every rank's groups
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        perf["train_s"] = time.perf_counter() - timer - perf["reward_wait_s"]
        perf["iteration_s"] = perf["rollout_s"] + perf["reward_wait_s"] + perf["train_s"]
        perf["images_per_s"] = world_size * B / perf["iteration_s"]
        state.update(iteration=iteration + 1, sampler=sampler.state_dict())  # a resume from here draws what follows
        state["iteration_s"].append(perf["iteration_s"])

        # TRY NOT TO MODIFY: logging, validation, checkpoints
        steps_per_iteration = B // args.train_batch_size
        if main_process:
            groups = rewards.view(-1, G)
            logged = {"train/reward_mean": rewards.mean(), "train/reward_std": rewards.std(unbiased=False),
                      "train/zero_std_group_frac": (groups.std(1) == 0).float().mean(),
                      "charts/lr": optimizer.param_groups[0]["lr"],
                      "charts/grad_norm": torch.stack(grad_norms).mean(), "charts/skipped_steps": skipped_steps,
                      **{f"losses/{k}": v / steps_per_iteration for k, v in losses.items()},
                      **{f"charts/decay_{k}": v for k, v in decays.items()}, **{f"perf/{k}": v for k, v in perf.items()}}
            for tag, value in logged.items():
                writer.add_scalar(tag, float(value), iteration + 1)
            iterations.set_postfix(reward=f"{float(rewards.mean()):.3f}", loss=f"{float(logged['losses/loss']):.4f}",
                                   s=f"{perf['iteration_s']:.1f}")
            if args.eval_every and ((iteration + 1) % args.eval_every == 0 or iteration + 1 == args.num_iterations):
                state["eval"].append(validate(pipe, eval_set, args, scorer, judge, scoring, judging, negative, autocast,
                                              writer, iteration + 1))
        peaks = actor_peak_memory(device, world_size)  # after validation: it may be the peak
        state["peak_mem_gib"] = {k: max(v, state["peak_mem_gib"].get(k, 0.0)) for k, v in peaks.items()}
        stop_signal, stopped_by = agreed_stop(signals.signum, nonfinite_streak, args.max_nonfinite_steps,
                                                scorer.failure, device, world_size)  # the scorer may fail in validation
        if main_process:
            writer.add_scalar("perf/peak_mem_gib", max(peaks.values()), iteration + 1)
        if stopped_by:
            break
        if main_process:
            if (iteration + 1) % args.save_every == 0 or iteration + 1 == args.num_iterations:
                save_last_iteration(run_dir, state, transformer, optimizer, args.keep_last)
            compile_cache.save()  # once, after this start's first iteration: every graph has compiled by then

    if main_process and stopped_by and state["iteration"]:  # a stop keeps the last completed iteration
        save_last_iteration(run_dir, state, transformer, optimizer, args.keep_last)
    if main_process:
        summary = write_summary(run_dir, state, args, Path(__file__).stem, world_size, world_size * B, stopped_by,
                                other_gpus_memory(device, {"reward": args.reward_device,
                                                           "text encoders": args.text_encoder_device}))
        writer.close()
        print(json.dumps(summary, indent=1))
    exit_code = run_exit_code(stop_signal, stopped_by, state["iteration"], run_dir)
    if world_size > 1:
        leave_process_group()
        os._exit(exit_code)  # skips the interpreter's teardown, in which gloo's threads now and then abort
    if exit_code:
        sys.exit(exit_code)
