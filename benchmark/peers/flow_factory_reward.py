"""Our brightness reward for Flow-Factory, which loads a reward by its python path (the config's
`reward_model: "flow_factory_reward.Brightness"`, with benchmark/peers on PYTHONPATH).

It scores as crd.py --reward brightness does (benchmark/peers/brightness.py); Flow-Factory hands
the images over as float tensors in [0, 1] (use_tensor_inputs).
"""

import torch
from brightness import brightness
from flow_factory.rewards.abc import PointwiseRewardModel, RewardModelOutput


class Brightness(PointwiseRewardModel):
    required_fields = ("prompt", "image")
    use_tensor_inputs = True

    @torch.no_grad()
    def __call__(self, prompt, image=None):
        return RewardModelOutput(rewards=brightness(image).to(self.device), extra_info={})
