"""Held-out PP-OCR of a benchmark's last checkpoints and of its base at several CFG scales: whether
an algorithm's adapters lose under guidance, and how that grows with the scale.

    python benchmark/ocr_proxy/guidance.py --out runs/ocr_proxy --seeds 0 1 2 --guidances 1 1.5 3 4.5

It scores, at each scale and the validation protocol's steps, the base and each run
{algo}_seed{S} of --out (its sampling adapter, and its policy adapter at the first scale), on the
words the runs validated on, with the pool's PP-OCR, and writes guidance.json in --out: means and
per-prompt scores, as run_benchmark.py's final scores.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.ocr_proxy import pretrain  # noqa: E402
from benchmark.ocr_proxy.ocr_pool import OcrPool  # noqa: E402
from benchmark.ocr_proxy.render import split_words  # noqa: E402
from benchmark.ocr_proxy.final_scores import final_scores  # noqa: E402
from benchmark.ocr_proxy.run_benchmark import ALGORITHMS  # noqa: E402


@dataclass
class Options:
    out: str
    """a run_benchmark.py --out whose runs have checkpoints"""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """the runs' seeds to score"""
    guidances: list[float] = field(default_factory=lambda: [1.0, 1.5, 3.0, 4.5])
    """CFG scales"""
    ocr_workers: int = 8
    """PP-OCR engines of the pool"""


def main(options: Options) -> dict:
    out = Path(options.out)
    report = json.loads((out / "benchmark.json").read_text())
    args = report["args"]
    task = pretrain.Task(**args["pretrain"]["task"])
    steps = args["pretrain"]["validation_steps"]
    words = split_words(task, args["pretrain"]["seed"])[args["eval_split"]][: args["eval_prompts"]]
    runs = {f"{algo}_seed{seed}": out / "runs" / f"{algo}_seed{seed}"
            for seed in options.seeds for algo in ALGORITHMS if (out / "runs" / f"{algo}_seed{seed}").is_dir()}
    if not runs:
        sys.exit(f"guidance.py: error: --out {out}: no runs {{algo}}_seed{{S}} of --seeds")
    pool = OcrPool(options.ocr_workers)  # forked before CUDA starts
    protocols = {f"cfg{g:g}_{steps}steps": (g, steps) for g in options.guidances}
    scores = final_scores(Path(args["pretrain"]["out"]).expanduser(), runs, words, pool,
                          args["pretrain"]["max_sequence_length"], task.resolution, protocols)
    pool.close()
    partial = out / ".guidance.json.tmp"
    partial.write_text(json.dumps({"protocols": protocols, "scores": scores}, indent=1))
    partial.replace(out / "guidance.json")
    for name, entry in scores.items():
        print(name, {k: round(v, 3) for k, v in entry.items() if isinstance(v, float)}, flush=True)
    return scores


if __name__ == "__main__":
    main(tyro.cli(Options))
