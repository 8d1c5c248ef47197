"""Held-out PP-OCR of the base model and of each run's last checkpoint, at several protocols.

    scores = final_scores(model, {"crd_seed0": runs / "crd_seed0"}, words, pool, 32, 128, protocols)

    # a benchmark's runs scored in the driver and in 8 processes: wall times, the same scores?
    python benchmark/ocr_proxy/final_scores.py --out runs/ocr_proxy --workers 0 8 --json speed.json

The images are sampled in this process, or with `workers` > 0 in that many processes side by side
(each loads the base once), while this process reads each model's images with the pool as they come.
Either way each image is the same computation on the same inputs, so the scores are the same
(tests/test_ocr_proxy.py checks it).
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import checkpoint  # noqa: E402
import lora_adapters  # noqa: E402
import sd3  # noqa: E402
from benchmark.ocr_proxy import pretrain  # noqa: E402
from benchmark.ocr_proxy.ocr_pool import OcrPool  # noqa: E402


def validated_adapter(checkpoint_dir: Path) -> str:
    """The adapter a checkpoint's trainer validated with (its trainer_state.json records it;
    "sampling" in checkpoints from before it): a fork's on-policy run is scored with its policy, as
    it validated."""
    return checkpoint.read_checkpoint_state(checkpoint_dir).get("validation_adapter") or "sampling"


class Sampler:
    """The base pipeline as the trainers load it (bf16 on CUDA), sampling held-out words at
    protocols."""

    def __init__(self, model: Path, max_sequence_length: int, resolution: int):
        cuda = torch.cuda.is_available()
        self.pipe = sd3.load_pipeline(str(model), "cuda" if cuda else "cpu",
                                      torch.bfloat16 if cuda else torch.float32)
        self.autocast = torch.autocast("cuda", torch.bfloat16, enabled=cuda)
        self.max_sequence_length, self.resolution = max_sequence_length, resolution

    def embed(self, prompts: list[str]):
        return sd3.encode_prompts(self.pipe, prompts, self.max_sequence_length)

    def at_protocols(self, adapter: str | None, words: list[str], named: dict,
                     prefix: str = "") -> dict:
        with lora_adapters.use_adapter(self.pipe.transformer, adapter):
            return {prefix + name: pretrain.sample_words(self.pipe, self.embed, words, n, g,
                                                         self.resolution, self.autocast)
                    for name, (g, n) in named.items()}

    def sample(self, index: int, run_dir: Path | None, words: list[str],
               protocols: dict) -> dict | None:
        """{"images": {protocol: (N, H, W, 3) uint8}} of the base (run_dir None), or of run_dir's
        last checkpoint with the adapter its trainer validated with, and with its policy at the
        first protocol ("policy_" + its name), with "checkpoint" and "adapter"; and the seconds it
        took ("sample_s"). None for a run with no checkpoint."""
        began = time.perf_counter()
        if run_dir is None:
            images = self.at_protocols(None, words, protocols)
            return {"images": images, "sample_s": time.perf_counter() - began}
        checkpoints = checkpoint.checkpoints(run_dir)
        if not checkpoints:
            return None
        adapters, trained = checkpoint.read_adapters(checkpoints[-1])
        validated = validated_adapter(checkpoints[-1])
        adapter = f"run{index}"  # run names may hold dots, which peft's module names cannot
        transformer = self.pipe.transformer
        lora_adapters.add_lora_adapters(transformer, trained["lora_rank"], trained["lora_alpha"],
                                        names=(adapter,))
        lora_adapters.load_lora_state_dict(transformer, adapter, adapters[validated])
        images = self.at_protocols(adapter, words, protocols)
        lora_adapters.load_lora_state_dict(transformer, adapter, adapters["policy"])
        validation = dict([next(iter(protocols.items()))])
        images |= self.at_protocols(adapter, words, validation, "policy_")
        return {"checkpoint": checkpoints[-1].name, "adapter": validated, "images": images,
                "sample_s": time.perf_counter() - began}


_sampler = None  # a sampling process's Sampler


def _start_sampler(*args):
    global _sampler
    _sampler = Sampler(*args)


def _sample(*args) -> dict | None:
    return _sampler.sample(*args)


def final_scores(model: Path, runs: dict[str, Path], words: list[str], pool: OcrPool,
                 max_sequence_length: int, resolution: int, protocols: dict[str, tuple[float, int]],
                 workers: int = 0, timings: dict | None = None) -> dict:
    """Held-out PP-OCR at `protocols` ({name: (CFG scale, ODE steps)}, the validation protocol
    first) of the base model and of each run's last checkpoint, with the adapter its trainer
    validated with (validated_adapter), and with the trained policy at the validation protocol
    ("policy_" + its name): CRD's sampling adapter is an EMA of the policy (here decay 0.9 from
    iteration 98 on; 0.999 from iteration 104 with crd.py's defaults), DGPO's follows it closely.
    Each entry keeps every word's score too, in `words`' order: {"per_prompt": {protocol: [...]}}.
    workers > 0: sampled in that many processes (spawned: this process may have used CUDA).
    timings, if given, gets each model's seconds of sampling and of reading ("sample_s",
    "read_s")."""
    timings = {} if timings is None else timings
    jobs = [(index, run_dir, words, protocols)
            for index, run_dir in enumerate([None, *runs.values()])]
    names = ["base", *runs]
    if not workers:
        sampler = Sampler(model, max_sequence_length, resolution)
        return _read(names, (sampler.sample(*job) for job in jobs), words, pool, timings)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, spawn, _start_sampler,
                             (model, max_sequence_length, resolution)) as executor:
        futures = [executor.submit(_sample, *job) for job in jobs]
        return _read(names, (future.result() for future in futures), words, pool, timings)


def _read(names: list[str], sampled, words: list[str], pool: OcrPool, timings: dict) -> dict:
    """{name: {"checkpoint", "adapter", protocol means..., "per_prompt"}} of each sampled entry,
    read with the pool as it comes (the next ones are sampled meanwhile), every protocol's images in
    one batch of reads; a run with no checkpoint is left out."""
    scores = {}
    for name, entry in zip(names, sampled):
        if entry is None:
            continue
        timings.setdefault("sample_s", []).append(round(entry.pop("sample_s"), 3))
        began = time.perf_counter()
        images = entry.pop("images")
        read = pool.score(np.concatenate(list(images.values())), words * len(images))[0]
        per_prompt = dict(zip(images, np.split(read, len(images))))
        timings.setdefault("read_s", []).append(round(time.perf_counter() - began, 3))
        means = {protocol: float(s.mean()) for protocol, s in per_prompt.items()}
        scores[name] = {**entry, **means,
                        "per_prompt": {protocol: s.tolist() for protocol, s in per_prompt.items()}}
    return scores


@dataclass
class Options:
    out: str
    """a run_benchmark.py --out whose runs have checkpoints"""
    runs: list[str] = field(default_factory=list)
    """the runs scored (default: every run of the report)"""
    workers: list[int] = field(default_factory=lambda: [0, 8])
    """sampling processes of each timing (0: this process)"""
    ocr_workers: int = 8
    """PP-OCR engines of the pool"""
    json: str = ""
    """write the timings here too"""


def main(options: Options) -> dict:
    """The timings (what --json holds), and the first timing's scores."""
    out = Path(options.out)
    report = json.loads((out / "benchmark.json").read_text())
    args = report["args"]
    if not options.workers:
        sys.exit("final_scores.py: error: --workers: give one or more counts (0: this process)")
    unknown = sorted(set(options.runs) - set(report["return_codes"]))
    if unknown:
        sys.exit(f"final_scores.py: error: --runs {' '.join(unknown)}: not runs of "
                 f"{out / 'benchmark.json'}")
    runs = {name: out / "runs" / name for name in options.runs or report["return_codes"]}
    protocols = pretrain.protocols(SimpleNamespace(**args["pretrain"]))
    pool = OcrPool(options.ocr_workers)  # forked before CUDA starts
    model, pretrained = Path(args["pretrain"]["out"]).expanduser(), args["pretrain"]
    timings, first = {}, None
    for workers in options.workers:
        began, split = time.perf_counter(), {}
        scores = final_scores(model, runs, report["eval_words"], pool,
                              pretrained["max_sequence_length"], pretrained["task"]["resolution"],
                              protocols, workers, split)
        first = first or scores
        timing = {"wall_s": round(time.perf_counter() - began, 2), "same_scores": scores == first,
                  **{f"{k}_sum": round(sum(v), 2) for k, v in split.items()}, **split}
        timings[str(workers)] = timing
        print(f"final_scores: {len(scores)} models, {workers} sampling processes: wall "
              f"{timing['wall_s']} s, the same scores: {timing['same_scores']}", flush=True)
        means = {name: {k: v for k, v in entry.items() if isinstance(v, float)}
                 for name, entry in first.items()}
        result = {"date": time.strftime("%Y-%m-%d"), "options": asdict(options),
                  "models": len(first), "protocols": protocols, "timings": timings, "means": means}
        if options.json:  # after each timing: a call cut short keeps those that finished
            Path(options.json).write_text(json.dumps(result, indent=1))
    pool.close()
    return {**result, "scores": first}


if __name__ == "__main__":
    main(tyro.cli(Options))
