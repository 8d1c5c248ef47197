"""The OCR proxy's runs side by side, eager (the driver's --no-compile) and then compiled (the
trainers' --compile: the transformer blocks and the VAE decoder), on one GPU and the same pretrained
base: run-iterations a second, each run's steady iteration, and what the runs used of the machine
(run_benchmark's `usage`). The `-openvino` settings run the same with the PP-OCR pool on OpenVINO
(run_benchmark's --ocr-engine openvino) instead of ONNX Runtime, `-blocking` with the trainers'
CUDA blocking synchronisation (run_benchmark's --blocking-sync) and `-mps` with the trainers'
kernels sharing the GPU through NVIDIA's MPS daemon (run_benchmark's --mps).

    python benchmark/ocr_proxy/compile_speed.py --out compile_speed.json --bench.out /tmp/cs

The base is pretrained first, in a process of its own (the drivers fork their PP-OCR pools before
CUDA is used). Each setting is then one run_benchmark.main of the same runs (every algorithm x
--bench.seeds) on that base, stopped by --bench.time-limit-s, in --bench.out/<setting>. A run's
steady iteration is the median of its perf/iteration_s after its first --skip iterations (compiled
runs compile there); the setting's rate is the sum over its runs of 1 / that median. The report is
written after each setting, so a call cut short keeps the settings that finished.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.ocr_proxy import pretrain, run_benchmark  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Setting:
    trainer_flag: str = ""
    """given after the driver's own --no-compile, so the last flag wins"""
    ocr_engine: Literal["onnxruntime", "openvino"] = "onnxruntime"
    """the PP-OCR pool's runtime"""
    blocking_sync: bool = False
    """the trainers' CUDA blocking synchronisation"""
    mps: bool = False
    """the trainers' kernels share the GPU through NVIDIA's MPS daemon"""


SETTINGS = {"eager": Setting(), "compiled": Setting("--compile"),
            "eager-openvino": Setting(ocr_engine="openvino"),
            "compiled-openvino": Setting("--compile", "openvino"),
            "eager-openvino-blocking": Setting(ocr_engine="openvino", blocking_sync=True),
            "eager-openvino-blocking-mps": Setting(ocr_engine="openvino", blocking_sync=True,
                                                   mps=True)}


@dataclass
class Args:
    out: str
    """the report (JSON), written after each setting"""
    settings: list[Literal[tuple(SETTINGS)]] = field(  # type: ignore[valid-type]
        default_factory=lambda: ["eager", "compiled"])
    """the settings timed, one after the other"""
    skip: int = 5
    """first iterations of each run left out of its steady iteration"""
    compile_s: float = 90.0
    """wall time the compiled setting gets on top of --bench.time-limit-s: its runs compile first"""
    bench: run_benchmark.Args = field(default_factory=lambda: run_benchmark.Args(
        out="/tmp/ocr_proxy_compile_speed", seeds=[0, 1], iterations=60, time_limit_s=150.0,
        final_scores=False))
    """the runs of each setting (its --trainer-args come after the setting's flag)"""


def gpu_name() -> str:
    """The first GPU's name, without initialising CUDA in this process."""
    if not shutil.which("nvidia-smi"):
        return "cpu"
    names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, check=False).stdout.split("\n")
    return names[0].strip() or "cpu"


def steady(run_dir: Path, skip: int) -> dict:
    logged = run_benchmark.scalars(run_dir, "perf/iteration_s")
    times = [value for step, value in logged if step > skip]
    median = statistics.median(times) if times else None
    return {"iterations": len(logged), "median_iteration_s": median}


def run_setting(args: Args, name: str) -> dict:
    setting = SETTINGS[name]
    limit_s = args.bench.time_limit_s + (args.compile_s if setting.trainer_flag else 0)
    bench = replace(args.bench, out=str(Path(args.bench.out) / name), time_limit_s=limit_s,
                    trainer_args=f"{setting.trainer_flag} {args.bench.trainer_args}".strip(),
                    ocr_engine=setting.ocr_engine, blocking_sync=setting.blocking_sync,
                    mps=setting.mps)
    began = time.perf_counter()
    report = run_benchmark.main(bench)
    runs = {run: {**steady(Path(bench.out) / "runs" / run, args.skip),
                  "first_iteration_s": report["runs"][run].get("warmup_iteration_s")}
            for run in report["return_codes"]}
    medians = [r["median_iteration_s"] for r in runs.values() if r["median_iteration_s"]]
    run_iterations = sum(r["iterations"] for r in runs.values())
    return {"trainer_args": bench.trainer_args, "ocr_engine": setting.ocr_engine,
            "blocking_sync": setting.blocking_sync, "mps": setting.mps, "time_limit_s": limit_s,
            "wall_s": time.perf_counter() - began, "phases_s": report["phases_s"], "runs": runs,
            "run_iterations": run_iterations,
            "run_iterations_per_s_of_rl": run_iterations / report["phases_s"]["rl"],
            "steady_run_iterations_per_s": sum(1 / m for m in medians) if medians else None,
            "usage": report["usage"], "return_codes": report["return_codes"],
            "failed": report["failed"]}


def main(args: Args) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True)
    report = {"date": time.strftime("%Y-%m-%d"), "commit": commit.stdout.strip() or None,
              "device": gpu_name(), "cores": len(os.sched_getaffinity(0)), "args": asdict(args),
              "settings": {}}
    began = time.perf_counter()
    process = multiprocessing.get_context("spawn").Process(target=pretrain.pretrain,
                                                           args=(args.bench.pretrain,))
    process.start()
    process.join()
    if process.exitcode:
        sys.exit(f"compile_speed.py: error: pretraining the base failed (exit {process.exitcode})")
    report["pretrain_s"] = time.perf_counter() - began
    for name in args.settings:
        report["settings"][name] = run_setting(args, name)
        partial = Path(args.out).with_suffix(".tmp")
        partial.write_text(json.dumps(report, indent=1))
        partial.replace(args.out)
        print(f"compile_speed: {name}: {report['settings'][name]['steady_run_iterations_per_s']} "
              "run-iterations/s (steady)", flush=True)
    return report


if __name__ == "__main__":
    main(tyro.cli(Args))
