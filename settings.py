"""The flags of what scores the images, one block shared by the three trainers and evaluate.py
(ScoringArgs), and a run's settings as one flat dict (flat_settings), as the command line,
checkpoints, the ranks' agreement and W&B name them.

    @dataclass
    class Args:
        scoring: ScoringArgs = field(default_factory=ScoringArgs)  # --reward, --reward-model, ...
"""

from dataclasses import dataclass, field, is_dataclass
from typing import Annotated

import tyro

from judges import AESTHETIC_CLIP, PICKSCORE_MODEL, PICKSCORE_PROCESSOR

# A flag of several words kept as one string, as --reward qwen-vl=0.8 pickscore=0.2 and
# --eval-judge paddle flat take them
WORDS = tyro.constructors.PrimitiveConstructorSpec(
    nargs="*", metavar="NAME[=WEIGHT] ...", instance_from_str=" ".join,
    is_instance=lambda value: isinstance(value, str), str_from_instance=str.split)


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # its flags are --reward, not --scoring.reward
@dataclass
class ScoringArgs:
    """What scores the images: the reward (or a mix of rewards), and where its models and servers
    and the judges' models are found."""

    reward: Annotated[str, WORDS] = "qwen-vl"
    """scorer, or a weighted mix (qwen-vl=0.8 pickscore=0.2): qwen-vl, vllm (OpenAI server), paddle
    (PP-OCR), pickscore, aesthetic, flat, brightness, compressibility"""
    reward_model: str = "Qwen/Qwen2.5-VL-3B-Instruct"
    """hub id or local directory of the OCR model (qwen-vl, vllm)"""
    reward_device: str = ""
    """device of the in-process reward model (empty: --device)"""
    reward_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """base URLs of `vllm serve` reward servers (reward vllm)"""
    reward_timeout: float = 60.0
    """seconds a reward server may take to answer one request (reward vllm)"""
    reward_retries: int = 3
    """retries, with backoff, of an image whose request failed (reward vllm)"""
    pickscore_model: str = PICKSCORE_MODEL
    """hub id or local directory of PickScore's CLIP model (reward or judge pickscore)"""
    pickscore_processor: str = PICKSCORE_PROCESSOR
    """hub id or local directory of PickScore's tokenizer and image processor"""
    aesthetic_model: str = AESTHETIC_CLIP
    """hub id or local directory of the CLIP whose embeddings the aesthetic head reads"""
    aesthetic_head: str = ""
    """the LAION aesthetic head, sac+logos+ava1-l14-linearMSE.pth (reward or judge aesthetic)"""


def flat_settings(args):
    """{field: value} of an Args (or a namespace of its fields), a nested block's fields beside the
    others: each field is one flag."""
    settings = {}
    for name, value in vars(args).items():
        settings |= flat_settings(value) if is_dataclass(value) else {name: value}
    return settings
