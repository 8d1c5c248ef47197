"""DiffusionNFT: Negative-aware FineTuning for text rendering with SD3.5 Medium and LoRA.

The matched sibling of crd.py (Zheng et al., arXiv 2509.16117): the same prompts, reward, rollouts,
batch and budget; only the loss and the snapshot schedule differ (`diff crd.py nft.py`). The
defaults are the authors' OCR configuration.
1. Reinforcement on the forward process: flow matching on the clean rollout latents, re-noised at
   the rollout's timesteps; no likelihoods, so any sampler can roll out.
2. An implicit positive and negative policy, v+- = v_old +- beta (v_theta - v_old): the optimality
   r = clip(A)/2c + 1/2 pulls v+ toward the data and 1 - r pulls v-, so one regression reinforces
   good images and pushes away from bad ones.
3. Errors in x0 space with an adaptive weight (their mean magnitude), and a small velocity MSE to
   the base model without guidance.
4. The old adapter rolls out: an EMA of the policy whose decay ramps with the optimizer steps;
   validation uses a second EMA (decay 0.9 after every step).

    python nft.py --group-size 6        # the DiffusionNFT baseline of the recipe
    bash run.sh nft                     # with the recipe's GPU layout (README)
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

    # Algorithm: DiffusionNFT (the authors' OCR configuration)
    nft_beta: float = 0.1
    """beta of the implicit policies v_old +- beta (v_theta - v_old)"""
    kl_beta: float = 1e-4
    """weight of the velocity MSE to the base model"""
    kl_cfg: float = 1.0
    """CFG scale of the base model in the MSE (1: conditional only)"""
    shared_group_noise: bool = False
    """use one training noise per group and timestep (else one per image)"""
    old_decay: tuple[float, float, float] = (75, 0.0075, 0.999)
    """EMA of the old adapter after each iteration: (start k, slope per k, max) at k steps"""
    eval_ema_decay: float = 0.9
    """most decay of the sampling adapter, the EMA of the policy that validation uses"""


# ALGO LOGIC: the loss of one training timestep
def nft_loss(v_theta, v_old, v_ref, target, sigma, advantages, adv_clip=5.0, beta=0.1,
             kl_beta=1e-4):
    """DiffusionNFT loss of images at their training timesteps.

    v_theta (B,C,H,W): policy velocity, with grad; v_old, v_ref: old adapter and base; target: the
    flow-matching velocity noise - x0; sigma (B,): the noise level t; advantages (B,).
        v+ = beta v_theta + (1 - beta) v_old,  v- = (1 + beta) v_old - beta v_theta
        e+- = x0+- - x0 = sigma (target - v+-),  w+- = max(mean|e+-|, 1e-5), detached
        L = (c / beta) mean_i (r_i mean e+^2 / w+ + (1 - r_i) mean e-^2 / w-)
            + kl_beta mean_i mean (v_theta - v_ref)^2
    with r = clip(A, -c, c) / (2c) + 1/2 in [0, 1], the optimality of an image.
    """
    dims = tuple(range(1, v_theta.ndim))
    v_theta = v_theta.float()
    v_old = v_old.float().detach()
    sigma = sigma.float().view(-1, *[1] * len(dims))
    step = beta * (v_theta - v_old)  # exactly 0 at the old adapter: A = 0 teaches nothing
    positive = v_old + step
    negative = v_old - step
    positive_error = sigma * (target.float() - positive)  # x0 of v+ minus the clean latent
    negative_error = sigma * (target.float() - negative)
    positive_weight = positive_error.detach().double().abs().mean(dims, keepdim=True)
    negative_weight = negative_error.detach().double().abs().mean(dims, keepdim=True)
    positive_loss = (positive_error.square() / positive_weight.clamp_min(1e-5).float()).mean(dims)
    negative_loss = (negative_error.square() / negative_weight.clamp_min(1e-5).float()).mean(dims)
    r = advantages.float().clamp(-adv_clip, adv_clip) / (2 * adv_clip) + 0.5  # in [0, 1]
    policy_loss = (adv_clip / beta) * (r * positive_loss + (1 - r) * negative_loss).mean()
    kl = (v_theta - v_ref.float()).square().mean(dims)  # (B,)
    kl_loss = kl_beta * kl.mean()
    info = {"policy_loss": policy_loss, "kl_loss": kl_loss, "kl": kl.mean(),
            "old_deviation": (v_theta - v_old).square().mean()}
    return policy_loss + kl_loss, {k: v.detach() for k, v in info.items()}


def ema_decay(step, start, slope, maximum):
    """0 before step `start`, then `slope` a step after it, up to `maximum`."""
    return 0.0 if step < start else min(slope * (step - start), maximum)


def eval_ema_decay(steps, maximum):
    """(1 + k) / (10 + k) at k optimizer steps, up to `maximum`: a short memory at first."""
    return min((1 + steps) / (10 + steps), maximum)


ROLLOUT_ADAPTER = "old"  # DiffusionNFT samples with its old adapter, the one its loss pairs with
VALIDATION_ADAPTER = "sampling"  # DiffusionNFT validates a second EMA of the policy, as its authors
OLD_ADAPTER = "old"  # what the loss compares the policy with: a snapshot the schedule moves
OLD_MOVES_EVERY_STEP = False  # the old adapter moves once an iteration, after its optimizer steps


def snapshots_after_step(transformer, args, steps):
    """The sampling adapter, what validation and evaluate.py use, is an EMA of the policy."""
    decays = {"sampling": eval_ema_decay(steps, args.eval_ema_decay)}
    ema_update_(transformer, "sampling", "policy", decays["sampling"])
    return decays


def snapshots_after_iteration(transformer, args, iterations, steps):
    """The old adapter moves toward the policy by its schedule at the optimizer steps taken."""
    decays = {"old": ema_decay(steps, *args.old_decay)}
    ema_update_(transformer, "old", "policy", decays["old"])
    return decays


def check_algorithm_args(args):
    """A DiffusionNFT setting out of range, or an EMA decay that could leave [0, 1], as one line."""
    check_numbers(args, {"nft_beta": (">", 0), "kl_beta": (">=", 0), "kl_cfg": (">=", 1)})
    _, slope, maximum = args.old_decay  # any start k is fine
    if slope < 0 or not 0 <= maximum <= 1:
        values = " ".join(f"{v:g}" for v in args.old_decay)
        fail(f"--old-decay {values}: needs a slope >= 0 and a max decay in [0, 1]")
    if not 0 <= args.eval_ema_decay <= 1:
        fail(f"--eval-ema-decay {args.eval_ema_decay:g}: must lie in [0, 1]")


def train_timestep_grid(grid, args):
    """The steps of the rollout grid that training draws from: all of them."""
    return grid


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
                loss, info = nft_loss(v_theta, v_old[m][span], ref[span], chunk.target,
                                      chunk.timesteps / 1000, advantages[chunk.image_index],
                                      args.adv_clip, args.nft_beta, args.kl_beta)
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
