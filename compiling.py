"""torch.compile of the transformer blocks and the VAE decoder (--compile, on CUDA) with its cache
file: on a cold start of one rank, worker processes (precompile.py) compile the first iteration's
graphs while the models load and the first validation runs eagerly."""

import torch

from iteration import policy_chunks
from precompile import Precompile
from rollout import CompileCache, compile_blocks, compile_decoder, images_per_call


def start_precompile(args, compile_cache, device, world_size):
    """A cold start of one rank compiles in worker processes (precompile.py) while the models load
    and the first validation runs eagerly: the first compiled call of each graph family as the first
    iteration makes it, its rows from the functions the loop's passes use. Several ranks, a compile
    cache to load, or no first validation to hide them behind: no workers."""
    if not compile_cache.cold or world_size > 1 or not args.validation.eval_every:
        return Precompile([])
    images = args.prompts_per_rank * args.group_size
    rows = images * args.num_train_timesteps
    most = args.forward_batch_size
    rollout_images = images_per_call(images, most)
    base_rows = images_per_call(rows, most, args.kl_cfg) * (2 if args.kl_cfg > 1 else 1)
    policy = policy_chunks(args.train_batch_size * args.num_train_timesteps, args)[0]
    passes = [{"adapter": "sampling", "grad": False, "rows": rollout_images},
              {"adapter": None, "grad": False, "rows": base_rows},
              {"adapter": "policy", "grad": True, "rows": policy.stop - policy.start},
              {"decode": min(rollout_images, 8)}]  # decode_latents' chunks
    return Precompile(passes, args.model, device, torch.bfloat16, (args.lora_rank, args.lora_alpha),
                      args.machine.gradient_checkpointing, args.resolution,
                      77 + args.max_sequence_length)


class Compiler:
    """torch.compile of the transformer blocks and the VAE decoder (CUDA, --compile), with its cache
    file. On a cold start, worker processes compile the graphs while the models load, and compiled
    code runs eagerly until they are done; the graphs are then found in the on-disk caches."""

    def __init__(self, args, device, world_size):
        compiled = args.machine.compile and device.type == "cuda"
        self.cache = CompileCache(args.model, device, compiled)
        self.workers = start_precompile(args, self.cache, device, world_size)

    def compile(self, pipe):
        if self.cache.enabled:
            compile_blocks(pipe.transformer)
            compile_decoder(pipe.vae)
        if self.workers.passes:
            torch.compiler.set_stance("force_eager")

    def wait(self):
        """Before the first iteration: wait for the workers, then compile as usual."""
        self.workers.wait()
        if self.workers.passes:
            torch.compiler.set_stance("default")

    def save(self):
        """The cache file, once: after the first iteration every graph has compiled."""
        self.cache.save()
