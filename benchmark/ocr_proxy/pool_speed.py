"""The PP-OCR pool alone: reads a second, CPU seconds a read and threads a worker, for each setting of the
workers' OpenCV threads, on noisy renders of random codes (the same images for every setting).

    python benchmark/ocr_proxy/pool_speed.py --workers 10 --out pool_speed.json

The pool is forked after torch is imported, as run_benchmark.py forks it. A setting's CPU time is its
workers' (user + system, from /proc) over its timed reads; its transcriptions are compared with the first
setting's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch  # noqa: F401  (imported before the fork, as the benchmark driver does)
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.ocr_proxy.machine import process_cpu_and_threads  # noqa: E402
from benchmark.ocr_proxy.ocr_pool import OcrPool  # noqa: E402
from benchmark.ocr_proxy.render import Task, render  # noqa: E402


@dataclass
class Args:
    workers: int = 10
    """PP-OCR engines of the pool"""
    images: int = 960
    """renders read by each setting (after a warm-up of 4 a worker)"""
    noise: float = 25.0
    """standard deviation of the Gaussian noise added to each render (0-255)"""
    opencv_threads: list[int] = field(default_factory=lambda: [-1, 1])
    """OpenCV threads of each worker, one setting each (-1: OpenCV's default)"""
    out: str = ""
    """also write the results to this JSON file"""


def noisy_renders(count: int, noise: float) -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(0)
    words = [f"{code:04d}" for code in rng.integers(0, 10_000, count)]
    images = [np.asarray(render(word, Task()), dtype=np.float32) for word in words]
    images = [np.clip(image + rng.normal(0, noise, image.shape), 0, 255) for image in images]
    return np.stack(images).astype(np.uint8), words


def measure(args: Args, opencv_threads: int, images: np.ndarray, words: list[str]) -> tuple[dict, list[str]]:
    pool = OcrPool(args.workers, None if opencv_threads == -1 else opencv_threads)
    try:
        warm = 4 * args.workers
        pool.score(images[:warm], words[:warm])
        before = [process_cpu_and_threads(pid)[0] for pid in pool.pids()]
        start = time.perf_counter()
        scores, texts = pool.score(images, words)
        wall = time.perf_counter() - start
        after = [process_cpu_and_threads(pid) for pid in pool.pids()]
    finally:
        pool.close()
    cpu = sum(a[0] - b for a, b in zip(after, before))
    return {"wall_s": round(wall, 2), "images_per_s": round(len(words) / wall, 1),
            "cpu_s_per_image": round(cpu / len(words), 4),
            "threads_per_worker": sorted({a[1] for a in after}),
            "mean_score": float(scores.mean()), "load1": round(os.getloadavg()[0], 1)}, texts


def main(args: Args) -> dict:
    if args.workers < 1 or args.images < 1 or not args.opencv_threads:
        sys.exit("pool_speed.py: error: --workers and --images must be at least 1, and "
                 "--opencv-threads name one or more settings")
    images, words = noisy_renders(args.images, args.noise)
    result = {"workers": args.workers, "images": args.images, "cores": os.cpu_count(), "settings": {}}
    first = None
    for threads in args.opencv_threads:
        row, texts = measure(args, threads, images, words)
        first = first or texts
        row["identical_to_the_first"] = sum(t == f for t, f in zip(texts, first))
        result["settings"][str(threads)] = row
        print(f"pool_speed: opencv threads {threads}: {row}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
