"""Validation: the held-out prompts rendered by the adapter the trainer names, on the main process,
scored by the reward and each --eval-judge while the next images sample, and logged: scalars, a
captioned grid, the transcriptions, and every prompt's scores in the run's EVAL_SCORES."""

import json
import time

import numpy as np
import torch

from checkpoint import EVAL_SCORES
from judges import judge_names, make_guarded_judges
from lora_adapters import use_adapter
from ocr_reward import READERS
from reward_mix import component_means, parse_mix
from rollout import captioned_grid, sample
from scoring import ScoringThread, image_rewards, scorer_options
from sd3 import encode_prompts


def judge_tag(name):
    """A judge's TensorBoard tag: eval/<name>; PP-OCR's keeps the eval/reward_paddle of the runs
    that had it as their one judge."""
    return "eval/reward_paddle" if name == "paddle" else f"eval/{name}"


class Validation:
    """The held-out prompts rendered by `adapter`, the one the trainer names (image i from seed
    eval_seed + i) at --eval-guidance, on the main process; the run's checkpoints record it, and
    evaluate.py scores it by default. The scorer and each --eval-judge (in a thread of its own)
    read each chunk of images while the next one samples. Logs the reward (a mix's weighted sum,
    and each component as eval/reward_<name>), each judge (judge_tag), a captioned grid, the
    transcriptions and the time it took, and appends every prompt's scores to EVAL_SCORES. A
    judge that is part of --reward is not scored again.
    A judge that fails (to load, or in a validation: its server died, its model raised) is a
    second opinion lost, not the run: one warning line names it and its error, the run goes on
    without it (no eval/<judge> from then on) and summary.json's failed_judges says why."""

    def __init__(self, pipe, eval_set, args, scorer, negative, run, adapter):
        self.pipe = pipe
        self.adapter = adapter
        run.validation_adapter = adapter  # checkpoints record it: evaluate.py's default --adapter
        self.args = args
        self.scorer = scorer
        self.negative = negative
        self.run = run
        self.prompts = [r["prompt"] for r in eval_set]
        self.targets = [r["target"] for r in eval_set]
        self.weights = parse_mix(args.scoring.reward)
        self.judges = []  # ScoringThreads of judges.GuardedJudges
        self.listed_judges = []  # as listed, failed ones too: the first is the summary's judge
        if run.main_process and args.validation.eval_every:
            names = [n for n in judge_names(args.validation.eval_judge) if n not in self.weights]
            judges = make_guarded_judges(names, **scorer_options(args.scoring, run.device))
            self.listed_judges = names
            self.judges = [ScoringThread(judge) for judge in judges]
            self.drop_failed_judges("loading the models")

    def due(self, iteration):
        """Whether this process validates after `iteration` iterations (0: before training, which
        a resumed run has done)."""
        if iteration == 0 and self.run.state["iteration"]:  # resumed: its model is not the base's
            return False
        every = self.args.validation.eval_every
        last = iteration == self.args.num_iterations
        return bool(self.run.main_process and every and (iteration % every == 0 or last))

    def __call__(self, iteration):
        """Validate, and keep the summary's entry in the run's state (Run.record_validation):
        [iteration, reward mean, the first judge's mean or None], and {judge: mean} after them
        unless the judges are PP-OCR's alone (or none)."""
        args = self.args
        settings = args.validation  # --eval-steps, --eval-guidance, --eval-seed
        writer = self.run.writer
        started = time.perf_counter()
        self.run.phase = f"the validation after iteration {iteration}"
        embeds, pooled = encode_prompts(self.pipe, self.prompts, args.max_sequence_length)
        seeds = [settings.eval_seed + i for i in range(len(self.prompts))]
        with use_adapter(self.pipe.transformer, self.adapter), self.run.autocast:
            samples = sample(self.pipe, embeds, pooled, seeds, settings.eval_steps,
                             settings.eval_guidance, args.resolution, args.resolution,
                             args.forward_batch_size,
                             negative_embeds=self.negative[0], negative_pooled=self.negative[1],
                             progress=True, on_decoded=self.score_chunk)
        images = samples["images"]
        if bad := int((~samples["finite"]).sum()):
            self.run.warn("validation images were NaN or inf", self.run.phase,
                          f"{bad} of {len(images)} validation images are NaN or inf (a diverged "
                          f"{self.adapter} adapter?): they decode black and are scored as black "
                          "images")
        components, texts = self.scorer.take()
        scores = image_rewards(components, self.weights)
        writer.add_scalar("eval/reward_mean", float(np.mean(scores)), iteration)
        if np.ndim(components) == 2:
            for name, value in component_means(torch.as_tensor(components), self.weights).items():
                writer.add_scalar(f"eval/reward_{name}", value, iteration)
        captions = [f"{s:.2f} {t}" for s, t in zip(scores, self.targets)]
        transcriptions = [f"{t} -> {x!r}" for t, x in zip(self.targets, texts)]
        judged = {}  # {name: (scores, texts)}
        if self.judges:  # they add the wait for the part of them not hidden behind the sampling
            waited = time.perf_counter()
            judged = {judge.scorer.name: judge.take() for judge in self.judges}
            judged = {name: judged[name] for name in self.drop_failed_judges(self.run.phase)}
            writer.add_scalar("perf/eval_judge_wait_s", time.perf_counter() - waited, iteration)
            for name, (judge_scores, _) in judged.items():
                writer.add_scalar(judge_tag(name), float(np.mean(judge_scores)), iteration)
            notes = [", ".join(f"{name} {judge_scores[i]:.2f}"
                               for name, (judge_scores, _) in judged.items())
                     for i in range(len(scores))]
            captions = [f"{s:.2f} ({note}) {t}" for s, note, t in zip(scores, notes, self.targets)]
            for name, (_, judge_texts) in judged.items():
                if name in READERS:
                    transcriptions = [f"{line} ({name}: {x!r})"
                                      for line, x in zip(transcriptions, judge_texts)]
        self.save_scores(iteration, scores, judged)
        grid = captioned_grid(images[:16], captions[:16])
        writer.add_image("eval/images", grid, iteration, dataformats="HWC")
        writer.add_text("eval/transcriptions", "\n\n".join(transcriptions), iteration)
        writer.add_scalar("perf/eval_s", time.perf_counter() - started, iteration)
        self.run.phase = None
        means = {name: float(np.mean(judge_scores)) for name, (judge_scores, _) in judged.items()}
        first = self.listed_judges[0] if self.listed_judges else None
        entry = [iteration, float(np.mean(scores)), means.get(first)]
        self.run.record_validation(entry + [means] if means and self.listed_judges != ["paddle"]
                                   else entry)

    def save_scores(self, iteration, scores, judged):
        """One line of EVAL_SCORES: every held-out prompt's reward and judge scores in the eval
        set's order, so that runs validated on the same prompts compare prompt by prompt."""
        line = {"iteration": iteration, "targets": list(self.targets),
                "reward": [float(s) for s in scores],
                "judges": {name: [float(s) for s in judge_scores]
                           for name, (judge_scores, _) in judged.items()}}
        with open(self.run.dir / EVAL_SCORES, "a") as file:
            file.write(json.dumps(line) + "\n")  # one write: a kill leaves at most a torn last line

    def drop_failed_judges(self, where):
        """Warn once of each judge that has failed, in one line, and score with it no more; returns
        the names of the judges that go on."""
        for judge in [judge for judge in self.judges if judge.failure]:
            judge.cancel()
            self.judges.remove(judge)
            self.run.failed_judges[judge.scorer.name] = judge.failure
            print(f"{where}: warning: {judge.failure}; the run goes on without it (summary.json: "
                  "failed_judges)", flush=True)
        return [judge.scorer.name for judge in self.judges]

    def score_chunk(self, rows, images):
        self.scorer.submit(images, self.targets[rows], self.prompts[rows])
        for judge in self.judges:
            judge.submit(images, self.targets[rows], self.prompts[rows])
