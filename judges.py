"""The judges of image quality beside the OCR reward: PickScore, the LAION aesthetic predictor and
the flat fraction (a weight-free sign of a blanked background), and make_judge, which builds any
scorer by name as a Judge that knows what it reads (the target, the prompt or the image alone):
judge(images, targets, prompts). GuardedJudge keeps a failing judge from ending the program.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from PIL import Image

from ocr_reward import READERS, SCORERS, Scorer, ServerError, make_scorer, to_pil


PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"  # a CLIP-H/14 tuned on Pick-a-Pic preferences
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"  # its tokenizer, image processor
PICKSCORE_SCALE = 26.0  # the anchors divide PickScore by 26 to bring it near [0, 1]
AESTHETIC_CLIP = "openai/clip-vit-large-patch14"  # the CLIP whose embeddings the LAION head reads
AESTHETIC_HEAD = "sac+logos+ava1-l14-linearMSE.pth"  # the LAION head's file name
AESTHETIC_WIDTHS = (1024, 128, 64, 16, 1)  # the head's layer widths after the embedding


JUDGES = ("paddle", "qwen-vl", "vllm", "pickscore", "aesthetic", "flat", "brightness",
          "compressibility")


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

        from sd3 import check_model_path

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

        images = to_pil(images)
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

        images = to_pil(images)
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
    for image in to_pil(images):
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
