"""Choose each algorithm's settings from a sweep on the validation words, by a rule noise can't
steer.

    python benchmark/ocr_proxy/choose.py --report runs/sweep/benchmark.json  # prints --variants

The sweep is a run_benchmark.py call with `--eval-split validation`, two or more seeds and variants
per algorithm (`ALGO:NAME=ARGS`, and the unrestricted ones every algorithm runs). Each run's score
of a held-out prompt is its mean over the validations of the second half of training: those at
iterations >= half of the last iteration that every run of the sweep reached (so a time limit that
cut some runs short cuts all alike). For each algorithm the rule keeps the variant named "default"
(or, without one, the variant written first) unless another beats it by more than the interval:
the lower bound of the 95% CI of (variant - default), compare.difference over seeds x prompts, is
above 0. Of such variants it takes the one with the largest lower bound. A variant no better than
the default thus displaces it in 1 sweep in 40, not in every other one by a noisy lead. It prints
one `ALGO:tuned=ARGS` per algorithm, the arguments for a run_benchmark.py call on the test words,
and writes the table behind the choice with --table.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.ocr_proxy.compare import difference, load  # noqa: E402
from benchmark.ocr_proxy.run_benchmark import Args, plan, run_name  # noqa: E402


@dataclass
class Options:
    report: str
    """benchmark.json of the sweep, or a results file holding it under 'benchmark'"""
    table: str = ""
    """also write the scores behind the choice to this JSON file"""
    name: str = "tuned"
    """variant name of the chosen settings in the printed arguments"""


def choose(report: dict, name: str = "tuned") -> tuple[dict[str, str], dict]:
    """({algorithm: its chosen ALGO:NAME=ARGS}, the table behind it) of a sweep's benchmark.json."""
    sweep = Args(**{k: v for k, v in report["args"].items() if k != "pretrain"})
    if len(sweep.seeds) < 2:
        sys.exit(f"choose.py: error: the sweep ran one seed (--seeds {sweep.seeds[0]}): the rule's "
                 "interval needs two or more")
    arguments, jobs = plan(sweep)
    validations = {run_name(*job): report["runs"][run_name(*job)].get("per_prompt", {})
                   for job in jobs}
    unvalidated = [run for run, scores in validations.items() if not scores]
    if unvalidated:
        sys.exit(f"choose.py: error: {', '.join(unvalidated)}: no per-prompt validation scores")
    last = min(max(map(int, scores)) for scores in validations.values())
    validated = set.intersection(*(set(map(int, s)) for s in validations.values()))
    kept = sorted(i for i in validated if i >= last / 2)
    # each run's score of each prompt: its mean over the kept validations
    per_prompt = {run: np.mean([scores[str(i)] for i in kept], axis=0)
                  for run, scores in validations.items()}
    table = {"iterations": kept, "variants": {},
             "rule": "the default, unless the 95% CI of (variant - default) over seeds x prompts "
                     "of the mean over these validations lies above 0: then the variant of the "
                     "largest lower bound"}
    chosen = {}
    for algo in sweep.algorithms:
        variants = list(dict.fromkeys(v for a, v in arguments if a == algo))
        default = "default" if "default" in variants else variants[0]
        scores = {v: np.array([per_prompt[run_name(algo, v, seed)] for seed in sweep.seeds])
                  for v in variants}
        rows = {v: {"score": float(x.mean()), "arguments": arguments[algo, v]}
                for v, x in scores.items()}
        for variant in variants:
            if variant != default:
                rows[variant]["vs_default"] = difference(scores[variant], scores[default])
        ahead = [v for v in variants if v != default and rows[v]["vs_default"]["low"] > 0]
        best = max(ahead, key=lambda v: rows[v]["vs_default"]["low"], default=default)
        table["variants"][algo] = {**rows, "chosen": best}
        chosen[algo] = f"{algo}:{name}={arguments[algo, best]}"
    return chosen, table


def versus(row: dict) -> str:
    """A variant's difference from the default with its interval, as the table prints it."""
    if "vs_default" not in row:
        return "the default"
    d = row["vs_default"]
    return f"{d['diff']:+.3f} vs the default, 95% CI [{d['low']:+.3f}, {d['high']:+.3f}]"


if __name__ == "__main__":
    options = tyro.cli(Options)
    chosen, table = choose(load(options.report, "choose.py"), options.name)
    if options.table:
        Path(options.table).write_text(json.dumps(table, indent=1))
    for algo, rows in table["variants"].items():
        listed = ", ".join(f"{v} {row['score']:.3f} ({versus(row)})"
                           for v, row in rows.items() if v != "chosen")
        print(f"choose: {algo}: {listed} -> {rows['chosen']}", file=sys.stderr)
    print(shlex.join(chosen.values()))
