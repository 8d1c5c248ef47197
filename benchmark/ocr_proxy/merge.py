"""One benchmark report from several of the same design: more seeds or more groups, run apart.

    python benchmark/ocr_proxy/merge.py OUT.json A/benchmark.json B/benchmark.json ...

The runs are deterministic given their seed and base (a run reproduced to the bit on another H200
and beside other runs), so runs of one design in different calls belong to one table. The reports
must share the pretrained base (the same per-prompt base scores on every protocol they share),
the held-out words and every argument that shapes a run; a variant name given different arguments
is refused. A run that two reports both hold is kept once where it reproduces (the same score on
every word at every validation and final protocol both have), else refused. The pool's PP-OCR
runtime (--ocr-engine) may differ only where such a run shows that the runtimes' reads gave the
same run. How often the runs validated may differ: a
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
            "mps", "final_guidances", "final_scores", "kl_only_control", "eval_every",
            "blocking_sync", "final_score_workers"}
# the pretraining arguments that only pace its progress lines
PRETRAIN_PER_CALL = {"out", "progress_every_s", "ocr_workers", "time_cap_s"}
# arguments run_benchmark gained after reports were kept, with what a report without one ran
ADDED_LATER = {"ocr_engine": "onnxruntime"}


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


def argument(report: dict, key: str):
    return report["args"].get(key, ADDED_LATER.get(key))


def differs(run: dict, earlier: dict, finals: dict, earlier_finals: dict) -> str | None:
    """How a run held by two reports fails to reproduce, in words; None where every score both
    have is the same on every word."""
    validated = set(run.get("per_prompt", {})) & set(earlier.get("per_prompt", {}))
    if not validated - {"0"}:
        return "the two share no validation after iteration 0"
    for iteration in sorted(validated, key=int):
        if run["per_prompt"][iteration] != earlier["per_prompt"][iteration]:
            return f"the validation at iteration {iteration} differs"
    scored = finals.get("per_prompt", {})
    earlier_scored = earlier_finals.get("per_prompt", {})
    for protocol in sorted(set(scored) & set(earlier_scored)):
        if scored[protocol] != earlier_scored[protocol]:
            return f"the final score at {protocol} differs"
    return None


def merge(reports: dict[str, dict]) -> dict:
    """The union of `reports` ({path: report}), after the checks of the module docstring."""
    (first_path, first), *others = reports.items()
    merged = {"args": dict(first["args"]), "eval_words": first["eval_words"],
              "base": first.get("base"), "runs": {}, "final_scores": {}, "return_codes": {},
              "failed": [], "parts": [], "reproduced": []}
    variants, held_by, checked = {}, {}, set()
    for path, report in reports.items():
        for key in set(report["args"]) | set(first["args"]):
            if key in PER_CALL or key in ("pretrain", "ocr_engine"):
                continue
            if argument(report, key) != argument(first, key):
                fail(f"{path}: --{key.replace('_', '-')} {argument(report, key)!r} where "
                     f"{first_path} has {argument(first, key)!r}")
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
        engine = argument(report, "ocr_engine")
        finals = {name: scores for name, scores in report.get("final_scores", {}).items()
                  if name != "base"}
        for name, run in report["runs"].items():
            if name not in merged["runs"]:
                held_by[name] = path
                continue
            earlier = held_by[name]
            where = differs(run, merged["runs"][name], finals.get(name, {}),
                            merged["final_scores"].get(name, {}))
            if where:
                fail(f"{path}: run {name} is also in {earlier} and does not reproduce it: {where}")
            merged["reproduced"].append({"run": name, "reports": [earlier, path]})
            checked.add(frozenset((engine, argument(reports[earlier], "ocr_engine"))))
        new = {name: run for name, run in report["runs"].items() if held_by[name] == path}
        merged["runs"].update(new)
        merged["return_codes"].update({name: code for name, code in
                                       report.get("return_codes", {}).items() if name in new})
        merged["failed"] += [name for name in report.get("failed", []) if name in new]
        merged["final_scores"].update({name: s for name, s in finals.items() if name in new})
        merged["parts"].append({"report": path, "seeds": report["args"]["seeds"],
                                "algorithms": report["args"]["algorithms"], "ocr_engine": engine,
                                "phases_s": report.get("phases_s"), "usage": report.get("usage")})
    engines = {argument(report, "ocr_engine") for report in reports.values()}
    for path, report in others:
        engine, first_engine = argument(report, "ocr_engine"), argument(first, "ocr_engine")
        if engine != first_engine and frozenset((engine, first_engine)) not in checked:
            fail(f"{path}: --ocr-engine {engine} where {first_path} ran {first_engine}, and no "
                 "run held by a report of each shows that the two read alike")
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
    merged["args"]["ocr_engine"] = sorted(engines) if len(engines) > 1 else engines.pop()
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
