"""Choose each algorithm's settings from a sweep on the validation words, by a fixed rule.

    python benchmark/ocr_proxy/choose.py --report runs/sweep/benchmark.json  # prints --variants

The sweep is a run_benchmark.py call with `--eval-split validation` and variants per algorithm
(`ALGO:NAME=ARGS`, and the unrestricted ones every algorithm runs). For each algorithm the rule
takes the variant with the highest held-out score averaged over seeds and over the validations of
the second half of training: those at iterations >= half of the last iteration that every run of
the sweep reached (so a time limit that cut some runs short cuts all alike). A tie keeps the
variant written first. It prints one `ALGO:tuned=ARGS` per algorithm, the arguments for a
run_benchmark.py call on the test words, and writes the table behind the choice with --table.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.ocr_proxy.run_benchmark import Args, plan, run_name  # noqa: E402


@dataclass
class Options:
    report: str
    """benchmark.json of the sweep"""
    table: str = ""
    """also write the scores behind the choice to this JSON file"""
    name: str = "tuned"
    """variant name of the chosen settings in the printed arguments"""


def choose(report: dict, name: str = "tuned") -> tuple[dict[str, str], dict]:
    """({algorithm: its chosen ALGO:NAME=ARGS}, the table behind it) of a sweep's benchmark.json."""
    sweep = Args(**{k: v for k, v in report["args"].items() if k != "pretrain"})
    arguments, jobs = plan(sweep)
    evals = {run_name(*job): dict(map(tuple, report["runs"][run_name(*job)]["eval"]))
             for job in jobs}
    unvalidated = [run for run, curve in evals.items() if not curve]
    if unvalidated:
        sys.exit(f"choose.py: error: {', '.join(unvalidated)}: no validation")
    last = min(max(curve) for curve in evals.values())
    kept = sorted(i for i in set.intersection(*(set(c) for c in evals.values())) if i >= last / 2)
    table = {"iterations": kept, "rule": "mean over seeds and these validations", "variants": {}}
    chosen = {}
    for algo in sweep.algorithms:
        scores = {}
        for variant in dict.fromkeys(v for a, v in arguments if a == algo):
            curves = [evals[run_name(algo, variant, seed)] for seed in sweep.seeds]
            scores[variant] = sum(c[i] for c in curves for i in kept) / (len(curves) * len(kept))
        best = max(scores, key=scores.get)  # max keeps the first of equal scores
        table["variants"][algo] = {v: {"score": s, "arguments": arguments[algo, v]}
                                   for v, s in scores.items()}
        table["variants"][algo]["chosen"] = best
        chosen[algo] = f"{algo}:{name}={arguments[algo, best]}"
    return chosen, table


if __name__ == "__main__":
    options = tyro.cli(Options)
    chosen, table = choose(json.loads(Path(options.report).read_text()), options.name)
    if options.table:
        Path(options.table).write_text(json.dumps(table, indent=1))
    for algo, scores in table["variants"].items():
        listed = ", ".join(f"{v} {s['score']:.3f}" for v, s in scores.items() if v != "chosen")
        print(f"choose: {algo}: {listed} -> {scores['chosen']}", file=sys.stderr)
    print(shlex.join(chosen.values()))
