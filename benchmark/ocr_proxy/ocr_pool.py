"""PP-OCR scoring in parallel: a pool of single-threaded RapidOCR engines, each reading as reward.PaddleScorer does.

The trainers score with one multi-threaded engine; pretraining validates often, so it spreads images over processes.
"""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np
from PIL import Image

from reward import PaddleScorer, ocr_score

_scorer = None  # each worker process's engine


class SingleThreadPaddleScorer(PaddleScorer):
    """reward.PaddleScorer's reading order and score with an engine on one CPU thread (the pool gives parallelism)."""

    def __init__(self):
        from rapidocr_onnxruntime import RapidOCR

        self.engine = RapidOCR(intra_op_num_threads=1, inter_op_num_threads=1)
        self.lock = threading.Lock()


def _start_worker():
    global _scorer
    _scorer = SingleThreadPaddleScorer()


def _score(item: tuple[np.ndarray, str]) -> tuple[float, str]:
    image, target = item
    text = _scorer.read(Image.fromarray(image))
    return ocr_score(text, target), text


class OcrPool:
    """score(images (B, H, W, 3) uint8, targets) -> (B,) scores and transcriptions; workers=0 scores in process.

    Forked workers: create the pool before CUDA is initialised.
    """

    def __init__(self, workers: int):
        self.pool = None
        if workers:
            self.pool = multiprocessing.get_context("fork").Pool(workers, initializer=_start_worker)
        else:
            _start_worker()

    def score(self, images: np.ndarray, targets: list[str]) -> tuple[np.ndarray, list[str]]:
        items = list(zip(images, targets))
        results = self.pool.map(_score, items, chunksize=1) if self.pool else [_score(item) for item in items]
        return np.array([r[0] for r in results], dtype=np.float32), [r[1] for r in results]

    def close(self):
        if self.pool:
            self.pool.terminate()
            self.pool.join()
