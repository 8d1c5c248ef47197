"""Differences between the benchmark's algorithms, with intervals that count seeds and prompts.

    python benchmark/ocr_proxy/compare.py runs/ocr_proxy/benchmark.json  # prints markdown tables
    python benchmark/ocr_proxy/compare.py benchmark/results/X.json --iteration 200 --json d.json

Each run scores the same held-out prompts in the same order with the same evaluation seeds, so a
group's scores (an algorithm or variant over its seeds) form a matrix X[s, p], seeds x prompts,
whose prompts every group shares. The difference of two groups is the difference of their means
over seeds and prompts, and its variance is a method-of-moments estimate under a crossed random-
effects model: score = mean + seed effect + prompt effect + group-by-prompt interaction + noise.

- Different groups (independent runs; prompts shared): the prompt effect is the same for both, so
  it cancels. V = var_s(m_a)/S_a + var_s(m_b)/S_b + max(0, var_p(d) - R_a/S_a - R_b/S_b)/P, where
  m_x are the per-seed means over prompts (they carry the run-to-run variance and the image noise),
  d the per-prompt difference of the seed-averaged scores, and R_x the two-way ANOVA residual mean
  square of X (the noise). var_p(d) less its noise part is the group-by-prompt interaction: how
  far the difference would move on other prompts of the task.
- paired_seeds (a rewarded run and its control on the same seed, in the same order; prompts
  shared as above): the one-sample version on D = A - B:
  V = var_s(row means of D)/S + max(0, var_p(column means of D) - R_D/S)/P.
- pair_prompts=False (as if each group had its own prompts, to show what sharing them saves):
  each group's own V_x = var_s(m_x)/S_x + max(0, var_p(column means of X) - R_x/S_x)/P, summed.

Variances have ddof=1. The interval is a t interval with Welch-Satterthwaite degrees of freedom
df = V^2 / sum(c_i^2 / df_i) over the nonzero components c_i of V, a seed term having S_x - 1
degrees of freedom and a prompt term P - 1. The MDE is the smallest true difference that a
two-sided test at 1 - confidence detects with probability `power`: (t_{1-alpha/2} + t_power) * se.
A group of one seed has no seed variance to estimate, so it gets no interval.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import tyro
from scipy import stats

# run_benchmark.KL_ONLY, the variant of --kl-only-control: that module loads torch in seconds
KL_ONLY = "klonly"


@dataclass
class Options:
    report: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="REPORT")]
    """run_benchmark.py's benchmark.json, or a results file holding it under 'benchmark'"""
    iteration: int | None = None
    """validation iteration to compare (default: the last one that every run validated)"""
    json: str = ""
    """also write the numbers to this JSON file"""
    seeds: list[int] | None = None
    """compare only the runs of these seeds, e.g. those run after a setting was picked on others"""


def residual_mean_square(x: np.ndarray) -> float:
    """The two-way ANOVA residual mean square of a seeds x prompts matrix: the noise's variance."""
    residual = x - x.mean(axis=1, keepdims=True) - x.mean(axis=0, keepdims=True) + x.mean()
    return float((residual**2).sum() / ((x.shape[0] - 1) * (x.shape[1] - 1)))


def variance_components(x: np.ndarray) -> list[tuple[float, int]]:
    """[(seed term, its df), (prompt term, its df)] of the variance of x's mean (one sample)."""
    seeds, prompts = x.shape
    seed_term = np.var(x.mean(axis=1), ddof=1) / seeds
    prompt_variance = np.var(x.mean(axis=0), ddof=1)
    prompt_term = max(0.0, prompt_variance - residual_mean_square(x) / seeds) / prompts
    return [(seed_term, seeds - 1), (prompt_term, prompts - 1)]


def difference(a, b, paired_seeds: bool = False, pair_prompts: bool = True,
               confidence: float = 0.95, power: float = 0.8) -> dict:
    """mean(a) - mean(b) of two seeds x prompts score matrices, its standard error, df, interval
    at `confidence` and minimum detectable difference at `power` (see the module docstring)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"scores of shapes {a.shape} and {b.shape}: give two seeds x prompts "
                         "matrices of the same prompts")
    if min(a.shape[0], b.shape[0]) < 2:
        raise ValueError("a group of one seed: its seed variance is unknown, so no interval")
    if a.shape[1] < 2:
        raise ValueError("one prompt: the prompt variance is unknown, so there is no interval")
    if paired_seeds and a.shape != b.shape:
        raise ValueError(f"paired seeds: {a.shape[0]} and {b.shape[0]} seeds")
    if paired_seeds:
        components = variance_components(a - b)
    elif pair_prompts:
        prompts = a.shape[1]
        interaction = np.var(a.mean(axis=0) - b.mean(axis=0), ddof=1)
        noise = residual_mean_square(a) / a.shape[0] + residual_mean_square(b) / b.shape[0]
        components = [(np.var(a.mean(axis=1), ddof=1) / a.shape[0], a.shape[0] - 1),
                      (np.var(b.mean(axis=1), ddof=1) / b.shape[0], b.shape[0] - 1),
                      (max(0.0, interaction - noise) / prompts, prompts - 1)]
    else:
        components = variance_components(a) + variance_components(b)
    variance = sum(c for c, _ in components)
    # a variance of exactly 0 (scores identical where they vary) has no sampling error to count
    df = variance**2 / sum(c**2 / d for c, d in components if c > 0) if variance > 0 else math.inf
    se = math.sqrt(variance)
    diff = float(a.mean() - b.mean())
    half = stats.t.ppf(1 - (1 - confidence) / 2, df) * se
    return {"mean_a": float(a.mean()), "mean_b": float(b.mean()), "diff": diff, "se": se,
            "df": float(df), "low": float(diff - half), "high": float(diff + half),
            "mde": float(half + stats.t.ppf(power, df) * se),
            "n_seeds_a": a.shape[0], "n_seeds_b": b.shape[0], "n_prompts": a.shape[1]}


def parse_run(name: str) -> tuple[str, str, int]:
    """(algorithm, variant, seed) of run_benchmark.run_name's '{algo}[_{variant}]_seed{S}'."""
    head, _, seed = name.rpartition("_seed")
    algo, _, variant = head.partition("_")  # the algorithms' names hold no '_'
    return algo, variant, int(seed)


def load(path: str, program: str = "compare.py") -> dict:
    """The benchmark report in `path`, bare or under 'benchmark'; one line for what it lacks."""
    def fail(message):
        sys.exit(f"{program}: error: {path}: {message}")

    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        fail(f"not a readable JSON file ({type(error).__name__}: {error})")
    report = report.get("benchmark", report) if isinstance(report, dict) else report
    runs = report.get("runs") if isinstance(report, dict) else None
    if not runs or not isinstance(runs, dict):
        fail("no 'runs': not a benchmark.json of run_benchmark.py")
    if not any("per_prompt" in run for run in runs.values()):
        fail("no per-prompt scores (runs[...]['per_prompt']): written by a run_benchmark.py from "
             "before them, so no intervals")
    for name, run in runs.items():
        try:
            parse_run(name)
        except ValueError:
            fail(f"run {name!r}: not a name of run_benchmark.py's ALGO[_VARIANT]_seedS")
        if not run.get("per_prompt"):
            fail(f"run {name}: no per-prompt validation (did it fail?)")
    return report


def protocols(report: dict, iteration: int | None, path: str) -> dict[str, dict[str, list]]:
    """{protocol: {run or 'base': per-prompt scores}}: the validation at `iteration`, then each
    final-score protocol."""
    runs = report["runs"]
    validated = set.intersection(*(set(map(int, run["per_prompt"])) for run in runs.values()))
    if iteration is None and not validated:
        sys.exit(f"compare.py: error: {path}: no validation iteration that every run reached")
    iteration = max(validated) if iteration is None else iteration
    lacking = [name for name, run in runs.items() if str(iteration) not in run["per_prompt"]]
    if lacking:
        sys.exit(f"compare.py: error: --iteration {iteration}: not validated by {len(lacking)} of "
                 f"{len(runs)} runs (e.g. {lacking[0]}); every run validated {sorted(validated)}")
    scores = {f"validation at iteration {iteration}": {name: run["per_prompt"][str(iteration)]
                                                         for name, run in runs.items()}}
    for name, final in report.get("final_scores", {}).items():
        for protocol, per_prompt in final.get("per_prompt", {}).items():
            scores.setdefault(protocol, {})[name] = per_prompt
    return scores


def compare(scores: dict[str, list], path: str) -> dict:
    """Group means, every pair's difference and each rewarded group's gain over its KL-only
    control (paired by seed) of one protocol's {run or 'base': per-prompt scores}."""
    if len({len(s) for s in scores.values()}) > 1:
        sys.exit(f"compare.py: error: {path}: runs scored different numbers of prompts "
                 f"({', '.join(f'{name} {len(s)}' for name, s in scores.items())})")
    groups = {}
    for name in sorted((n for n in scores if n != "base"), key=parse_run):
        algo, variant, seed = parse_run(name)
        groups.setdefault((algo, variant), {})[seed] = scores[name]
    matrices = {f"{algo} {variant}".strip(): np.array(list(seeds.values()), dtype=np.float64)
                for (algo, variant), seeds in groups.items()}
    seeds = {f"{algo} {variant}".strip(): list(s) for (algo, variant), s in groups.items()}
    result = {"prompts": len(next(iter(scores.values()))),
              "groups": {label: {"mean": float(x.mean()), "seeds": seeds[label]}
                         for label, x in matrices.items()},
              "differences": [], "reward_attributable": []}
    if "base" in scores:
        result["base"] = float(np.mean(scores["base"]))
    labels = list(matrices)
    try:
        for i, first in enumerate(labels):
            for second in labels[i + 1 :]:
                result["differences"].append(
                    {"a": first, "b": second, **difference(matrices[first], matrices[second])})
        for (algo, variant), label in zip(groups, labels):
            control = f"{algo} {KL_ONLY}"
            if variant != KL_ONLY and seeds.get(control) == seeds[label]:
                result["reward_attributable"].append(
                    {"a": label, "b": control,
                     **difference(matrices[label], matrices[control], paired_seeds=True)})
    except ValueError as error:
        counts = ", ".join(f"{label} {len(s)}" for label, s in seeds.items())
        sys.exit(f"compare.py: error: {path}: {error} (seeds: {counts})")
    return result


def markdown(protocol: str, result: dict) -> str:
    """One protocol's tables: group means, then differences with their intervals."""
    lines = [f"### {protocol} ({result['prompts']} prompts)", "", "| group | mean | seeds |",
             "|---|---:|---:|"]
    if "base" in result:
        lines.append(f"| base | {result['base']:.3f} | - |")
    lines += [f"| {label} | {group['mean']:.3f} | {len(group['seeds'])} |"
              for label, group in result["groups"].items()]
    tables = (("difference", result["differences"]),
              ("reward-attributable gain (paired by seed)", result["reward_attributable"]))
    for title, rows in tables:
        if rows:
            lines += ["", f"| {title} | diff | 95% CI | MDE (80% power) | CI excludes 0 |",
                      "|---|---:|---:|---:|:-:|"]
        for r in rows:
            excludes = "yes" if r["low"] > 0 or r["high"] < 0 else "no"
            lines.append(f"| {r['a']} - {r['b']} | {r['diff']:+.3f} | "
                         f"[{r['low']:+.3f}, {r['high']:+.3f}] | {r['mde']:.3f} | {excludes} |")
    return "\n".join(lines)


def only_seeds(report: dict, seeds: list[int], path: str) -> dict:
    """The report with the runs (and their final scores) of `seeds` alone."""
    kept = [name for name in report["runs"] if parse_run(name)[2] in seeds]
    if not kept:
        sys.exit(f"compare.py: error: --seeds {' '.join(map(str, seeds))}: no run of {path} has "
                 "one of them")
    finals = {name: scores for name, scores in report.get("final_scores", {}).items()
              if name in kept or name == "base"}
    return {**report, "runs": {name: report["runs"][name] for name in kept},
            "final_scores": finals}


def main(options: Options) -> dict:
    report = load(options.report)
    if options.seeds is not None:
        report = only_seeds(report, options.seeds, options.report)
    results = {protocol: compare(scores, options.report)
               for protocol, scores in protocols(report, options.iteration, options.report).items()}
    print(f"Held-out PP-OCR of {options.report}: means over seeds x prompts; a difference's 95% CI "
          "counts run-to-run, image and prompt-sampling variance (the prompts are shared, so their "
          "difficulty cancels); MDE: the smallest true difference detected at 80% power.")
    for protocol, result in results.items():
        print("\n" + markdown(protocol, result))
    if options.json:
        partial = Path(options.json).with_name(f".{Path(options.json).name}.tmp")
        partial.write_text(json.dumps(results, indent=1))
        partial.replace(options.json)  # at once: a reader never sees half a file
    return results


if __name__ == "__main__":
    main(tyro.cli(Options))
