"""Memory: about what one iteration holds at its peak, held against the memory there is before the
run starts (memory_error; a dry run reads the model's shape from its config files, model_shape),
and the line that tells a failed allocation, naming the phase and the flags that lower it
(out_of_memory_line)."""

import json
import os
import resource
from pathlib import Path
from types import SimpleNamespace

import torch

from sd3 import (MEDIUM_HUB_ID, RANDOM_MEDIUM, TINY, TINY_DIR_NAME, available_host_memory,
                 cache_root, load_pipeline)


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
    if args.machine.gradient_checkpointing:  # each block's input, one block's while recomputed
        kept = layers + ACTIVATIONS_PER_TOKEN
    policy_rows = args.train_batch_size * min(args.machine.policy_timesteps_per_forward,
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


def model_shape(model):
    """What iteration_memory reads of a pipeline (the transformer's config, the VAE's scale factor,
    the tokenizer's length), without its weights: the random model built on the meta device (for
    SD3.5 Medium's hub id too: its shapes), a local folder's config files (the tiny model's once
    its first use has saved it); None where there are none to read, another hub id too (the run
    checks once the model has loaded)."""
    if model in (RANDOM_MEDIUM, MEDIUM_HUB_ID):
        return load_pipeline(RANDOM_MEDIUM, device="meta")
    path = cache_root() / TINY_DIR_NAME if model == TINY else Path(model).expanduser()
    if not path.is_dir():  # a hub id: diffusers would download its configs
        return None
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    try:
        transformer = SD3Transformer2DModel.load_config(path, subfolder="transformer")
        vae = AutoencoderKL.load_config(path, subfolder="vae")
        tokenizer = json.loads((path / "tokenizer" / "tokenizer_config.json").read_text())
    except (OSError, ValueError):  # not a diffusers model's folder: the run says so
        return None
    return SimpleNamespace(transformer=SimpleNamespace(config=SimpleNamespace(**transformer)),
                           vae_scale_factor=2 ** (len(vae["block_out_channels"]) - 1),
                           tokenizer_max_length=tokenizer.get("model_max_length", 77))


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


def out_of_memory_line(error, phase, device, remedy):
    """(what stopped the program, what to do) of a failed allocation in `phase()` on `device`, the
    flags `remedy` lowering it (checks.errors_end_in_one_line tells it); None for other errors."""
    if not out_of_memory(error):
        return None
    return f"out of memory in {phase()} ({memory_in_use(device)})", remedy


TRAINER_MEMORY_FLAGS = ("lower --forward-batch-size or --policy-timesteps-per-forward, or add "
                        "--gradient-checkpointing or move the text encoders with "
                        "--text-encoder-device")
