"""SD3.5 as the trainers and evaluate.py load it: a hub id or a local diffusers folder, `tiny` (a small model of the
same classes, built once and cached, for the CPU demo and the tests) or `random-sd3.5-medium` (full-size random
weights); the checks of a model folder before it loads; the prompts' text embeddings.

    pipe = load_pipeline("stabilityai/stable-diffusion-3.5-medium", "cuda", torch.bfloat16)  # or TINY, RANDOM_MEDIUM
    embeds, pooled = encode_prompts(pipe, prompts)          # (B, 333, 4096), (B, 2048)
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import string
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch

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
MEDIUM_HUB_ID = "stabilityai/stable-diffusion-3.5-medium"  # its shapes are MEDIUM_CONFIG's
TINY_DIR_NAME = "tiny-sd3-v2"  # bump when the tiny model changes, so stale caches are not reused

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
