"""PP-OCR in parallel: a pool of single-threaded RapidOCR engines, each reading as ocr_reward.PaddleScorer does, and a
local server that gives the trainers' `--reward vllm` client those reads.

ocr_reward.PaddleScorer reads one image at a time with one engine spread over every core, and several trainers side by
side, each with such an engine, slow each other down; one single-threaded engine per core in parallel is what scales.

    pool = OcrPool(28)                                 # fork before CUDA is used in this process
    scores, texts = pool.score(images, targets)         # ocr_reward.ocr_score of each read
    with serve(pool) as url:                            # crd.py --reward vllm --reward-urls URL: the same scores
        ...
"""

from __future__ import annotations

import base64
import io
import json
import multiprocessing
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import cv2
import numpy as np
from PIL import Image

from ocr_reward import PaddleScorer, ocr_score

_scorer = None  # each worker process's engine


def _start_worker(engine: str):
    global _scorer
    _scorer = PaddleScorer(threads=1, engine=engine)  # one a process: the pool is the parallelism


def _read(image: np.ndarray) -> str:
    return _scorer.read(Image.fromarray(image))


def _score(item: tuple[np.ndarray, str]) -> tuple[float, str]:
    image, target = item
    text = _read(image)
    return ocr_score(text, target), text


class OcrPool:
    """score(images (B, H, W, 3) uint8, targets) -> (B,) scores and transcriptions; workers=0 scores in process.

    Forked workers: create the pool before CUDA is initialised. opencv_threads: OpenCV's threads in each worker
    (None: this process's, by default a thread a core, which took a third of each read's CPU time on 16 cores).
    engine: PaddleScorer's (onnxruntime, or openvino: the same models at float32).
    """

    def __init__(self, workers: int, opencv_threads: int | None = 1, engine: str = "onnxruntime"):
        self.pool = None
        if workers:
            # set here, where OpenCV's threads exist, for the workers to inherit: a forked worker that
            # sets them itself waits forever on a pool this process had used
            previous = cv2.getNumThreads()
            cv2.setNumThreads(previous if opencv_threads is None else opencv_threads)
            try:
                self.pool = multiprocessing.get_context("fork").Pool(workers, initializer=_start_worker,
                                                                     initargs=(engine,))
            finally:
                cv2.setNumThreads(previous)
        else:
            _start_worker(engine)

    def score(self, images: np.ndarray, targets: list[str]) -> tuple[np.ndarray, list[str]]:
        items = list(zip(images, targets))
        results = self.pool.map(_score, items, chunksize=1) if self.pool else [_score(item) for item in items]
        return np.array([r[0] for r in results], dtype=np.float32), [r[1] for r in results]

    def read(self, image: np.ndarray) -> str:
        """One image's text; safe to call from many threads at once."""
        return self.pool.apply(_read, (image,)) if self.pool else _read(image)

    def pids(self) -> list[int]:
        """The worker processes' ids (none in process)."""
        return [worker.pid for worker in self.pool._pool] if self.pool else []

    def close(self):
        if self.pool:
            self.pool.terminate()
            self.pool.join()


MODEL_NAME = "pp-ocr"  # what GET /v1/models lists: the trainers' --reward-model
BLIND_MODEL_NAME = "pp-ocr-blind"  # served too: reads no text, so every image scores 0 and every advantage is 0


class PoolServer(ThreadingHTTPServer):
    """The pool's HTTP server, a thread a request. Each trainer opens a connection an image, all of
    an iteration's at once (nine runs: 432): with socketserver's listen backlog of 5 the kernel
    drops most of them, and each dropped one waits a second for its SYN to be sent again. HTTP/1.0,
    a connection a request: on a kept-alive connection each further answer waited ~40 ms for the
    client's delayed ACK of the handler's first write (Nagle's algorithm); 48 requests, two at a
    time, then took ten times as long."""

    request_queue_size = 1024
    daemon_threads = True


@contextmanager
def serve(pool: OcrPool):
    """POST /v1/chat/completions on 127.0.0.1 (a free port), answered with the PP-OCR read of the request's image,
    and GET /v1/models (the client's health check), in a thread until the block exits; yields the base URL for the
    trainers' --reward-urls. A request for BLIND_MODEL_NAME is answered with no text: a reward that teaches nothing."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.reply({"object": "list", "data": [{"id": name, "object": "model"}
                                                   for name in (MODEL_NAME, BLIND_MODEL_NAME)]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            parts = body["messages"][0]["content"]
            url = next(p["image_url"]["url"] for p in parts if p["type"] == "image_url")
            image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
            text = "" if body["model"] == BLIND_MODEL_NAME else pool.read(np.asarray(image))
            message = {"role": "assistant", "content": text}
            self.reply({"object": "chat.completion", "model": body["model"],
                        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

        def reply(self, payload: dict):
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = PoolServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
