"""Our brightness reward for Flow-Factory, which loads a reward by its python path (the config's
`reward_model: "flow_factory_reward.Brightness"`, with benchmark/peers on PYTHONPATH).

It scores as ocr_reward.brightness (crd.py --reward brightness) does: the mean of an image's pixels
rounded to 8 bits, over 255. Flow-Factory hands the images over as float tensors in [0, 1]
(use_tensor_inputs), the pipeline's postprocessed output before ours becomes uint8; NaN is black.
"""

import torch
from flow_factory.rewards.abc import PointwiseRewardModel, RewardModelOutput


class Brightness(PointwiseRewardModel):
    required_fields = ("prompt", "image")
    use_tensor_inputs = True

    @torch.no_grad()
    def __call__(self, prompt, image=None):
        pixels = [torch.nan_to_num(x.float(), nan=0.0).clamp(0, 1) for x in image]
        scores = torch.stack([(x * 255).round().mean() / 255 for x in pixels])
        return RewardModelOutput(rewards=scores.to(self.device), extra_info={})
