"""Pretrain the OCR proxy's base model: a small StableDiffusion3Pipeline that renders 4-digit codes partly legibly.

    python benchmark/ocr_proxy/pretrain.py --out ~/.cache/crd/ocr-proxy      # one GPU, a few minutes; reused if done

1. Renders the task's training words (benchmark/ocr_proxy/render.py) and trains a small AutoencoderKL on them
   (16 latent channels, 8x down, like SD3's), then records each image's latent distribution once.
2. Trains an SD3Transformer2DModel with rectified flow on those latents (logit-normal t, 10% empty prompts so that
   CFG works), jointly with the pipeline's own CLIP-L, CLIP-G and T5 encoders (per-character tokenizers, as in
   sd3.py's tiny model): letter identity and order reach the image only through them.
3. Every `eval_every` steps, samples the validation words at the benchmark's validation protocol (CFG
   `validation_guidance`, `validation_steps` steps; by default CFG 1, 40 steps, as Flow-Factory's CRD example
   validates), at the trainers' rollout protocol (CFG 1, 10 steps) and at the recipe's (CFG 4.5, 40 steps), and
   scores them with PP-OCR. Training stops at the first validation score >= `target` (or at the time cap); the
   evaluated state whose score is closest to `target` is saved. The test words are never used.

The directory is a diffusers StableDiffusion3Pipeline (bf16) that crd.py and dgpo.py load with --model DIR, plus
proxy.json (the configuration, the validation history and wall times). Same arguments, same seed: same words and
the same training on one kind of GPU (torch's deterministic algorithms: two short runs gave identical weights on one
H200, and on one H100; without them, the base score had moved by 0.05 between two GPU runs). An H100 and an H200
give other transformer and text-encoder weights (the base then scores 0.336 against 0.316): runs to be compared
across GPU kinds share a base carried in. A directory whose proxy.json holds the same configuration is reused as it
is.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import rollout  # noqa: E402
import run_dirs  # noqa: E402
import sd3  # noqa: E402  (before diffusers' SD3 pipeline: it quiets transformers' torchvision warnings)
from diffusers import StableDiffusion3Pipeline  # noqa: E402
from benchmark.ocr_proxy.ocr_pool import OcrPool  # noqa: E402
from benchmark.ocr_proxy.render import Task, prompt, render, split_words  # noqa: E402

# 15.5M parameters, 31 MB in bf16: small enough to carry between machines. No dual attention (SD3.5-M's extra
# attention of the first blocks): the task needs none. clip_l + clip_g hidden sizes = the T5 width (SD3 pads CLIP to it).
PROXY_CONFIG = dict(
    transformer=dict(sample_size=16, num_layers=5, attention_head_dim=64, num_attention_heads=4,
                     joint_attention_dim=256, caption_projection_dim=256, pooled_projection_dim=256,
                     pos_embed_max_size=16, dual_attention_layers=(), qk_norm="rms_norm"),
    vae=dict(block_out_channels=(32, 64, 64, 64), layers_per_block=1, norm_num_groups=32),
    clip_l=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                projection_dim=128, hidden_act="quick_gelu", vocab_size=None),
    clip_g=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                projection_dim=128, hidden_act="gelu", vocab_size=None),
    t5=dict(d_model=256, d_ff=512, num_layers=2, num_heads=4, d_kv=64, vocab_size=None, dropout_rate=0.0),
)
MODEL_CONFIGS = {"proxy": PROXY_CONFIG, "tiny": sd3.TINY_CONFIG}  # tiny: the CPU test's
ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


@dataclass
class Args:
    """Pretrain the OCR proxy's base model."""

    out: str
    """model directory (a diffusers StableDiffusion3Pipeline); reused when its proxy.json has this configuration"""
    seed: int = 0
    """seed of the word split, the initial weights and the training noise"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """training device"""
    task: Task = field(default_factory=Task)
    """what is rendered"""
    model: Literal["proxy", "tiny"] = "proxy"
    """model size: proxy (15.5M parameters) or tiny (sd3.py's, for CPU tests)"""
    max_sequence_length: int = 32
    """T5 tokens; the trainers must run with the same --max-sequence-length"""
    vae_steps: int = 1500
    """autoencoder training steps"""
    vae_batch_size: int = 64
    """images per autoencoder step"""
    vae_learning_rate: float = 1e-3
    """AdamW learning rate of the autoencoder"""
    vae_kl_weight: float = 1e-4
    """weight of the per-element KL to N(0, 1): keeps the latent space smooth for decoding generated latents"""
    steps: int = 30000
    """most transformer training steps"""
    batch_size: int = 256
    """images per transformer step"""
    learning_rate: float = 3e-4
    """AdamW learning rate of the transformer"""
    text_encoder_learning_rate: float = 1e-3
    """AdamW learning rate of the CLIP and T5 encoders: spelling is learned there"""
    warmup_steps: int = 200
    """linear learning-rate warm-up"""
    prompt_dropout: float = 0.1
    """fraction of images trained with the empty prompt (classifier-free guidance)"""
    eval_every: int = 100
    """validate every N transformer steps"""
    eval_words: int = 64
    """validation words sampled at each validation"""
    target: float = 0.4
    """stop at the first validation PP-OCR score (at the validation protocol) at or above this"""
    validation_guidance: float = 1.0
    """CFG of the validation protocol that decides the stop (the RL runs validate at it too): 1, as Flow-Factory's
    CRD example validates its CFG-free policy (examples/crd/lora/sd3_5/default.yaml, line 109)"""
    validation_steps: int = 40
    """ODE steps of the validation protocol (line 110 there; the trainers' --eval-steps)"""
    rollout_steps: int = 10
    """ODE steps of the rollout protocol, CFG 1 (the trainers' --num-steps)"""
    time_cap_s: float = 300.0
    """stop transformer training after this many seconds whatever the score (then the result depends on speed)"""
    ocr_workers: int = 14
    """PP-OCR processes for validation (0: in this process)"""
    progress_every_s: float = 30.0
    """seconds between progress lines of the autoencoder and transformer training (0: every step)"""


class Progress:
    """A line at most every `every_s` seconds of a training loop, and at its last step, so a run
    of minutes on a CPU shows where it is. It reads the clock only; the loss it prints is the
    step's, read when it prints."""

    def __init__(self, what: str, total: int, every_s: float):
        self.what, self.total, self.every_s = what, total, every_s
        self.started = self.printed = time.perf_counter()

    def __call__(self, step: int, loss: torch.Tensor) -> None:
        now = time.perf_counter()
        if now - self.printed >= self.every_s or step == self.total:
            self.printed = now
            print(f"pretrain: {self.what} step {step}/{self.total}, loss {float(loss):.4f}, "
                  f"{now - self.started:.0f} s", flush=True)


def unreadable_renders(task: Task) -> str | None:
    """Why the task's renders cannot be read (as a pretrain.py error), or None: a symbol without ink (the font is too
    small), two symbols drawn alike (the font lacks their glyphs and draws the same box), or a longest word (`length`
    of the widest symbol) cut by the image's border. render() draws every word black on white, centred, at one size,
    so that word is the worst case."""
    def ink(image):
        return np.asarray(image.convert("L")) < 128  # at least half-way to black: what survives as a stroke

    drawn, widths = {}, {}
    for symbol in task.alphabet:
        image = render(symbol, task)
        columns = np.flatnonzero(ink(image).any(axis=0))
        if not len(columns):
            return (f"--task: {symbol!r} renders without ink at --task.font-size {task.font_size} (no pixel half-way "
                    "to black)")
        if image.tobytes() in drawn:
            return (f"--task.alphabet {task.alphabet!r}: {drawn[image.tobytes()]!r} and {symbol!r} render as the "
                    f"same image at --task.font-size {task.font_size} (the font lacks their glyphs, or the size is too "
                    "small)")
        drawn[image.tobytes()] = symbol
        widths[symbol] = columns[-1] - columns[0]
    word = max(widths, key=widths.get) * task.length
    marked = ink(render(word, task))
    if marked[0].any() or marked[-1].any() or marked[:, 0].any() or marked[:, -1].any():
        return (f"--task.font-size {task.font_size}: {word!r}, the widest word of --task.length {task.length}, does "
                f"not fit the image of --task.resolution {task.resolution} (its ink reaches the border)")
    return None


def check_args(args: Args) -> None:
    """One line for an argument that would fail minutes into pretraining (or never stop it)."""
    def fail(message):
        sys.exit(f"pretrain.py: error: {message}")

    for flag in ("vae_steps", "vae_batch_size", "steps", "batch_size", "eval_every", "eval_words", "validation_steps",
                 "rollout_steps", "max_sequence_length"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if args.task.font_size < 1:
        fail(f"--task.font-size {args.task.font_size}: must be at least 1")
    for flag in ("warmup_steps", "ocr_workers"):
        if getattr(args, flag) < 0:
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 0")
    for flag in ("vae_learning_rate", "learning_rate", "text_encoder_learning_rate"):
        if not (math.isfinite(getattr(args, flag)) and getattr(args, flag) > 0):
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag):g}: must be a finite number > 0")
    for flag, (low, high) in {"vae_kl_weight": (0, math.inf), "prompt_dropout": (0, 1), "target": (0, math.inf),
                              "validation_guidance": (1, math.inf)}.items():
        if not (math.isfinite(getattr(args, flag)) and low <= getattr(args, flag) <= high):
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag):g}: must be a finite number in [{low:g}, {high:g}]")
    blocked = run_dirs.directory_blocked(Path(args.out).expanduser())
    if blocked:
        fail(f"--out {args.out}: {blocked}")
    if args.task.resolution < 16 or args.task.resolution % 16:
        fail(f"--task.resolution {args.task.resolution}: must be a positive multiple of 16 (VAE factor 8 x patch size 2)")
    if not args.task.alphabet or args.task.length < 1 or min(args.task.test_words, args.task.validation_words) < 1:
        fail("--task.alphabet, --task.length, --task.test-words and --task.validation-words: need at least one each")
    if len(set(args.task.alphabet)) < len(args.task.alphabet):
        fail(f"--task.alphabet {args.task.alphabet!r}: repeats a symbol, so held-out words would repeat training words")
    try:
        split_words(args.task, args.seed)
    except ValueError as error:
        fail(f"--task: {error}")
    unreadable = unreadable_renders(args.task)
    if unreadable:
        fail(unreadable)
    if args.time_cap_s <= 0:
        fail(f"--time-cap-s {args.time_cap_s:g}: must be positive")
    if not (math.isfinite(args.progress_every_s) and args.progress_every_s >= 0):
        fail(f"--progress-every-s {args.progress_every_s:g}: must be a finite number >= 0")


def config_key(args: Args) -> dict:
    """What determines the model: all but where it goes, the device, the scorer's parallelism and
    how often it prints."""
    key = asdict(args)
    for name in ("out", "device", "ocr_workers", "progress_every_s"):
        key.pop(name)
    return key


def protocols(args: Args) -> dict[str, tuple[float, int]]:
    """{name: (CFG scale, ODE steps)}: the validation protocol first, then the rollout's and the recipe's."""
    named = [(args.validation_guidance, args.validation_steps), (1.0, args.rollout_steps), (4.5, args.validation_steps)]
    return {f"cfg{g:g}_{n}steps": (g, n) for g, n in named}


def render_batch(words: list[str], task: Task) -> torch.Tensor:
    """(N, 3, H, W) uint8 renders."""
    return torch.from_numpy(np.stack([np.asarray(render(w, task)) for w in words])).permute(0, 3, 1, 2).contiguous()


def tokenize(components: dict, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, ...]:
    """Token ids (N, 77), (N, 77), (N, max_sequence_length) exactly as StableDiffusion3Pipeline.encode_prompt makes them."""
    clip = [components[name](prompts, padding="max_length", max_length=77, truncation=True,
                             return_tensors="pt").input_ids for name in ("tokenizer", "tokenizer_2")]
    t5 = components["tokenizer_3"](prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                                   add_special_tokens=True, return_tensors="pt").input_ids
    return clip[0], clip[1], t5


def encode_ids(components: dict, ids_l, ids_g, ids_t5) -> tuple[torch.Tensor, torch.Tensor]:
    """StableDiffusion3Pipeline.encode_prompt from token ids, differentiable: embeddings (N, 77 + S, D), pooled (N, P)."""
    out_l = components["text_encoder"](ids_l, output_hidden_states=True)
    out_g = components["text_encoder_2"](ids_g, output_hidden_states=True)
    clip = torch.cat([out_l.hidden_states[-2], out_g.hidden_states[-2]], dim=-1)  # penultimate layer, like SD3
    t5 = components["text_encoder_3"](ids_t5)[0]
    clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return torch.cat([clip, t5], dim=-2), torch.cat([out_l[0], out_g[0]], dim=-1)


def train_vae(vae, images: torch.Tensor, args: Args, generator: torch.Generator, autocast) -> float:
    """Reconstruction MSE (pixels in [-1, 1]) + KL; returns the last 50 steps' mean MSE."""
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.vae_learning_rate, weight_decay=0.0)
    vae.train().requires_grad_(True)
    losses = []
    progress = Progress("autoencoder", args.vae_steps, args.progress_every_s)
    for step in range(args.vae_steps):
        index = torch.randint(len(images), (args.vae_batch_size,), generator=generator, device=images.device)
        x = images[index].float() / 127.5 - 1  # (b, 3, H, W)
        with autocast:
            posterior = vae.encode(x).latent_dist
            z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator, device=x.device)
            reconstruction = vae.decode(z).sample
        mse = F.mse_loss(reconstruction.float(), x)
        kl = posterior.kl().mean() / posterior.mean[0].numel()  # per latent element
        (mse + args.vae_kl_weight * kl).backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(mse.detach())
        progress(step + 1, losses[-1])
    vae.eval().requires_grad_(False)
    return float(torch.stack(losses[-50:]).mean())


@torch.no_grad()
def latent_distribution(vae, images: torch.Tensor, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std (N, 16, h, w) of every image, float32."""
    means, stds = [], []
    for chunk in images.split(256):
        with autocast:
            posterior = vae.encode(chunk.float() / 127.5 - 1).latent_dist
        means.append(posterior.mean.float())
        stds.append(posterior.std.float())
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def sample_words(pipe, embed, words: list[str], num_steps: int, guidance: float, resolution: int,
                 autocast) -> np.ndarray:
    """(N, H, W, 3) uint8: one image per word, image i from seed i, as the trainers validate."""
    embeds, pooled = embed([prompt(w) for w in words])
    negative = embed([""])
    with autocast:
        return rollout.sample(pipe, embeds, pooled, list(range(len(words))), num_steps, guidance, resolution,
                              resolution, max_batch_size=256, negative_embeds=negative[0],
                              negative_pooled=negative[1])["images"]


def sample_and_score(pipe, embed, words: list[str], num_steps: int, guidance: float, resolution: int, pool: OcrPool,
                     autocast) -> tuple[np.ndarray, np.ndarray]:
    """PP-OCR scores of one image per word (sample_words) and the images."""
    images = sample_words(pipe, embed, words, num_steps, guidance, resolution, autocast)
    scores, _ = pool.score(images, words)
    return scores, images


@torch.no_grad()
def evaluate_saved(out: Path, words: list[str], args: Args, pool: OcrPool) -> dict:
    """PP-OCR of `words` with the saved directory loaded as the trainers load it (bf16 on CUDA), at both protocols."""
    device = torch.device(args.device)
    pipe = sd3.load_pipeline(str(out), device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def embed(prompts):
        return sd3.encode_prompts(pipe, prompts, args.max_sequence_length)

    return {"words": len(words), **{name: float(sample_and_score(pipe, embed, words, n, g, args.task.resolution,
                                                                 pool, autocast)[0].mean())
                                    for name, (g, n) in protocols(args).items()}}


def save_pipeline(components: dict, out: Path, metadata: dict) -> None:
    """bf16 diffusers directory + proxy.json, written to a temporary directory and renamed (never half-written)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        saved = {k: copy.deepcopy(v).to(torch.bfloat16).cpu() if isinstance(v, torch.nn.Module) else v
                 for k, v in components.items()}
        StableDiffusion3Pipeline(**saved).save_pretrained(partial)
        (partial / "proxy.json").write_text(json.dumps(metadata, indent=1))
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def pretrain(args: Args) -> Path:
    """Build (or reuse) the model directory args.out; returns its path."""
    check_args(args)
    out = Path(args.out).expanduser()
    key = config_key(args)
    saved = json.loads((out / "proxy.json").read_text()) if (out / "proxy.json").is_file() else {}
    if saved.get("config") == key and "test_base" in saved:
        print(f"pretrain: reusing {out}", flush=True)
        return out
    started = time.perf_counter()
    pool = OcrPool(args.ocr_workers)  # forked before CUDA starts
    device = torch.device(args.device)
    if device.type == "cuda":  # for the rest of the process; cuBLAS reads its setting at this process's first matmul
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel: a warning
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    generator = torch.Generator(device).manual_seed(args.seed)
    torch.manual_seed(args.seed)
    words = split_words(args.task, args.seed)
    components = sd3._build_components(MODEL_CONFIGS[args.model])
    modules = {k: v.to(device) for k, v in components.items() if isinstance(v, torch.nn.Module)}
    times = {}

    # 1. autoencoder
    timer = time.perf_counter()
    images = render_batch(words["train"], args.task).to(device)  # (N, 3, H, W) uint8
    vae = modules["vae"]
    vae_mse = train_vae(vae, images, args, generator, autocast)
    mean, std = latent_distribution(vae, images, autocast)
    shift, scale = float(mean.mean()), float(1 / (mean + std * torch.randn_like(std)).std())
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)  # unit-variance latents, as SD3's
    times["vae_s"] = time.perf_counter() - timer
    print(f"pretrain: autoencoder {args.vae_steps} steps, MSE {vae_mse:.4f}, {times['vae_s']:.0f} s", flush=True)

    # 2. transformer and text encoders
    timer = time.perf_counter()
    ids = [t.to(device) for t in tokenize(components, [prompt(w) for w in words["train"]] + [""], args.max_sequence_length)]
    empty = len(words["train"])  # the last row of ids: the empty prompt
    transformer = modules["transformer"]
    encoders = [modules[name] for name in ENCODERS]
    for module in (transformer, *encoders):
        module.train().requires_grad_(True)
    optimizer = torch.optim.AdamW([
        {"params": list(transformer.parameters()), "lr": args.learning_rate},
        {"params": [p for e in encoders for p in e.parameters()], "lr": args.text_encoder_learning_rate}],
        weight_decay=0.0)
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    pipe = StableDiffusion3Pipeline(**components)

    def embed(prompts):
        return encode_ids(modules, *[t.to(device) for t in tokenize(components, prompts, args.max_sequence_length)])

    def evaluate(step):
        train_s = time.perf_counter() - timer - eval_s[0]
        for module in (transformer, *encoders):
            module.eval()
        val = words["validation"][: args.eval_words]
        entry = {"step": step, **{name: float(sample_and_score(pipe, embed, val, n, g, args.task.resolution,
                                                                pool, autocast)[0].mean())
                                  for name, (g, n) in protocols(args).items()}, "train_s": train_s}
        for module in (transformer, *encoders):
            module.train()
        print(f"pretrain: step {step}: validation PP-OCR " + ", ".join(f"{entry[k]:.3f} ({k})" for k in protocols(args))
              + f", {entry['train_s']:.0f} s of training", flush=True)
        return entry

    validation = next(iter(protocols(args)))  # the protocol that decides the stop
    history, best, eval_s, loss_sum, stop = [], None, [0.0], 0.0, "steps"
    progress = Progress("transformer", args.steps, args.progress_every_s)
    for step in range(1, args.steps + 1):
        for group, base_lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = base_lr * min(1.0, step / args.warmup_steps)
        index = torch.randint(len(mean), (args.batch_size,), generator=generator, device=device)
        dropped = torch.rand(args.batch_size, generator=generator, device=device) < args.prompt_dropout
        rows = torch.where(dropped, empty, index)
        x0 = (mean[index] + std[index] * torch.randn(mean[index].shape, generator=generator, device=device) - shift) * scale
        sigma = torch.sigmoid(torch.randn(args.batch_size, generator=generator, device=device))  # logit-normal t
        noise = torch.randn(x0.shape, generator=generator, device=device)
        noisy = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise  # (b, 16, h, w)
        with autocast:
            embeds, pooled = encode_ids(modules, *[t[rows] for t in ids])
            velocity = transformer(hidden_states=noisy, timestep=sigma * 1000, encoder_hidden_states=embeds,
                                   pooled_projections=pooled, return_dict=False)[0]
        loss = F.mse_loss(velocity.float(), noise - x0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        progress(step, loss.detach())
        if step % args.eval_every == 0 or step == args.steps:
            eval_timer = time.perf_counter()
            entry = {**evaluate(step), "loss": float(loss_sum) / args.eval_every}
            loss_sum = 0.0
            history.append(entry)
            if best is None or abs(entry[validation] - args.target) < abs(best[0][validation] - args.target):
                best = (entry, {name: {k: v.detach().cpu().clone() for k, v in modules[name].state_dict().items()}
                                for name in ("transformer", *ENCODERS)})
            eval_s[0] += time.perf_counter() - eval_timer
            if entry[validation] >= args.target:
                stop = "target"
                break
            if entry["train_s"] >= args.time_cap_s:
                stop = "time cap"
                break
    times["transformer_s"] = time.perf_counter() - timer - eval_s[0]
    times["validation_s"] = eval_s[0]
    chosen, state = best
    for name, weights in state.items():
        modules[name].load_state_dict(weights)
    for module in modules.values():
        module.eval().requires_grad_(False)
    times["total_s"] = time.perf_counter() - started
    metadata = {"config": key, "model_config": MODEL_CONFIGS[args.model], "stopped_by": stop,
                "validation": validation, "chosen": chosen, "history": history, "vae_mse": vae_mse, "times": times,
                "parameters": {k: sum(p.numel() for p in m.parameters()) for k, m in modules.items()},
                "words": {k: len(v) for k, v in words.items()}}
    save_pipeline(components, out, metadata)
    # Reported, never used to decide anything: the test words stay held out.
    metadata["test_base"] = evaluate_saved(out, words["test"], args, pool)
    pool.close()
    (out / ".proxy.json.tmp").write_text(json.dumps(metadata, indent=1))
    (out / ".proxy.json.tmp").replace(out / "proxy.json")
    print(f"pretrain: held-out test PP-OCR of the saved model: {metadata['test_base']}", flush=True)
    print(f"pretrain: saved {out} (step {chosen['step']}, validation {chosen[validation]:.3f} ({validation}); stopped by "
          f"{stop}; {times['total_s']:.0f} s in all)", flush=True)
    return out


if __name__ == "__main__":
    pretrain(tyro.cli(Args))
