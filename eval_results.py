"""evaluate.py's results file, results.jsonl in its results directory: the lock one evaluate.py
holds on the directory, the prompts already scored read back to resume, and the summary's
statistics (mean and standard error) for results.json."""

import fcntl
import json
import os

import numpy as np

from checks import fail
from judges import JUDGES


def lock_results(out):
    """An exclusive lock on out/evaluate.lock, held while this process lives (the trainers lock
    run.lock so): a second evaluate.py on the same results would score every prompt again."""
    try:
        lock = open(out / "evaluate.lock", "a+")
    except OSError as error:
        fail(f"cannot write {out / 'evaluate.lock'} ({error.strerror or error})")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        other = lock.read().strip() or "?"
        fail(f"{out} is in use by another evaluate.py (pid {other}): wait for it to end; the same "
             "command then continues its results")
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def read_results(path, settings, prompts):
    """{index: record} of the prompts already scored in results.jsonl; a new file (settings line
    only) if none.

    A line cut by a kill is dropped. A file written with other settings, or for other prompts, is an
    error; so is a line that is not what evaluate.py writes, named by its number."""
    raw = path.read_bytes() if path.is_file() else b""
    complete = raw[: raw.rfind(b"\n") + 1]
    if not complete:
        path.write_text(json.dumps({"settings": settings}) + "\n")
        return {}

    def parse(number, line, fields, what):
        """Line `number`: a JSON object whose `fields` ({key: type}) hold values of their types;
        else fail naming it."""
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        if isinstance(value, dict):
            wrong = [json.dumps(key) for key, kind in fields.items()
                     if key not in value or not isinstance(value[key], kind)]
            problem = f"{', '.join(wrong)} missing or of another type" if wrong else None
        else:
            problem = "not a JSON object"
        if problem:
            fail(f"{path}, line {number}: not {what} of evaluate.py ({problem}); delete the file "
                 "or pass another --output-dir or --name")
        return value

    lines = complete.splitlines()
    old = parse(1, lines[0], {"settings": dict},
                "the settings line of a results file")["settings"]
    changed = [f"{key} {old.get(key)!r} -> {settings.get(key)!r}"
               for key in sorted(old.keys() | settings.keys()) if old.get(key) != settings.get(key)]
    if changed:
        fail(f"{path} was written with other settings ({'; '.join(changed)}): pass another "
             "--output-dir or --name, or delete it")
    # what the summary and grid read
    fields = {"index": int, "prompt": str, "target": str, "score": (int, float)}
    judges = (settings["judge"] or "").split()
    for name in judges:
        fields[f"{name}_score"] = (int, float, type(None))  # null: the judge had failed
    if settings.get("reward", "qwen-vl") not in JUDGES:  # a mix
        fields["components"] = dict
    scored = {}
    for number, line in enumerate(lines[1:], 2):
        record = parse(number, line, fields, "a prompt's record")
        scored[record["index"]] = record
    # a prompt that a failed judge did not score is scored again, the judge given another chance
    scored = {index: record for index, record in scored.items()
              if all(record[f"{name}_score"] is not None for name in judges)}
    for index, record in scored.items():
        if index < len(prompts) and record["prompt"] != prompts[index]:
            fail(f"{path}: prompt {index} is {record['prompt']!r}, but {prompts[index]!r} in "
                 "--eval-data now")
    if len(complete) < len(raw):
        with path.open("r+b") as f:
            f.truncate(len(complete))
    return scored


def mean_and_stderr(values):
    """(mean, standard error of the mean) of `values`; the standard error is None for one value."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) > 1:
        return float(values.mean()), float(values.std(ddof=1) / np.sqrt(len(values)))
    return float(values.mean()), None
