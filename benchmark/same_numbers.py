"""Check that two source trees train to the same numbers, bitwise.

    python benchmark/same_numbers.py .oldmain .          # the old main (git archive) vs the tree
    python benchmark/same_numbers.py ROOT_A ROOT_B --out report.json
    python benchmark/same_numbers.py . . --flags="--device cuda --no-compile" --trainers crd nft
                                         # one tree twice: is a GPU run reproducible?
    python benchmark/same_numbers.py . . --flags-b=--no-compile    # a flag that keeps the numbers

Runs README's CPU demo (the tiny model) with crd.py and with dgpo.py in each tree (--flags after
it in both, --flags-b in the second only, whose own record in trainer_state.json is not compared;
--trainers), then compares
every tensor of every checkpoint file (LoRA export, adapters, optimizer state), trainer_state.json
and summary.json (less timings, memory and paths), and every TensorBoard scalar (less perf/*) and
image. One line per item, then `identical` (exit 0) or the differences (exit 1). Each tree has a
CRD_CACHE of its own, so it builds its own tiny model; about 25 s a run on two idle cores.
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

DEMO = ["--model", "tiny", "--reward", "brightness", "--train-data", "tests/data/ocr/train.txt",
        "--eval-data", "tests/data/ocr/test.txt", "--resolution", "64", "--prompts-per-rank", "2",
        "--group-size", "4", "--num-iterations", "6", "--eval-every", "3", "--save-every", "3",
        "--eval-prompts", "8", "--eval-steps", "10", "--device", "cpu"]  # README's demo command
UNTIMED = re.compile(r"(_s$|per_s|peak_mem|output_dir)")  # timings, memory, paths: not the math


def run(root, trainer, out, cache, flags=()):
    cmd = [sys.executable, f"{trainer}.py", *DEMO, "--output-dir", str(out), "--run-name", "same",
           *flags]
    env = {**os.environ, "CRD_CACHE": cache}
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env)
    if done.returncode:
        print(f"{root}: {trainer}.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return out / "same"


def same_tensor(a, b):
    as_bytes = lambda t: t.detach().reshape(-1).contiguous().view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def diff(a, b, path=""):
    """Where two nested values (dicts, lists, tensors, numbers, bytes) differ: a list of paths."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return [] if tensors and same_tensor(a, b) else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        keys = [k for k in [*a, *(k for k in b if k not in a)] if not UNTIMED.search(str(k))]
        return [p for k in keys for p in diff(a.get(k), b.get(k), f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in diff(x, y, f"{path}/{i}")]
    return [] if type(a) is type(b) and a == b else [path]


def load(path):
    if path.suffix == ".safetensors":
        return load_file(path)
    if path.suffix == ".pt":
        return torch.load(path, weights_only=True)
    return json.loads(path.read_text())


def events(run_dir):
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0}).Reload()
    tags = acc.Tags()
    scalars = {f"scalar {t}": [(s.step, s.value) for s in acc.Scalars(t)]
               for t in tags["scalars"] if not t.startswith("perf/")}
    images = {f"image {t}": [(i.step, i.encoded_image_string) for i in acc.Images(t)]
              for t in tags["images"]}
    return {**scalars, **images}


def compare(run_a, run_b):
    """{item: differing paths} for every checkpoint file and TensorBoard tag of either run."""
    files = lambda run: {str(p.relative_to(run)) for p in run.glob("global_step_*/**/*")
                         if p.is_file()}
    items = {}
    for name in sorted(files(run_a) | files(run_b) | {"summary.json"}):
        a, b = run_a / name, run_b / name
        items[name] = diff(load(a), load(b)) if a.is_file() and b.is_file() else ["missing"]
    ev_a, ev_b = events(run_a), events(run_b)
    for tag in sorted(ev_a.keys() | ev_b.keys()):
        items[tag] = diff(ev_a.get(tag), ev_b.get(tag))
    return items


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root_a", type=Path)
    parser.add_argument("root_b", type=Path)
    parser.add_argument("--out", type=Path, help="the differences as JSON")
    parser.add_argument("--trainers", nargs="+", default=["crd", "dgpo"],
                        choices=["crd", "dgpo", "nft"])
    parser.add_argument("--flags", default="", help="trainer flags after the demo's, in both trees")
    parser.add_argument("--flags-b", default="", help="trainer flags after --flags, in ROOT_B only")
    cli = parser.parse_args()
    flags, flags_b = shlex.split(cli.flags), shlex.split(cli.flags_b)
    sides = (("a", cli.root_a, flags), ("b", cli.root_b, flags + flags_b))
    given = {f"/args/{flag[2:].replace('-', '_').removeprefix('no_')}"  # B's record of its flags
             for flag in flags_b if flag.startswith("--")}
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for trainer in cli.trainers:
            runs = [run(root.resolve(), trainer, Path(tmp, side, trainer), f"{tmp}/{side}/cache",
                        side_flags) for side, root, side_flags in sides]
            if not all((r / "summary.json").is_file() for r in runs):
                report[trainer] = {"run": ["failed"]}
                continue
            report[trainer] = {item: [p for p in paths if p not in given]
                               for item, paths in compare(*runs).items()}
            for item, paths in report[trainer].items():
                shown = f": {paths[:5]}" if paths else ""
                print(f"{'DIFF' if paths else 'same'} {trainer} {item}{shown}")
    differences = {f"{t} {item}": paths for t, items in report.items()
                   for item, paths in items.items() if paths}
    if cli.out:
        cli.out.write_text(json.dumps({"identical": not differences, "differences": differences},
                                      indent=1))
    print("identical" if not differences else
          f"{len(differences)} differences:\n" + "\n".join(differences))
    sys.exit(1 if differences else 0)


if __name__ == "__main__":
    main()
