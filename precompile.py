"""Compile a trainer's graphs in worker processes while it loads its models and runs its first validation eagerly.

A cold start (no rollout.CompileCache file yet) compiles ten graphs one after the other, each in the first call that
needs it: part of the first validation and of the first iteration. Here one worker process per pass (the sampling
adapter's, the base model's, the policy's with its backward, the VAE decoder's) builds the smallest SD3 transformer
with the model's block kinds (one dual-attention block, one plain, the last; random weights) or the VAE, adds the
trainer's LoRA adapters, compiles as the trainer does, makes the first iteration's first call of that pass and exits.
The graphs are the trainer's, for a graph takes the weights as inputs and holds only the code, shapes and dtypes;
torch.compile's on-disk caches (inductor's and AOTAutograd's, shared by the user's processes) then hold them, and the
trainer's own compile finds them there as on a warm start. The time this saves is in docs/performance.md.

    precompile = Precompile(passes, model, device, torch.bfloat16, lora=(32, 64), resolution=512, text_tokens=333)
    ...                                 # load the models
    with precompile.eager():            # the first validation, eagerly, while the workers compile
        ...
    precompile.wait()                   # then the first iteration's compiles are cache hits

The trainers reach it through compiling.Compiler. A worker that fails costs nothing but time: the trainer compiles
that graph itself. Run as a script, this file is one worker: python precompile.py '<JSON spec>'.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext

import torch

import lora_adapters
import rollout
import sd3


def block_kinds(config) -> list[tuple[bool, bool]]:
    """(dual attention, last) of each block of an SD3 transformer config: what its blocks' compiled code depends on."""
    dual = set(config.get("dual_attention_layers") or ())
    return [(i in dual, i == config["num_layers"] - 1) for i in range(config["num_layers"])]


def smallest_config(config) -> dict:
    """The transformer config with one block of each kind of `config`'s, in their order."""
    kinds = block_kinds(config)
    kept = [i for i, kind in enumerate(kinds) if kind not in kinds[:i]]
    dual = tuple(j for j, i in enumerate(kept) if kinds[i][0])
    return {**config, "num_layers": len(kept), "dual_attention_layers": dual}


def model_configs(model: str) -> tuple[dict, dict]:
    """The transformer's and the VAE's configs of `model` (sd3.load_pipeline's names), without loading weights."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    if model in (sd3.TINY, sd3.RANDOM_MEDIUM):
        config = sd3.TINY_CONFIG if model == sd3.TINY else sd3.MEDIUM_CONFIG
        with torch.device("meta"):
            return dict(sd3.random_transformer(config).config), dict(sd3.random_vae(config).config)
    path = os.path.expanduser(model)
    return (dict(SD3Transformer2DModel.load_config(path, subfolder="transformer")),
            dict(AutoencoderKL.load_config(path, subfolder="vae")))


def run_pass(spec: dict) -> None:
    """Make the trainer's first call of one graph family (spec["pass"]) on a model of spec["model"]'s configs."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    device, dtype, job = torch.device(spec["device"]), getattr(torch, spec["dtype"]), spec["pass"]
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else nullcontext()  # the trainers'
    transformer_config, vae_config = model_configs(spec["model"])
    latent = spec["resolution"] // 2 ** (len(vae_config["block_out_channels"]) - 1)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the dtypes of from_pretrained(dtype=...), without a float32 copy
    try:
        with torch.device(device):
            if "decode" in job:
                vae = AutoencoderKL.from_config(vae_config).eval().requires_grad_(False)
            else:
                transformer = SD3Transformer2DModel.from_config(smallest_config(transformer_config))
                transformer.eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default_dtype)
    if "decode" in job:
        rollout.compile_decoder(vae)
        latents = torch.randn(job["decode"], vae_config["latent_channels"], latent, latent, device=device, dtype=dtype)
        with torch.no_grad(), autocast:
            vae.decode(latents, return_dict=False)
        return
    lora_adapters.add_lora_adapters(transformer, *spec["lora"])
    if spec["gradient_checkpointing"]:
        transformer.enable_gradient_checkpointing()
    rollout.compile_blocks(transformer)
    rows, config = job["rows"], transformer.config
    latents = torch.randn(rows, config.in_channels, latent, latent, device=device)
    embeds = torch.randn(rows, spec["text_tokens"], config.joint_attention_dim, device=device)
    pooled = torch.randn(rows, config.pooled_projection_dim, device=device)
    with torch.set_grad_enabled(job["grad"]), autocast, lora_adapters.use_adapter(transformer, job["adapter"]):
        velocity = rollout.predict_velocity(transformer, latents, torch.full((rows,), 500.0), embeds, pooled)
    if job["grad"]:
        velocity.float().square().mean().backward()


class Precompile:
    """Worker processes, one per pass, each compiling the trainer's first call of one graph family (see run_pass), at
    a lower CPU priority than the trainer's model loading.

    A pass is {"adapter": "sampling" | "policy" | None, "grad": bool, "rows": transformer rows} or {"decode": images}.
    No passes: nothing runs, eager() and wait() do nothing.
    """

    def __init__(self, passes: list[dict], model: str = "", device: str | torch.device = "cuda",
                 dtype: torch.dtype = torch.bfloat16, lora: tuple[int, int] = (32, 64),
                 gradient_checkpointing: bool = False, resolution: int = 512, text_tokens: int = 333):
        self.passes, self.started, self.workers = passes, time.perf_counter(), []
        for job in passes:
            spec = {"model": model, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                    "lora": list(lora), "gradient_checkpointing": gradient_checkpointing, "resolution": resolution,
                    "text_tokens": text_tokens, "pass": job, "parent": os.getpid()}
            log = tempfile.TemporaryFile()  # read back only if the worker fails
            # a session of its own: a Ctrl-C is the trainer's, which then finishes an iteration that needs the graphs
            process = subprocess.Popen([sys.executable, os.path.abspath(__file__), json.dumps(spec)],
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            self.workers.append((job, process, log))
        if passes:
            print(f"cold start: compiling in {len(passes)} worker process{'es' * (len(passes) > 1)} while the models "
                  "load", flush=True)

    @contextmanager
    def eager(self):
        """Run torch.compile'd code eagerly inside if there are workers: the first compiled calls are then the first
        iteration's, those the workers make (the graphs take the batch size symbolically, the VAE decoder does not)."""
        with torch.compiler.set_stance("force_eager") if self.passes else nullcontext():
            yield

    def wait(self, timeout_s: float = 900.0) -> None:
        """Wait for every worker (those not finished in timeout_s are stopped); name the ones that failed."""
        if not self.workers:
            return
        ended = {}  # worker index: seconds from the start to its end
        while len(ended) < len(self.workers) and time.perf_counter() - self.started < timeout_s:
            ended |= {i: time.perf_counter() - self.started for i, (_, process, _) in enumerate(self.workers)
                      if i not in ended and process.poll() is not None}
            time.sleep(0.1)
        for i, (job, process, log) in enumerate(self.workers):
            if process.poll() is None:
                process.kill()
                process.wait()
            if process.returncode:
                log.seek(0)
                lines = log.read().decode(errors="replace").strip().splitlines() or ["no output"]
                print(f"compile worker {json.dumps(job)} failed (exit {process.returncode}: {lines[-1][:300]}); the "
                      "trainer compiles its graphs itself", flush=True)
            log.close()
        each = ", ".join(f"{'decoder' if 'decode' in job else job['adapter'] or 'base'} {ended.get(i, timeout_s):.0f}"
                         for i, (job, _, _) in enumerate(self.workers))
        print(f"compile workers done after {time.perf_counter() - self.started:.0f} s ({each} s)", flush=True)
        self.workers = []


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:  # a trainer killed outright leaves no worker compiling for nobody
        time.sleep(1.0)
    os._exit(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="One compile worker of a trainer: compiling.Compiler starts it, not a user.",
        epilog=__doc__.split("\n\n")[0])
    parser.add_argument("spec", help="the JSON spec of the pass to compile (Precompile writes it)")
    try:
        spec = json.loads(parser.parse_args().spec)
        spec["parent"]
    except (ValueError, TypeError, KeyError):  # only Precompile writes a spec: a hand-run worker
        parser.exit(2, "precompile.py: error: spec: not a JSON object of Precompile's (with "
                       "\"parent\", \"pass\", ...); the trainers start this worker themselves\n")
    threading.Thread(target=_exit_with, args=(spec["parent"],), daemon=True).start()
    os.nice(10)  # the trainer's model loading first
    try:
        run_pass(spec)
    except Exception as error:  # the trainer shows the last line
        sys.exit(f"{type(error).__name__}: {' '.join(str(error).split())}")
