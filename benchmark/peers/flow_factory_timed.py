"""Flow-Factory's trainer as `python -m flow_factory.train CONFIG` runs it (its CLI's way for one
process), with each iteration timed from outside: no file of Flow-Factory's is changed.

    PYTHONPATH=CHECKOUT/src:benchmark/peers python benchmark/peers/flow_factory_timed.py CONFIG

CRDTrainer.start() calls these methods once an iteration, in this order; each is wrapped, and
waits for the GPU before and after (as crd.py's PhaseTimer does):
    sample                  the rollout: batches of one group, prompts encoded before training
    prepare_feedback        the rewards (computed here, after the rollout) and the advantages
    optimize                the old snapshot's pass, then the policy's forwards and updates
    _update_sampling_model  the sampling snapshot's blend, the iteration's last call
An iteration runs from sample's start to _update_sampling_model's end: rollout_s, reward_s,
train_s and what falls between (the EMA and old snapshot's blends, logging). One JSON line an
iteration goes to $PEERS_TIMING: the phases, the images, and the peak memory so far
(torch.cuda.max_memory_allocated; on the CPU the process's peak RSS, as crd.py's summary.json).

With PEERS_BF16_LOAD=1 the pipeline is loaded in bfloat16 (SD3_5Adapter.load_pipeline):
Flow-Factory loads it in float32 and casts it to bfloat16 once loaded, the same weights minutes
later. Start-up only, before anything is timed.
"""

import json
import os
import resource
import sys
import time

import torch
from flow_factory.trainers.crd import CRDTrainer

iteration = {}


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(method, phase):
    def wrapper(self, *args, **kwargs):
        synchronize()
        started = time.perf_counter()
        if phase == "rollout_s":
            iteration.clear()
            iteration["started"] = started
        out = method(self, *args, **kwargs)
        synchronize()
        iteration[phase] = time.perf_counter() - started
        if phase == "rollout_s":
            iteration["images"] = len(out)
        if phase == "end":
            report(self.epoch)
        return out
    return wrapper


def peak_memory_gib():
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def report(epoch):
    line = {"iteration": epoch + 1, "iteration_s": time.perf_counter() - iteration["started"],
            **{k: iteration[k] for k in ("rollout_s", "reward_s", "train_s", "images")},
            "peak_mem_gib": peak_memory_gib()}
    print("PEERS_TIMING", json.dumps(line), flush=True)
    with open(os.environ["PEERS_TIMING"], "a") as out:
        out.write(json.dumps(line) + "\n")


CRDTrainer.sample = timed(CRDTrainer.sample, "rollout_s")
CRDTrainer.prepare_feedback = timed(CRDTrainer.prepare_feedback, "reward_s")
CRDTrainer.optimize = timed(CRDTrainer.optimize, "train_s")
CRDTrainer._update_sampling_model = timed(CRDTrainer._update_sampling_model, "end")

if os.environ.get("PEERS_BF16_LOAD") == "1":
    from diffusers import StableDiffusion3Pipeline
    from flow_factory.models.stable_diffusion.sd3_5 import SD3_5Adapter

    SD3_5Adapter.load_pipeline = lambda self: StableDiffusion3Pipeline.from_pretrained(
        self.model_args.model_name_or_path, dtype=torch.bfloat16)

if __name__ == "__main__":
    from flow_factory.train import main

    sys.argv = ["flow_factory.train", *sys.argv[1:]]
    main()
