"""The parts of a training iteration around its loss: the seed of each image, the training rows
(one image at one timestep each) cut into micro batches and policy chunks, the guarded optimizer
step and the per-phase timer."""

import time
from dataclasses import dataclass

import torch

from distributed import all_mean_
from rollout import predict_velocity


def image_seed(seed, iteration, index):
    """The seed of image `index` (over all ranks) of an iteration: below 2^63 for seed < 2^23."""
    return (seed << 40) + (iteration << 20) + index


def policy_chunks(rows, args):
    """Slices of a micro batch's `rows`, one policy forward and backward each."""
    per_forward = args.train_batch_size * args.machine.policy_timesteps_per_forward
    return [slice(start, min(start + per_forward, rows)) for start in range(0, rows, per_forward)]


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


class GuardedStep:
    """The optimizer step of a micro batch: gradients averaged over ranks and clipped; a non-finite
    gradient norm skips the step (counted and printed; the run stops after --max-nonfinite-steps in
    a row). Gradients are zeroed either way. `steps` counts the steps taken, a resumed run's too."""

    def __init__(self, optimizer, params, args, world_size):
        self.optimizer = optimizer
        self.params = params
        self.args = args
        self.world_size = world_size
        self.steps = 0  # Run.start sets a resumed run's
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
            self.steps += 1
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
