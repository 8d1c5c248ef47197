"""One benchmark report from several of the same design: more seeds or more groups, run apart.

    python benchmark/ocr_proxy/merge.py OUT.json A/benchmark.json B/benchmark.json ...

The runs are deterministic given their seed (a run reproduces to the bit on another machine or
beside other runs), so runs of one design in different calls belong to one table. The reports
must share the pretrained base (the same per-prompt base scores on every protocol they share),
the held-out words and every argument that shapes a run; a run name two reports both hold, or a
variant name given different arguments, is refused. How often the runs validated may differ: a
validation samples from its own seeds and changes no run (a run validated every 75 iterations
scores, at 75, 150 and 225, what it scores validated every 25). OUT holds the union of the runs,
their final scores and return codes, with each report's seeds, phases and machine use under
'parts'; compare.py reads it (the iterations every run validated, and the final scores of the runs
that have them).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

# arguments that say only how or where a call ran, not what a run is
PER_CALL = {"out", "seeds", "time_limit_s", "resume", "algorithms", "variants", "ocr_workers",
            "mps", "final_guidances", "final_scores", "kl_only_control", "eval_every"}
# the pretraining arguments that only pace its progress lines
PRETRAIN_PER_CALL = {"out", "progress_every_s", "ocr_workers", "time_cap_s"}


@dataclass
class Options:
    out: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="OUT")]
    """the merged report to write (JSON)"""
    reports: Annotated[tuple[str, ...], tyro.conf.Positional, tyro.conf.arg(metavar="REPORT")]
    """run_benchmark.py's benchmark.json files, or results files holding one under 'benchmark'"""


def fail(message: str):
    sys.exit(f"merge.py: error: {message}")


def load(path: str) -> dict:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        fail(f"{path}: not a readable JSON file ({type(error).__name__}: {error})")
    report = report.get("benchmark", report) if isinstance(report, dict) else report
    if not isinstance(report, dict) or not isinstance(report.get("runs"), dict):
        fail(f"{path}: no 'runs': not a benchmark.json of run_benchmark.py")
    return report


def base_scores(report: dict) -> dict[str, list]:
    """{protocol: the base model's per-prompt scores} of a report's final scores."""
    return report.get("final_scores", {}).get("base", {}).get("per_prompt", {})


def variant_args(args: dict) -> dict[tuple[str, str], str]:
    """{(algorithm, variant name): its arguments} of --variants' [ALGO:]NAME=ARGS entries."""
    named = {}
    for entry in args.get("variants", []):
        head, _, arguments = entry.partition("=")
        algo, _, name = head.rpartition(":")
        for one in [algo] if algo else args.get("algorithms", []):
            named[(one, name)] = arguments
    return named


def merge(reports: dict[str, dict]) -> dict:
    """The union of `reports` ({path: report}), after the checks of the module docstring."""
    (first_path, first), *others = reports.items()
    merged = {"args": dict(first["args"]), "eval_words": first["eval_words"],
              "base": first.get("base"), "runs": {}, "final_scores": {}, "return_codes": {},
              "failed": [], "parts": []}
    variants = {}
    for path, report in reports.items():
        for key in set(report["args"]) | set(first["args"]):
            if key in PER_CALL or key == "pretrain":
                continue
            if report["args"].get(key) != first["args"].get(key):
                fail(f"{path}: --{key.replace('_', '-')} {report['args'].get(key)!r} where "
                     f"{first_path} has {first['args'].get(key)!r}")
        pretrain, first_pretrain = report["args"]["pretrain"], first["args"]["pretrain"]
        for key in set(pretrain) & set(first_pretrain) - PRETRAIN_PER_CALL:
            if pretrain[key] != first_pretrain[key]:
                fail(f"{path}: --pretrain.{key.replace('_', '-')} {pretrain[key]!r} where "
                     f"{first_path} has {first_pretrain[key]!r}")
        if report["eval_words"] != first["eval_words"]:
            fail(f"{path}: other held-out words than {first_path}'s")
        base, first_base = base_scores(report), base_scores(first)
        for protocol in set(base) & set(first_base):
            if base[protocol] != first_base[protocol]:
                fail(f"{path}: the base scores other per-prompt values at {protocol} than in "
                     f"{first_path}: another pretrained base")
        for key, arguments in variant_args(report["args"]).items():
            if variants.setdefault(key, (arguments, path))[0] != arguments:
                fail(f"{path}: variant {key[0]}:{key[1]} runs {arguments!r} where "
                     f"{variants[key][1]} ran {variants[key][0]!r}")
        for name in report["runs"]:
            if name in merged["runs"]:
                fail(f"{path}: run {name} is also in an earlier report")
        merged["runs"].update(report["runs"])
        merged["return_codes"].update(report.get("return_codes", {}))
        merged["failed"] += report.get("failed", [])
        finals = {name: scores for name, scores in report.get("final_scores", {}).items()
                  if name != "base"}
        merged["final_scores"].update(finals)
        merged["parts"].append({"report": path, "seeds": report["args"]["seeds"],
                                "algorithms": report["args"]["algorithms"],
                                "phases_s": report.get("phases_s"), "usage": report.get("usage")})
    # the base at the protocols every report that scored it scored it at, the first such report's
    # values (equal to the others'); a report run without final scores has none to share
    scored = [report for report in reports.values() if base_scores(report)]
    shared = set.intersection(*(set(base_scores(report)) for report in scored)) if scored else set()
    if shared:
        base = scored[0]["final_scores"]["base"]
        kept = {key: value for key, value in base.items() if key in shared}
        per_prompt = {key: value for key, value in base["per_prompt"].items() if key in shared}
        merged["final_scores"] = {"base": {**kept, "per_prompt": per_prompt},
                                  **merged["final_scores"]}
    merged["args"]["seeds"] = sorted({s for r in reports.values() for s in r["args"]["seeds"]})
    merged["args"]["algorithms"] = sorted({a for r in reports.values()
                                           for a in r["args"]["algorithms"]})
    merged["args"]["variants"] = list(dict.fromkeys(v for r in reports.values()
                                                    for v in r["args"].get("variants", [])))
    for key in ("out", "time_limit_s", "resume"):
        merged["args"].pop(key, None)
    return merged


def main(options: Options) -> dict:
    if len(options.reports) < 2:
        fail("give OUT and at least two reports to merge")
    merged = merge({path: load(path) for path in options.reports})
    partial = Path(options.out).with_name(f".{Path(options.out).name}.tmp")
    partial.write_text(json.dumps(merged, indent=1))
    partial.replace(options.out)  # at once: a reader never sees half a file
    seeds = merged["args"]["seeds"]
    print(f"merge.py: {len(merged['runs'])} runs ({', '.join(merged['args']['algorithms'])}; "
          f"seeds {seeds[0]}-{seeds[-1]}) of {len(options.reports)} reports in {options.out}")
    return merged


if __name__ == "__main__":
    main(tyro.cli(Options))
