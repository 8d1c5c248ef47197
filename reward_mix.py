"""A weighted mix of rewards: the --reward spec ("qwen-vl=0.8 pickscore=0.2") parsed and written
canonically, a MixScorer that scores each component, (B, K), and Flow-Factory's two aggregations of
the components into the one reward that the trainer's advantages normalise (sum, gdpo).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from judges import JUDGES, Judge, judge_names, make_judge
from ocr_reward import READERS, to_pil


AGGREGATIONS = ("sum", "gdpo")  # Flow-Factory's advantage_aggregation


# the magnitudes of a normal float32, the type in which weighted_sum weighs the rewards
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def parse_mix(spec) -> dict[str, float]:
    """{name: weight} of a mix spec, in its order: "qwen-vl=0.8 pickscore=0.2", or a list of such
    items (["qwen-vl=0.8", "pickscore=0.2"]); commas separate too. A bare name weighs 1, so
    "qwen-vl" is today's single reward. A weight is any number but 0 that float32, in which the
    rewards are weighted, holds (a negative one penalises: flat=-0.5). A ValueError names the
    first bad item in one line."""
    items = [spec] if isinstance(spec, str) else list(spec)
    items = [item for part in items for item in re.split(r"[\s,]+", part) if item]
    if not items:
        raise ValueError("empty reward mix: give at least one reward, e.g. qwen-vl or "
                         "qwen-vl=0.8 pickscore=0.2")
    weights: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if name not in JUDGES:
            raise ValueError(f"reward mix item {item!r}: unknown reward {name!r}; choose from "
                             f"{', '.join(JUDGES)}")
        if name in weights:
            raise ValueError(f"reward mix item {item!r}: {name} is listed twice")
        try:
            weight = float(value) if sep else 1.0
        except ValueError:
            weight = None
        if weight is None or not np.isfinite(weight) or weight == 0:
            raise ValueError(f"reward mix item {item!r}: the weight must be a finite number "
                             f"other than 0, as in {name}=0.5")
        if not FLOAT32_TINY <= abs(weight) <= FLOAT32_MAX:  # else inf, or 0 or subnormal there
            raise ValueError(f"reward mix item {item!r}: the weight {weight:g} is outside "
                             f"float32's range, in which rewards are weighted (magnitudes "
                             f"{FLOAT32_TINY:.3g} to {FLOAT32_MAX:.3g}): every weighted reward "
                             "would be inf or 0")
        weights[name] = weight
    return weights


def normalize_reward_specs(reward, judges, judge_flag: str, urls, aesthetic_head,
                           judged: bool = True) -> tuple[str, str]:
    """The canonical (reward, judges) specs of the trainers' --reward and --eval-judge, or
    evaluate.py's --reward and --judge (judge_flag names it), as checkpoints, run names and
    results record them: ("qwen-vl=0.8 pickscore=0.2", "paddle flat"; "none": no judge). A
    ValueError in one line names the flag: a bad spec, or a vllm or aesthetic reward or judge
    without its --reward-urls or --aesthetic-head. judged: whether the judges are scored (a
    trainer that never validates loads none)."""
    try:
        reward = format_mix(parse_mix(reward))
    except ValueError as error:
        raise ValueError(f"--reward: {error}") from None
    try:
        names = judge_names(judges)
    except ValueError as error:
        raise ValueError(f"{judge_flag}: {error}") from None
    scorers = set(parse_mix(reward)) | set(names if judged else [])
    if "vllm" in scorers and not urls:
        raise ValueError("--reward-urls: the vllm reward or judge needs at least one server URL")
    if "aesthetic" in scorers and not aesthetic_head:
        raise ValueError("--aesthetic-head: the aesthetic reward or judge needs the LAION head's "
                         "file (sac+logos+ava1-l14-linearMSE.pth)")
    return reward, " ".join(names) or "none"


def format_mix(weights: dict[str, float]) -> str:
    """The canonical spec of a mix ("qwen-vl=0.8 pickscore=0.2"); one reward of weight 1 is its
    bare name, so a one-reward run is named as today. parse_mix(format_mix(w)) == w."""
    if len(weights) == 1 and next(iter(weights.values())) == 1.0:
        return next(iter(weights))
    numbers = {name: repr(float(weight)) for name, weight in weights.items()}  # shortest exact
    return " ".join(f"{name}={n[:-2] if n.endswith('.0') else n}" for name, n in numbers.items())


class MixScorer:
    """The components of a reward mix, each a Judge, scored on the same images:
    mix(images, targets, prompts) gives (B, K) float32 scores, a column per component in `names`
    order, and the transcriptions of the first component that reads text (qwen-vl, vllm,
    paddle; else ""). The components run at once, a thread each, so that a reward server and an
    in-process model overlap. weights: {name: weight}, as parse_mix gives them."""

    def __init__(self, judges: list[Judge], weights: dict[str, float]):
        if [judge.name for judge in judges] != list(weights):
            raise ValueError(f"judges {[j.name for j in judges]} do not match the weights "
                             f"{list(weights)}")
        self.judges, self.weights, self.names = judges, dict(weights), list(weights)
        self.pool = ThreadPoolExecutor(len(judges)) if len(judges) > 1 else None

    def __call__(self, images, targets, prompts=None):
        images = to_pil(images)
        if self.pool is None:
            results = [self.judges[0](images, targets, prompts)]
        else:
            futures = [self.pool.submit(judge, images, targets, prompts) for judge in self.judges]
            results = [future.result() for future in futures]
        scores = np.stack([np.asarray(s, dtype=np.float32) for s, _ in results], axis=1)
        read = [texts for judge, (_, texts) in zip(self.judges, results) if judge.name in READERS]
        return scores, read[0] if read else [""] * len(images)

    @property
    def spec(self) -> str:
        return format_mix(self.weights)


def make_mix(spec, **options) -> MixScorer:
    """The reward mix of `spec` (parse_mix's syntax), each component make_judge(name, **options)."""
    weights = parse_mix(spec)
    return MixScorer([make_judge(name, **options) for name in weights], weights)


def weighted_sum(rewards, weights):
    """sum_k w_k r_k: rewards (N, K) torch, K weights -> (N,) in the rewards' dtype. One reward
    of weight 1 gives its column bit for bit (x * 1.0 and a sum of one term are exact).
    Flow-Factory's weighted sum: src/flow_factory/advantage/advantage_processor.py, 361-366."""
    import torch

    weights = torch.as_tensor(list(weights), dtype=rewards.dtype, device=rewards.device)
    if rewards.ndim != 2 or rewards.shape[1] != len(weights):
        raise ValueError(f"rewards {tuple(rewards.shape)} need one column per weight "
                         f"({len(weights)})")
    return (rewards * weights).sum(1)


def group_standardize(rewards, group_size: int, floor: float = 1e-6):
    """(r - group mean) / max(group std, floor) of one reward (N,), with groups of group_size
    consecutive images and the population std: GDPO's per-reward normalisation as Flow-Factory
    writes it (advantage_processor.py, lines 457-464). A constant group gives zeros."""
    groups = rewards.reshape(-1, group_size)
    std = groups.std(1, unbiased=False, keepdim=True).clamp_min(floor)
    return ((groups - groups.mean(1, keepdim=True)) / std).flatten()


def aggregate_rewards(rewards, weights, group_size: int, aggregation: str = "sum"):
    """The one reward (N,) that a mix's advantages normalise; rewards (N, K) torch, groups of
    group_size consecutive images. Flow-Factory's two aggregations (advantage_aggregation: sum |
    gdpo; dispatched in src/flow_factory/advantage/advantage_processor.py, lines 133-137):
      sum:  sum_k w_k r_k, the weighted reward (compute_weighted_sum, lines 361-386); a reward of
            a larger scale weighs more.
      gdpo: sum_k w_k z_k, z_k = group_standardize(r_k) (compute_gdpo, lines 455-468); each
            reward counts by its weight whatever its scale.
    One reward of weight 1 under sum is its column bit for bit."""
    import torch

    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose from "
                         f"{', '.join(AGGREGATIONS)}")
    weights = list(weights)
    if aggregation == "sum":
        return weighted_sum(rewards, weights)
    standardized = [group_standardize(rewards[:, k], group_size) for k in range(rewards.shape[1])]
    return weighted_sum(torch.stack(standardized, 1), weights)


def mix_advantages(rewards, weights, group_size: int, normalize, aggregation: str = "sum"):
    """Advantages (N,) of a reward mix; rewards (N, K) torch, every image of the iteration:
    normalize(aggregate_rewards(rewards, weights, group_size, aggregation)).

    normalize: the trainer's own advantages of one reward, (N,) -> (N,), e.g.
    lambda r: group_advantages(r, group_size, global_std, adv_clip); the advantage formula
    stays in the trainer. With one reward of weight 1, sum gives normalize(rewards[:, 0]) bit
    for bit: today's advantages. gdpo's last step in Flow-Factory is a batch normalisation,
    (c - mean) / std over all images (lines 469-470); c is centred in every group already, so a
    normalize by the global std is that step (but for its epsilon), then the trainer's clip.
    With the per-group std, each group is divided by its own std instead.
    """
    return normalize(aggregate_rewards(rewards, weights, group_size, aggregation))


def component_means(rewards, names) -> dict[str, float]:
    """{name: the mean of its column} of (N, K) rewards, for train/reward_<name>."""
    return {name: float(rewards[:, k].double().mean()) for k, name in enumerate(names)}
