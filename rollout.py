"""The rollout: SD3's batched flow-matching sampler (a deterministic Euler ODE, with CFG or without), its velocity
pass in row chunks, the VAE decode, torch.compile of the transformer blocks and the VAE decoder with its cache file,
and captioned image grids.

Like `cleanrl_utils`, the modules under it are the "environment" the trainers import: no loss, advantage, EMA schedule
or optimizer lives here. The model comes from sd3.py and its adapters from adapters.py:

    pipe = load_pipeline("stabilityai/stable-diffusion-3.5-medium", "cuda", torch.bfloat16)  # sd3.py
    add_lora_adapters(pipe.transformer)                                                     # adapters.py
    embeds, pooled = encode_prompts(pipe, prompts)
    with use_adapter(pipe.transformer, "sampling"):
        out = sample(pipe, embeds, pooled, seeds)          # {"latents", "images", "timesteps", "sigmas"}
"""

from __future__ import annotations

import logging
import math
import os
import re
import warnings
from contextlib import suppress
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from tqdm.auto import tqdm

from sd3 import cache_root, negative_embeddings

# diffusers, transformers and peft (4 of the 6 seconds a trainer takes to start) are imported in the functions that
# use them, so that argument checks, --dry-run and --help answer before they load.


# ---- torch.compile ---------------------------------------------------------------------------------------------------


def allow_block_graphs() -> None:
    """Let dynamo keep 64 graphs per code object: the blocks share their code, and their kinds,
    adapter settings, grad modes and batch sizes outgrow its default of 8, past which they run eager."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


def compile_blocks(transformer, dynamic: bool | None | Literal["batch"] = "batch") -> None:
    """Regional torch.compile: each transformer block is compiled, the embeddings and output layer stay eager.

    The blocks share their code, so a few graphs serve all 24 of SD3.5-M's: one per block kind (dual attention,
    plain, last), adapter setting (a named adapter or none: use_adapter keeps peft's active adapter name fixed) and
    grad mode. `dynamic="batch"` makes only the batch dimension symbolic, so that every batch size (rollout, CFG,
    training chunks) shares its kind's graph while the token counts and widths stay constants in the generated
    kernels, which compile faster than torch.compile's dynamic=True (every dimension symbolic) and run as fast
    (benchmark/HISTORY.md). True and None (a dimension turns symbolic once it changes) are torch.compile's own, kept
    for benchmark/startup.py's comparisons. The compiling is paid in the first validation and iteration, unless
    a CompileCache holds it or precompile.py's workers compiled it.
    """
    allow_block_graphs()
    for block in transformer.transformer_blocks:
        block.compile(dynamic=None if dynamic == "batch" else dynamic)
    for layer in (transformer.pos_embed, transformer.context_embedder):  # they make the first block's inputs
        layer.register_forward_hook(_like_a_block_output)
    if dynamic == "batch":
        for layer in (transformer.pos_embed, transformer.context_embedder, transformer.time_text_embed):
            layer.register_forward_hook(_batch_dynamic)


def _like_a_block_output(module, args, output):
    """The first block's inputs as every later block gets its own, so that it runs their graph: not a view (the
    context embedder's linear returns one, and dynamo guards on its base) and, in grad mode, requiring grad (the
    backward through the first block's inputs is a small cost beside a separate graph's minute of compiling)."""
    if output._base is not None:
        output = output.clone()
    return output.requires_grad_() if torch.is_grad_enabled() and not output.requires_grad else output


def _batch_dynamic(module, args, output):
    """Mark the batch dimension of a block input symbolic for the first graph of each kind, which every later batch
    size and block then reuses (a batch of 1 gets its own). Made contiguous here because the transformer calls
    .contiguous() on the patch embedding, which for a strided view returns a new tensor without the mark."""
    output = output.contiguous()
    torch._dynamo.maybe_mark_dynamic(output, 0)
    return output


# In bfloat16, diffusers' Upsample2D.forward calls its lru_cache-wrapped is_torch_version
# (upsampling.py lines 156 and 180 in diffusers 0.40), and dynamo warns on every cold start that it
# traces through the cache. The function only compares version strings, so tracing it is correct:
# the warning is expected. It is matched by its text, file and call (at any line, for other
# diffusers versions), so that every other lru_cache warning still shows.
UPSAMPLING_LRU_CACHE_WARNING = (
    r"Dynamo detected a call to a `functools\.lru_cache`-wrapped function at "
    r"'upsampling\.py:\d+'(?s:.*)"
    r"diffusers[/\\]models[/\\]upsampling\.py\", line \d+, in forward\n.*is_torch_version")


def compile_decoder(vae) -> None:
    """torch.compile the VAE decoder: its group norms and activations over full-resolution maps are memory-bound eagerly."""
    # for the whole process: dynamo warns when it traces, at the first decode, after this returns
    warnings.filterwarnings("ignore", UPSAMPLING_LRU_CACHE_WARNING, UserWarning,
                            r"torch\._dynamo\.")
    vae.decoder.compile()


class CompileCache:
    """torch.compile's work (inductor kernels, AOTAutograd graphs, autotuning) kept in one file across runs.

    Loaded before anything compiles, so that a resume or the next run on the same GPU kind and torch version skips
    most of the minutes of compiling; saved once, after the first iteration (every graph has compiled by then). The
    file is $CRD_CACHE/compile/<torch version>-<GPU>-<model>.bin: delete it to measure a cold start.
    """

    def __init__(self, model: str, device: torch.device, enabled: bool):
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        name = re.sub(r"[^A-Za-z0-9.+-]+", "_", f"{torch.__version__}-{gpu}-{Path(model).name}")
        self.path = cache_root() / "compile" / f"{name}.bin"
        self.enabled, self.saved = enabled, False
        self.cold = enabled  # nothing loaded: every graph compiles in this start
        if enabled and self.path.is_file():  # a damaged or foreign file costs a cold start, not the run
            torch_log = logging.getLogger("torch.compiler._cache")  # it would log the unpickling traceback
            level, reason = torch_log.level, "not a torch.compile cache of this torch version"
            torch_log.setLevel(logging.ERROR)
            try:
                loaded = torch.compiler.load_cache_artifacts(self.path.read_bytes())
            except Exception as e:
                loaded, reason = None, f"{type(e).__name__}: {e}"
            finally:
                torch_log.setLevel(level)
            if loaded is None:
                print(f"compile cache {self.path} not loaded ({reason}); compiling from scratch", flush=True)
            self.cold = loaded is None

    def save(self) -> None:
        """Write the artifacts of this process's compiles (those loaded included) once, atomically."""
        if not self.enabled or self.saved:
            return
        self.saved = True
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts:
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                partial.write_bytes(artifacts[0])
                partial.replace(self.path)
            except OSError as e:  # a full or read-only disk costs the next start its cache, not this run
                with suppress(OSError):
                    partial.unlink()
                print(f"compile cache not saved to {self.path} ({e.strerror or e})", flush=True)


# ---- sampling --------------------------------------------------------------------------------------------------------


def images_per_call(batch: int, max_rows: int | None, guidance_scale: float = 1.0) -> int:
    """Images in each transformer call: no call gets more than max_rows rows (a CFG image takes two), and the calls
    are as equal as can be (54 images by 48 run as 27 + 27, not as 48 + a slow 6)."""
    if not max_rows:
        return batch
    most = max(1, max_rows // (2 if guidance_scale > 1 else 1))
    return -(-batch // -(-batch // most))


def predict_velocity(transformer, latents, timesteps, prompt_embeds, pooled, guidance_scale: float = 1.0,
                     negative_embeds=None, negative_pooled=None, max_batch_size: int | None = None,
                     wait_each_chunk: bool = False,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """Flow-matching velocity (B, C, h, w) of latents (B, C, h, w) at timesteps (scalar or (B,), 0..1000 scale).

    With guidance_scale > 1, the unconditional and conditional branches run as one batch of 2B (diffusers' order)
    and v = v_unc + s (v_cond - v_unc); negative embeddings of batch 1 are broadcast to B. With max_batch_size,
    no transformer call gets more than that many rows (a CFG image takes two). With wait_each_chunk, the host waits
    for each transformer call on a CUDA device to finish; it releases the GIL while it waits. Otherwise it runs
    ahead until the launch queue is full and then blocks inside a launch, holding the GIL, which starves a scorer
    thread beside it (its kernels are launched from Python too).
    The inputs are cast to `dtype`, by default the transformer's (a diffusers model's `.dtype`;
    vLLM-Omni's transformer has none: omni_rollout passes its engine's).
    """
    batch, dtype = latents.shape[0], dtype or transformer.dtype
    t = torch.as_tensor(timesteps, device=latents.device, dtype=torch.float32).reshape(-1).expand(batch)  # (B,)
    chunk = images_per_call(batch, max_batch_size, guidance_scale)
    if batch > chunk:
        return torch.cat([predict_velocity(transformer, latents[i : i + chunk], t[i : i + chunk],
                                           prompt_embeds[i : i + chunk], pooled[i : i + chunk], guidance_scale,
                                           negative_embeds, negative_pooled,
                                           wait_each_chunk=wait_each_chunk, dtype=dtype)
                          for i in range(0, batch, chunk)])
    if guidance_scale > 1:
        if negative_embeds is None or negative_pooled is None:
            raise ValueError("guidance_scale > 1 needs negative_embeds and negative_pooled")
        latents, t = torch.cat([latents, latents]), torch.cat([t, t])
        prompt_embeds = torch.cat([negative_embeds.expand(batch, -1, -1), prompt_embeds])  # (2B, S, D)
        pooled = torch.cat([negative_pooled.expand(batch, -1), pooled])  # (2B, P)
    v = transformer(hidden_states=latents.to(dtype), timestep=t, encoder_hidden_states=prompt_embeds.to(dtype),
                    pooled_projections=pooled.to(dtype), return_dict=False)[0]
    if wait_each_chunk and latents.device.type == "cuda":
        torch.cuda.current_stream(latents.device).synchronize()
    if guidance_scale > 1:
        v_unc, v_cond = v.chunk(2)
        v = v_unc + guidance_scale * (v_cond - v_unc)
    return v


def initial_latents(seeds: list[int], shape: tuple[int, int, int], device, dtype) -> torch.Tensor:
    """Noise (B, C, h, w); image i's from its own CPU generator seeded with seeds[i], so it reproduces alone."""
    noise = [torch.randn(shape, generator=torch.Generator("cpu").manual_seed(s)) for s in seeds]
    return torch.stack(noise).to(device=device, dtype=dtype)


def latent_shape(pipe, height: int, width: int) -> tuple[int, int, int]:
    """The (C, h, w) of one image's latents at height x width pixels."""
    channels = pipe.transformer.config.in_channels
    return channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor


def euler_schedule(scheduler, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout's time grid, float32 on the CPU: timesteps (T,) on the 0..1000 scale and sigmas
    (T + 1,) ending at 0, the flow-matching scheduler's for num_steps steps (SD3: shifted by its
    config's shift, 3.0). Both rollout engines take their grid from here, omni_rollout's pipeline
    from the engine's copy of the scheduler: they step through the same float32 values."""
    scheduler.set_timesteps(num_steps)  # so the scheduler config's shift applies
    return scheduler.timesteps.float(), scheduler.sigmas.float()


def unshifted_sigmas(scheduler, num_steps: int) -> list[float]:
    """The T sigmas of euler_schedule before the scheduler shifts them, as it computes them.

    vLLM-Omni's request field `sigmas` takes these: its pipelines hand them to the scheduler,
    which applies the shift again. set_timesteps(sigmas=...) rounds them to float32 before the
    shift, so that grid can differ from euler_schedule's in the last bit: omni_rollout's pipeline
    checks the request's sigmas and takes its grid from euler_schedule."""
    t_max = scheduler._sigma_to_t(scheduler.sigma_max)
    t_min = scheduler._sigma_to_t(scheduler.sigma_min)
    return (np.linspace(t_max, t_min, num_steps) / scheduler.config.num_train_timesteps).tolist()


def euler_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor,
               sigma_next: torch.Tensor) -> torch.Tensor:
    """One step of the flow-matching ODE dx/dsigma = v from sigma to sigma_next (0-d float32
    tensors of the grid): x + (sigma_next - sigma) v, in float32 even for bf16 models, like
    diffusers' scheduler."""
    return x + float(sigma_next - sigma) * v.float()


def euler_rollout(transformer, latents, prompt_embeds, pooled, timesteps, sigmas,
                  guidance_scale: float = 1.0, negative_embeds=None, negative_pooled=None,
                  max_batch_size: int | None = None, dtype: torch.dtype | None = None,
                  wait_each_chunk: bool = False, on_step=None, on_chunk=None) -> torch.Tensor:
    """A rollout's deterministic Euler ODE, in place over float32 latents (B, C, h, w): from the
    initial noise through timesteps (T,) (on the latents' device) and sigmas (T + 1,)
    (euler_schedule) to the final latents, which it returns.

    The images run in equal chunks such that no transformer call gets more than max_batch_size
    rows (a CFG image takes two: images_per_call), each chunk through all T steps before the next;
    on_step() after every step, on_chunk(chunk, x) with each chunk's slice and final latents as
    soon as they exist. Both rollout engines run this loop: sample() here, and omni_rollout's
    pipeline inside vLLM-Omni, with the engine's transformer and `dtype`.
    """
    per_call = images_per_call(len(latents), max_batch_size, guidance_scale)
    for start in range(0, len(latents), per_call):
        chunk = slice(start, start + per_call)
        x = latents[chunk]
        for i, t in enumerate(timesteps):
            v = predict_velocity(transformer, x, t, prompt_embeds[chunk], pooled[chunk],
                                 guidance_scale, negative_embeds, negative_pooled,
                                 wait_each_chunk=wait_each_chunk, dtype=dtype)
            x = euler_step(x, v, sigmas[i], sigmas[i + 1])
            if on_step is not None:
                on_step()
        latents[chunk] = x
        if on_chunk is not None:
            on_chunk(chunk, x)
    return latents


@torch.no_grad()
def decode_latents(pipe, latents: torch.Tensor, max_batch_size: int = 8) -> np.ndarray:
    """Latents (B, C, h, w) -> uint8 images (B, H, W, 3), undoing the VAE's scaling and shift like the pipeline.

    Decoded max_batch_size at a time: the VAE's full-resolution activations dominate the rollout's peak memory.
    """
    return _decode_latents(pipe, latents, max_batch_size)[0]


def _decode_latents(pipe, latents: torch.Tensor, max_batch_size: int = 8) -> tuple[np.ndarray, torch.Tensor]:
    """decode_latents, and (B,) whether each image's pixels are finite; NaN pixels are made 0 (black)."""
    vae = pipe.vae
    latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
    images, finite = [], []
    for chunk in latents.split(max_batch_size):
        pixels = vae.decode(chunk, return_dict=False)[0]
        finite.append(torch.isfinite(pixels).flatten(1).all(1))
        images.append(pipe.image_processor.postprocess(pixels, output_type="np"))  # clamped: inf becomes 0 or 1
    images, finite = np.concatenate(images), torch.cat(finite)
    if not finite.all():
        images = np.nan_to_num(images, nan=0.0)  # else the cast of NaN is the platform's choice
    return (images * 255).round().astype(np.uint8), finite


_nonfinite_images = 0  # of this process's sample() calls (nonfinite_images)


def nonfinite_images() -> int:
    """How many images sample() has made in this process whose latents or pixels were NaN or inf (a diverged model):
    they decode black, and a reward scores them as black images. The trainers count a rollout's by the difference."""
    return _nonfinite_images


class ChunkDecoder:
    """Decodes a rollout's chunks of final latents as they come (euler_rollout's on_chunk),
    keeping the images and whether their pixels are finite; hands each chunk's slice and images
    to on_decoded(chunk, images) if given."""

    def __init__(self, pipe, on_decoded=None):
        self.pipe, self.on_decoded = pipe, on_decoded
        self.images, self.finite = [], []  # per chunk: (n, H, W, 3) uint8, (n,) bool

    def __call__(self, chunk: slice, latents: torch.Tensor) -> None:
        images, finite = _decode_latents(self.pipe, latents)
        self.images.append(images)
        self.finite.append(finite)
        if self.on_decoded is not None:
            self.on_decoded(chunk, images)


def sample_output(latents, timesteps, sigmas, decoded: ChunkDecoder | None = None) -> dict:
    """sample()'s dict of a finished rollout (and of its decoded images, if any), whichever
    engine ran it; counts its non-finite images for nonfinite_images()."""
    global _nonfinite_images
    finite = torch.isfinite(latents).flatten(1).all(1)
    if decoded is not None:
        finite &= torch.cat(decoded.finite)
    finite = finite.cpu().numpy()
    _nonfinite_images += int((~finite).sum())
    out = {"latents": latents, "timesteps": timesteps,  # (B, C, h, w), (T,) float32
           "sigmas": sigmas, "finite": finite}  # (T + 1,) float32, (B,) bool
    if decoded is not None:
        out["images"] = np.concatenate(decoded.images)  # (B, H, W, 3) uint8
    return out


@torch.no_grad()
def sample(pipe, prompt_embeds, pooled, seeds: list[int], num_steps: int = 10, guidance_scale: float = 1.0,
           height: int = 512, width: int = 512, max_batch_size: int = 32, negative_embeds=None, negative_pooled=None,
           decode: bool = True, progress: bool = False, on_decoded=None) -> dict:
    """Deterministic Euler ODE on the scheduler's (shifted) sigmas, one image per seed, in equal chunks of images
    such that no transformer call gets more than max_batch_size rows (a CFG image takes two).

    Runs whichever adapter is active (wrap it in `use_adapter`). CFG when guidance_scale > 1, against the empty
    prompt unless negative embeddings are given. on_decoded(chunk, images), if given, gets each chunk's slice and
    decoded images as soon as they exist, so that a caller can score them in a thread while the next chunk samples.
    out["finite"] (B,) says which images' latents (and pixels) are finite (nonfinite_images counts the others).
    omni_rollout.OmniRollout.sample is the same call through vLLM-Omni.
    """
    transformer, device = pipe.transformer, pipe.transformer.device
    if len(seeds) != prompt_embeds.shape[0]:
        raise ValueError(f"{len(seeds)} seeds for {prompt_embeds.shape[0]} prompt embeddings")
    if on_decoded is not None and not decode:
        raise ValueError("on_decoded needs decode=True")
    if guidance_scale > 1 and negative_embeds is None:
        negative_embeds, negative_pooled = negative_embeddings(pipe, prompt_embeds.shape[1] - pipe.tokenizer_max_length)
    timesteps, sigmas = euler_schedule(pipe.scheduler, num_steps)  # (T,), (T + 1,)
    shape = latent_shape(pipe, height, width)
    latents = initial_latents(seeds, shape, device, torch.float32)  # (B, C, h, w)
    per_call = images_per_call(len(seeds), max_batch_size, guidance_scale)
    bar = tqdm(total=math.ceil(len(seeds) / per_call) * num_steps, desc="sampling", disable=not progress,
               delay=5.0)  # shown once sampling takes long
    decoded = ChunkDecoder(pipe, on_decoded) if decode else None
    euler_rollout(transformer, latents, prompt_embeds, pooled, timesteps.to(device), sigmas,
                  guidance_scale, negative_embeds, negative_pooled, max_batch_size,
                  wait_each_chunk=on_decoded is not None,  # the caller may score the chunk before
                  on_step=bar.update, on_chunk=decoded)
    bar.close()
    return sample_output(latents, timesteps, sigmas, decoded)


# ---- image grids -----------------------------------------------------------------------------------------------------

# Pillow's own scalable font (Aileron) has only ASCII glyphs; DejaVu Sans, found in the system's font folders where
# installed, also draws Latin accents, Greek and Cyrillic. Neither has CJK glyphs, which are drawn as boxes.
CAPTION_FONT = "DejaVuSans.ttf"


def caption_font(size: int) -> ImageFont.FreeTypeFont:
    try:
        return ImageFont.truetype(CAPTION_FONT, size)
    except OSError:
        return ImageFont.load_default(size=size)


def wrap_text(text: str, font: ImageFont.FreeTypeFont, width: float) -> list[str]:
    """`text` as lines no wider than `width` pixels: broken between words, inside a word only where it alone is wider."""
    lines = []
    for word in text.split():
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] += f" {word}"
            continue
        lines.append("")
        for char in word:
            if lines[-1] and font.getlength(lines[-1] + char) > width:
                lines.append("")
            lines[-1] += char
    return lines


def captioned_grid(images: np.ndarray, captions: list[str], columns: int = 4) -> np.ndarray:
    """(N, H, W, 3) uint8 images -> one (rows * (H + caption), columns * W, 3) grid, each image above its caption,
    which is wrapped to the image's width, never cut."""
    n, height, width, _ = images.shape
    font = caption_font(max(10, width // 40))
    lines = [wrap_text(caption, font, width - 4) for caption in captions]
    ascent, descent = font.getmetrics()
    strip = max(map(len, lines), default=0) * (ascent + descent) + 4  # the tallest caption sets every row's strip
    canvas = Image.new("RGB", (columns * width, -(-n // columns) * (height + strip)), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (image, caption_lines) in enumerate(zip(images, lines)):
        x, y = i % columns * width, i // columns * (height + strip)
        canvas.paste(Image.fromarray(image), (x, y))
        draw.multiline_text((x + 2, y + height + 2), "\n".join(caption_lines), fill="black", font=font, spacing=0)
    return np.asarray(canvas)
