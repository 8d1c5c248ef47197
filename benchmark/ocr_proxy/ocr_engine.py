"""Would OpenVINO read PP-OCR's models faster than ONNX Runtime on the CPU, and read the same? The
proxy's runs side by side are bound by PP-OCR reads on the CPU; OpenVINO runs the same ONNX files.

    python benchmark/ocr_proxy/ocr_engine.py --out ocr_engine.json

Each engine reads the same images, one thread, as a pool worker does: the tiles of the validation
grids stored in benchmark/results (the proxy's own outputs, many of them hard to read) and noisy
renders of random codes. `onnxruntime` is ocr_reward.PaddleScorer as the proxy runs it;
`openvino-f32` is PaddleScorer(engine="openvino"), the same ONNX files compiled by OpenVINO for the
CPU at float32; `openvino-default` at OpenVINO's default precision (bfloat16 on a CPU with AMX), as
rapidocr-openvino leaves it. It reports the CPU time a read (the process's, every thread; the
engines take turns image by image) and how many transcriptions differ from ONNX Runtime's: the
reward is a function of the transcription, so a reward that reads differently is another reward.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmark.ocr_proxy.pool_speed import noisy_renders  # noqa: E402
from benchmark.ocr_proxy.rec_width import cpu_model, grid_tiles, tally  # noqa: E402
from ocr_reward import PaddleScorer, run_with_openvino  # noqa: E402

ENGINES = ("onnxruntime", "openvino-f32", "openvino-default")


@dataclass
class Args:
    engines: list[str] = field(default_factory=lambda: list(ENGINES))
    """engines to read with (onnxruntime, openvino-f32, openvino-default); the first is the one the
    others are compared with"""
    grids: str = "benchmark/results/*_grid_*.png"
    """the validation grids whose tiles are read (a glob under the repository's root)"""
    renders: int = 200
    """noisy renders of random codes also read"""
    noise: float = 70.0
    """standard deviation of the renders' Gaussian noise (0-255)"""
    out: str = ""
    """also write the results to this JSON file"""


def scorer(engine: str) -> tuple[PaddleScorer, dict]:
    """A single-threaded PaddleScorer reading with `engine`, and how OpenVINO compiled it."""
    if engine == "onnxruntime":
        return PaddleScorer(threads=1), {}
    if engine == "openvino-f32":
        reader = PaddleScorer(threads=1, engine="openvino")
    else:
        reader = PaddleScorer(threads=1)
        run_with_openvino(reader.engine, threads=1, precision=None)
    import openvino

    sessions = {"det": reader.engine.text_det.infer, "rec": reader.engine.text_rec.session}
    precision = {name: session.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
                 for name, session in sessions.items()}
    return reader, {"openvino": openvino.__version__, "inference_precision": precision}


def read_all(readers: dict, images: list[Image.Image]) -> dict:
    """Each engine's transcriptions and CPU seconds a read (after a warm-up of 8 reads each). The
    engines take turns image by image, so that a machine's drift falls on each alike."""
    for reader in readers.values():
        for image in images[:8]:
            reader.read(image)
    texts = {engine: [] for engine in readers}
    cpu_s = dict.fromkeys(readers, 0.0)
    for image in images:
        for engine, reader in readers.items():
            started = time.process_time()
            texts[engine].append(reader.read(image))
            cpu_s[engine] += time.process_time() - started
    return {engine: (texts[engine], cpu_s[engine] / len(images)) for engine in readers}


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
            return sorted(flag for flag in flags if flag.startswith(("avx512f", "amx", "avx2")))
    return []


def main(args: Args) -> dict:
    if unknown := [engine for engine in args.engines if engine not in ENGINES]:
        raise SystemExit(f"ocr_engine.py: error: --engines {unknown[0]}: one of "
                         f"{', '.join(ENGINES)}")
    arrays, _ = noisy_renders(args.renders, args.noise)
    sets = {"grid_tiles": grid_tiles(args.grids),
            "renders": [Image.fromarray(array) for array in arrays]}
    report = {"cpu": cpu_model(), "cores": os.cpu_count(), "cpu_flags": cpu_flags(),
              "engine_threads": 1, "engines": args.engines, "noise": args.noise,
              "images": {name: len(images) for name, images in sets.items()}}
    readers = {}
    for engine in args.engines:
        readers[engine], compiled = scorer(engine)
        if compiled:
            report[engine] = compiled
    for name, images in sets.items():
        report[name] = tally(read_all(readers, images))
        for engine, row in report[name].items():
            print(f"{name}, {engine}: {row['cpu_ms_per_read']:.1f} ms a read, {row['differ']} of "
                  f"{len(images)} transcriptions differ from {args.engines[0]}'s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(tyro.cli(Args))
