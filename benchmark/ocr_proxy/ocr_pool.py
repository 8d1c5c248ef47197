"""PP-OCR in parallel: a pool of single-threaded RapidOCR engines, each reading as ocr_reward.PaddleScorer does, and a
local server that gives the trainers' `--reward vllm` client those reads.

ocr_reward.PaddleScorer reads one image at a time with one engine spread over every core, and several trainers side by
side, each with such an engine, slow each other down; one single-threaded engine per core in parallel is what scales.

    pool = OcrPool(28)                                 # fork before CUDA is used in this process
    scores, texts = pool.score(images, targets)         # ocr_reward.ocr_score of each read
    with serve(pool) as url:                            # crd.py --reward vllm --reward-urls URL: the same scores
        ...
    pool = TorchOcrPool("cuda")                         # the same reads, PP-OCR's networks batched on a GPU

Almost all of a read's CPU time is PP-OCR's two networks, the recognition network most. TorchOcrPool runs them from
the same ONNX files in torch (onnx_network.py) on a GPU, in batches of every read waiting, and keeps RapidOCR's own
steps around them on the CPU.
"""

from __future__ import annotations

import base64
import io
import json
import multiprocessing
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import cv2
import numpy as np
import torch
from PIL import Image

from benchmark.ocr_proxy.onnx_network import OnnxNetwork
from ocr_reward import PaddleScorer, ocr_score

_scorer = None  # each worker process's engine


def _start_worker():
    global _scorer
    _scorer = PaddleScorer(threads=1)  # one engine per process: the pool gives the parallelism


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
    """

    def __init__(self, workers: int, opencv_threads: int | None = 1):
        self.pool = None
        if workers:
            # set here, where OpenCV's threads exist, for the workers to inherit: a forked worker that
            # sets them itself waits forever on a pool this process had used
            previous = cv2.getNumThreads()
            cv2.setNumThreads(previous if opencv_threads is None else opencv_threads)
            try:
                self.pool = multiprocessing.get_context("fork").Pool(workers, initializer=_start_worker)
            finally:
                cv2.setNumThreads(previous)
        else:
            _start_worker()

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


class BatchedNetwork:
    """A torch network on a device, called as RapidOCR calls its ONNX Runtime session (a float32
    array in, [the output array] out), from many threads at once: a thread of its own runs every
    input waiting with the first one's shape as one batch."""

    def __init__(self, network: torch.nn.Module, device: str):
        self.network, self.device = network.to(device), device
        self.waiting: queue.Queue = queue.Queue()
        self.batches = 0
        self.thread = threading.Thread(target=self.run_batches, daemon=True)
        self.thread.start()

    def __call__(self, inputs: np.ndarray) -> list[np.ndarray]:
        done: Future = Future()
        self.waiting.put((inputs, done))
        return [done.result()]

    def run_batches(self):
        later = []  # inputs of another shape than the batch's
        while True:
            items = later or [self.waiting.get()]
            while True:
                try:
                    items.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            if any(item is None for item in items):  # close()
                return
            batch = [item for item in items if item[0].shape[1:] == items[0][0].shape[1:]]
            later = [item for item in items if item[0].shape[1:] != items[0][0].shape[1:]]
            try:
                inputs = torch.from_numpy(np.concatenate([x for x, _ in batch])).to(self.device)
                with torch.inference_mode():
                    outputs = self.network(inputs).float().cpu().numpy()
                self.batches += 1
                sizes = [len(x) for x, _ in batch]
                for (_, done), end, size in zip(batch, np.cumsum(sizes), sizes):
                    done.set_result(outputs[end - size : end])
            except Exception as error:  # every caller's read fails with it, none waits forever
                for _, done in batch:
                    done.set_exception(error)

    def close(self):
        self.waiting.put(None)
        self.thread.join()


class TorchOcrPool:
    """OcrPool's reads, with PP-OCR's detection and recognition networks batched on a device (a GPU;
    "cpu" in tests) and RapidOCR's steps around them on `threads` CPU threads, each with its own
    engine (RapidOCR's detector keeps per-call state). No worker processes: the reads are this
    process's CPU time. The networks run at torch's default precision, which on a GPU lets cuDNN's
    convolutions use TF32 (this process's sampling does too): pool_speed.py compares the reads
    with ONNX Runtime's."""

    def __init__(self, device: str = "cuda", threads: int = 16):
        from rapidocr_onnxruntime.main import DEFAULT_CFG_PATH
        from rapidocr_onnxruntime.utils import read_yaml, update_model_path

        config = update_model_path(read_yaml(DEFAULT_CFG_PATH))
        self.detector = BatchedNetwork(OnnxNetwork(config["Det"]["model_path"]), device)
        self.recognizer = BatchedNetwork(OnnxNetwork(config["Rec"]["model_path"]), device)
        self.local = threading.local()
        self.readers = ThreadPoolExecutor(threads, thread_name_prefix="pp-ocr")

    def _read(self, image: np.ndarray) -> str:
        scorer = getattr(self.local, "scorer", None)
        if scorer is None:
            scorer = self.local.scorer = PaddleScorer(threads=1)
            scorer.engine.text_det.infer = self.detector
            scorer.engine.text_rec.session = self.recognizer
        return scorer.read(Image.fromarray(image))

    def score(self, images: np.ndarray, targets: list[str]) -> tuple[np.ndarray, list[str]]:
        texts = list(self.readers.map(self._read, images))
        return np.array([ocr_score(t, w) for t, w in zip(texts, targets)], dtype=np.float32), texts

    def read(self, image: np.ndarray) -> str:
        """One image's text; safe to call from many threads at once."""
        return self.readers.submit(self._read, image).result()

    def pids(self) -> list[int]:
        """No worker processes: the reads run in this one."""
        return []

    def close(self):
        self.readers.shutdown()
        self.detector.close()
        self.recognizer.close()


MODEL_NAME = "pp-ocr"  # what GET /v1/models lists: the trainers' --reward-model
BLIND_MODEL_NAME = "pp-ocr-blind"  # served too: reads no text, so every image scores 0 and every advantage is 0


class PoolServer(ThreadingHTTPServer):
    """The pool's HTTP server, a thread a request. Each trainer opens a connection an image, all of
    an iteration's at once (nine runs: 432): with socketserver's listen backlog of 5 the kernel
    drops most of them, and each dropped one waits a second for its SYN to be sent again."""

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
