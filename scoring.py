"""Scorers as a run reads them: in a thread of their own while the GPU works (ScoringThread), a
failure turned into NaN scores that stop the run on every rank (GuardedScorer), --reward's scorer
made from the trainers' flags (TrainingScorer), and the reward statistics a run logs."""

from __future__ import annotations

import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from judges import JUDGES, make_judge
from ocr_reward import Scorer, ServerError
from reward_mix import aggregate_rewards, component_means, make_mix, parse_mix, weighted_sum


class GuardedScorer:
    """A scorer that does not raise: when the wrapped one fails (a reward server still failing after
    its retries, or any other error), it returns NaN scores, and `failure` keeps the first failure
    in one line. The trainers see the NaN among the gathered rewards on every rank and stop together
    before training on them, keeping the last completed iteration, rather than dying mid-iteration
    with a traceback. An error that is not a server's (a bug in a scorer) also prints its traceback,
    which its fix needs."""

    def __init__(self, scorer: Scorer):
        self.scorer, self.failure = scorer, None

    def __call__(self, images, targets, *prompts):
        """prompts: passed on when given (a Judge, a MixScorer); a MixScorer's NaNs are (B, K)."""
        try:
            return self.scorer(images, targets, *prompts)
        except Exception as error:
            if not isinstance(error, ServerError):
                traceback.print_exc()
            said = error if isinstance(error, ServerError) else repr(error)
            self.failure = self.failure or f"the reward failed: {said}"
            names = getattr(self.scorer, "names", None)  # a MixScorer's
            shape = (len(targets), len(names)) if names else len(targets)
            return np.full(shape, np.nan, dtype=np.float32), [""] * len(targets)


class ScoringThread:
    """A scorer that reads in a thread of its own, so that the GPU works meanwhile: `submit` images
    now, `take` their scores later. One thread: the jobs of one scorer never overlap each other."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer
        self.executor = ThreadPoolExecutor(1)
        self.pending = []  # futures of (scores, texts, seconds), in submission order
        self.seconds = 0.0  # the scorer's own time for the jobs taken last

    @property
    def failure(self) -> str | None:
        """The first failure of a GuardedScorer, in one line; None while it has not failed."""
        return getattr(self.scorer, "failure", None)

    def submit(self, images, targets, prompts=None) -> None:
        """prompts: for a Judge or a MixScorer (PickScore reads them); plain scorers take none."""
        extra = () if prompts is None else (prompts,)
        self.pending.append(self.executor.submit(self._score, images, targets, *extra))

    def take(self, jobs: int | None = None) -> tuple[np.ndarray, list[str]]:
        """Scores (N,) and transcriptions of the first `jobs` jobs not yet taken (all: None), in
        order."""
        taken = self.pending[:jobs] if jobs is not None else self.pending
        self.pending = self.pending[len(taken):]
        results = [future.result() for future in taken]
        self.seconds = sum(seconds for _, _, seconds in results)
        scores = np.concatenate([scores for scores, _, _ in results]) if results else np.zeros(0)
        return scores, [text for _, texts, _ in results for text in texts]

    def cancel(self) -> None:
        """Drop the jobs not started yet (a signal ends the program)."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _score(self, images, targets, *prompts):
        started = time.perf_counter()
        scores, texts = self.scorer(images, targets, *prompts)
        return scores, texts, time.perf_counter() - started


def scorer_options(scoring, device):
    """make_judge's options from --reward's block (settings.ScoringArgs): where the reward models
    run and how they are found."""
    return dict(device=scoring.reward_device or str(device), model_path=scoring.reward_model,
                urls=scoring.reward_urls, timeout=scoring.reward_timeout,
                max_retries=scoring.reward_retries, pickscore_model=scoring.pickscore_model,
                pickscore_processor=scoring.pickscore_processor,
                aesthetic_model=scoring.aesthetic_model,
                aesthetic_head_path=scoring.aesthetic_head or None)


class TrainingScorer(ScoringThread):
    """--reward, read in a thread of its own while the GPU works (ScoringThread); a failure
    gives NaN scores (GuardedScorer), which stop the run on every rank before it trains on them.
    One reward (a bare name) scores each image; a mix (qwen-vl=0.8 pickscore=0.2, or any
    --reward-aggregation gdpo) gives a column per component, and aggregate() makes them one."""

    def __init__(self, args, device, batch_size):
        reward = args.scoring.reward
        self.weights = parse_mix(reward)
        self.aggregation = args.reward_aggregation
        self.group_size = args.group_size
        self.mix = reward not in JUDGES or args.reward_aggregation != "sum"
        options = {**scorer_options(args.scoring, device), "batch_size": batch_size}
        make = make_mix if self.mix else make_judge
        scorer = make(reward, **options)
        super().__init__(GuardedScorer(scorer))

    def aggregate(self, rewards):
        """The reward that the trainer's advantages normalise, (N,): one reward as it is, a mix's
        (N, K) by --reward-aggregation, Flow-Factory's sum or gdpo (reward_mix.aggregate_rewards).
        """
        if not self.mix:
            return rewards
        return aggregate_rewards(rewards, self.weights.values(), self.group_size, self.aggregation)


def training_scorer(args, device, batch_size):
    """--reward in a thread of its own (TrainingScorer)."""
    return TrainingScorer(args, device, batch_size)


def reward_stats(rewards, group_size, weights):
    """train/*: the reward (N,), or a mix's (N, K) components' weighted sum, with each component
    as train/reward_<name>."""
    components = {}
    if rewards.ndim == 2:
        components = {f"train/reward_{name}": value
                      for name, value in component_means(rewards, weights).items()}
        rewards = weighted_sum(rewards, weights.values())
    groups = rewards.view(-1, group_size)
    return {"train/reward_mean": rewards.mean(), "train/reward_std": rewards.std(unbiased=False),
            "train/zero_std_group_frac": (groups.std(1) == 0).float().mean(), **components}


def image_rewards(scores, weights):
    """One reward's scores (N,) as they are; a mix's (N, K) as their weighted sum (N,)."""
    if np.ndim(scores) == 1:
        return scores
    return weighted_sum(torch.as_tensor(scores), weights.values()).numpy()
