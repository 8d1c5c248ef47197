"""Would a narrower recognition input make PP-OCR's reads cheaper without changing them? RapidOCR
pads each text crop to at least rec_img_shape's width (320 pixels at height 48) before its
recognition network; a smaller width pads a crop only to its own.

    python benchmark/ocr_proxy/rec_width.py --out rec_width.json

Each width reads the same images with one single-threaded engine configured as
ocr_reward.PaddleScorer (the proxy's scorer) but for rec_img_shape: the tiles of the validation
grids stored in benchmark/results (the proxy's own outputs, many of them hard to read) and noisy
renders of random codes (easy ones). It reports the CPU time a read and how many transcriptions
differ from width 320's, today's: a reward that reads differently is another reward.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmark.ocr_proxy.pool_speed import noisy_renders  # noqa: E402
from ocr_reward import PaddleScorer  # noqa: E402

TILE = 128  # the proxy's images; a grid is 4 x 4 of them, each row with a caption below


@dataclass
class Args:
    widths: list[int] = field(default_factory=lambda: [320, 256, 192, 160, 48])
    """rec_img_shape widths to read with; the first is the one the others are compared with"""
    grids: str = "benchmark/results/*_grid_*.png"
    """the validation grids whose tiles are read (a glob under the repository's root)"""
    renders: int = 200
    """noisy renders of random codes also read"""
    noise: float = 70.0
    """standard deviation of the renders' Gaussian noise (0-255)"""
    out: str = ""
    """also write the results to this JSON file"""


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def grid_tiles(pattern: str) -> list[Image.Image]:
    tiles = []
    for path in sorted(ROOT.glob(pattern)):
        grid = Image.open(path).convert("RGB")
        row = grid.height // 4
        tiles += [grid.crop((x * TILE, y * row, (x + 1) * TILE, y * row + TILE))
                  for y in range(4) for x in range(4)]
    return tiles


def read_all(width: int, images: list[Image.Image]) -> tuple[list[str], float]:
    """The transcriptions and the CPU seconds a read (after a warm-up of 8 reads)."""
    from rapidocr_onnxruntime import RapidOCR

    scorer = PaddleScorer(threads=1)
    scorer.engine = RapidOCR(use_cls=False, det_limit_side_len=960, det_limit_type="max",
                             intra_op_num_threads=1, inter_op_num_threads=1,
                             rec_img_shape=[3, 48, width])
    for image in images[:8]:
        scorer.read(image)
    started = time.process_time()
    texts = [scorer.read(image) for image in images]
    return texts, (time.process_time() - started) / len(images)


def tally(reads: dict) -> dict:
    """For each setting's (transcriptions, CPU seconds a read), the CPU milliseconds a read and how
    many transcriptions differ from the first setting's."""
    first, _ = next(iter(reads.values()))
    return {str(key): {"cpu_ms_per_read": round(1000 * cpu_s, 1),
                       "differ": sum(a != b for a, b in zip(texts, first))}
            for key, (texts, cpu_s) in reads.items()}


def main(args: Args) -> dict:
    arrays, _ = noisy_renders(args.renders, args.noise)
    sets = {"grid_tiles": grid_tiles(args.grids),
            "renders": [Image.fromarray(array) for array in arrays]}
    report = {"cpu": cpu_model(), "cores": os.cpu_count(), "engine_threads": 1,
              "widths": args.widths, "noise": args.noise,
              "images": {name: len(images) for name, images in sets.items()}}
    for name, images in sets.items():
        report[name] = tally({width: read_all(width, images) for width in args.widths})
        for width, row in report[name].items():
            print(f"{name}, width {width}: {row['cpu_ms_per_read']:.1f} ms a read, {row['differ']} "
                  f"of {len(images)} transcriptions differ from width {args.widths[0]}'s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(tyro.cli(Args))
