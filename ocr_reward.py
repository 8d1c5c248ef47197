"""The OCR reward of text rendering: the target a prompt quotes, the Levenshtein score of a
transcription against it, and the readers that transcribe an image: PP-OCR (paddle), Qwen2.5-VL in
process (qwen-vl) and a `vllm serve` client (vllm); beside them two cheap image statistics
(brightness, compressibility) that the CPU demo trains on. make_scorer builds one by name.

A scorer maps images and their target strings to scores in [0, 1] and the transcriptions it read:
    scorer = make_scorer("paddle")           # or "qwen-vl", "vllm", "brightness", ...
    scores, texts = scorer(images, targets)  # (B, H, W, 3) uint8 or PILs -> (B,) float32, B texts
This module holds no loss and no advantage formula: it is part of the "environment". Heavy libraries
(torch, transformers, rapidocr, openvino, requests) are imported only when a scorer is built.
"""

from __future__ import annotations

import base64
import io
import itertools
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import Levenshtein
import numpy as np
from PIL import Image


INSTRUCTION = ("Please output only the text content from the image without any additional "
               "descriptions or formatting.")
SCORERS = ("qwen-vl", "vllm", "paddle", "brightness", "compressibility")
# What Qwen2.5-VL's chat template renders for one user turn (image, then text) with its default
# system prompt, i.e. the prompt `vllm serve` builds server-side for the same request, so both
# scorers see the same input.
QWEN_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|>{image_pads}<|vision_end|>{instruction}<|im_end|>\n<|im_start|>assistant\n"
)
# A chat template that renders what Qwen2.5-VL-Instruct's does for text and image turns (QWEN_PROMPT
# for one user turn): `vllm serve` of a saved random model builds the same prompt as of the real one
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_QUOTED = re.compile(r'"([^"]*)"')
# Qwen2.5-VL-3B-Instruct's architecture with random weights (benchmarks)
RANDOM_QWEN = "random-qwen2.5-vl-3b"
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
# Qwen2.5-VL-3B-Instruct's architecture (its config.json; 3,754,622,976 parameters) and the tiny
# CPU-test model's (tests/tiny_models.py). pixels: the image processor's (min_pixels, max_pixels);
# vocab_size None: only the bytes and special tokens. mrope_section splits head_dim / 2 over (time,
# height, width).
MROPE = dict(rope_type="default", rope_theta=1e6)
QWEN_3B = dict(
    text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
              num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
              rms_norm_eps=1e-6, rope_parameters={**MROPE, "mrope_section": [16, 24, 24]}),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                out_hidden_size=2048, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                window_size=112,
                fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", tokens_per_second=2),
    pixels=(56 * 56, 28 * 28 * 16384))


READERS = ("qwen-vl", "vllm", "paddle")  # the scorers that transcribe text


def extract_target(prompt: str) -> str | None:
    """The text inside the first pair of double quotes of `prompt`, or None when there is none."""
    match = _QUOTED.search(prompt)
    return None if match is None else match.group(1)


def ocr_score(text: str, target: str) -> float:
    """1 - d/len(target) after removing whitespace and lower-casing both strings.

    d is 0 when the target is a substring of the text, else the Levenshtein distance capped at
    len(target). An empty target scores 1 only for an empty text.
    """
    text = "".join(text.split()).lower()
    target = "".join(target.split()).lower()
    if not target:
        return float(not text)
    if target in text:
        return 1.0
    return 1.0 - min(Levenshtein.distance(text, target), len(target)) / len(target)


class Scorer(Protocol):
    def __call__(self, images: np.ndarray | list[Image.Image],
                 targets: list[str]) -> tuple[np.ndarray, list[str]]:
        """Scores (B,) float32 in [0, 1] and the B transcriptions for B images and their B target
        strings.

        PickScore takes the B prompts instead of the targets, the aesthetic and flat judges
        ignore them; their scores are the anchors' numbers, not all in [0, 1] (see make_judge)."""
        ...


class ServerError(RuntimeError):
    """A vLLM server stayed unreachable, kept timing out or failing, or rejected the request."""


def to_pil(images: np.ndarray | list[Image.Image]) -> list[Image.Image]:
    if isinstance(images, np.ndarray):
        return [Image.fromarray(image) for image in images]
    return [image.convert("RGB") for image in images]


def _score_texts(texts: list[str], targets: list[str]) -> tuple[np.ndarray, list[str]]:
    if len(texts) != len(targets):
        raise ValueError(f"got {len(texts)} images but {len(targets)} targets")
    return np.array([ocr_score(t, g) for t, g in zip(texts, targets)], dtype=np.float32), texts


OCR_ENGINES = ("onnxruntime", "openvino")


class OpenVinoSession:
    """A RapidOCR session whose call, `session(batch) -> [output]`, OpenVINO runs; its other
    methods (the recogniser asks for its character list) are the ONNX Runtime session's."""

    def __init__(self, session, compiled):
        self.session, self.compiled = session, compiled

    def __call__(self, batch: np.ndarray) -> list[np.ndarray]:
        return [self.compiled(batch)[0]]

    def __getattr__(self, name):
        return getattr(self.session, name)


def run_with_openvino(engine, threads: int = -1, precision: str | None = "f32") -> None:
    """Run a RapidOCR engine's detection and recognition models, the same ONNX files, with
    OpenVINO on the CPU. float32 by default: OpenVINO's own default is bfloat16 on a CPU with AMX,
    which reads hard images differently."""
    import openvino

    core = openvino.Core()
    # unpinned: each process would pin its inference threads to the first cores, so that a pool's
    # single-threaded engines (one a process) would all run on one core
    config = {"ENABLE_CPU_PINNING": False}
    if threads > 0:
        config["INFERENCE_NUM_THREADS"] = threads
    if precision:
        config["INFERENCE_PRECISION_HINT"] = precision
    for holder, attribute in ((engine.text_det, "infer"), (engine.text_rec, "session")):
        session = getattr(holder, attribute)
        model = core.compile_model(session.session._model_path, "CPU", config)
        setattr(holder, attribute, OpenVinoSession(session, model))


class PaddleScorer:
    """PP-OCR (det + rec ONNX models shipped in the rapidocr wheel) on CPU: Flow-GRPO's original
    metric.

    Configured as Flow-GRPO's reward calls PaddleOCR (flow_grpo/ocr.py of Luo-Yihong/DGPO, lines
    34-38 and 62: `PaddleOCR(use_angle_cls=False, lang="en")`, `ocr(img, cls=False)`): no angle
    classifier, and PaddleOCR 2.x's detector defaults (tools/infer/utility.py: det_limit_side_len
    960, det_limit_type "max"), which leave images smaller than 960 pixels at their size. RapidOCR's
    own defaults would run the classifier and upscale every image to 736 pixels on its short side
    (8x the reading time of a 128-pixel image, 2x at 512). threads: the engine's threads (-1: every
    core). engine: "onnxruntime" runs the ONNX models as RapidOCR does; "openvino" runs the same
    files with OpenVINO at float32 (see run_with_openvino).
    """

    def __init__(self, threads: int = -1, engine: str = "onnxruntime"):
        from rapidocr_onnxruntime import RapidOCR

        if engine not in OCR_ENGINES:
            raise ValueError(f"PP-OCR engine {engine!r}: one of {', '.join(OCR_ENGINES)}")
        self.engine = RapidOCR(use_cls=False, det_limit_side_len=960, det_limit_type="max",
                               intra_op_num_threads=threads, inter_op_num_threads=threads)
        if engine == "openvino":
            run_with_openvino(self.engine, threads)
        # one engine, shared by threads (the test OCR server calls it concurrently)
        self.lock = threading.Lock()

    def read(self, image: Image.Image) -> str:
        """The recognised text boxes joined in reading order: lines top to bottom, boxes left to
        right."""
        with self.lock:
            result, _ = self.engine(image)
        boxes = []  # (top, bottom, left, text); a box is four (x, y) corners
        for corners, text, _ in result or []:
            xs, ys = zip(*corners)
            boxes.append((min(ys), max(ys), min(xs), text))
        lines: list[list[tuple]] = []
        # a box whose vertical centre lies inside the current line's first box joins that line
        for box in sorted(boxes):
            if lines and lines[-1][0][0] <= (box[0] + box[1]) / 2 <= lines[-1][0][1]:
                lines[-1].append(box)
            else:
                lines.append([box])
        return " ".join(box[3] for line in lines for box in sorted(line, key=lambda x: x[2]))

    def __call__(self, images, targets):
        return _score_texts([self.read(image) for image in to_pil(images)], targets)


def check_reward_model(model_path: str) -> None:
    """A RuntimeError naming --reward-model when it is meant as a local directory and holds no
    transformers model (sd3.check_model_path's rule); transformers would call it a malformed
    repo id."""
    from sd3 import check_model_path

    check_model_path(model_path, "--reward-model", "config.json", "a transformers model")


class QwenVLScorer:
    """Qwen2.5-VL-Instruct through transformers: batched greedy transcription, scored against the
    targets.

    The tokenizer and image processor are loaded on their own rather than through AutoProcessor:
    transformers 5's Qwen2.5-VL processor (and AutoImageProcessor) insist on torchvision, whose
    registry wheel is a CUDA build that does not load against CI's CPU torch. So the image
    placeholders are expanded here, as the processor would, and the PIL image processor is used on
    every machine (the same preprocessing on CPU and GPU).
    """

    def __init__(self, model_path: str, device: str, batch_size: int, max_new_tokens: int):
        import torch
        from transformers import (AutoTokenizer, Qwen2_5_VLForConditionalGeneration,
                                  Qwen2VLImageProcessorPil)

        self.device, self.batch_size = torch.device(device), batch_size
        self.max_new_tokens = max_new_tokens
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        # nothing to download: built directly on the device, never saved
        if model_path == RANDOM_QWEN:
            self.tokenizer, self.image_processor, model = random_qwen_vl(QWEN_3B, self.device,
                                                                         dtype)
        else:
            check_reward_model(model_path)
            try:
                # generate appends
                self.tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
                self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_path)
                model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_path, dtype=dtype)
            # hub errors are OSErrors; a malformed repo id is a ValueError
            except (OSError, ValueError) as e:
                raise RuntimeError(
                    f"could not load the Qwen2.5-VL reward model from {model_path!r}: {e}\n"
                    "If it is a gated or private hub model, log in with `hf auth login`; offline, "
                    "download it and pass its local directory as the model path."
                ) from e
        self.model = model.to(self.device).eval()
        # A high-priority stream of its own: the trainers call the scorer from a thread while their
        # passes fill the GPU
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        self.image_token_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def model_inputs(self, images: list[Image.Image]) -> dict:
        """The chat prompts (left-padded) and pixel values of a batch of images, on the model's
        device."""
        vision = self.image_processor(images=images, return_tensors="pt")
        # one pad per merged patch
        n_pads = vision["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2
        prompts = [QWEN_PROMPT.format(image_pads="<|image_pad|>" * n, instruction=INSTRUCTION)
                   for n in n_pads.tolist()]
        inputs = self.tokenizer(prompts, padding=True, return_tensors="pt")
        # 1 marks image tokens: without it the model silently falls back to 1-D positions for the
        # image (no M-RoPE).
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.image_token_id).int()
        return {k: v.to(self.device) for k, v in {**inputs, **vision}.items()}

    def transcribe(self, images: list[Image.Image]) -> list[str]:
        import torch

        inputs = self.model_inputs(images)
        with torch.inference_mode():
            out = self.model.generate(
                **inputs, do_sample=False, max_new_tokens=self.max_new_tokens,
                pad_token_id=self.tokenizer.pad_token_id
            )
        new_tokens = out[:, inputs["input_ids"].shape[1] :]
        return self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)

    def __call__(self, images, targets):
        import torch

        images = to_pil(images)
        chunks = [images[i : i + self.batch_size] for i in range(0, len(images), self.batch_size)]
        with torch.cuda.stream(self.stream):  # a no-op for None (CPU)
            texts = [text.strip() for chunk in chunks for text in self.transcribe(chunk)]
        return _score_texts(texts, targets)


class VLLMScorer:
    """Client for `vllm serve <model>`: one OpenAI chat-completions request per image, round-robin
    over servers.

    Each server is asked for its models when the scorer is built, so that a missing, silent or wrong
    server is an error before any model is loaded rather than after a rollout.
    """

    def __init__(self, urls: list[str], model: str, concurrency: int, max_new_tokens: int,
                 timeout: float, max_retries: int):
        import requests

        if not urls:
            raise ValueError("the vllm scorer needs at least one server URL")
        self.requests, self.urls, self.model = requests, [u.rstrip("/") for u in urls], model
        self.max_new_tokens = max_new_tokens
        self.timeout, self.max_retries = timeout, max_retries
        # threads and their HTTP sessions live as long as the scorer: a thread reuses its
        # connection where the server keeps it alive (vLLM's does) instead of opening one an image
        self.threads, self.sessions = ThreadPoolExecutor(concurrency), threading.local()
        self.backoff = 0.25  # seconds before the first retry, doubled for each further one
        # next() on it is atomic under the GIL, so threads share it safely
        self.counter = itertools.count()
        for url in self.urls:
            self.check_server(url)

    def check_server(self, url: str) -> None:
        """GET /v1/models: the server answers within the timeout and serves self.model, else a
        ServerError."""
        try:
            response = self.requests.get(f"{url}/v1/models", timeout=self.timeout)
        except self.requests.Timeout:  # before ConnectionError: a connect timeout is both
            raise ServerError(f"vLLM server {url} did not answer GET /v1/models within "
                              f"{self.timeout:g} s") from None
        except self.requests.ConnectionError as e:
            raise ServerError(f"no vLLM server at {url} ({type(e).__name__}); start one with "
                              f"`vllm serve {self.model}` and start training once "
                              f"{url}/health answers (a server that is still loading its model "
                              "refuses connections), or pass the URL of a running one") from None
        except self.requests.RequestException as e:  # a malformed URL
            hint = "; write it as http://HOST:PORT" if "://" not in url else ""
            raise ServerError(f"reward server URL {url}: {e}{hint}") from None
        try:
            answered = response.status_code == 200
            served = [entry["id"] for entry in response.json()["data"]] if answered else None
        except (ValueError, KeyError, TypeError):
            served = None
        if served is None:
            raise ServerError(f"{url} is not an OpenAI-compatible server: GET /v1/models gave HTTP "
                              f"{response.status_code} {response.text[:100]!r}")
        if self.model not in served:
            names = ", ".join(map(repr, served)) or "no model"
            raise ServerError(f"vLLM server {url} serves {names}, "
                              f"not the reward model {self.model!r}")

    def transcribe(self, image: Image.Image) -> str:
        url = self.urls[next(self.counter) % len(self.urls)]
        buffer = io.BytesIO()
        # lossless at any level, so the server reads exactly our pixels; level 1 encodes a
        # 128-pixel render 3.6x faster than PIL's default 6, for about a sixth more bytes
        image.save(buffer, format="PNG", compress_level=1)
        data_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        content = [{"type": "image_url", "image_url": {"url": data_url}},
                   {"type": "text", "text": INSTRUCTION}]
        payload = {"model": self.model, "messages": [{"role": "user", "content": content}],
                   "temperature": 0.0, "max_tokens": self.max_new_tokens}
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self.session().post(f"{url}/v1/chat/completions", json=payload,
                                               timeout=self.timeout)
            except (self.requests.ConnectionError, self.requests.Timeout) as e:
                # the OS's reason, without urllib3's wrapping
                reason = re.search(r"\[Errno -?\d+\] [^'\")]+", str(e))
                cause = f"{type(e).__name__}: {reason.group(0) if reason else e}"
                continue
            if response.status_code == 200:
                return (response.json()["choices"][0]["message"]["content"] or "").strip()
            cause = f"HTTP {response.status_code}: {response.text[:200]}"
            # a 4xx (wrong model name, bad payload) will not get better by retrying
            if response.status_code < 500:
                raise ServerError(f"vLLM server {url} rejected the request: {cause}")
            # a 5xx: an overloaded or restarting server may recover, so retry
        raise ServerError(f"vLLM server {url} failed {self.max_retries + 1} attempts (timeout "
                          f"{self.timeout:g} s); last: {cause}")

    def session(self):
        """This thread's requests.Session (a Session is not shared between threads)."""
        if not hasattr(self.sessions, "session"):
            self.sessions.session = self.requests.Session()
        return self.sessions.session

    def __call__(self, images, targets):
        return _score_texts(list(self.threads.map(self.transcribe, to_pil(images))), targets)


def random_qwen_vl(spec: dict, device="cpu", dtype=None):
    """Tokenizer, image processor and a random-weight Qwen2.5-VL of architecture `spec` (QWEN_3B or
    tests/tiny_models.TINY_QWEN).

    The tokenizer is a byte-level BPE without merges (each byte is a token) plus Qwen's special
    tokens, padded with unused tokens to the vocabulary size. The model is created directly on
    `device` in `dtype` (default: torch's): no float32 copy on the CPU first, and "meta" counts
    parameters without memory.
    """
    import torch
    from tokenizers import pre_tokenizers
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer,
                              Qwen2VLImageProcessorPil)

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    unused = (spec["text"]["vocab_size"] or 0) - len(tokens) - len(QWEN_SPECIALS) - 1
    tokens += [f"<unused{i}>" for i in range(unused)]
    # adds <|endoftext|> (eos, pad); left padding, as generate appends
    tokenizer = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[],
                               padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    ids = tokenizer.convert_tokens_to_ids
    pad, eos = ids("<|endoftext|>"), ids("<|im_end|>")
    text = {**spec["text"], "vocab_size": len(tokenizer), "bos_token_id": pad, "eos_token_id": eos,
            "pad_token_id": pad}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=spec["vision"],
                              tie_word_embeddings=True, image_token_id=ids("<|image_pad|>"),
                              video_token_id=ids("<|video_pad|>"),
                              vision_start_token_id=ids("<|vision_start|>"),
                              vision_end_token_id=ids("<|vision_end|>"))
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype or default_dtype)
    try:
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, pad
    min_pixels, max_pixels = spec["pixels"]
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    return tokenizer, Qwen2VLImageProcessorPil(size=size), model


def save_random_qwen_vl(out_dir: str, spec: dict = QWEN_3B, device: str = "cpu") -> None:
    """Save a random-weight Qwen2.5-VL of architecture `spec` (bfloat16 on CUDA) as a folder that
    `vllm serve` and --reward qwen-vl load as they load the real model: safetensors weights, the
    byte tokenizer with QWEN_CHAT_TEMPLATE, the image processor."""
    import torch

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    tokenizer, image_processor, model = random_qwen_vl(spec, device, dtype)
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    for part in (tokenizer, image_processor, model):
        part.save_pretrained(out_dir)


def brightness(images, targets=None) -> tuple[np.ndarray, list[str]]:
    """Mean pixel value / 255; targets are ignored (a reward for learning checks on tiny models)."""
    scores = [np.asarray(image, dtype=np.float32).mean() / 255.0 for image in to_pil(images)]
    return np.array(scores, dtype=np.float32), [""] * len(scores)


def compressibility(images, targets=None) -> tuple[np.ndarray, list[str]]:
    """1 - (JPEG bytes at quality 95) / (raw RGB bytes), clipped to [0, 1]: higher = more
    compressible."""
    scores = []
    for image in to_pil(images):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=95)
        scores.append(np.clip(1.0 - buffer.tell() / (image.width * image.height * 3), 0.0, 1.0))
    return np.array(scores, dtype=np.float32), [""] * len(scores)


def make_scorer(name: str, *, device: str = "cpu", model_path: str = "Qwen/Qwen2.5-VL-3B-Instruct",
                urls: list[str] | None = None, batch_size: int = 32, max_new_tokens: int = 32,
                timeout: float = 60.0, max_retries: int = 3) -> Scorer:
    """Build the scorer `name` (one of SCORERS); models are loaded here, once.

    batch_size is the generation batch for qwen-vl and the number of concurrent requests for vllm;
    urls (e.g. ["http://localhost:8000"]), timeout (seconds per request) and max_retries are for
    vllm only. qwen-vl with model_path=RANDOM_QWEN builds Qwen2.5-VL-3B with random weights on
    `device` (for benchmarks).
    """
    if name == "paddle":
        return PaddleScorer()
    if name == "qwen-vl":
        return QwenVLScorer(model_path, device, batch_size, max_new_tokens)
    if name == "vllm":
        return VLLMScorer(urls or [], model_path, batch_size, max_new_tokens, timeout, max_retries)
    if name in ("brightness", "compressibility"):
        return brightness if name == "brightness" else compressibility
    raise ValueError(f"unknown scorer {name!r}; choose one of {SCORERS}")
