"""The ranks of a run: this rank's device and the process group it joins, the check that every
rank runs the same settings, tensors averaged and gathered over the ranks, the stop signals a
process takes (GracefulStop) and the stop that every rank agrees on, and leaving the group in
step."""

import os
import re
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from checkpoint import PROMPT_FILES, prompt_files_sha256
from settings import flat_settings


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
    settings |= {f"--{name.replace('_', '-')}": value for name, value in flat_settings(args).items()
                 if name not in PER_NODE}
    hashes = prompt_files_sha256(flat_settings(args))
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


# torch 2.13 renamed all_gather_into_tensor (a FutureWarning on every rank); older torch has only it
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather(tensor, world_size):
    """(N, ...) on each rank -> (world_size * N, ...), rank-major, on every rank."""
    if world_size == 1:
        return tensor
    out = tensor.new_empty(world_size * len(tensor), *tensor.shape[1:])
    all_gather_into(out, tensor.contiguous())
    return out


def lost_peer_line(error):
    """(what stopped the run, what to do) where a collective failed because another rank went
    away (torch's DistError; gloo's RuntimeError from its transport: a connection closed or reset),
    else None."""
    if not dist.is_initialized():
        return None
    if not isinstance(error, dist.DistError) and not (
            isinstance(error, RuntimeError) and "gloo/transport" in str(error)):
        return None
    # gloo's: "[.../pair.cc:553] Connection closed by peer [10.0.0.2]:7306. This is typically ..."
    said = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
    first = re.split(r"(?<=\.)\s", said, maxsplit=1)[0].rstrip(".") or type(error).__name__
    return (f"a collective of the ranks failed: another rank stopped answering (its process "
            f"ended or its node was lost; its own output says why): {first}",
            "once every node runs again, --resume-from latest continues")


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


def signalled_ranks(signum, world_size):
    """Which ranks a stop signal reached, on which hosts, e.g. "ranks 2, 3 on node-b" (a
    collective, after agreed_stop agreed on a signal)."""
    ranks = [None] * world_size
    dist.all_gather_object(ranks, (dist.get_rank(), socket.gethostname(), signum))
    hosts = {}  # {host: the ranks on it that the signal reached}
    for rank, host, received in ranks:
        if received:
            hosts.setdefault(host, []).append(str(rank))
    named = [f"{'ranks' if len(on_host) > 1 else 'rank'} {', '.join(on_host)} on {host}"
             for host, on_host in hosts.items()]
    return "; ".join(named)


def leave_process_group():
    """Tear the process group down in step with the other ranks and flush this rank's output; a
    distributed trainer then ends in os._exit, as gloo's threads now and then abort the
    interpreter's teardown ("terminate called without an active exception")."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


class GracefulStop:
    """SIGTERM and SIGINT set `signum` (SIGUSR1, Slurm's pre-emption warning, as SIGTERM): the
    trainer finishes the iteration, saves and exits 128 + signal. The same signal again exits at
    once (a checkpoint being written is removed), except under torchrun: it forwards the signal it
    got to its workers, which may have had it already (Slurm signals every process of a job), and
    kills them itself --shutdown-timeout seconds later (launch.py). A copy that comes within a
    second of the first is the same request: `timeout` and `kill -TERM -PGID` signal the trainer
    and then its whole process group."""

    SAME_REQUEST_S = 1.0

    def __init__(self):
        self.signum, self.first_at = None, 0.0
        self.exit_on_repeat = "TORCHELASTIC_RUN_ID" not in os.environ
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, self.handle)

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGUSR1:  # Slurm's pre-emption warning: a stop, exit status 143
            name, signum = "SIGUSR1 (handled as SIGTERM)", signal.SIGTERM
        if signum == self.signum and time.monotonic() - self.first_at < self.SAME_REQUEST_S:
            return
        if signum == self.signum and self.exit_on_repeat:
            print(f"{name} again: exiting now, without a checkpoint", file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)
        if self.signum is None:
            self.signum, self.first_at = signum, time.monotonic()
        name_again = signal.Signals(self.signum).name
        again = f" ({name_again} again to exit at once)" if self.exit_on_repeat else ""
        print(f"{name}: finishing this iteration, then saving a checkpoint{again}", flush=True)
