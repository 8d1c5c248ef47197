"""CRD: Centered Reward Distillation for text rendering with Stable Diffusion 3.5 Medium and LoRA.

CRD (Zhu et al., arXiv 2603.14128) trains a diffusion model toward the KL-regularised optimum
p_ref(x|c) exp(r(x,c)/beta) / Z(c) by regressing the model's implicit reward, a likelihood ratio
read off flow-matching errors, onto the task reward. Unlike GRPO/DDPO-style diffusion RL:
1. Rollouts are a deterministic 10-step ODE; no per-step log-probabilities: the log-ratio against
   an "old" snapshot is estimated from denoising errors at re-noised timesteps.
2. Within-prompt centering: implicit and task rewards are both centred over the images of one
   prompt, which cancels the intractable log Z(c) exactly; the loss is their squared mismatch.
3. The sampler ("sampling" EMA adapter) is decoupled from the ratio reference ("old" EMA adapter),
   each with its own decay schedule, against ratio-signal collapse.
4. A KL anchor to the CFG-guided base model, its per-sample strength growing with the advantage.

    python crd.py --group-size 6        # the recipe: SD3.5-M + LoRA, Qwen2.5-VL-3B OCR reward
    bash run.sh crd                     # the recipe with its GPU layout (README)
    tensorboard --logdir runs
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from einops import rearrange

from checks import check_numbers, check_shared_args, fail, loading_errors_as_one_line
from compiling import Compiler
from data import GroupSampler
from iteration import GuardedStep, TrainingRows, image_seed
from lora_adapters import add_lora_adapters, ema_update_, lora_parameters, use_adapter
from omni_rollout import RolloutEngine
from run import Run
from scoring import training_scorer
from sd3 import encode_prompts, load_pipeline, negative_embeddings
from settings import TrainerArgs
from validation import Validation


@dataclass
class Args(TrainerArgs):
    """Train SD3.5 with LoRA by reinforcement learning on the OCR text-rendering task."""

    # TrainerArgs (settings.py): the flags outside the algorithm, read as args.scoring.reward,
    # args.validation.eval_every, args.output.resume_from, args.machine.device and the like

    # Experiment
    exp_name: str = Path(__file__).stem
    """name of this experiment: the prefix of the run directory"""
    seed: int = 42
    """seed of the prompt order, rollout noise and training noise"""

    # Model, data and rollout
    model: str = "stabilityai/stable-diffusion-3.5-medium"
    """hub id or local directory of SD3.5, `tiny` (CPU demo) or `random-sd3.5-medium`"""
    train_data: str = "data/ocr/train.jsonl"
    """training prompts (.jsonl from data.py, or Flow-GRPO's raw .txt)"""
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
    lora_rank: int = 32
    """LoRA rank"""
    lora_alpha: int = 64
    """LoRA alpha"""
    forward_batch_size: int = 48
    """most images in one no-grad transformer forward (0: all)"""

    # Reward (--reward, its models and servers: args.scoring)
    reward_aggregation: Literal["sum", "gdpo"] = "sum"
    """a mix's advantages: of its weighted sum (sum), or of the weighted sum of its rewards each
    standardised within its prompt group (gdpo, where the weights alone count)"""

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
    """stop, with a checkpoint, after this many non-finite gradients in a row (each skips a step)"""
    global_std: bool = True
    """normalise advantages by the std over all images of the iteration (else per group)"""
    adv_clip: float = 5.0
    """advantages are clipped to [-adv_clip, adv_clip]"""

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
    old_decay: tuple[float, float, float, float] = (0, 0.25, 0.005, 0.999)
    """EMA of the old adapter after each iteration: (start k, initial decay, slope per k, max)"""
    sampling_decay: tuple[float, float, float, float] = (75, 0.0, 0.0075, 0.999)
    """EMA of the sampling adapter after each iteration, as --old-decay"""
    ema_counts_optimizer_steps: bool = False
    """k of the EMA schedules counts optimizer steps (else 2 an iteration, as the paper's rounds)"""


# ALGO LOGIC: the loss of one training timestep
def crd_loss(v_theta, v_old, v_ref, target, advantages, group_size, adv_clip=5.0, beta=1.0,
             kl_beta=0.1, kl_floor=1e-4):
    """CRD loss of whole prompt groups (contiguous rows) at their training timesteps.

    v_theta (B,C,H,W): policy velocity, with grad; v_old, v_ref: old adapter and CFG-guided base;
    target: the flow-matching velocity noise - x0; advantages (B,).
        r_i = mean[-(v_theta - u)^2 / w_theta + (v_old - u)^2 / w_old],  w = max(mean|v - u|, 1e-5)
        L = (c / beta) mean_i (beta (r_i - sg(mean_g r)) - (a_i - mean_g a))^2
            + mean_i (kl_floor + a_i (kl_beta - kl_floor)) mean (v_theta - v_ref)^2
    with w_theta detached and a = clip(A, -c, c) / (2c) + 1/2 in [0, 1].
    """
    dims = tuple(range(1, v_theta.ndim))
    error = v_theta.float() - target.float()
    old_error = v_old.float() - target.float()
    weight = error.abs().mean(dims, keepdim=True).clamp_min(1e-5).detach()
    old_weight = old_error.abs().mean(dims, keepdim=True).clamp_min(1e-5)
    implicit_reward = (-error.square() / weight + old_error.square() / old_weight).mean(dims)
    scaled_adv = advantages.float().clamp(-adv_clip, adv_clip) / (2 * adv_clip) + 0.5  # in [0, 1]
    groups_r = rearrange(implicit_reward, "(g i) -> g i", i=group_size)
    groups_a = rearrange(scaled_adv, "(g i) -> g i", i=group_size)
    centred_r = groups_r - groups_r.mean(1, keepdim=True).detach()
    centred_a = groups_a - groups_a.mean(1, keepdim=True)
    policy_loss = (adv_clip / beta) * (beta * centred_r - centred_a).square().mean()
    kl = (v_theta.float() - v_ref.float()).square().mean(dims)  # (B,)
    kl_loss = ((kl_floor + scaled_adv * (kl_beta - kl_floor)) * kl).mean()
    info = {"policy_loss": policy_loss, "kl_loss": kl_loss, "kl": kl.mean(),
            "implicit_reward_std": centred_r.std()}
    return policy_loss + kl_loss, {k: v.detach() for k, v in info.items()}


def ema_decay(step, start, initial, slope, maximum):
    """`initial` before step `start`, then rising by `slope` a step up to `maximum`."""
    return initial if step < start else min(initial + slope * (step - start), maximum)


ROLLOUT_ADAPTER = "sampling"  # CRD samples with an EMA of its own, decoupled from the old adapter
VALIDATION_ADAPTER = "sampling"  # CRD validates the EMA it samples with, a smoothed policy
OLD_ADAPTER = "old"  # what the loss compares the policy with: a snapshot the schedule moves
OLD_MOVES_EVERY_STEP = False  # CRD's snapshots move once an iteration, after its optimizer steps


def snapshots_after_step(transformer, args, steps):
    """CRD moves no snapshot between the optimizer steps of an iteration."""
    return {}


def snapshots_after_iteration(transformer, args, iterations, steps):
    """The old and sampling adapters move toward the policy, each by its schedule at
    k = 2 x iterations done (the paper's 2 optimizer steps a round), or at the steps taken."""
    k = steps if args.ema_counts_optimizer_steps else 2 * iterations
    decays = {"old": ema_decay(k, *args.old_decay), "sampling": ema_decay(k, *args.sampling_decay)}
    for name, decay in decays.items():
        ema_update_(transformer, name, "policy", decay)
    return decays


def check_algorithm_args(args):
    """A CRD setting out of range, or an EMA schedule that could leave [0, 1], as one line."""
    check_numbers(args, {"crd_beta": (">", 0), "kl_beta": (">=", 0), "kl_floor": (">=", 0),
                         "kl_cfg": (">=", 1)})
    if args.kl_floor > args.kl_beta:
        fail(f"--kl-floor {args.kl_floor:g}: must not exceed --kl-beta {args.kl_beta:g} (the KL "
             "weight of an image rises from floor to beta with its advantage)")
    for flag in ("old_decay", "sampling_decay"):
        _, initial, slope, maximum = getattr(args, flag)  # any start k is fine
        if slope < 0 or not (0 <= initial <= 1 and 0 <= maximum <= 1):
            values = " ".join(f"{v:g}" for v in getattr(args, flag))
            fail(f"--{flag.replace('_', '-')} {values}: needs an initial decay in [0, 1], a slope "
                 ">= 0 and a max decay in [0, 1]")


def train_timestep_grid(grid, args):
    """The steps of the rollout grid that training draws from: all but the last, near-zero one."""
    return grid[:-1]


def group_advantages(rewards, group_size, global_std=True, clip=5.0):
    """(r_i - mean_group r) / (std + 1e-4), clipped to +-clip; std over all rewards or per group."""
    groups = rearrange(rewards, "(g i) -> g i", i=group_size)
    std = rewards.std(unbiased=False) if global_std else groups.std(1, unbiased=False, keepdim=True)
    return ((groups - groups.mean(1, keepdim=True)) / (std + 1e-4)).clamp(-clip, clip).flatten()


def micro_batch_rows(per_image, micro_batch):
    """(T, B, ...) -> (B*T, ...): micro batches of T * micro_batch rows, each timestep-major."""
    return rearrange(per_image, "t (m j) ... -> (m t j) ...", j=micro_batch)


def training_rows(x0, grid, args, iteration, rank):
    """Each group's T training timesteps (drawn from the grid in random order) and noise, seeded by
    the group's global index so that any world size agrees, as micro-batch rows."""
    G = args.group_size
    T = args.num_train_timesteps
    generator = torch.Generator(x0.device)
    timesteps = []
    noise = []
    for group_start in range(0, len(x0), G):
        generator.manual_seed(image_seed(args.seed, iteration, rank * len(x0) + group_start))
        order = torch.randperm(len(grid), generator=generator, device=x0.device)
        timesteps.append(grid[order[:T]])  # (T,)
        shape = (T, 1 if args.shared_group_noise else G, *x0.shape[1:])
        group_noise = torch.randn(shape, generator=generator, device=x0.device)
        noise.append(group_noise.expand(T, G, -1, -1, -1))
    micro_batch = args.train_batch_size
    timesteps = torch.stack(timesteps, 1).repeat_interleave(G, 1)  # (T, B)
    timesteps = micro_batch_rows(timesteps, micro_batch)  # (B*T,)
    noise = micro_batch_rows(torch.cat(noise, 1), micro_batch)  # (B*T, C, h, w)
    image_index = torch.arange(len(x0), device=x0.device).expand(T, -1)
    image_index = micro_batch_rows(image_index, micro_batch)
    x0 = x0[image_index]
    sigma = (timesteps / 1000).view(-1, 1, 1, 1)
    noisy = (1 - sigma) * x0 + sigma * noise  # x_t on the flow-matching path
    return TrainingRows(noisy, timesteps, noise - x0, image_index)  # target: the velocity


def check_args(args):
    """Every flag before anything loads, each bad one as one line (checks.check_shared_args)."""
    check_shared_args(args, check_algorithm_args, train_timestep_grid)


if __name__ == "__main__":
    args = tyro.cli(Args)
    args.train_batch_size = args.train_batch_size or args.group_size
    check_args(args)
    run = Run(args, Path(__file__).stem)  # ranks, run directory and its lock, stop signals
    torch.manual_seed(args.seed)  # the LoRA init; rollouts and training seed their own noise
    device = run.device
    images_per_rank = args.prompts_per_rank * args.group_size
    micro_rows = args.train_batch_size * args.num_train_timesteps  # training rows of one step
    with loading_errors_as_one_line():
        engine = RolloutEngine(args, run.world_size, device)  # vllm-omni: checked, not started
        train_set, eval_set = run.read_inputs()  # prompts and model paths; --dry-run ends here
        sampler = GroupSampler(len(train_set), args.prompts_per_rank, args.group_size, args.seed,
                               run.rank, run.world_size)
        compiler = Compiler(args, device, run.world_size)  # cold: workers compile meanwhile
        scorer = training_scorer(args, device, images_per_rank)  # a reward server is checked now
        pipe = load_pipeline(args.model, device, run.dtype, resolution=args.resolution,
                             text_encoder_device=args.machine.text_encoder_device or None)
        negative = negative_embeddings(pipe, args.max_sequence_length)  # the empty prompt's
        validation = Validation(pipe, eval_set, args, scorer, negative, run, VALIDATION_ADAPTER)
    transformer = pipe.transformer
    add_lora_adapters(transformer, args.lora_rank, args.lora_alpha)  # policy, old, sampling
    if args.machine.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    compiler.compile(pipe)
    params = lora_parameters(transformer, "policy")
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=args.adam_betas,
                                  weight_decay=args.weight_decay, eps=args.adam_eps)
    optimizer_step = GuardedStep(optimizer, params, args, run.world_size)
    run.start(transformer, optimizer_step, sampler, pipe)  # a new run's state, or the resumed
    engine.start(pipe, run.dtype)  # vllm-omni: loads the model, checks that an adapter binds

    if validation.due(0):  # before training
        validation(0)
    for iteration in run.iterations(compiler):
        timer = run.timer()
        # ROLLOUT: whole prompt groups, deterministic ODE, CFG 1
        indices = sampler.next_indices()
        prompts = [train_set[i]["prompt"] for i in indices]
        targets = [train_set[i]["target"] for i in indices]
        embeds, pooled = encode_prompts(pipe, prompts, args.max_sequence_length)
        seeds = [image_seed(args.seed, iteration, run.rank * images_per_rank + j)
                 for j in range(images_per_rank)]
        with use_adapter(transformer, ROLLOUT_ADAPTER), run.autocast:
            samples = engine.sample(pipe, embeds, pooled, seeds, args.num_steps, 1.0,
                                    args.resolution, args.resolution, args.forward_batch_size,
                                    progress=run.main_process)
        timer.lap("rollout_s")
        scorer.submit(samples["images"], targets, prompts)  # read while the passes below run

        # ALGO LOGIC: each group trains on T timesteps of the rollout grid, with fresh noise
        grid = train_timestep_grid(samples["timesteps"], args).to(device)
        rows = training_rows(samples["latents"].to(device), grid, args, iteration, run.rank)
        # what needs no reward runs while the scorer reads: the base model, old until it moves
        old_fixed = micro_rows if OLD_MOVES_EVERY_STEP else len(rows)
        with torch.no_grad(), run.autocast:
            with use_adapter(transformer, None):
                v_ref = rows.velocity(transformer, embeds, pooled, args, args.kl_cfg, negative)
            with use_adapter(transformer, OLD_ADAPTER):
                v_old = rows[:old_fixed].velocity(transformer, embeds, pooled, args)
        v_old = list(v_old.split(micro_rows))  # one tensor per micro batch
        timer.lap("train_s")
        scores = scorer.take()[0]
        timer.lap("reward_wait_s")
        rewards = run.gather(torch.as_tensor(scores, dtype=torch.float32, device=device))
        if run.reward_failed(rewards, scorer):  # on any rank: every rank stops before training
            break
        reward = scorer.aggregate(rewards)  # a mix's components as one, by --reward-aggregation
        advantages = group_advantages(reward, args.group_size, args.global_std, args.adv_clip)
        advantages = advantages[run.rank * images_per_rank : (run.rank + 1) * images_per_rank]
        losses = {}
        decays = {}
        for m in run.progress(range(images_per_rank // args.train_batch_size), "training"):
            batch = rows[m * micro_rows : (m + 1) * micro_rows]
            ref = v_ref[m * micro_rows : (m + 1) * micro_rows]
            if m == len(v_old):  # the old adapter moved after the last optimizer step
                with torch.no_grad(), run.autocast, use_adapter(transformer, OLD_ADAPTER):
                    v_old.append(batch.velocity(transformer, embeds, pooled, args, wait=False))
            for span in batch.policy_chunks(args):  # a few timesteps a forward and backward
                chunk = batch[span]
                with use_adapter(transformer, "policy"), run.autocast:
                    v_theta = chunk.velocity(transformer, embeds, pooled)
                loss, info = crd_loss(v_theta, v_old[m][span], ref[span], chunk.target,
                                      advantages[chunk.image_index], args.group_size,
                                      args.adv_clip, args.crd_beta, args.kl_beta, args.kl_floor)
                chunk_weight = len(chunk) / micro_rows  # the loss is the mean over the T timesteps
                (loss * chunk_weight).backward()
                for key, value in {"loss": loss.detach(), **info}.items():
                    losses[key] = losses.get(key, 0.0) + value * chunk_weight
            if optimizer_step(iteration):  # averaged over ranks, clipped; non-finite: skipped
                decays |= snapshots_after_step(transformer, args, optimizer_step.steps)
        if optimizer_step.stepped_this_iteration:  # skipped steps move no snapshot
            decays |= snapshots_after_iteration(transformer, args, iteration + 1,
                                                optimizer_step.steps)
        run.average(list(losses.values()))  # the losses of every rank's groups
        timer.lap("train_s")

        # TRY NOT TO MODIFY: logging, validation, checkpoints
        steps = images_per_rank // args.train_batch_size
        logged = {**optimizer_step.stats(), **{f"losses/{k}": v / steps for k, v in losses.items()},
                  **{f"charts/decay_{k}": v for k, v in decays.items()},
                  **timer.perf(run.world_size * images_per_rank, scorer.seconds)}
        run.end_iteration(iteration + 1, sampler, rewards, logged)  # + train/reward_mean, std, ...
        if validation.due(iteration + 1):
            validation(iteration + 1)
        if run.agreed_stop(scorer):
            break
        run.save_if_due()

    engine.close()  # vllm-omni: its processes end before the exit
    run.finish()  # summary.json and the exit status
