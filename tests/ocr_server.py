"""A stand-in for `vllm serve` in tests: OpenAI chat completions on 127.0.0.1, answered by PP-OCR.

    with ocr_server(read=paddle.read, delay=0.0, fail_first=0) as (url, server):   # url = "http://127.0.0.1:<port>"
        ...                                                                        # server.requests: requests so far
GET /v1/models lists `model` (vLLM's default served name is the model's hub id). `delay` sleeps before each chat
completion (to trigger client timeouts); `fail_first` answers the first n of them with `fail_status`; `silent` accepts
connections but never answers any request, like a hung server.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image


class _Server(ThreadingHTTPServer):
    # Closing joins the handler threads: one still sleeping past a client's timeout must not run OCR
    # (onnxruntime) while the interpreter shuts down, which aborts the process.
    daemon_threads = False
    block_on_close = True

    def handle_error(self, request, client_address):
        pass  # a client that timed out closed its socket; the handler's write then fails, which is expected


@contextmanager
def ocr_server(read, delay: float = 0.0, fail_first: int = 0, fail_status: int = 500,
               model: str = "Qwen/Qwen2.5-VL-3B-Instruct", silent: bool = False):
    """Serve GET /v1/models and POST /v1/chat/completions in a thread until the block exits; yields (base URL, server)."""
    lock, closing = threading.Lock(), threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if silent:
                return closing.wait()
            if self.path != "/v1/models":
                return self.reply(404, {"error": "not found"})
            self.reply(200, {"object": "list", "data": [{"id": model, "object": "model"}]})

        def do_POST(self):
            if silent:
                return closing.wait()
            with lock:
                server.requests += 1
                fail = server.requests <= fail_first
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(delay)
            if fail or self.path != "/v1/chat/completions":
                return self.reply(fail_status if fail else 404, {"error": "injected failure" if fail else "not found"})
            parts = body["messages"][0]["content"]
            url = next(p["image_url"]["url"] for p in parts if p["type"] == "image_url")
            assert url.startswith("data:image/png;base64,")
            image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
            text = read(image)
            self.reply(200, {"object": "chat.completion", "model": body["model"],
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "finish_reason": "stop"}]})

        def reply(self, status: int, payload: dict):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass  # keep test output quiet

    server = _Server(("127.0.0.1", 0), Handler)  # port 0: the OS picks a free port
    server.requests = 0
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        closing.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
