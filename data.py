"""Flow-GRPO OCR prompts: txt -> jsonl conversion, loading, and the prompt-group sampler.

    python data.py --input-dir DIR --output-dir DIR      # DIR/{train,test}.txt -> DIR/{train,test}.jsonl

Each record is {"prompt": ..., "target": ...}, the target being the text inside the first pair of double quotes.
This module holds no algorithm logic: it only decides which prompts each rank renders in each iteration.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from reward import extract_target


class DataError(ValueError):
    """Bad input data; the message names the file (and line)."""


def load_prompts(path: str | Path, skip_untargeted: bool = False) -> tuple[list[dict], int]:
    """Read a .jsonl (records with "prompt", optional "target") or a raw .txt (one prompt per line).

    Empty lines are ignored. Returns the records and how many lines were skipped for having no quoted target
    (an error instead, naming file and line, unless `skip_untargeted`).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: prompt file not found")
    records, skipped = [], 0
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    record = json.loads(line)
                    prompt = record["prompt"]
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    raise DataError(f"{path}:{number}: not a JSON object with a 'prompt' ({error})") from None
                target = record.get("target", extract_target(prompt))
            else:
                prompt = line.strip()
                target = extract_target(prompt)
            if target is None:
                if not skip_untargeted:
                    raise DataError(f"{path}:{number}: no quoted target text in prompt {prompt[:80]!r}")
                skipped += 1
                continue
            records.append({"prompt": prompt, "target": target})
    if not records:
        raise DataError(f"{path}: no prompts")
    return records, skipped


def convert(input_dir: str | Path, output_dir: str | Path, skip_untargeted: bool = False) -> dict[str, tuple[int, int]]:
    """Convert input_dir/{train,test}.txt to output_dir/{train,test}.jsonl; returns {split: (written, skipped)}."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in ("train", "test"):
        records, skipped = load_prompts(Path(input_dir) / f"{split}.txt", skip_untargeted)
        partial = output_dir / f".{split}.jsonl.tmp"
        partial.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        partial.replace(output_dir / f"{split}.jsonl")
        counts[split] = (len(records), skipped)
    return counts


class GroupSampler:
    """Seeded prompt groups: each iteration draws `prompts_per_rank * world_size` distinct prompts without
    replacement from the epoch's permutation (a new permutation when too few remain), gives rank r the r-th
    slice, and repeats each prompt `group_size` times contiguously, so a rank always holds whole groups.
    Every rank computes the same permutation, so the state is global and tiny."""

    def __init__(self, num_prompts: int, prompts_per_rank: int, group_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if prompts_per_rank * world_size > num_prompts:
            raise DataError(f"{prompts_per_rank} prompts x {world_size} ranks per iteration, but only {num_prompts} prompts")
        self.num_prompts, self.prompts_per_rank, self.group_size = num_prompts, prompts_per_rank, group_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch, self.position = 0, 0

    def permutation(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_prompts, generator=generator).tolist()

    def next_indices(self) -> list[int]:
        """Dataset indices for this rank's next batch: (prompts_per_rank * group_size,), groups contiguous."""
        needed = self.prompts_per_rank * self.world_size
        if self.position + needed > self.num_prompts:
            self.epoch, self.position = self.epoch + 1, 0
        drawn = self.permutation()[self.position : self.position + needed]
        self.position += needed
        mine = drawn[self.rank * self.prompts_per_rank : (self.rank + 1) * self.prompts_per_rank]
        return [index for index in mine for _ in range(self.group_size)]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-dir", required=True, help="folder with Flow-GRPO's train.txt and test.txt")
    parser.add_argument("--output-dir", required=True, help="where train.jsonl and test.jsonl are written")
    parser.add_argument("--skip-untargeted", action="store_true", help="skip (and count) lines with no quoted target")
    cli = parser.parse_args()
    try:
        for split, (written, skipped) in convert(cli.input_dir, cli.output_dir, cli.skip_untargeted).items():
            print(f"{split}: {written} prompts written" + (f", {skipped} lines without a quoted target skipped" if skipped else ""))
    except DataError as error:
        parser.exit(1, f"data.py: error: {error}\n")
