"""flow_grpo's scripts/train_sd3.py (yifan123/flow_grpo), or DiffusionNFT's scripts/train_nft_sd3.py
(NVlabs/DiffusionNFT, which grew from it), as `python SCRIPT --config=CONFIG` runs it, each
iteration timed from outside: no file of theirs is changed.

    PYTHONPATH=CHECKOUT:benchmark/peers python benchmark/peers/flow_grpo_timed.py SCRIPT \\
        ITERATIONS --config=benchmark/peers/flow_grpo_config.py:VALUES.json

The script is loaded as a module; these names of it are wrapped, then absl runs its main:
    DistributedKRepeatSampler.set_epoch   the first call after an iteration ended starts the next
    pipeline_with_logprob                 a rollout batch (their sum is rollout_s)
    compute_log_prob (flow_grpo)          the first call of an iteration starts training
    DDP.train (DiffusionNFT)              starts training
    eval (flow_grpo)                      called at the top of every epoch (eval_freq 1), it ends
                                          the iteration before: no validation runs; after
                                          ITERATIONS iterations it ends the run, whose loop has no
                                          end of its own
    return_decay (DiffusionNFT)           called just before the old adapter's blend (a copy of
                                          the LoRA weights, left out), it ends the iteration
                                          (debug, their own switch, skips the validation and
                                          checkpoints; num_epochs ends the run)
and flow_grpo.rewards.multi_score gains the reward {"brightness": 1.0}, scored as crd.py --reward
brightness (brightness.py). Each phase waits for the GPU before and after, as crd.py's PhaseTimer
does. reward_s is what lies between the rollout's end and training's start: the wait for the
reward threads and the advantages. One JSON line an iteration goes to $PEERS_TIMING: the phases,
the images, and the peak memory so far (torch.cuda.max_memory_allocated; on the CPU the process's
peak RSS).
"""

import importlib.util
import json
import os
import resource
import sys
import time

import flow_grpo.rewards
import torch
from absl import app
from brightness import brightness

BRIGHTNESS = {"brightness": 1.0}
iteration = {}
ended = []


def now():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def peak_memory_gib():
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def start_iteration():
    if not iteration:
        iteration.update(started=now(), rollout_s=0.0, images=0)


def start_training():
    if iteration and "training" not in iteration:
        iteration["training"] = now()
        iteration["reward_s"] = iteration["training"] - iteration["rollout_end"]


def end_iteration():
    """The iteration's line, once one ran; False when none was open."""
    if not iteration:
        return False
    ended_at = now()
    line = {"iteration": len(ended) + 1, "iteration_s": ended_at - iteration["started"],
            "rollout_s": iteration["rollout_s"], "reward_s": iteration["reward_s"],
            "train_s": ended_at - iteration["training"], "images": iteration["images"],
            "peak_mem_gib": peak_memory_gib()}
    print("PEERS_TIMING", json.dumps(line), flush=True)
    with open(os.environ["PEERS_TIMING"], "a") as out:
        out.write(json.dumps(line) + "\n")
    ended.append(line)
    iteration.clear()
    return True


def wrap(function, before=None, after=None):
    def wrapper(*args, **kwargs):
        if before:
            before()
        out = function(*args, **kwargs)
        if after:
            after()
        return out
    return wrapper


def timed_rollout(pipeline_with_logprob):
    def rollout(*args, **kwargs):
        start_iteration()
        started = now()
        images, *rest = pipeline_with_logprob(*args, **kwargs)
        iteration["rollout_end"] = now()
        iteration["rollout_s"] += iteration["rollout_end"] - started
        iteration["images"] += len(images)
        return (images, *rest)
    return rollout


def with_brightness(multi_score):
    def scorer(device, score_dict):
        if dict(score_dict) != BRIGHTNESS:
            return multi_score(device, score_dict)

        def score(images, prompts, metadata, only_strict=True):
            scores = brightness(images).tolist()
            return {"brightness": scores, "avg": scores}, {}
        return score
    return scorer


def mark_epoch(iterations):
    """flow_grpo's eval: ends the iteration before; after the last, the run."""
    def mark(*args, **kwargs):
        if end_iteration() and len(ended) == iterations:
            sys.exit(0)
    return mark


def load(script, iterations):
    """The script as a module, its names wrapped as above; flow_grpo's run ends after
    `iterations`."""
    spec = importlib.util.spec_from_file_location("peer_train", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sampler = module.DistributedKRepeatSampler
    sampler.set_epoch = wrap(sampler.set_epoch, before=start_iteration)
    module.pipeline_with_logprob = timed_rollout(module.pipeline_with_logprob)
    if hasattr(module, "compute_log_prob"):  # flow_grpo
        module.compute_log_prob = wrap(module.compute_log_prob, before=start_training)
        module.eval = mark_epoch(iterations)
    else:  # DiffusionNFT
        class TimedDDP(module.DDP):
            def train(self, mode=True):
                if mode:
                    start_training()
                return super().train(mode)
        module.DDP = TimedDDP
        module.return_decay = wrap(module.return_decay, after=end_iteration)
    return module


if __name__ == "__main__":
    script, iterations, *flags = sys.argv[1:]
    flow_grpo.rewards.multi_score = with_brightness(flow_grpo.rewards.multi_score)
    main = load(script, int(iterations)).main
    sys.argv = [script, *flags]
    app.run(main)
