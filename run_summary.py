"""summary.json, how a run ended: completed or what stopped it, its validation rewards, its iteration times and the
peak memory of every rank and GPU; and a stopped run's last checkpoint (save_last_iteration), whose failure the
summary then gives as what stopped the run (a full disk).
"""

import json
import resource
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from checkpoint import CHECKPOINT_FILES, RunError, entry_judges, save_checkpoint
from distributed import all_gather_into


def save_last_iteration(run_dir, state, transformer, optimizer, keep_last, stopped_by=None):
    """save_checkpoint of the last completed iteration, state["iteration"]. A write error (a full
    disk) ends the process with its line (the trainers' error format), naming the latest complete
    checkpoint, after a summary.json that gives it as what stopped the run (after `stopped_by`,
    what had stopped it before, if anything)."""
    try:
        return save_checkpoint(run_dir, state["iteration"], transformer, optimizer, state, keep_last)
    except RunError as error:
        failure = str(error)
    try:
        summary_of_state(run_dir, state, f"{stopped_by}; then {failure}" if stopped_by else failure)
    except OSError as error:  # the disk may still be full
        failure += f"; summary.json could not be written either ({error.strerror or error})"
    sys.exit(f"{Path(sys.argv[0]).name}: error: {failure}")


def summary_of_state(run_dir, state, stopped_by, device=None, failed_judges=None):
    """write_summary of a trainer's state (start_state's: it holds the run's Args, algorithm and
    world size), as the trainer writes it at its end; `device`: the actor's (default: its --device,
    as the trainers name it); failed_judges: {judge: why} of the judges that failed."""
    args = SimpleNamespace(**state["args"])
    world_size = state["world_size"]
    if device is None:
        device = torch.device(args.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    roles = {"reward": args.reward_device, "text encoders": args.text_encoder_device}
    images = world_size * args.prompts_per_rank * args.group_size
    return write_summary(run_dir, state, args, state["algorithm"], world_size, images, stopped_by,
                         other_gpus_memory(device, roles), failed_judges)


def peak_memory_gib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # host peak RSS (KiB on Linux)


def actor_peak_memory(device, world_size):
    """{"actor rank r <device>": peak GiB} of every rank (a collective: every rank calls it)."""
    peak = torch.tensor([[peak_memory_gib(device), -1 if device.index is None else device.index]], dtype=torch.float64,
                        device=device)  # (1, 2): GiB, device index
    peaks = peak.new_empty(world_size, 2)
    if world_size > 1:
        all_gather_into(peaks, peak)
    else:
        peaks.copy_(peak)
    return {f"actor rank {r} {device.type}{'' if i < 0 else f':{i:.0f}'}": p for r, (p, i) in enumerate(peaks.tolist())}


def other_gpus_memory(actor_device, roles):
    """{"<roles> cuda:i": GiB} of the CUDA devices in roles ({role: device name}) that are not the actor's: this
    process's peak, and what every process (a vLLM reward server too) holds there now."""
    devices = {}
    for role, name in roles.items():
        device = torch.device(name or "cpu")
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
            if device != actor_device:
                devices.setdefault(device, []).append(role)
    memory = {}
    for device, names in devices.items():
        memory[f"{' + '.join(names)} {device}"] = peak_memory_gib(device)
        free, total = torch.cuda.mem_get_info(device)
        memory[f"{device} in use by all processes at the end"] = (total - free) / 2**30
    return memory


def write_summary(run_dir, state, args, algorithm, world_size, images_per_iteration, stopped_by,
                  other_gpus, failed_judges=None):
    """summary.json: whether the run did all its iterations and nothing stopped it (else what did,
    `stopped_by`), validation rewards, iteration times with the first iteration of every start
    (torch.compile's warm-up) reported apart from the mean, and peak memory. failed_judges
    ({judge: why}: the judges this start went on without) only where one failed."""
    history = [entry for entry in state["eval"] if np.isfinite(entry[1])]  # NaN: its scorer failed (the run stopped)
    times = state["iteration_s"]
    warmups = set(state["start_iterations"])
    steady = [t for i, t in enumerate(times, 1) if i not in warmups]
    mean = float(np.mean(steady)) if steady else None
    best = max(history, key=lambda e: e[1], default=[None, None])
    judge = lambda entry: entry[2]  # the first --eval-judge on the same images, or None
    last = Path(run_dir) / f"global_step_{state['iteration']}"
    saved = not state["iteration"] or all((last / name).exists() for name in CHECKPOINT_FILES)
    # a full disk may have lost the last checkpoint, an error stopped the last iteration: incomplete
    completed = state["iteration"] >= args.num_iterations and saved and not stopped_by
    summary = {"algorithm": algorithm, "reward": args.reward, "completed": completed,
               "stopped_by": None if completed else stopped_by, "iterations": state["iteration"],
               "optimizer_steps": state["optimizer_steps"], "world_size": world_size,
               "initial_eval_reward": history[0][1] if history else None,
               "final_eval_reward": history[-1][1] if history else None,
               "best_eval_reward": best[1], "best_eval_iteration": best[0],
               "initial_eval_judge": judge(history[0]) if history else None,
               "final_eval_judge": judge(history[-1]) if history else None,
               "warmup_iteration_s": times[0] if times else None,
               "mean_iteration_s": mean, "mean_iteration_excludes": sorted(warmups & set(range(1, len(times) + 1))),
               "train_images_per_s": images_per_iteration / mean if mean else None,
               "peak_mem_gib": {**state["peak_mem_gib"], **other_gpus}}
    if any(len(entry) == 4 for entry in history):  # judges other than PP-OCR alone
        judged = [entry_judges(entry) for entry in history]
        names = list(dict.fromkeys(name for means in judged for name in means))
        summary["eval_judges"] = {name: {"initial": next(m[name] for m in judged if name in m),
                                         "final": next(m[name] for m in reversed(judged) if name in m)}
                                  for name in names}
    if failed_judges:
        summary["failed_judges"] = dict(failed_judges)
    partial = run_dir / ".summary.json.tmp"  # replaced at once: a kill never leaves half a summary
    partial.write_text(json.dumps(summary, indent=1, allow_nan=False))
    partial.replace(run_dir / "summary.json")
    return summary
