"""The PP-OCR pool alone: reads a second and CPU seconds a read for each setting of the pool, on noisy renders of
random codes (the same images for every setting), and how far each setting's reads agree with the first's.

    python benchmark/ocr_proxy/pool_speed.py --workers 10 --out pool_speed.json
    python benchmark/ocr_proxy/pool_speed.py --split --settings cpu:1          # where a read's CPU time goes

A setting is `cpu:N` (OcrPool: --workers processes, each with N OpenCV threads; -1: OpenCV's
default), or `openvino:N`, the same with the workers' networks on OpenVINO (engine="openvino"). The pool
is forked after torch is imported, as run_benchmark.py forks it. A setting's CPU time is its workers' (user +
system, from /proc) over its timed reads. The renders carry Gaussian noise at each --noise level, so that some
reads are hard.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import torch
import tyro
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.ocr_proxy.machine import process_cpu_and_threads  # noqa: E402
from benchmark.ocr_proxy.ocr_pool import OcrPool  # noqa: E402
from benchmark.ocr_proxy.render import Task, render  # noqa: E402
from ocr_reward import PaddleScorer  # noqa: E402


@dataclass
class Args:
    workers: int = 10
    """PP-OCR engines of the pool"""
    images: int = 960
    """renders read by each setting at each noise level (after a warm-up of 4 a worker)"""
    noise: list[float] = field(default_factory=lambda: [25.0])
    """standard deviations of the Gaussian noise added to the renders (0-255), one set of renders each"""
    settings: list[str] = field(default_factory=lambda: ["cpu:-1", "cpu:1"])
    """the pools to time: cpu:N (N OpenCV threads a worker; -1: OpenCV's default), or openvino:N
    (the same, the networks on OpenVINO)"""
    split: bool = False
    """also time one single-threaded engine's reads (of the first noise level's renders), split into
    its detection network, its recognition network and RapidOCR's steps around them"""
    out: str = ""
    """also write the results to this JSON file"""


def noisy_renders(count: int, noise: float) -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(0)
    words = [f"{code:04d}" for code in rng.integers(0, 10_000, count)]
    images = [np.asarray(render(word, Task()), dtype=np.float32) for word in words]
    images = [np.clip(image + rng.normal(0, noise, image.shape), 0, 255) for image in images]
    return np.stack(images).astype(np.uint8), words


def make_pool(setting: str, workers: int) -> OcrPool:
    kind, value = setting.split(":", 1)
    return OcrPool(workers, None if value == "-1" else int(value),
                   engine="openvino" if kind == "openvino" else "onnxruntime")


def measure(setting: str, workers: int, images: np.ndarray, words: list[str]) -> tuple[dict, np.ndarray, list]:
    pool = make_pool(setting, workers)
    try:
        warm = 4 * workers
        pool.score(images[:warm], words[:warm])
        pids = pool.pids()
        before = [process_cpu_and_threads(pid)[0] for pid in pids]
        start = time.perf_counter()
        scores, texts = pool.score(images, words)
        wall = time.perf_counter() - start
        after = [process_cpu_and_threads(pid) for pid in pids]
    finally:
        pool.close()
    cpu = sum(a[0] - b for a, b in zip(after, before))
    return {"wall_s": round(wall, 2), "images_per_s": round(len(words) / wall, 1),
            "cpu_s_per_image": round(cpu / len(words), 4), "threads_per_process": sorted({a[1] for a in after}),
            "mean_score": round(float(scores.mean()), 4), "load1": round(os.getloadavg()[0], 1)}, scores, texts


def split_read(images: np.ndarray) -> dict:
    """CPU seconds a read of one single-threaded engine spends in each network and in the rest, with
    one OpenCV thread, as a pool worker has."""
    cv2.setNumThreads(1)
    scorer = PaddleScorer(threads=1)
    spent = {"detection": 0.0, "recognition": 0.0}

    def timed(name, session):
        def call(inputs):
            start = time.process_time()
            outputs = session(inputs)
            spent[name] += time.process_time() - start
            return outputs
        return call

    scorer.engine.text_det.infer = timed("detection", scorer.engine.text_det.infer)
    scorer.engine.text_rec.session = timed("recognition", scorer.engine.text_rec.session)
    warm = min(20, len(images) // 2)
    for image in images[:warm]:
        scorer.read(Image.fromarray(image))
    spent.update(detection=0.0, recognition=0.0)
    start = time.process_time()
    for image in images[warm:]:
        scorer.read(Image.fromarray(image))
    total, reads = time.process_time() - start, len(images) - warm
    networks = spent["detection"] + spent["recognition"]
    return {"reads": reads, "cpu_s_per_read": round(total / reads, 5),
            "detection_network_s": round(spent["detection"] / reads, 5),
            "recognition_network_s": round(spent["recognition"] / reads, 5),
            "the_rest_s": round((total - networks) / reads, 5), "networks_share": round(networks / total, 3)}


def main(args: Args) -> dict:
    kinds_and_threads = [setting.partition(":")[::2] for setting in args.settings]
    valid = all(kind in ("cpu", "openvino") and threads.lstrip("-").isdigit()
                for kind, threads in kinds_and_threads)
    if args.workers < 1 or args.images < 1 or not args.settings or not args.noise or not valid:
        sys.exit("pool_speed.py: error: --workers and --images must be at least 1, --noise names one or more "
                 "levels, and --settings one or more of cpu:N or openvino:N")
    result = {"workers": args.workers, "images": args.images, "cores": os.cpu_count(),
              "torch": torch.__version__, "settings": {}}
    for noise in args.noise:
        images, words = noisy_renders(args.images, noise)
        first = None
        for setting in args.settings:
            row, scores, texts = measure(setting, args.workers, images, words)
            first = first or (setting, scores, texts)
            row["identical_to_" + first[0]] = sum(t == f for t, f in zip(texts, first[2]))
            row["score_difference_to_" + first[0]] = {
                "mean": round(float((scores - first[1]).mean()), 5),
                "max_abs": round(float(np.abs(scores - first[1]).max()), 4)}
            result["settings"].setdefault(setting, {})[f"noise{noise:g}"] = row
            print(f"pool_speed: {setting}, noise {noise:g}: {row}", flush=True)
    if args.split:  # after the pools, as it leaves this process one OpenCV thread
        result["one_engine_read"] = split_read(noisy_renders(args.images, args.noise[0])[0])
        print(f"pool_speed: one engine's read: {result['one_engine_read']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
