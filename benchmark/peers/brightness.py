"""The brightness reward as crd.py --reward brightness scores it (ocr_reward.brightness): the mean
of an image's pixels rounded to 8 bits, over 255, for the peers' trainers, which hand their images
over as float tensors in [0, 1] (the pipeline's output before ours becomes uint8); NaN is black."""

import torch


def brightness(images) -> torch.Tensor:
    pixels = [torch.nan_to_num(x.float(), nan=0.0).clamp(0, 1) for x in images]
    return torch.stack([(x * 255).round().mean() / 255 for x in pixels])
