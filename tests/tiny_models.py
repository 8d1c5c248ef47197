"""Tiny random reward models for the tests: a CLIP (PickScore's and the aesthetic judge's
architecture), a LAION-layout aesthetic head and a Qwen2.5-VL, each saved where the real model's
from_pretrained (or torch.load) calls load it."""

from __future__ import annotations

from pathlib import Path

from judges import aesthetic_head
from ocr_reward import MROPE, save_random_qwen_vl


TINY_QWEN = dict(  # images capped at 112x112 pixels (16 image tokens) so that CPU tests stay fast
    text=dict(vocab_size=None, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
              rope_parameters={**MROPE, "mrope_section": [2, 3, 3]}),
    vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                fullatt_block_indexes=[1]),
    pixels=(56 * 56, 112 * 112))


def build_tiny_clip(out_dir: str | Path, projection_dim: int = 16, logit_scale: float = 2.0,
                    seed: int = 0) -> Path:
    """Save a random tiny CLIPModel (224-pixel images in 32-pixel patches, 2 layers of width
    32), a byte-level CLIP tokenizer (no merges) and CLIP's image processor to out_dir, which
    PickScoreScorer(out_dir, out_dir) and AestheticScorer(out_dir, head) then load through the
    from_pretrained calls that load the real models. logit_scale: the log of the logit scale
    (the real PickScore's exp is ~100; 2.0 tells a test whether it is exponentiated)."""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[])
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    text = dict(vocab_size=len(tokenizer), max_position_embeddings=77, **layers, **ids)
    vision = dict(image_size=224, patch_size=32, **layers)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim,
                        logit_scale_init_value=logit_scale)
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    CLIPImageProcessorPil().save_pretrained(out_dir)  # CLIP's: 224 bicubic, crop 224, mean/std
    return Path(out_dir)


def save_random_aesthetic_head(path: str | Path, in_features: int = 16, seed: int = 0) -> Path:
    """A random LAION-layout aesthetic head for in_features-d embeddings, saved as the real one
    is (a state dict)."""
    import torch

    torch.manual_seed(seed)
    torch.save(aesthetic_head(in_features).state_dict(), path)
    return Path(path)


def build_tiny_qwen_vl(out_dir: str | Path) -> Path:
    """Save a random tiny Qwen2.5-VL (TINY_QWEN: same classes as the real one) with a byte-level
    tokenizer to out_dir.

    make_scorer("qwen-vl", model_path=out_dir) then loads it through the same from_pretrained calls
    as the real model.
    """
    import torch

    torch.manual_seed(0)
    save_random_qwen_vl(str(out_dir), TINY_QWEN)
    return Path(out_dir)
