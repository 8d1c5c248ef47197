"""Flow-GRPO OCR prompts: txt -> jsonl conversion, loading, and the prompt-group sampler.

    python data.py --input DIR --output-dir OUT          # -> OUT/{train,test}.jsonl
    python data.py --input A.txt B.txt --output-dir OUT  # -> OUT/A.jsonl, OUT/B.jsonl
    python data.py --input_dir DIR --output_dir OUT      # the recipe's spellings, the same options

DIR holds Flow-GRPO's train.txt and test.txt.

Each record is {"prompt": ..., "target": ...}, the target being the text inside the first pair of
double quotes; a JSON Lines input's other fields are kept. No output may be an input. This module
holds no algorithm logic: it only decides which prompts each rank renders in each iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import unicodedata
from pathlib import Path

import torch

from ocr_reward import extract_target


class DataError(ValueError):
    """Bad input data; the message names the file (and line)."""


def normalized_target(target: str) -> str:
    """`target` as the reward compares it: NFC (a decomposed accent is the composed one a read
    gives) without format characters (bidi marks, zero-width spaces), which no image shows."""
    visible = "".join(c for c in target if unicodedata.category(c) != "Cf")
    return unicodedata.normalize("NFC", visible)


def load_prompts(path: str | Path, skip_untargeted: bool = False) -> tuple[list[dict], int]:
    """Read JSON Lines (a .jsonl or .json file, any case: one object a line, with a "prompt"
    string and an optional "target" string) or raw text (any other name: one prompt a line).

    Empty lines are ignored. Each record is {"prompt", "target", "source", "extra"}: the source is
    its "file:line" for later messages, extra the line's other JSON fields ({} for raw text), which
    `convert` writes back. A line without a target, or with an empty one (`""`, which a blank image
    would match), is an error naming file and line, unless `skip_untargeted`: then it is skipped and
    counted. A JSON object in raw text (a misnamed JSON Lines file) is always an error. Targets are
    normalized_target's; in raw text an escaped quote (\\") is a quote. Returns the records and the
    number skipped.
    """
    path = Path(path)
    if not path.is_file():
        what = "a directory, not a prompt file" if path.is_dir() else "prompt file not found"
        raise DataError(f"{path}: {what}")
    # Some editors start a file with a UTF-8 byte-order mark: it is no part of the first prompt
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        byte = data[error.start]
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {byte:#04x}); "
                        "save the file as UTF-8") from None
    json_lines = path.suffix.lower() in (".jsonl", ".json")
    records, skipped = [], 0
    # Windows and old-Mac line ends are line ends too: read as one line, a file would be one prompt
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    for number, line in enumerate(lines, start=1):
        where = f"{path}:{number}"
        if not line.strip():
            continue
        if "\0" in line:
            raise DataError(f"{where}: a NUL byte; not a text file of prompts")
        if json_lines:
            try:
                record = json.loads(line)
                prompt, target = record["prompt"], record.get("target")
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                array = line.lstrip().startswith("[")
                reason = "one object a line, not a JSON array" if array else error
                raise DataError(f"{where}: not a JSON object with a 'prompt' ({reason})") from None
            extra = {key: value for key, value in record.items() if key not in ("prompt", "target")}
            if not isinstance(prompt, str) or not prompt.strip():
                raise DataError(f"{where}: 'prompt' must be a non-empty string, not {prompt!r:.60}")
            if target is None:
                target = extract_target(prompt)
            elif not isinstance(target, str):
                raise DataError(f"{where}: 'target' must be a string, not {target!r:.60}")
        else:
            prompt = line.strip()
            extra = {}
            try:
                json_object = prompt.startswith("{") and isinstance(json.loads(prompt), dict)
            except json.JSONDecodeError:
                json_object = False
            if json_object:  # its first quoted word, "prompt", would become the target
                raise DataError(f"{where}: a JSON object in a raw text file of prompts; "
                                "name the file .jsonl to read it as JSON Lines")
            prompt = prompt.replace('\\"', '"')  # a prompt copied from code: \"HI\" is "HI"
            target = extract_target(prompt)
        target = None if target is None else normalized_target(target)
        if target is None or not target.strip():
            if not skip_untargeted:
                what = "no quoted target text" if target is None else "an empty target text"
                raise DataError(f"{where}: {what} in prompt {prompt[:80]!r}")
            skipped += 1
            continue
        records.append({"prompt": prompt, "target": target, "source": where, "extra": extra})
    if not records:
        raise DataError(f"{path}: no prompts")
    return records, skipped


def load_train_and_eval_prompts(args, world_size: int,
                                verbose: bool = True) -> tuple[list[dict], list[dict]]:
    """A trainer's prompts: every record of --train-data and the first --eval-prompts of
    --eval-data. Fewer training prompts than one iteration draws over all ranks is a DataError;
    with `verbose`, a validation set shorter than asked for, or one that is the training set, is
    printed."""
    validation = args.validation
    train_set = load_prompts(args.train_data)[0]
    eval_set = load_prompts(validation.eval_data)[0][: validation.eval_prompts]
    if validation.eval_every and len(eval_set) < validation.eval_prompts and verbose:
        print(f"--eval-prompts {validation.eval_prompts}: {validation.eval_data} holds "
              f"{len(eval_set)}; validating those")
    same = Path(validation.eval_data).resolve() == Path(args.train_data).resolve()
    if validation.eval_every and same and verbose:
        print(f"--eval-data {validation.eval_data} is --train-data: validation scores training "
              "prompts, not held-out ones")
    if len(train_set) < args.prompts_per_rank * world_size:
        raise DataError(f"--train-data {args.train_data}: {len(train_set)} prompt(s), fewer than "
                        f"the --prompts-per-rank {args.prompts_per_rank} x {world_size} rank(s) of "
                        "one iteration")
    return train_set, eval_set


def same_file(output: Path, file: Path) -> bool:
    """Whether output is the input file: the same path (after links and `..`, which an output
    folder yet to be made may hold), a symlink to it or a hard link of it."""
    # os.path.realpath, unlike Path.resolve, gives an output in a symlink loop back without an error
    if os.path.realpath(output) == os.path.realpath(file):
        return True
    try:
        return os.path.samefile(output, file)
    except OSError:  # a missing (or unreadable) output is no input: every input was read
        return False


def convert(inputs: list[str | Path], output_dir: str | Path,
            skip_untargeted: bool = False, overwrite: bool = False) -> dict[str, tuple[int, int]]:
    """Convert prompt files to output_dir/{name}.jsonl; returns {name: (written, skipped)}.

    Each input is a .txt, .jsonl or .json file (name: its stem) or a folder holding Flow-GRPO's
    train.txt and test.txt. A JSON Lines record keeps its fields besides "prompt" and "target".
    Every input is read and checked, and no output may be an input or (without overwrite) an
    existing file, before anything is written; each output is written whole or not at all.
    """
    files = []
    for path in map(Path, inputs):
        files += [path / "train.txt", path / "test.txt"] if path.is_dir() else [path]
    loaded = {}
    for file in files:
        if file.stem in loaded:
            raise DataError(f"{file}: another input is also named {file.stem!r}; "
                            f"both would write {file.stem}.jsonl")
        loaded[file.stem] = load_prompts(file, skip_untargeted)
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise DataError(f"output directory {output_dir} is a file")
    for output in (output_dir / f"{name}.jsonl" for name in loaded):
        for file in files:
            if same_file(output, file):
                raise DataError(f"{output} is the input {file}: converting would replace it; "
                                "choose another --output-dir")
        if not overwrite and (output.exists() or output.is_symlink()):
            raise DataError(f"{output} already exists: converting would replace it; pass "
                            "--overwrite, or choose another --output-dir")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(f"output directory {output_dir}: {error.strerror or error}") from None
    counts = {}
    for name, (records, skipped) in loaded.items():
        partial, final = output_dir / f".{name}.jsonl.tmp", output_dir / f"{name}.jsonl"
        lines = []
        for r in records:
            record = {"prompt": r["prompt"], "target": r["target"], **r["extra"]}
            lines.append(json.dumps(record, ensure_ascii=False) + "\n")
        try:
            partial.write_text("".join(lines), encoding="utf-8")
            os.replace(partial, final)  # atomic: a reader sees the old file or the whole new one
        except OSError as error:
            partial.unlink(missing_ok=True)
            raise DataError(f"{final}: not written ({error.strerror or error})") from None
        counts[name] = (len(records), skipped)
    return counts


class GroupSampler:
    """Seeded prompt groups: each iteration draws `prompts_per_rank * world_size` distinct prompts
    without replacement from the epoch's permutation (a new permutation when too few remain), gives
    rank r the r-th slice, and repeats each prompt `group_size` times contiguously, so a rank always
    holds whole groups. Every rank computes the same permutation: the state is global and tiny."""

    def __init__(self, num_prompts: int, prompts_per_rank: int, group_size: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        if prompts_per_rank * world_size > num_prompts:
            raise DataError(f"{prompts_per_rank} prompts x {world_size} ranks per iteration, "
                            f"but only {num_prompts} prompts")
        self.num_prompts, self.prompts_per_rank = num_prompts, prompts_per_rank
        self.group_size = group_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch, self.position = 0, 0

    def permutation(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_prompts, generator=generator).tolist()

    def next_indices(self) -> list[int]:
        """This rank's next batch of indices, (prompts_per_rank * group_size,): groups contiguous"""
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
    # Aliases, because the recipe's command spells them --input_dir and --output_dir
    parser.add_argument("--input", "--input-dir", "--input_dir", nargs="+", required=True,
                        metavar="PATH", help="prompt files (.txt, one prompt a line, or .jsonl or "
                        ".json, one object a line), or folders holding Flow-GRPO's train.txt and "
                        "test.txt")
    parser.add_argument("--output-dir", "--output_dir", required=True, metavar="DIR",
                        help="where {name}.jsonl is written for each input file")
    parser.add_argument("--skip-untargeted", action="store_true",
                        help="skip (and count) lines with no quoted target or an empty one")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace {name}.jsonl files that already exist in --output-dir")
    cli = parser.parse_args()
    try:
        counts = convert(cli.input, cli.output_dir, cli.skip_untargeted, cli.overwrite)
        for name, (written, skipped) in counts.items():
            note = f", {skipped} lines without a quoted target skipped" if skipped else ""
            print(f"{name}: {written} prompts written{note}")
    except DataError as error:
        parser.exit(1, f"data.py: error: {error}\n")
