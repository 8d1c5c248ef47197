"""SD3 rollout environment: model loading, text encoding, LoRA adapters, a batched flow-matching sampler, VAE decode,
captioned image grids.

Like `cleanrl_utils`, this module is the "environment" the trainers import: no loss, advantage, EMA schedule or
optimizer lives here. One transformer carries three LoRA adapters (trainable `policy`, EMA copies `old` and
`sampling`); the reference model is the same transformer with its adapters disabled:

    pipe = load_pipeline("stabilityai/stable-diffusion-3.5-medium", "cuda", torch.bfloat16)  # or TINY, RANDOM_MEDIUM
    add_lora_adapters(pipe.transformer)
    embeds, pooled = encode_prompts(pipe, prompts)          # (B, 333, 4096), (B, 2048)
    with use_adapter(pipe.transformer, "sampling"):
        out = sample(pipe, embeds, pooled, seeds)          # {"latents", "images", "timesteps", "sigmas"}
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import string
import tempfile
import warnings
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from tqdm.auto import tqdm

# diffusers, transformers and peft (4 of the 6 seconds a trainer takes to start) are imported in the functions that
# use them, so that argument checks, --dry-run and --help answer before they load.
if TYPE_CHECKING:
    from diffusers import StableDiffusion3Pipeline
    from transformers import CLIPTokenizer, T5Tokenizer

# Without torchvision, transformers warns at the SD3 pipeline's import that its image processors fall back to PIL
# ones; the pipeline does not use them, and the qwen-vl scorer loads the PIL one by name.
logging.getLogger("transformers.utils.import_utils").addFilter(
    lambda record: "requires torchvision" not in record.getMessage())

TINY = "tiny"
RANDOM_MEDIUM = "random-sd3.5-medium"
TINY_DIR_NAME = "tiny-sd3-v2"  # bump when the tiny model changes, so stale caches are not reused
# the joint-attention projections of every block; "attn." does not match SD3.5-M's second attention, "attn2."
LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]

# The configs of stabilityai/stable-diffusion-3.5-medium. vocab_size is the size of the locally built tokenizer
# (None: just its characters); each text encoder's vocabulary matches its tokenizer.
MEDIUM_CONFIG = dict(
    transformer=dict(sample_size=128, num_layers=24, attention_head_dim=64, num_attention_heads=24,
                     joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
                     pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
    vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32),
    clip_l=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                projection_dim=768, hidden_act="quick_gelu", vocab_size=49408),
    clip_g=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                projection_dim=1280, hidden_act="gelu", vocab_size=49408),
    t5=dict(d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64, vocab_size=32128),
)
# The same structure (dual attention, qk-norm, 16 latent channels, an 8x VAE, 77 + 256 text tokens), ~170k weights.
TINY_CONFIG = dict(
    transformer=dict(sample_size=8, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                     joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
                     pos_embed_max_size=64, dual_attention_layers=(0,), qk_norm="rms_norm"),
    vae=dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4),
    clip_l=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                projection_dim=16, hidden_act="quick_gelu", vocab_size=None),
    clip_g=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                projection_dim=16, hidden_act="gelu", vocab_size=None),
    t5=dict(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=None),
)


def _clip_tokenizer(vocab_size: int | None) -> CLIPTokenizer:
    """Byte-level BPE without merges (each character is a token), padded with unused tokens to `vocab_size`."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = chars + [c + "</w>" for c in chars]
    tokens += [f"<unused{i}>" for i in range((vocab_size or 0) - len(tokens) - 2)]
    vocab = {t: i for i, t in enumerate(tokens + ["<|startoftext|>", "<|endoftext|>"])}  # last, as in CLIP's vocab
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _t5_tokenizer(vocab_size: int | None) -> T5Tokenizer:
    """Unigram over single characters, padded with unused pieces to `vocab_size`."""
    from transformers import T5Tokenizer

    pieces = ["<pad>", "</s>", "<unk>", "▁"] + list(string.ascii_letters + string.digits + string.punctuation)
    pieces += [f"<unused{i}>" for i in range((vocab_size or 0) - len(pieces))]
    return T5Tokenizer(vocab=[(p, 0.0 if i < 3 else -5.0) for i, p in enumerate(pieces)], extra_ids=0)


def _build_components(config: dict, text_encoder_device: str | torch.device | None = None) -> dict:
    """StableDiffusion3Pipeline's components with random weights, created on the default device and dtype (the text
    encoders on `text_encoder_device` if given)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tok_l, tok_g = _clip_tokenizer(config["clip_l"]["vocab_size"]), _clip_tokenizer(config["clip_g"]["vocab_size"])
    tok_t5 = _t5_tokenizer(config["t5"]["vocab_size"])

    def clip(cfg: dict, tok: CLIPTokenizer) -> CLIPTextModelWithProjection:
        ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        return CLIPTextModelWithProjection(CLIPTextConfig(**{**cfg, "vocab_size": len(tok)}, **ids))

    t5 = T5Config(**{**config["t5"], "vocab_size": len(tok_t5)}, feed_forward_proj="gated-gelu")
    vae, transformer = random_vae(config), random_transformer(config)  # this order fixes the tiny model's weights
    with torch.device(text_encoder_device) if text_encoder_device else nullcontext():
        encoders = dict(text_encoder=clip(config["clip_l"], tok_l), text_encoder_2=clip(config["clip_g"], tok_g),
                        text_encoder_3=T5EncoderModel(t5))
    return dict(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **encoders,
                tokenizer=tok_l, tokenizer_2=tok_g, tokenizer_3=tok_t5)


def random_transformer(config: dict):
    """The SD3 transformer of a config of this module's (TINY_CONFIG, MEDIUM_CONFIG), random weights."""
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(patch_size=2, in_channels=16, out_channels=16, **config["transformer"])


def random_vae(config: dict):
    """The SD3 VAE of a config of this module's, random weights."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
                         scaling_factor=1.5305, shift_factor=0.0609, **config["vae"])


def cache_root() -> Path:
    """$CRD_CACHE, by default (unset or empty) ~/.cache/crd: the tiny model and the compile cache."""
    return Path(os.environ.get("CRD_CACHE") or Path.home() / ".cache" / "crd")  # empty is not the current directory


def _tiny_model_dir(cache_dir: str | Path | None) -> Path:
    """The tiny model's directory, built (with a fixed seed) and saved on first use. A RuntimeError names CRD_CACHE
    (or `cache_dir`) when the build cannot start there: a file in the way, or no permission."""
    from diffusers import StableDiffusion3Pipeline

    path = Path(cache_dir or cache_root() / TINY_DIR_NAME)
    if (path / "model_index.json").exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    except OSError as error:  # its own message names neither CRD_CACHE nor the problem: "[Errno 17] File exists"
        reason = "not a directory" if isinstance(error, FileExistsError) else error.strerror or str(error)
        where = f"cache_dir {path}: its parent" if cache_dir else f"CRD_CACHE {path.parent}"
        role = "" if cache_dir else " (the cache of the tiny model and the compile cache)"
        raise RuntimeError(f"{where}: {reason}{role}") from None
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            components = _build_components(TINY_CONFIG)
            # Zero the decoder's residual branches (resnet conv2, attention output): a deep random decoder with a
            # GroupNorm in every block makes image statistics such as brightness nearly independent of the latents;
            # without those branches it maps latents smoothly to pixels, like a trained VAE, so cheap image rewards
            # respond to the policy in CPU learning checks.
            for name, param in components["vae"].decoder.named_parameters():
                if ".conv2." in name or ".to_out." in name:
                    param.data.zero_()
            StableDiffusion3Pipeline(**components).save_pretrained(tmp)
        tmp.rename(path)  # atomic, so a concurrent or interrupted build is never picked up half-written
    except OSError:
        if not (path / "model_index.json").exists():  # else another process finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def error_line(error: BaseException) -> str:
    """An exception's message as one line of at most 300 characters (its type's name if empty)."""
    return " ".join(str(error).split())[:300] or type(error).__name__


def check_model_path(model: str, flag: str = "--model", marker: str = "model_index.json",
                     kind: str = "a diffusers pipeline") -> None:
    """A RuntimeError naming `flag` and `model` when it is meant as a local directory and is not one holding `kind`
    (a directory with a `marker` file); the loader would call it a malformed hub id. A diffusers
    pipeline must also hold every component folder its model_index.json lists (missing_components).

    Meant as a directory: anything but a hub id `name` or `org/name`, and a hub-id-like path that exists, in whole
    or its first part (`models/sd35` with a local `models/`). TINY and RANDOM_MEDIUM pass.
    """
    path = Path(model).expanduser()
    hub_id = re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", model) is not None
    partly_local = "/" in model and Path(model.split("/")[0]).is_dir()
    if model in (TINY, RANDOM_MEDIUM) or (hub_id and not path.exists() and not partly_local):
        return
    if not path.is_dir():
        raise RuntimeError(f"{flag} {model}: " + ("not a directory" if path.exists() else "no such directory"))
    if not (path / marker).is_file():
        raise RuntimeError(f"{flag} {model}: no {marker} in this directory, so not {kind}")
    if marker == "model_index.json":
        missing = missing_components(path)
        if missing:
            raise RuntimeError(f"{flag} {model}: {missing}")


def missing_components(path: Path) -> str | None:
    """What a diffusers pipeline directory lacks of what its model_index.json lists, or None.

    Each entry of model_index.json that names a [library, class] is a component loaded from the
    subfolder of that name; a null one ([null, null], e.g. SD3's image_encoder) is not loaded.
    Unchecked, a missing folder surfaces at loading as diffusers' "no file named config.json found
    in directory <root>", which names the root, not the folder.
    """
    index_path = path / "model_index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return f"model_index.json cannot be read ({error})"
    if not isinstance(index, dict):
        return "model_index.json is not a JSON object"
    missing = []
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list):  # _class_name, _diffusers_version
            continue
        if None in entry or (path / name).is_dir():
            continue
        missing.append((f"{name}/", str(entry[-1])))
    if not missing:
        return None
    folders = ", ".join(folder for folder, _ in missing)
    classes = ", ".join(cls for _, cls in missing)
    if len(missing) == 1:
        return f"no {folders} folder: model_index.json lists it as the pipeline's {classes}"
    return f"no {folders} folders: model_index.json lists them as the pipeline's {classes}"


def safetensors_error(path) -> str | None:
    """Why safetensors cannot open the file at `path` (a missing, truncated or foreign file), or None: its header and
    size are checked, no tensor is read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt"):
            return None
    except (SafetensorError, OSError) as error:
        return str(error)


def resolution_error(pipe, resolution: int) -> str | None:
    """Why `pipe` cannot generate `resolution` pixels a side, or None: SD3 crops a position embedding of
    pos_embed_max_size patches a side (None: no limit), so a larger image fails at its first sample."""
    config = pipe.transformer.config
    if config.pos_embed_max_size is None:
        return None
    largest = config.pos_embed_max_size * config.patch_size * pipe.vae_scale_factor
    if resolution <= largest:
        return None
    return (f"--resolution {resolution}: this model generates at most {largest} px (pos_embed_max_size "
            f"{config.pos_embed_max_size} x patch {config.patch_size} x VAE {pipe.vae_scale_factor})")


def available_host_memory() -> int | None:
    """Bytes of memory Linux reports available for new allocations (MemAvailable), or None where it reports none."""
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return int(meminfo["MemAvailable"].split()[0]) * 1024  # kB
    except (OSError, KeyError, ValueError):
        return None  # not Linux: let the allocator decide


def random_medium_memory_error(dtype: torch.dtype) -> str | None:
    """Why RANDOM_MEDIUM cannot be built on this machine's CPU in `dtype` (its 7.9B weights would not fit the memory
    Linux reports available: the process would be killed without a word), or None."""
    needed = 7.91e9 * dtype.itemsize
    available = available_host_memory()
    if available is None or needed <= available:
        return None
    return (f"--model {RANDOM_MEDIUM}: its 7.9B random weights need {needed / 2**30:.1f} GiB in "
            f"{str(dtype).split('.')[-1]} on the CPU, and this machine has {available / 2**30:.1f} GiB available (it is "
            "meant for GPU benchmarks)")


def load_pipeline(model: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                  cache_dir: str | Path | None = None,
                  text_encoder_device: str | torch.device | None = None,
                  resolution: int | None = None) -> StableDiffusion3Pipeline:
    """A frozen (eval, no grad) StableDiffusion3Pipeline: hub id, local directory, TINY or RANDOM_MEDIUM.

    The CLIP and T5 text encoders (10.4 GiB of SD3.5-M's 14.7 in bf16) go to `text_encoder_device` if given, else
    to `device` with the rest; encode_prompts returns its embeddings on the transformer's device either way.

    TINY is built locally and saved to `cache_dir` (default $CRD_CACHE/tiny-sd3-v2, CRD_CACHE=~/.cache/crd), then
    loaded through the same `from_pretrained` as a real model. RANDOM_MEDIUM, SD3.5-M with random weights, is
    created directly on `device` in `dtype` ("meta" counts parameters without memory) and never saved.
    A `resolution` the model cannot generate is a RuntimeError (resolution_error).
    """
    from diffusers import StableDiffusion3Pipeline
    from safetensors import SafetensorError

    if model == RANDOM_MEDIUM:
        if torch.device(device).type == "cpu" and (error := random_medium_memory_error(dtype)):
            raise RuntimeError(error)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # no float32 copy; and initialising 8B weights on the CPU takes minutes
        try:
            with torch.device(device):
                pipe = StableDiffusion3Pipeline(**_build_components(MEDIUM_CONFIG, text_encoder_device))
        finally:
            torch.set_default_dtype(default_dtype)
    else:
        check_model_path(model)
        path = _tiny_model_dir(cache_dir) if model == TINY else os.path.expanduser(model)
        try:
            pipe = StableDiffusion3Pipeline.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError, KeyError, SafetensorError) as e:  # KeyError: a model_index.json lacking a part
            reason = error_line(e).rstrip(".")  # diffusers' name the file
            if isinstance(e, SafetensorError):  # safetensors' does not
                reason = next((f"{f}: {reason}" for f in sorted(Path(path).rglob("*.safetensors"))
                               if safetensors_error(f)), reason)
            hint = ("" if os.path.isdir(path) else " For the gated stabilityai/stable-diffusion-3.5-medium, log in "
                    "with `hf auth login` and accept the SD3.5 licence on its model page, or pass a local directory "
                    "that holds a diffusers StableDiffusion3Pipeline.")
            raise RuntimeError(f"could not load the SD3 model {str(path)!r}: {reason}.{hint}") from e
        for name, component in pipe.components.items():
            if isinstance(component, torch.nn.Module):
                component.to(text_encoder_device or device if name.startswith("text_encoder") else device)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval().requires_grad_(False)
    if resolution and (error := resolution_error(pipe, resolution)):
        raise RuntimeError(error)
    return pipe


def _not_a_cut_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(("The following part of your input was truncated",
                                               "Token indices sequence length is longer"))


@contextmanager
def _without_cut_notices():
    """Silence the pipeline's and the tokenizers' notices that a prompt is longer than a text encoder reads."""
    from diffusers import StableDiffusion3Pipeline

    names = (StableDiffusion3Pipeline.__module__, "transformers.tokenization_utils_base")
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addFilter(_not_a_cut_notice)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_not_a_cut_notice)


@torch.no_grad()
def encode_prompts(pipe, prompts: list[str], max_sequence_length: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """CLIP-L + CLIP-G + T5 embeddings (B, 77 + max_sequence_length, D) and pooled (B, P); each distinct prompt once.

    The pipeline's notices of prompts cut at CLIP's 77 tokens (normal for SD3, whose T5 reads the whole prompt) and at
    max_sequence_length are silenced: each would print every cut prompt in every iteration. A cut that hides a
    target is reported once, when the prompts are loaded (`warn_cut_targets`).
    """
    unique = list(dict.fromkeys(prompts))  # a batch repeats each prompt group_size times
    with _without_cut_notices():
        embeds, _, pooled, _ = pipe.encode_prompt(unique, None, None, device=pipe.text_encoder.device,
                                                  do_classifier_free_guidance=False,
                                                  max_sequence_length=max_sequence_length)
    device = pipe.transformer.device
    index = torch.tensor([unique.index(p) for p in prompts], device=device)
    return embeds.to(device)[index], pooled.to(device)[index]


def warn_cut_targets(records: list[dict], pipe, max_sequence_length: int = 256) -> None:
    """Warn once (naming the first one's "source", from data.load_prompts) if prompts have their target text beyond
    the T5 tokens the model reads: no image can be rewarded for text the model is not shown."""
    located = [(r, r["prompt"].find(r["target"])) for r in records]
    located = [(r, start + len(r["target"])) for r, start in located if start >= 0]  # a target not in its prompt: n/a
    if not located:
        return
    with _without_cut_notices():
        token_ids = pipe.tokenizer_3([r["prompt"][:end] for r, end in located])["input_ids"]  # each ends with </s>
    cut = [r for (r, _), ids in zip(located, token_ids) if len(ids) > max_sequence_length]
    if cut:
        logging.getLogger(__name__).warning(
            f"{cut[0]['source']}: the target {cut[0]['target']!r} lies beyond the first {max_sequence_length} T5 tokens "
            f"of its prompt, which are all the model reads (--max-sequence-length); {len(cut)} prompt(s) like it")


def negative_embeddings(pipe, max_sequence_length: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings (1, 77 + max_sequence_length, D) and (1, P) of the empty prompt, encoded once per pipe and length."""
    cache = vars(pipe).setdefault("_negative_cache", {})
    if max_sequence_length not in cache:
        cache[max_sequence_length] = encode_prompts(pipe, [""], max_sequence_length)
    return cache[max_sequence_length]


# ---- LoRA adapters ---------------------------------------------------------------------------------------------------


SLOT = "in_use"  # the one adapter peft's layers run: use_adapter points its tensors at a named adapter's


def add_lora_adapters(transformer, rank: int = 32, alpha: int = 64, names=("policy", "old", "sampling"),
                      targets=LORA_TARGETS) -> None:
    """One gaussian-init LoRA (A random, B zero) per name, all equal to names[0]: the active and only trainable one.

    LoRA tensors are float32 whatever the base dtype (fp32 master weights); everything else is frozen.
    peft's layers always run the adapter SLOT, whose tensors are a named adapter's (see use_adapter).
    """
    from peft import LoraConfig

    with warnings.catch_warnings():  # peft warns that several adapters on one model is unusual; here it is the point
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        slot = [] if SLOT in getattr(transformer, "peft_config", {}) else [SLOT]  # once per model
        for name in (*names, *slot):
            config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(targets))
            transformer.add_adapter(config, adapter_name=name)
    vars(transformer).pop("_lora_layers", None)  # new layers: drop use_adapter's cached list
    for name in names:
        for p in lora_parameters(transformer, name):
            p.data = p.data.float()
    for name in names[1:]:
        load_lora_state_dict(transformer, name, lora_state_dict(transformer, names[0]))
    transformer.requires_grad_(False)
    for p in lora_parameters(transformer, names[0]):
        p.requires_grad_(True)
    for layer in _lora_layers(transformer):
        layer._active_adapter = [SLOT]
        _point_slot_at(layer, names[0])


def _named_lora_parameters(transformer, name: str) -> list[tuple[str, torch.nn.Parameter]]:
    """(key without the adapter name, parameter) of adapter `name`, in module order; keys as in peft's state dicts."""
    pattern = re.compile(rf"\.(lora_[AB])\.{re.escape(name)}\.")
    named = transformer.named_parameters(remove_duplicate=False)  # the slot's tensors are also another adapter's
    return [(pattern.sub(r".\1.", k), p) for k, p in named if pattern.search(k)]


def lora_parameters(transformer, name: str = "policy") -> list[torch.nn.Parameter]:
    """The LoRA tensors of adapter `name`, in a fixed order (the same for every adapter)."""
    return [p for _, p in _named_lora_parameters(transformer, name)]


def lora_state_dict(transformer, name: str) -> dict[str, torch.Tensor]:
    """Adapter `name` as {key: tensor}, keys free of the name; like `state_dict()`, the tensors alias the weights."""
    return {k: p.detach() for k, p in _named_lora_parameters(transformer, name)}


@torch.no_grad()
def load_lora_state_dict(transformer, name: str, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (from `lora_state_dict` of any adapter) into adapter `name`, in place. Other keys: KeyError;
    other shapes (a LoRA of another model with the same layer names): RuntimeError naming the first."""
    params = dict(_named_lora_parameters(transformer, name))
    if params.keys() != state.keys():
        raise KeyError(f"state dict does not match adapter {name!r}: {sorted(params.keys() ^ state.keys())[:3]}")
    for k, p in params.items():
        if state[k].shape != p.shape:
            raise RuntimeError(f"{k} has shape {tuple(state[k].shape)}, the model's layer takes {tuple(p.shape)}")
    for k, p in params.items():
        p.copy_(state[k])


def _lora_layers(transformer) -> list:
    if "_lora_layers" not in vars(transformer):  # collect once: walking SD3.5-M's ~4k modules takes milliseconds
        from peft.tuners.tuners_utils import BaseTunerLayer

        transformer._lora_layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]
    return transformer._lora_layers


def _point_slot_at(layer, name: str) -> None:
    layer.lora_A[SLOT].weight, layer.lora_B[SLOT].weight = layer.lora_A[name].weight, layer.lora_B[name].weight
    layer.scaling[SLOT] = layer.scaling[name]


@contextmanager
def use_adapter(transformer, name: str | None):
    """Run with adapter `name`, or with all adapters disabled (the base model) for None.

    The LoRA layers always run the adapter SLOT, whose tensors are pointed at adapter `name`'s: torch.compile's graphs
    guard on the name of peft's active adapter (one graph per adapter and block kind, a minute of compiling each), not
    on which tensors it holds. peft's set_adapter() would also rewrite requires_grad, freezing or unfreezing the policy
    mid-step; requires_grad is left alone. The base model runs with the adapters disabled rather than through an
    adapter with B = 0, which would save graphs but add LoRA work to every base pass (benchmark/HISTORY.md).
    """
    if name is not None and (name == SLOT or name not in getattr(transformer, "peft_config", {})):
        raise ValueError(f"unknown adapter {name!r}")
    layers = _lora_layers(transformer)
    saved = [(layer._disable_adapters, layer.lora_A[SLOT].weight, layer.lora_B[SLOT].weight, layer.scaling[SLOT])
             for layer in layers]
    for layer in layers:
        layer._disable_adapters = name is None
        if name is not None:
            _point_slot_at(layer, name)
    try:
        yield
    finally:
        for layer, (disabled, a, b, scaling) in zip(layers, saved):
            layer._disable_adapters = disabled
            layer.lora_A[SLOT].weight, layer.lora_B[SLOT].weight, layer.scaling[SLOT] = a, b, scaling


class SnapshotError(ValueError):
    """An EMA decay outside [0, 1] (a schedule's NaN): the snapshot is left as it was."""


@torch.no_grad()
def ema_update_(transformer, target: str, source: str, decay: float) -> None:
    """In place, over LoRA tensors only: target <- decay * target + (1 - decay) * source. A decay
    outside [0, 1], NaN included, raises SnapshotError first: the adapter stays finite."""
    if not 0.0 <= decay <= 1.0:
        raise SnapshotError(f"the {target} adapter's EMA decay is {decay}, outside [0, 1]: its "
                            "schedule (ema_decay and its flag) gave it; the adapter is unchanged")
    torch._foreach_lerp_(lora_parameters(transformer, target), lora_parameters(transformer, source), 1.0 - decay)


def active_adapter(transformer) -> str | None:
    """The adapter `use_adapter` made the LoRA layers run, or None while they run the base model
    (adapters disabled, or none added)."""
    layers = _lora_layers(transformer)
    if not layers or layers[0]._disable_adapters:
        return None
    layer = layers[0]
    for name in transformer.peft_config:
        if name != SLOT and layer.lora_A[name].weight is layer.lora_A[SLOT].weight:
            return name
    raise RuntimeError("the LoRA layers run no named adapter")  # only past use_adapter


def save_peft_lora(state: dict[str, torch.Tensor], config, out_dir: str | Path) -> None:
    """A LoRA as a PEFT adapter directory, as peft's PeftModel.save_pretrained writes one:
    adapter_config.json (`config`, the adapter's LoraConfig: rank, alpha, targets) and
    adapter_model.safetensors, with `state`'s keys (lora_state_dict's, such as
    `transformer_blocks.0.attn.to_q.lora_A.weight`) under `base_model.model.`. vLLM's LoRA loader,
    vLLM-Omni's included, reads this layout."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    tensors = {f"base_model.model.{k}": v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))


def export_lora(transformer, name: str, out_dir: str | Path,
                format: Literal["diffusers", "peft"] = "diffusers") -> None:
    """Adapter `name` in diffusers' LoRA format (safetensors): StableDiffusion3Pipeline.load_lora_weights(out_dir).

    format="peft": a PEFT adapter directory instead (save_peft_lora), the layout vLLM-Omni loads a
    request's LoRA from (omni_rollout)."""
    from diffusers import StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict

    if format == "peft":
        save_peft_lora(lora_state_dict(transformer, name), transformer.peft_config[name], out_dir)
        return
    if format != "diffusers":
        raise ValueError(f"unknown LoRA format {format!r}")
    StableDiffusion3Pipeline.save_lora_weights(
        out_dir, transformer_lora_layers=get_peft_model_state_dict(transformer, adapter_name=name),
        transformer_lora_adapter_metadata=transformer.peft_config[name].to_dict(),  # rank and alpha: the LoRA scale
    )


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
