"""OCR reward for text rendering: target extraction, the Levenshtein score, and scorers.

A scorer maps images and their target strings to scores in [0, 1] and the transcriptions it read:
    scorer = make_scorer("paddle")                   # or "qwen-vl", "vllm", "brightness", "compressibility"
    scores, texts = scorer(images, targets)          # images: (B, H, W, 3) uint8 or PIL list -> (B,) float32, B strings
Judges (make_judges) add image-quality scorers (PickScore, the LAION aesthetic predictor) and the
flat fraction, a weight-free sign of a blanked background: judge(images, targets, prompts).
A reward mix (make_mix("qwen-vl=0.8 pickscore=0.2")) scores each component, (B, K), and
mix_advantages combines them by Flow-Factory's two aggregations around the trainer's own
normalisation. This module holds no loss and no advantage formula of its own: it is part of the
"environment".
Heavy libraries (torch, transformers, rapidocr, requests) are imported only when a scorer is built.
"""

from __future__ import annotations

import base64
import io
import itertools
import re
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import Levenshtein
import numpy as np
from PIL import Image

INSTRUCTION = "Please output only the text content from the image without any additional descriptions or formatting."
SCORERS = ("qwen-vl", "vllm", "paddle", "brightness", "compressibility")
# What Qwen2.5-VL's chat template renders for one user turn (image, then text) with its default system prompt,
# i.e. the prompt `vllm serve` builds server-side for the same request, so both scorers see the same input.
QWEN_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|>{image_pads}<|vision_end|>{instruction}<|im_end|>\n<|im_start|>assistant\n"
)
_QUOTED = re.compile(r'"([^"]*)"')
RANDOM_QWEN = "random-qwen2.5-vl-3b"  # Qwen2.5-VL-3B-Instruct's architecture with random weights (benchmarks)
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2.5-VL-3B-Instruct's architecture (its config.json; 3,754,622,976 parameters) and the tiny CPU-test model's.
# pixels: the image processor's (min_pixels, max_pixels); vocab_size None: only the bytes and special tokens.
_MROPE = dict(rope_type="default", rope_theta=1e6)  # mrope_section splits head_dim / 2 over (time, height, width)
QWEN_3B = dict(
    text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
              num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6,
              rope_parameters={**_MROPE, "mrope_section": [16, 24, 24]}),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                hidden_act="silu", tokens_per_second=2),
    pixels=(56 * 56, 28 * 28 * 16384))
TINY_QWEN = dict(  # images capped at 112x112 pixels (16 image tokens) so that CPU tests stay fast
    text=dict(vocab_size=None, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096,
              rope_parameters={**_MROPE, "mrope_section": [2, 3, 3]}),
    vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                fullatt_block_indexes=[1]),
    pixels=(56 * 56, 112 * 112))


def extract_target(prompt: str) -> str | None:
    """The text inside the first pair of double quotes of `prompt`, or None when there is none."""
    match = _QUOTED.search(prompt)
    return None if match is None else match.group(1)


def ocr_score(text: str, target: str) -> float:
    """1 - d/len(target) after removing whitespace and lower-casing both strings.

    d is 0 when the target is a substring of the text, else the Levenshtein distance capped at len(target).
    An empty target scores 1 only for an empty text.
    """
    text = "".join(text.split()).lower()
    target = "".join(target.split()).lower()
    if not target:
        return float(not text)
    if target in text:
        return 1.0
    return 1.0 - min(Levenshtein.distance(text, target), len(target)) / len(target)


class Scorer(Protocol):
    def __call__(self, images: np.ndarray | list[Image.Image], targets: list[str]) -> tuple[np.ndarray, list[str]]:
        """Scores (B,) float32 in [0, 1] and the B transcriptions for B images and their B target strings.

        PickScore takes the B prompts instead of the targets, the aesthetic and flat judges
        ignore them; their scores are the anchors' numbers, not all in [0, 1] (see make_judge)."""
        ...


class ServerError(RuntimeError):
    """A vLLM server stayed unreachable, kept timing out or failing, or rejected the request."""


def _to_pil(images: np.ndarray | list[Image.Image]) -> list[Image.Image]:
    if isinstance(images, np.ndarray):
        return [Image.fromarray(image) for image in images]
    return [image.convert("RGB") for image in images]


def _score_texts(texts: list[str], targets: list[str]) -> tuple[np.ndarray, list[str]]:
    if len(texts) != len(targets):
        raise ValueError(f"got {len(texts)} images but {len(targets)} targets")
    return np.array([ocr_score(t, g) for t, g in zip(texts, targets)], dtype=np.float32), texts


class PaddleScorer:
    """PP-OCR (det + rec ONNX models shipped in the rapidocr wheel) on CPU: Flow-GRPO's original metric.

    Configured as Flow-GRPO's reward calls PaddleOCR (flow_grpo/ocr.py of Luo-Yihong/DGPO, lines 34-38 and 62:
    `PaddleOCR(use_angle_cls=False, lang="en")`, `ocr(img, cls=False)`): no angle classifier, and PaddleOCR 2.x's
    detector defaults (tools/infer/utility.py: det_limit_side_len 960, det_limit_type "max"), which leave images
    smaller than 960 pixels at their size. RapidOCR's own defaults would run the classifier and upscale every image
    to 736 pixels on its short side (8x the reading time of a 128-pixel image, 2x at 512).
    threads: ONNX Runtime threads per engine (-1: every core).
    """

    def __init__(self, threads: int = -1):
        from rapidocr_onnxruntime import RapidOCR

        self.engine = RapidOCR(use_cls=False, det_limit_side_len=960, det_limit_type="max",
                               intra_op_num_threads=threads, inter_op_num_threads=threads)
        self.lock = threading.Lock()  # one engine, shared by threads (the test OCR server calls it concurrently)

    def read(self, image: Image.Image) -> str:
        """The recognised text boxes joined in reading order: lines top to bottom, boxes left to right."""
        with self.lock:
            result, _ = self.engine(image)
        boxes = []  # (top, bottom, left, text); a box is four (x, y) corners
        for corners, text, _ in result or []:
            xs, ys = zip(*corners)
            boxes.append((min(ys), max(ys), min(xs), text))
        lines: list[list[tuple]] = []
        for box in sorted(boxes):  # a box whose vertical centre lies inside the current line's first box joins that line
            if lines and lines[-1][0][0] <= (box[0] + box[1]) / 2 <= lines[-1][0][1]:
                lines[-1].append(box)
            else:
                lines.append([box])
        return " ".join(box[3] for line in lines for box in sorted(line, key=lambda x: x[2]))

    def __call__(self, images, targets):
        return _score_texts([self.read(image) for image in _to_pil(images)], targets)


def check_reward_model(model_path: str) -> None:
    """A RuntimeError naming --reward-model when it is meant as a local directory and holds no transformers model
    (rollout.check_model_path's rule); transformers would call it a malformed repo id."""
    from rollout import check_model_path

    check_model_path(model_path, "--reward-model", "config.json", "a transformers model")


class QwenVLScorer:
    """Qwen2.5-VL-Instruct through transformers: batched greedy transcription, scored against the targets.

    The tokenizer and image processor are loaded on their own rather than through AutoProcessor: transformers 5's
    Qwen2.5-VL processor (and AutoImageProcessor) insist on torchvision, whose registry wheel is a CUDA build that
    does not load against CI's CPU torch. So the image placeholders are expanded here, as the processor would, and
    the PIL image processor is used on every machine (the same preprocessing on CPU and GPU).
    """

    def __init__(self, model_path: str, device: str, batch_size: int, max_new_tokens: int):
        import torch
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

        self.device, self.batch_size, self.max_new_tokens = torch.device(device), batch_size, max_new_tokens
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if model_path == RANDOM_QWEN:  # nothing to download: built directly on the device, never saved
            self.tokenizer, self.image_processor, model = _random_qwen_vl(QWEN_3B, self.device, dtype)
        else:
            check_reward_model(model_path)
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")  # generate appends
                self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_path)
                model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_path, dtype=dtype)
            except (OSError, ValueError) as e:  # hub errors are OSErrors; a malformed repo id is a ValueError
                raise RuntimeError(
                    f"could not load the Qwen2.5-VL reward model from {model_path!r}: {e}\n"
                    "If it is a gated or private hub model, log in with `hf auth login`; offline, download it and "
                    "pass its local directory as the model path."
                ) from e
        self.model = model.to(self.device).eval()
        # A high-priority stream of its own: the trainers call the scorer from a thread while their passes fill the GPU
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self.image_token_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def model_inputs(self, images: list[Image.Image]) -> dict:
        """The chat prompts (left-padded) and pixel values of a batch of images, on the model's device."""
        vision = self.image_processor(images=images, return_tensors="pt")
        n_pads = vision["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2  # one pad per merged patch
        prompts = [QWEN_PROMPT.format(image_pads="<|image_pad|>" * n, instruction=INSTRUCTION) for n in n_pads.tolist()]
        inputs = self.tokenizer(prompts, padding=True, return_tensors="pt")
        # 1 marks image tokens: without it the model silently falls back to 1-D positions for the image (no M-RoPE).
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.image_token_id).int()
        return {k: v.to(self.device) for k, v in {**inputs, **vision}.items()}

    def transcribe(self, images: list[Image.Image]) -> list[str]:
        import torch

        inputs = self.model_inputs(images)
        with torch.inference_mode():
            out = self.model.generate(
                **inputs, do_sample=False, max_new_tokens=self.max_new_tokens, pad_token_id=self.tokenizer.pad_token_id
            )
        return self.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    def __call__(self, images, targets):
        import torch

        images = _to_pil(images)
        chunks = [images[i : i + self.batch_size] for i in range(0, len(images), self.batch_size)]
        with torch.cuda.stream(self.stream):  # a no-op for None (CPU)
            texts = [text.strip() for chunk in chunks for text in self.transcribe(chunk)]
        return _score_texts(texts, targets)


class VLLMScorer:
    """Client for `vllm serve <model>`: one OpenAI chat-completions request per image, round-robin over servers.

    Each server is asked for its models when the scorer is built, so that a missing, silent or wrong server is an
    error before any model is loaded rather than after a rollout.
    """

    def __init__(self, urls: list[str], model: str, concurrency: int, max_new_tokens: int, timeout: float, max_retries: int):
        import requests

        if not urls:
            raise ValueError("the vllm scorer needs at least one server URL")
        self.requests, self.urls, self.model = requests, [u.rstrip("/") for u in urls], model
        self.concurrency, self.max_new_tokens = concurrency, max_new_tokens
        self.timeout, self.max_retries = timeout, max_retries
        self.backoff = 0.25  # seconds before the first retry, doubled for each further one
        self.counter = itertools.count()  # next() on it is atomic under the GIL, so threads share it safely
        for url in self.urls:
            self.check_server(url)

    def check_server(self, url: str) -> None:
        """GET /v1/models: the server answers within the timeout and serves self.model, else a ServerError."""
        try:
            response = self.requests.get(f"{url}/v1/models", timeout=self.timeout)
        except self.requests.Timeout:  # before ConnectionError: a connect timeout is both
            raise ServerError(f"vLLM server {url} did not answer GET /v1/models within {self.timeout:g} s") from None
        except self.requests.ConnectionError as e:
            raise ServerError(f"no vLLM server at {url} ({type(e).__name__}); start one with "
                              f"`vllm serve {self.model}`, or pass the URL of a running one") from None
        except self.requests.RequestException as e:  # a malformed URL
            hint = "; write it as http://HOST:PORT" if "://" not in url else ""
            raise ServerError(f"reward server URL {url}: {e}{hint}") from None
        try:
            served = [entry["id"] for entry in response.json()["data"]] if response.status_code == 200 else None
        except (ValueError, KeyError, TypeError):
            served = None
        if served is None:
            raise ServerError(f"{url} is not an OpenAI-compatible server: GET /v1/models gave HTTP "
                              f"{response.status_code} {response.text[:100]!r}")
        if self.model not in served:
            raise ServerError(f"vLLM server {url} serves {', '.join(map(repr, served)) or 'no model'}, "
                              f"not the reward model {self.model!r}")

    def transcribe(self, image: Image.Image) -> str:
        url = self.urls[next(self.counter) % len(self.urls)]
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")  # lossless, so the server reads exactly our pixels
        data_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        content = [{"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": INSTRUCTION}]
        payload = {"model": self.model, "messages": [{"role": "user", "content": content}],
                   "temperature": 0.0, "max_tokens": self.max_new_tokens}
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self.requests.post(f"{url}/v1/chat/completions", json=payload, timeout=self.timeout)
            except (self.requests.ConnectionError, self.requests.Timeout) as e:
                reason = re.search(r"\[Errno -?\d+\] [^'\")]+", str(e))  # the OS's reason, without urllib3's wrapping
                cause = f"{type(e).__name__}: {reason.group(0) if reason else e}"
                continue
            if response.status_code == 200:
                return (response.json()["choices"][0]["message"]["content"] or "").strip()
            cause = f"HTTP {response.status_code}: {response.text[:200]}"
            if response.status_code < 500:  # a 4xx (wrong model name, bad payload) will not get better by retrying
                raise ServerError(f"vLLM server {url} rejected the request: {cause}")
            # a 5xx: an overloaded or restarting server may recover, so retry
        raise ServerError(f"vLLM server {url} failed {self.max_retries + 1} attempts (timeout {self.timeout:g} s); last: {cause}")

    def __call__(self, images, targets):
        with ThreadPoolExecutor(self.concurrency) as pool:
            return _score_texts(list(pool.map(self.transcribe, _to_pil(images))), targets)


class GuardedScorer:
    """A scorer that does not raise: when the wrapped one fails (a reward server still failing after its retries, or any
    other error), it returns NaN scores, and `failure` keeps the first failure in one line. The trainers see the NaN
    among the gathered rewards on every rank and stop together before training on them, keeping the last completed
    iteration, rather than dying mid-iteration with a traceback. An error that is not a server's (a bug in a scorer)
    also prints its traceback, which its fix needs."""

    def __init__(self, scorer: Scorer):
        self.scorer, self.failure = scorer, None

    def __call__(self, images, targets, *prompts):
        """prompts: passed on when given (a Judge, a MixScorer); a MixScorer's NaNs are (B, K)."""
        try:
            return self.scorer(images, targets, *prompts)
        except Exception as error:
            if not isinstance(error, ServerError):
                traceback.print_exc()
            self.failure = self.failure or f"the reward failed: {error if isinstance(error, ServerError) else repr(error)}"
            names = getattr(self.scorer, "names", None)  # a MixScorer's
            shape = (len(targets), len(names)) if names else len(targets)
            return np.full(shape, np.nan, dtype=np.float32), [""] * len(targets)


class ScoringThread:
    """A scorer that reads in a thread of its own, so that the GPU works meanwhile: `submit` images
    now, `take` their scores later. One thread: the jobs of one scorer never overlap each other."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer
        self.executor = ThreadPoolExecutor(1)
        self.pending = []  # futures of (scores, texts, seconds), in submission order
        self.seconds = 0.0  # the scorer's own time for the jobs taken last

    @property
    def failure(self) -> str | None:
        """The first failure of a GuardedScorer, in one line; None while it has not failed."""
        return getattr(self.scorer, "failure", None)

    def submit(self, images, targets, prompts=None) -> None:
        """prompts: for a Judge or a MixScorer (PickScore reads them); plain scorers take none."""
        extra = () if prompts is None else (prompts,)
        self.pending.append(self.executor.submit(self._score, images, targets, *extra))

    def take(self, jobs: int | None = None) -> tuple[np.ndarray, list[str]]:
        """Scores (N,) and transcriptions of the first `jobs` jobs not yet taken (all: None), in order."""
        taken = self.pending[:jobs] if jobs is not None else self.pending
        self.pending = self.pending[len(taken):]
        results = [future.result() for future in taken]
        self.seconds = sum(seconds for _, _, seconds in results)
        scores = np.concatenate([scores for scores, _, _ in results]) if results else np.zeros(0)
        return scores, [text for _, texts, _ in results for text in texts]

    def cancel(self) -> None:
        """Drop the jobs not started yet (a signal ends the program)."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _score(self, images, targets, *prompts):
        started = time.perf_counter()
        scores, texts = self.scorer(images, targets, *prompts)
        return scores, texts, time.perf_counter() - started


def brightness(images, targets=None) -> tuple[np.ndarray, list[str]]:
    """Mean pixel value / 255; targets are ignored (a reward for learning checks on tiny models)."""
    scores = [np.asarray(image, dtype=np.float32).mean() / 255.0 for image in _to_pil(images)]
    return np.array(scores, dtype=np.float32), [""] * len(scores)


def compressibility(images, targets=None) -> tuple[np.ndarray, list[str]]:
    """1 - (JPEG bytes at quality 95) / (raw RGB bytes), clipped to [0, 1]: higher = more compressible."""
    scores = []
    for image in _to_pil(images):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=95)
        scores.append(np.clip(1.0 - buffer.tell() / (image.width * image.height * 3), 0.0, 1.0))
    return np.array(scores, dtype=np.float32), [""] * len(scores)


def make_scorer(name: str, *, device: str = "cpu", model_path: str = "Qwen/Qwen2.5-VL-3B-Instruct",
                urls: list[str] | None = None, batch_size: int = 32, max_new_tokens: int = 32, timeout: float = 60.0,
                max_retries: int = 3) -> Scorer:
    """Build the scorer `name` (one of SCORERS); models are loaded here, once.

    batch_size is the generation batch for qwen-vl and the number of concurrent requests for vllm;
    urls (e.g. ["http://localhost:8000"]), timeout (seconds per request) and max_retries are for vllm only.
    qwen-vl with model_path=RANDOM_QWEN builds Qwen2.5-VL-3B with random weights on `device` (for benchmarks).
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


# ---- image-quality judges ----------------------------------------------------------------------

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"  # a CLIP-H/14 tuned on Pick-a-Pic preferences
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"  # its tokenizer, image processor
PICKSCORE_SCALE = 26.0  # the anchors divide PickScore by 26 to bring it near [0, 1]
AESTHETIC_CLIP = "openai/clip-vit-large-patch14"  # the CLIP whose embeddings the LAION head reads
AESTHETIC_HEAD = "sac+logos+ava1-l14-linearMSE.pth"  # the LAION head's file name
AESTHETIC_WIDTHS = (1024, 128, 64, 16, 1)  # the head's layer widths after the embedding
READERS = ("qwen-vl", "vllm", "paddle")  # the scorers that transcribe text
JUDGES = ("paddle", "qwen-vl", "vllm", "pickscore", "aesthetic", "flat", "brightness",
          "compressibility")
AGGREGATIONS = ("sum", "gdpo")  # Flow-Factory's advantage_aggregation


class ClipModel:
    """A transformers CLIPModel in float32 with the PIL CLIP image processor (and the tokenizer)
    of `processor_path`; `what` names it in errors ("the PickScore model").

    The processor is CLIPImageProcessorPil, not AutoProcessor's pick: transformers 5 picks a
    torchvision backend where torchvision is installed (GPU machines with vLLM) and the PIL one
    elsewhere, which need not resize alike. The PIL one is transformers 4's CLIPProcessor, which
    Flow-GRPO ran; here it runs on every machine.
    """

    def __init__(self, model_path: str, processor_path: str, device: str, batch_size: int,
                 what: str, tokenizer: bool = True):
        import torch
        from transformers import CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

        from rollout import check_model_path

        check_model_path(model_path, what, "config.json", "a transformers model")
        check_model_path(processor_path, f"{what}'s processor", "preprocessor_config.json",
                         "an image processor")
        try:
            self.image_processor = CLIPImageProcessorPil.from_pretrained(processor_path)
            self.tokenizer = CLIPTokenizer.from_pretrained(processor_path) if tokenizer else None
            model = CLIPModel.from_pretrained(model_path, dtype=torch.float32)
        except (OSError, ValueError) as e:  # hub errors are OSErrors, a malformed id a ValueError
            raise RuntimeError(
                f"could not load {what} from {model_path!r} (processor {processor_path!r}): {e}\n"
                "Offline, download it and pass its local directory.") from e
        self.device, self.batch_size = torch.device(device), batch_size
        self.model = model.to(self.device).eval()
        # a high-priority stream, as QwenVLScorer's: the trainers score while the GPU is busy
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None

    def pixel_values(self, images: list[Image.Image]):
        """Short side to 224 (bicubic), centre crop 224x224, scaled to [0, 1], CLIP mean/std."""
        pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        return pixels.to(self.device)

    def tokens(self, texts: list[str]) -> dict:
        """Padded to the longest, cut to CLIP's 77 positions (the end token kept)."""
        inputs = self.tokenizer(texts, padding=True, truncation=True, max_length=77,
                                return_tensors="pt")
        return {k: v.to(self.device) for k, v in inputs.items()}

    def image_features(self, images: list[Image.Image]):
        """The projected image embeddings (B, D), not normalised."""
        return self.model.get_image_features(pixel_values=self.pixel_values(images)).pooler_output

    def text_features(self, texts: list[str]):
        """The projected text embeddings (B, D) at each text's end token, not normalised."""
        return self.model.get_text_features(**self.tokens(texts)).pooler_output

    def chunks(self, *lists):
        """The lists cut into batches of batch_size, zipped."""
        for i in range(0, len(lists[0]), self.batch_size):
            yield [items[i : i + self.batch_size] for items in lists]


class PickScoreScorer:
    """PickScore (Kirstain et al. 2023): exp(logit_scale) * cos(text, image) / 26, PickScore's CLIP.

    As Flow-GRPO's flow_grpo/pickscore_scorer.py: the processor and model (lines 8-13), images
    and padded prompts cut to 77 tokens (19-34), both embeddings L2-normalised (38-42), the
    scaled cosine divided by 26 (45-49); Flow-Factory's src/flow_factory/rewards/pick_score.py
    is the same (47-50, 58-84, 138). Called as scorer(images, prompts): it reads the whole
    prompt, not the quoted target. Scores (B,) float32; 26 x a score is the PickScore of the
    papers' tables.
    """

    def __init__(self, model_path: str = PICKSCORE_MODEL, processor_path: str = PICKSCORE_PROCESSOR,
                 device: str = "cpu", batch_size: int = 32):
        self.clip = ClipModel(model_path, processor_path, device, batch_size, "the PickScore model")

    def __call__(self, images, prompts):
        import torch
        from torch.nn.functional import normalize

        images = _to_pil(images)
        if len(images) != len(prompts):
            raise ValueError(f"got {len(images)} images but {len(prompts)} prompts")
        scores = []
        with torch.inference_mode(), torch.cuda.stream(self.clip.stream):
            scale = self.clip.model.logit_scale.exp()
            for image_chunk, prompt_chunk in self.clip.chunks(images, list(prompts)):
                image = normalize(self.clip.image_features(image_chunk), dim=-1)
                text = normalize(self.clip.text_features(prompt_chunk), dim=-1)
                scores.append((scale * (image * text).sum(-1) / PICKSCORE_SCALE).float().cpu())
        scores = torch.cat(scores).numpy() if scores else np.zeros(0, np.float32)
        return scores, [""] * len(images)


def aesthetic_head(in_features: int = 768):
    """The LAION improved-aesthetic-predictor's MLP, 768 -> 1024 -> 128 -> 64 -> 16 -> 1, linear.

    Its checkpoint's keys are `layers.{0,2,4,6,7}`: the layers between were dropouts, the identity
    at inference, kept here as nn.Identity placeholders (no weights) to load the file as it is.
    """
    import torch.nn as nn

    widths = (in_features, *AESTHETIC_WIDTHS)
    layers = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < 3:  # the trained model's dropouts after the first three layers
            layers.append(nn.Identity())
    head = nn.Module()
    head.layers = nn.Sequential(*layers)
    return head


class AestheticScorer:
    """The LAION aesthetic predictor (improved-aesthetic-predictor's sac+logos+ava1-l14-linearMSE
    head) on CLIP ViT-L/14 image embeddings.

    As Flow-GRPO's flow_grpo/aesthetic_scorer.py: CLIP ViT-L/14 and its processor (lines 35-36),
    the head (13-25, loaded at 38-41), the L2-normalised image embedding read by the head
    (48-53). Reads images only. Scores (B,) float32: the predicted rating on AVA's 1-10 scale,
    as Flow-GRPO logs it (not in [0, 1]). head_path: the head's .pth file (AESTHETIC_HEAD, from
    christophschuhmann/improved-aesthetic-predictor, also in yifan123/flow_grpo's assets).
    """

    def __init__(self, model_path: str = AESTHETIC_CLIP, head_path: str | None = None,
                 device: str = "cpu", batch_size: int = 32):
        import torch

        if head_path is None or not Path(head_path).is_file():
            where = "no such file" if head_path else "no file given"
            raise RuntimeError(
                f"the aesthetic head {head_path or ''}: {where}; it is {AESTHETIC_HEAD} of "
                "christophschuhmann/improved-aesthetic-predictor (also in yifan123/flow_grpo, "
                "flow_grpo/assets/)")
        self.clip = ClipModel(model_path, model_path, device, batch_size, "the aesthetic CLIP",
                              tokenizer=False)
        width = self.clip.model.config.projection_dim
        head = aesthetic_head(width)
        try:
            head.load_state_dict(torch.load(head_path, map_location="cpu", weights_only=True))
        except Exception as e:  # not a state dict, another layout or width
            raise RuntimeError(f"the aesthetic head {head_path}: not a LAION aesthetic MLP for "
                               f"{width}-d embeddings: {e}") from e
        self.head = head.to(self.clip.device).eval()

    def __call__(self, images, prompts=None):
        import torch
        from torch.nn.functional import normalize

        images = _to_pil(images)
        scores = []
        with torch.inference_mode(), torch.cuda.stream(self.clip.stream):
            for (chunk,) in self.clip.chunks(images):
                embedding = normalize(self.clip.image_features(chunk), dim=-1)
                scores.append(self.head.layers(embedding)[:, 0].float().cpu())
        scores = torch.cat(scores).numpy() if scores else np.zeros(0, np.float32)
        return scores, [""] * len(images)


def flat_fraction(images, targets=None, patch: int = 8,
                  threshold: float = 4.0) -> tuple[np.ndarray, list[str]]:
    """The fraction of the image in flat tiles: patch x patch tiles whose pixels have a standard
    deviation of at most `threshold` (of 255) in every RGB channel. Targets are ignored.

    A weight-free sign of the background-blanking hack, where an OCR reward teaches a model to
    draw the text on an empty page: text on a uniform background scores near 1 (only the tiles
    the strokes cross are not flat), a photograph's texture near 0 (a clear sky or a plain wall
    counts as flat). Higher is more blanked: a judge to watch, not a reward to raise. The image
    is cut to whole tiles from its top-left corner.
    """
    scores = []
    for image in _to_pil(images):
        pixels = np.asarray(image, dtype=np.float32)
        rows, cols = pixels.shape[0] // patch, pixels.shape[1] // patch
        if not rows or not cols:
            raise ValueError(f"a {pixels.shape[1]}x{pixels.shape[0]} image has no "
                             f"{patch}x{patch} tile")
        tiles = pixels[: rows * patch, : cols * patch].reshape(rows, patch, cols, patch, 3)
        flat = tiles.std(axis=(1, 3)).max(-1) <= threshold  # (rows, cols)
        scores.append(flat.mean())
    return np.array(scores, dtype=np.float32), [""] * len(scores)


class Judge:
    """A named scorer that knows what it reads: `reads` is "target" (the OCR scorers), "prompt"
    (PickScore) or "image" (aesthetic, flat, brightness, compressibility). judge(images, targets,
    prompts) gives (B,) float32 scores and B transcriptions ("" where it reads no text).
    higher_is_better is False for flat, the one to keep low. Log it as eval/<name>."""

    def __init__(self, name: str, scorer: Scorer, reads: str = "target",
                 higher_is_better: bool = True):
        self.name, self.scorer, self.reads = name, scorer, reads
        self.higher_is_better = higher_is_better

    def __call__(self, images, targets=None, prompts=None):
        texts = prompts if self.reads == "prompt" else targets
        if texts is None and self.reads != "image":
            raise ValueError(f"the {self.name} judge reads the {self.reads}s: pass them")
        return self.scorer(images, [""] * len(images) if texts is None else texts)

    def __repr__(self) -> str:
        return f"Judge({self.name!r}, reads={self.reads!r})"


def make_judge(name: str, *, device: str = "cpu", batch_size: int = 32,
               pickscore_model: str = PICKSCORE_MODEL,
               pickscore_processor: str = PICKSCORE_PROCESSOR,
               aesthetic_model: str = AESTHETIC_CLIP, aesthetic_head_path: str | None = None,
               **scorer_options) -> Judge:
    """The judge `name` (one of JUDGES); models are loaded here, once.

    The OCR scorers are make_scorer's (scorer_options: model_path, urls, max_new_tokens, timeout,
    max_retries); device and batch_size are theirs and the CLIP judges' (where they run, images
    per forward). aesthetic_head_path: the LAION head's file (AestheticScorer).
    """
    if name == "pickscore":
        scorer = PickScoreScorer(pickscore_model, pickscore_processor, device, batch_size)
        return Judge(name, scorer, reads="prompt")
    if name == "aesthetic":
        scorer = AestheticScorer(aesthetic_model, aesthetic_head_path, device, batch_size)
        return Judge(name, scorer, reads="image")
    if name == "flat":
        return Judge(name, flat_fraction, reads="image", higher_is_better=False)
    if name in SCORERS:
        scorer = make_scorer(name, device=device, batch_size=batch_size, **scorer_options)
        return Judge(name, scorer, reads="target" if name in READERS else "image")
    raise ValueError(f"unknown judge {name!r}; choose from {', '.join(JUDGES)}")


def judge_names(names) -> list[str]:
    """The judges of a list of names (["paddle", "pickscore"]) or of a string of them ("paddle
    pickscore flat", commas too), in order; "none" alone, or no name: none. An unknown name or one
    listed twice is a ValueError in one line."""
    names = [names] if isinstance(names, str) else list(names)
    names = [name for part in names for name in re.split(r"[\s,]+", part) if name]
    if names == ["none"]:
        return []
    for i, name in enumerate(names):
        if name not in JUDGES:
            raise ValueError(f"unknown judge {name!r}; choose from {', '.join(JUDGES)}, "
                             "or none alone")
        if name in names[:i]:
            raise ValueError(f"judge {name!r} is listed twice")
    return names


def make_judges(names, **options) -> list[Judge]:
    """The judges `names` in order (e.g. ["paddle", "pickscore", "flat"]; ["none"]: none);
    options go to make_judge. An unknown name or one listed twice is an error before any model
    is loaded (judge_names)."""
    return [make_judge(name, **options) for name in judge_names(names)]


def judge_failure(name: str, error: Exception) -> str:
    """One line naming the judge and its error: a server's message as it is, else its type and
    the first line of its message."""
    lines = str(error).splitlines()
    message = lines[0] if lines else ""
    if not isinstance(error, ServerError):
        message = f"{type(error).__name__}: {message}" if message else repr(error)
    return f"the {name} judge failed: {message}"


class GuardedJudge:
    """A judge that does not raise. A judge is a second opinion: when it fails (its server died,
    its model raises or runs out of memory), the trainers and evaluate.py go on without it
    rather than lose the run. The first error is kept in `failure`, one line naming the judge
    (judge_failure); from then on it scores NaN without calling its scorer again. judge None:
    it failed to load, with `failure` saying why."""

    def __init__(self, name: str, judge: Judge | None, failure: str | None = None):
        self.name, self.judge, self.failure = name, judge, failure

    def __call__(self, images, targets=None, prompts=None):
        if self.failure is None:
            try:
                return self.judge(images, targets, prompts)
            except Exception as error:  # any error: a second opinion must not end the program
                self.failure = judge_failure(self.name, error)
        return np.full(len(images), np.nan, dtype=np.float32), [""] * len(images)


def make_guarded_judges(names, **options) -> list[GuardedJudge]:
    """make_judges, each judge guarded (GuardedJudge): one that cannot be built (its server
    down, its model folder broken) is returned as failed already. An unknown name or one listed
    twice is still a ValueError before any model is loaded."""
    judges = []
    for name in judge_names(names):
        try:
            judges.append(GuardedJudge(name, make_judge(name, **options)))
        except Exception as error:  # as GuardedJudge: the other judges and the run go on
            judges.append(GuardedJudge(name, None, judge_failure(name, error)))
    return judges


# ---- a weighted mix of rewards -----------------------------------------------------------------


# the magnitudes of a normal float32, the type in which weighted_sum weighs the rewards
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def parse_mix(spec) -> dict[str, float]:
    """{name: weight} of a mix spec, in its order: "qwen-vl=0.8 pickscore=0.2", or a list of such
    items (["qwen-vl=0.8", "pickscore=0.2"]); commas separate too. A bare name weighs 1, so
    "qwen-vl" is today's single reward. A weight is any number but 0 that float32, in which the
    rewards are weighted, holds (a negative one penalises: flat=-0.5). A ValueError names the
    first bad item in one line."""
    items = [spec] if isinstance(spec, str) else list(spec)
    items = [item for part in items for item in re.split(r"[\s,]+", part) if item]
    if not items:
        raise ValueError("empty reward mix: give at least one reward, e.g. qwen-vl or "
                         "qwen-vl=0.8 pickscore=0.2")
    weights: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if name not in JUDGES:
            raise ValueError(f"reward mix item {item!r}: unknown reward {name!r}; choose from "
                             f"{', '.join(JUDGES)}")
        if name in weights:
            raise ValueError(f"reward mix item {item!r}: {name} is listed twice")
        try:
            weight = float(value) if sep else 1.0
        except ValueError:
            weight = None
        if weight is None or not np.isfinite(weight) or weight == 0:
            raise ValueError(f"reward mix item {item!r}: the weight must be a finite number "
                             f"other than 0, as in {name}=0.5")
        if not FLOAT32_TINY <= abs(weight) <= FLOAT32_MAX:  # else inf, or 0 or subnormal there
            raise ValueError(f"reward mix item {item!r}: the weight {weight:g} is outside "
                             f"float32's range, in which rewards are weighted (magnitudes "
                             f"{FLOAT32_TINY:.3g} to {FLOAT32_MAX:.3g}): every weighted reward "
                             "would be inf or 0")
        weights[name] = weight
    return weights


def normalize_reward_specs(reward, judges, judge_flag: str, urls, aesthetic_head,
                           judged: bool = True) -> tuple[str, str]:
    """The canonical (reward, judges) specs of the trainers' --reward and --eval-judge, or
    evaluate.py's --reward and --judge (judge_flag names it), as checkpoints, run names and
    results record them: ("qwen-vl=0.8 pickscore=0.2", "paddle flat"; "none": no judge). A
    ValueError in one line names the flag: a bad spec, or a vllm or aesthetic reward or judge
    without its --reward-urls or --aesthetic-head. judged: whether the judges are scored (a
    trainer that never validates loads none)."""
    try:
        reward = format_mix(parse_mix(reward))
    except ValueError as error:
        raise ValueError(f"--reward: {error}") from None
    try:
        names = judge_names(judges)
    except ValueError as error:
        raise ValueError(f"{judge_flag}: {error}") from None
    scorers = set(parse_mix(reward)) | set(names if judged else [])
    if "vllm" in scorers and not urls:
        raise ValueError("--reward-urls: the vllm reward or judge needs at least one server URL")
    if "aesthetic" in scorers and not aesthetic_head:
        raise ValueError("--aesthetic-head: the aesthetic reward or judge needs the LAION head's "
                         "file (sac+logos+ava1-l14-linearMSE.pth)")
    return reward, " ".join(names) or "none"


def format_mix(weights: dict[str, float]) -> str:
    """The canonical spec of a mix ("qwen-vl=0.8 pickscore=0.2"); one reward of weight 1 is its
    bare name, so a one-reward run is named as today. parse_mix(format_mix(w)) == w."""
    if len(weights) == 1 and next(iter(weights.values())) == 1.0:
        return next(iter(weights))
    numbers = {name: repr(float(weight)) for name, weight in weights.items()}  # shortest exact
    return " ".join(f"{name}={n[:-2] if n.endswith('.0') else n}" for name, n in numbers.items())


class MixScorer:
    """The components of a reward mix, each a Judge, scored on the same images:
    mix(images, targets, prompts) gives (B, K) float32 scores, a column per component in `names`
    order, and the transcriptions of the first component that reads text (qwen-vl, vllm,
    paddle; else ""). The components run at once, a thread each, so that a reward server and an
    in-process model overlap. weights: {name: weight}, as parse_mix gives them."""

    def __init__(self, judges: list[Judge], weights: dict[str, float]):
        if [judge.name for judge in judges] != list(weights):
            raise ValueError(f"judges {[j.name for j in judges]} do not match the weights "
                             f"{list(weights)}")
        self.judges, self.weights, self.names = judges, dict(weights), list(weights)
        self.pool = ThreadPoolExecutor(len(judges)) if len(judges) > 1 else None

    def __call__(self, images, targets, prompts=None):
        images = _to_pil(images)
        if self.pool is None:
            results = [self.judges[0](images, targets, prompts)]
        else:
            futures = [self.pool.submit(judge, images, targets, prompts) for judge in self.judges]
            results = [future.result() for future in futures]
        scores = np.stack([np.asarray(s, dtype=np.float32) for s, _ in results], axis=1)
        read = [texts for judge, (_, texts) in zip(self.judges, results) if judge.name in READERS]
        return scores, read[0] if read else [""] * len(images)

    @property
    def spec(self) -> str:
        return format_mix(self.weights)


def make_mix(spec, **options) -> MixScorer:
    """The reward mix of `spec` (parse_mix's syntax), each component make_judge(name, **options)."""
    weights = parse_mix(spec)
    return MixScorer([make_judge(name, **options) for name in weights], weights)


def weighted_sum(rewards, weights):
    """sum_k w_k r_k: rewards (N, K) torch, K weights -> (N,) in the rewards' dtype. One reward
    of weight 1 gives its column bit for bit (x * 1.0 and a sum of one term are exact).
    Flow-Factory's weighted sum: src/flow_factory/advantage/advantage_processor.py, 361-366."""
    import torch

    weights = torch.as_tensor(list(weights), dtype=rewards.dtype, device=rewards.device)
    if rewards.ndim != 2 or rewards.shape[1] != len(weights):
        raise ValueError(f"rewards {tuple(rewards.shape)} need one column per weight "
                         f"({len(weights)})")
    return (rewards * weights).sum(1)


def group_standardize(rewards, group_size: int, floor: float = 1e-6):
    """(r - group mean) / max(group std, floor) of one reward (N,), with groups of group_size
    consecutive images and the population std: GDPO's per-reward normalisation as Flow-Factory
    writes it (advantage_processor.py, lines 457-464). A constant group gives zeros."""
    groups = rewards.reshape(-1, group_size)
    std = groups.std(1, unbiased=False, keepdim=True).clamp_min(floor)
    return ((groups - groups.mean(1, keepdim=True)) / std).flatten()


def aggregate_rewards(rewards, weights, group_size: int, aggregation: str = "sum"):
    """The one reward (N,) that a mix's advantages normalise; rewards (N, K) torch, groups of
    group_size consecutive images. Flow-Factory's two aggregations (advantage_aggregation: sum |
    gdpo; dispatched in src/flow_factory/advantage/advantage_processor.py, lines 133-137):
      sum:  sum_k w_k r_k, the weighted reward (compute_weighted_sum, lines 361-386); a reward of
            a larger scale weighs more.
      gdpo: sum_k w_k z_k, z_k = group_standardize(r_k) (compute_gdpo, lines 455-468); each
            reward counts by its weight whatever its scale.
    One reward of weight 1 under sum is its column bit for bit."""
    import torch

    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose from "
                         f"{', '.join(AGGREGATIONS)}")
    weights = list(weights)
    if aggregation == "sum":
        return weighted_sum(rewards, weights)
    standardized = [group_standardize(rewards[:, k], group_size) for k in range(rewards.shape[1])]
    return weighted_sum(torch.stack(standardized, 1), weights)


def mix_advantages(rewards, weights, group_size: int, normalize, aggregation: str = "sum"):
    """Advantages (N,) of a reward mix; rewards (N, K) torch, every image of the iteration:
    normalize(aggregate_rewards(rewards, weights, group_size, aggregation)).

    normalize: the trainer's own advantages of one reward, (N,) -> (N,), e.g.
    lambda r: group_advantages(r, group_size, global_std, adv_clip); the advantage formula
    stays in the trainer. With one reward of weight 1, sum gives normalize(rewards[:, 0]) bit
    for bit: today's advantages. gdpo's last step in Flow-Factory is a batch normalisation,
    (c - mean) / std over all images (lines 469-470); c is centred in every group already, so a
    normalize by the global std is that step (but for its epsilon), then the trainer's clip.
    With the per-group std, each group is divided by its own std instead.
    """
    return normalize(aggregate_rewards(rewards, weights, group_size, aggregation))


def component_means(rewards, names) -> dict[str, float]:
    """{name: the mean of its column} of (N, K) rewards, for train/reward_<name>."""
    return {name: float(rewards[:, k].double().mean()) for k, name in enumerate(names)}


# ---- tiny random CLIP models for the tests -----------------------------------------------------


def build_tiny_clip(out_dir: str | Path, projection_dim: int = 16, logit_scale: float = 2.0,
                    seed: int = 0) -> Path:
    """Save a random tiny CLIPModel (224-pixel images in 32-pixel patches, 2 layers of width
    32), a byte-level CLIP tokenizer (no merges) and CLIP's image processor to out_dir, which
    PickScoreScorer(out_dir, out_dir) and AestheticScorer(out_dir, head) then load through the
    from_pretrained calls that load the real models. logit_scale: the log of the logit scale
    (the real PickScore's exp is ~100; 2.0 tells a test whether it is exponentiated)."""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[])
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    text = dict(vocab_size=len(tokenizer), max_position_embeddings=77, **layers, **ids)
    vision = dict(image_size=224, patch_size=32, **layers)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim,
                        logit_scale_init_value=logit_scale)
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    CLIPImageProcessorPil().save_pretrained(out_dir)  # CLIP's: 224 bicubic, crop 224, mean/std
    return Path(out_dir)


def save_random_aesthetic_head(path: str | Path, in_features: int = 16, seed: int = 0) -> Path:
    """A random LAION-layout aesthetic head for in_features-d embeddings, saved as the real one
    is (a state dict)."""
    import torch

    torch.manual_seed(seed)
    torch.save(aesthetic_head(in_features).state_dict(), path)
    return Path(path)


def _random_qwen_vl(spec: dict, device="cpu", dtype=None):
    """Tokenizer, image processor and a random-weight Qwen2.5-VL of architecture `spec` (QWEN_3B or TINY_QWEN).

    The tokenizer is a byte-level BPE without merges (each byte is a token) plus Qwen's special tokens, padded with
    unused tokens to the vocabulary size. The model is created directly on `device` in `dtype` (default: torch's):
    no float32 copy on the CPU first, and "meta" counts parameters without memory.
    """
    import torch
    from tokenizers import pre_tokenizers
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer, Qwen2VLImageProcessorPil

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [f"<unused{i}>" for i in range((spec["text"]["vocab_size"] or 0) - len(tokens) - len(QWEN_SPECIALS) - 1)]
    # adds <|endoftext|> (eos, pad); left padding, as generate appends
    tokenizer = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[], padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    ids = tokenizer.convert_tokens_to_ids
    pad, eos = ids("<|endoftext|>"), ids("<|im_end|>")
    text = {**spec["text"], "vocab_size": len(tokenizer), "bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=spec["vision"], tie_word_embeddings=True,
                              image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                              vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype or default_dtype)
    try:
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, pad
    min_pixels, max_pixels = spec["pixels"]
    return tokenizer, Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}), model


def build_tiny_qwen_vl(out_dir: str | Path) -> Path:
    """Save a random tiny Qwen2.5-VL (TINY_QWEN: same classes as the real one) with a byte-level tokenizer to out_dir.

    make_scorer("qwen-vl", model_path=out_dir) then loads it through the same from_pretrained calls as the real model.
    """
    import torch

    torch.manual_seed(0)
    for part in _random_qwen_vl(TINY_QWEN):
        part.save_pretrained(out_dir)
    return Path(out_dir)
