"""The OCR proxy task: fixed-length codes rendered with Pillow's bundled font, split into disjoint word sets.

    task = Task()                                     # 4 digits, 128x128, black on white, centred
    words = split_words(task, seed=0)                 # {"train": [...], "validation": [...], "test": [...]}
    image = render(words["test"][0], task)            # PIL RGB image
    write_prompts(path, words["test"], task)          # jsonl for crd.py/dgpo.py: {"prompt", "target"}

Every code of `length` symbols of `alphabet` is a word; a seeded shuffle assigns each to exactly one set. The
pretraining sees only "train"; "validation" decides when pretraining stops; "test" is the RL benchmark's held-out
set, never shown to the base model and never used for a decision.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

PROMPT = 'A sign that says "{}"'


@dataclass(frozen=True)
class Task:
    """What is rendered: the benchmark's difficulty knob."""

    alphabet: str = "0123456789"
    """symbols of the codes"""
    length: int = 4
    """symbols per code"""
    resolution: int = 128
    """image height and width in pixels"""
    font_size: int = 40
    """pixel size of Pillow's bundled scalable font (Aileron Regular)"""
    test_words: int = 256
    """held-out words for the RL benchmark's validation"""
    validation_words: int = 256
    """held-out words that decide when pretraining stops"""


def all_words(task: Task) -> list[str]:
    return ["".join(symbols) for symbols in itertools.product(task.alphabet, repeat=task.length)]


def split_words(task: Task, seed: int) -> dict[str, list[str]]:
    """Disjoint train, validation and test words, the same for the same task and seed."""
    words = all_words(task)
    held_out = task.test_words + task.validation_words
    if held_out >= len(words):
        raise ValueError(f"{len(words)} words of {task.length} symbols of {task.alphabet!r}: too few to hold out {held_out}")
    random.Random(seed).shuffle(words)
    return {"test": words[: task.test_words], "validation": words[task.test_words : held_out],
            "train": words[held_out:]}


def prompt(word: str) -> str:
    return PROMPT.format(word)


@lru_cache(maxsize=8)
def _font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


def render(word: str, task: Task) -> Image.Image:
    """Black text centred on white: the easiest image PP-OCR can read, so the benchmark measures spelling."""
    image = Image.new("RGB", (task.resolution, task.resolution), "white")
    centre = task.resolution / 2
    ImageDraw.Draw(image).text((centre, centre), word, font=_font(task.font_size), fill="black", anchor="mm")
    return image


def write_prompts(path: str | Path, words: list[str]) -> Path:
    """One {"prompt", "target"} record per word: the trainers' --train-data / --eval-data format."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": prompt(w), "target": w}) + "\n" for w in words), encoding="utf-8")
    return path
