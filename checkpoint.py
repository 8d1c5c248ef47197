"""Checkpoints: `global_step_N/` written atomically and read back (the adapters, the optimizer, the sampler and
the run's state), the state's fields checked, and the settings a resume may change (no algorithm logic).

A resume refuses settings that would change the run's math (`SAFE_TO_CHANGE_ON_RESUME` lists what may change) and
prompt files whose contents changed; a checkpoint is written to a temporary directory renamed when complete, so a
crash, Ctrl-C or a full disk never leaves half of one (a RunError names the latest complete checkpoint).
"""

import hashlib
import io
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from judges import AESTHETIC_CLIP, PICKSCORE_MODEL, PICKSCORE_PROCESSOR
from lora_adapters import export_lora, load_lora_state_dict, lora_state_dict
from reward_mix import parse_mix
from settings import flat_settings


ADAPTERS = ("policy", "old", "sampling")
EVAL_SCORES = "eval_scores.jsonl"  # a run's per-prompt validation scores, a line a validation
# what a save writes: a global_step_N without one of them is no complete checkpoint
CHECKPOINT_FILES = ("policy_lora", "adapters.safetensors", "optimizer.pt", "trainer_state.json")

# Every Args field not named here defines the run: a resume that changes it is refused, so a new algorithm field is
# protected without being listed. These may change because the training continues the same trajectory with them:
SAFE_TO_CHANGE_ON_RESUME = {
    "num_iterations", "save_every", "keep_last", "max_nonfinite_steps",  # how long it runs and what it keeps
    "resume_from", "overwrite", "output_dir", "run_name", "exp_name",  # where it is (checked against the checkpoint)
    # placement, batching into forwards and kernels: the same math up to float rounding
    "device", "text_encoder_device", "reward_device", "forward_batch_size", "policy_timesteps_per_forward", "compile",
    "gradient_checkpointing", "reward_urls", "reward_timeout", "reward_retries",  # the same scorer, reached otherwise
    # validation cost: it never feeds training (the change is printed: the eval curve changes protocol there)
    "eval_every", "eval_prompts", "eval_steps", "eval_judge", "dry_run",
    "rollout_engine",  # the same Euler ODE and seeded noise, through vLLM-Omni or diffusers
    "track", "wandb_project_name", "wandb_entity",  # where the run is logged besides TensorBoard
}
# Settings added after runs had been saved: {field: the value every run before it had}. A checkpoint
# records one only where it differs (record_args), so a run at these values saves what it saved
# before and a checkpoint without it resumes as having that value.
ADDED_SETTINGS = {"reward_aggregation": "sum", "pickscore_model": PICKSCORE_MODEL,
                  "pickscore_processor": PICKSCORE_PROCESSOR, "aesthetic_model": AESTHETIC_CLIP,
                  "aesthetic_head": "", "rollout_engine": "diffusers",
                  "track": False, "wandb_project_name": "crd", "wandb_entity": ""}
# The models of a reward or judge: they define the run where the reward has that component, and
# may change otherwise (a judge's, which never feeds training)
JUDGE_MODELS = {"pickscore_model": "pickscore", "pickscore_processor": "pickscore",
                "aesthetic_model": "aesthetic", "aesthetic_head": "aesthetic"}
# Per-rank sizes define the run through their global value (x world size): a resume at another world size may change
# them as long as the prompts per iteration and the images per optimizer step stay the same.
PER_RANK = {"prompts_per_rank": "prompts per iteration", "train_batch_size": "images per optimizer step"}
# How a start finds (or replaces) its run, not settings of it: a resume continues the checkpoint's run directory, and
# run_directory refuses an --output-dir/--run-name naming another, so their values (defaults when not given) are no
# changes to report
RUN_LOCATION = ("resume_from", "overwrite", "output_dir", "run_name")
# The prompt files, whose contents a checkpoint records (sha256): a resume needs the prompts the run trained on
PROMPT_FILES = {"train_data": "--train-data", "eval_data": "--eval-data"}


def whole(value, least=0):
    """Whether a JSON value is a whole number >= least (true and false are not numbers here)."""
    return type(value) is int and value >= least


def number(value):
    return type(value) in (int, float)


def eval_entry(entry):
    """[iteration, reward (NaN: its scorer failed), the first judge's mean or null], then {judge:
    mean} where the judges were not PP-OCR alone (Validation)."""
    return (type(entry) is list and len(entry) in (3, 4) and whole(entry[0]) and number(entry[1])
            and (entry[2] is None or number(entry[2]))
            and (len(entry) == 3 or type(entry[3]) is dict and all(map(number, entry[3].values()))))


def entry_judges(entry):
    """{judge: mean} of a validation's entry: an entry of 3 had PP-OCR alone, or no judge."""
    if len(entry) == 4:
        return entry[3]
    return {} if entry[2] is None else {"paddle": entry[2]}


# What each field of trainer_state.json must hold, and how the error says it: the trainers use them unchecked, some only
# after the model loaded or an iteration ran.
STATE_FIELDS = {
    "args": (lambda v: type(v) is dict, "an object (the run's settings)"),
    "iteration": (whole, "a whole number >= 0"),
    "optimizer_steps": (whole, "a whole number >= 0"),
    "sampler": (lambda v: type(v) is dict and whole(v.get("epoch")) and whole(v.get("position")),
                'an object {"epoch": whole number >= 0, "position": whole number >= 0}'),
    "eval": (lambda v: type(v) is list and all(map(eval_entry, v)),
             "a list of [iteration, reward, judge's mean or null(, {judge: mean})] entries"),
    "iteration_s": (lambda v: type(v) is list and all(map(number, v)), "a list of numbers"),
    "start_iterations": (lambda v: type(v) is list and all(whole(i, 1) for i in v), "a list of whole numbers >= 1"),
    "peak_mem_gib": (lambda v: type(v) is dict and all(map(number, v.values())), "an object of numbers"),
    "world_size": (lambda v: whole(v, 1), "a whole number >= 1"),
    "algorithm": (lambda v: type(v) is str, "a string"),
    "data_sha256": (lambda v: type(v) is dict and all(type(h) is str for h in v.values()), "an object of strings"),
    # absent from checkpoints written before it was recorded: evaluate.py then scores "sampling"
    "validation_adapter": (lambda v: v is None or type(v) is str, "an adapter's name"),
}


class RunError(Exception):
    """A one-line error about the run directory, a checkpoint or a resume (the trainers print it and exit)."""


class RunComplete(RunError):
    """A resume of a run that has done all its --num-iterations: there is nothing to train. `exit_code`: 0 under
    --resume-from latest, which a requeued job or a restart passes with the command that started the run; 1 for a
    checkpoint named by hand (a rerun by mistake, refused like the others)."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


def resume_changes(checkpoint_state, args, world_size, algorithm):
    """(refused, allowed): "name old -> new" for each setting that differs from the checkpoint's."""
    saved, current = checkpoint_state["args"], json.loads(json.dumps(flat_settings(args)))  # tuples: lists
    saved, current = {**ADDED_SETTINGS, **saved}, {**ADDED_SETTINGS, **current}  # absent: as before it was added
    saved_world = checkpoint_state["world_size"]
    if checkpoint_state["algorithm"] != algorithm:  # its Args differ too: this says it all
        return [f"algorithm {checkpoint_state['algorithm']} -> {algorithm}"], []
    refused, allowed = [], []
    for name in sorted(saved.keys() | current.keys()):
        old, new = saved.get(name, "(absent)"), current.get(name, "(absent)")
        if name in PER_RANK and whole(old) and whole(new):  # a damaged or absent one is reported as it is
            old, new = old * saved_world, new * world_size
            name = f"{PER_RANK[name]} ({name} x ranks)"
        if old != new and name not in RUN_LOCATION:
            safe = name in SAFE_TO_CHANGE_ON_RESUME or judge_model_unused(name, saved, current)
            (allowed if safe else refused).append(f"{name} {old} -> {new}")
    return refused, allowed


def judge_model_unused(name, saved, current):
    """Whether a JUDGE_MODELS flag is one of a component neither --reward has (then only a judge
    reads it)."""
    try:
        rewards = set(parse_mix(saved.get("reward", ""))) | set(parse_mix(current.get("reward", "")))
    except (ValueError, TypeError):  # a damaged state: the setting stays refused
        return False
    return name in JUDGE_MODELS and JUDGE_MODELS[name] not in rewards


def record_args(args):
    """The Args as a checkpoint records them: ADDED_SETTINGS at their old value left out."""
    return {name: value for name, value in flat_settings(args).items()
            if not (name in ADDED_SETTINGS and value == ADDED_SETTINGS[name])}


def read_checkpoint_state(checkpoint):
    """trainer_state.json of a checkpoint directory, its fields checked (STATE_FIELDS)."""
    path = Path(checkpoint) / "trainer_state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise RunError(f"--resume-from {checkpoint}: not a checkpoint directory ({error})") from None
    if not isinstance(state, dict) or not {"args", "iteration", "sampler"} <= state.keys():
        raise RunError(f"--resume-from {checkpoint}: {path} is not a trainer state (no args, iteration and sampler)")
    for field, (valid, what) in STATE_FIELDS.items():
        if not valid(state.get(field)):
            raise RunError(f'{path}: "{field}" must be {what}')
    return state


def save_checkpoint(run_dir, iteration, transformer, optimizer, state, keep_last):
    """Write global_step_{iteration}/ atomically (a temporary directory renamed at the end), readable as the user's
    umask allows, and keep the latest keep_last (0: all). Its trainer_state.json is `state` with the sha256 of the
    prompt files its args name ("data_sha256", which a resume compares): the trainers record them at start
    (start_state), else they are taken now. A full disk or another write error: RunError naming the latest complete
    checkpoint, nothing half-written left."""
    if "data_sha256" not in state and (hashes := prompt_files_sha256(state.get("args", {}))):
        state = {**state, "data_sha256": hashes}
    try:
        partial = Path(tempfile.mkdtemp(prefix=f".global_step_{iteration}.", dir=run_dir))
        try:
            umask = os.umask(0)
            os.umask(umask)
            partial.chmod(0o777 & ~umask)  # mkdtemp makes it 0700: a team on shared storage could not read it
            export_lora(transformer, "policy", partial / "policy_lora")
            adapters = {f"{name}.{key}": value.contiguous() for name in ADAPTERS
                        for key, value in lora_state_dict(transformer, name).items()}
            save_file(adapters, partial / "adapters.safetensors")
            # torch.save reports a failed write (a full disk) as a RuntimeError without the OS's
            # reason ("unexpected pos", "basic_ios::clear"): serialized in memory, the file is
            # written here, and the OSError says why
            serialized = io.BytesIO()
            torch.save(optimizer.state_dict(), serialized)
            write_file(partial / "optimizer.pt", serialized.getbuffer())
            write_file(partial / "trainer_state.json", json.dumps(state, indent=1).encode())
            for path in partial.rglob("*"):  # safetensors writes its files 0600, whatever the umask
                path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        final = run_dir / f"global_step_{iteration}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
    except (OSError, SafetensorError) as error:  # safetensors reports a full disk as its own error
        latest = checkpoints(run_dir)[-1:]
        raise RunError(f"could not write the checkpoint global_step_{iteration} ({error}); the latest complete "
                       f"checkpoint is {latest[0] if latest else 'none'}") from None
    for old in checkpoints(run_dir)[:-keep_last] if keep_last else []:
        shutil.rmtree(old)
    return final


def write_file(path, data):
    """Bytes to a new file at `path`, created as the umask says; an OSError names the file (a
    failed write alone names none)."""
    try:
        with open(path, "wb") as file:
            file.write(data)
    except OSError as error:
        raise OSError(error.errno, error.strerror, Path(path).name) from None


def prompt_files_sha256(run_args):
    """{Args field: hex sha256 of its file's contents} of the PROMPT_FILES that a run's Args (a dict) name and that can
    be read (one that cannot is the trainers' error, where they load it)."""
    hashes = {}
    for field in PROMPT_FILES:
        try:
            hashes[field] = hashlib.sha256(Path(run_args[field]).read_bytes()).hexdigest()
        except (KeyError, TypeError, OSError):
            pass
    return hashes


def checkpoints(run_dir):
    """The complete checkpoints of a run directory, oldest first."""
    return sorted(Path(run_dir).glob("global_step_*"), key=lambda p: int(p.name.split("_")[-1]))


def tensor_shapes(path):
    """{key: shape} of a safetensors file, from its header and size (no tensor is read); RunError if it is missing,
    truncated or foreign."""
    try:
        with safe_open(path, "pt") as tensors:
            return {key: tensors.get_slice(key).get_shape() for key in tensors.keys()}
    except (SafetensorError, OSError) as error:
        raise RunError(f"{path}: not a readable safetensors file ({error})") from None


def adapters_error(shapes, rank):
    """Why tensors {key: shape} are not an adapters.safetensors of LoRA rank `rank`, or None: each key is
    "{adapter}.{LoRA key}", a lora_A weight is (rank, in) and a lora_B weight (out, rank)."""
    for key, shape in shapes.items():
        if "." not in key:
            return f'the tensor "{key}" names no adapter (its keys are "<adapter>.<LoRA key>")'
        rank_dim = 0 if ".lora_A." in key else 1 if ".lora_B." in key else None
        if rank_dim is not None and (len(shape) != 2 or shape[rank_dim] != rank):
            return (f"{key} has the shape {tuple(shape)}, not a rank-{rank} LoRA's (trainer_state.json records "
                    f"lora_rank {rank})")
    return None


def read_adapters(checkpoint):
    """({adapter name: LoRA {key: tensor}}, the run's Args as saved) of a checkpoint directory, for tools that load a
    trained adapter beside the trainers (evaluate.py, the benchmarks); RunError names what is missing or does not fit
    the recorded lora_rank."""
    path = Path(checkpoint)
    if not (path / "trainer_state.json").is_file() or not (path / "adapters.safetensors").is_file():
        raise RunError(f"{path}: not a checkpoint directory (no trainer_state.json and adapters.safetensors)")
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except ValueError as error:
        raise RunError(f"{path / 'trainer_state.json'}: not JSON ({error})") from None
    trained = state.get("args") if isinstance(state, dict) else None
    if not isinstance(trained, dict) or not all(whole(trained.get(name), 1) for name in ("lora_rank", "lora_alpha")):
        raise RunError(f"{path}: its trainer_state.json records no Args (lora_rank, lora_alpha: whole numbers >= 1)")
    try:
        tensors = load_file(path / "adapters.safetensors")
    except (SafetensorError, OSError) as error:
        raise RunError(f"{path / 'adapters.safetensors'}: not a readable safetensors file ({error})") from None
    if error := adapters_error({key: value.shape for key, value in tensors.items()}, trained["lora_rank"]):
        raise RunError(f"{path / 'adapters.safetensors'}: {error}")
    adapters = {}
    for key, value in tensors.items():
        name, lora_key = key.split(".", 1)
        adapters.setdefault(name, {})[lora_key] = value
    return adapters, trained


def load_checkpoint(path, transformer, optimizer, device):
    """The checkpoint's adapters and optimizer state into transformer and optimizer; returns its trainer state."""
    adapters, _ = read_adapters(path)
    missing = [name for name in ADAPTERS if name not in adapters]
    if missing:
        raise RunError(f"{Path(path) / 'adapters.safetensors'}: no {', '.join(missing)} adapter")
    for name in ADAPTERS:
        try:
            load_lora_state_dict(transformer, name, adapters[name])
        except (KeyError, RuntimeError) as error:  # other LoRA keys or layer sizes: a checkpoint of another model
            raise RunError(f"{Path(path) / 'adapters.safetensors'}: its {name} adapter does not fit the model "
                           f"({error.args[0]})") from None
    try:
        optimizer.load_state_dict(torch.load(Path(path) / "optimizer.pt", map_location=device, weights_only=True))
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as error:
        raise RunError(f"{Path(path) / 'optimizer.pt'}: not a readable optimizer state ({error})") from None
    return read_checkpoint_state(path)


def start_state(args, transformer, optimizer, sampler, device, world_size, algorithm, prompt_sha256,
                validation_adapter=None):
    """The run's state (what trainer_state.json holds) at this start: a new run's, or --resume-from's, whose
    checkpoint also restores the adapters, the optimizer and the sampler (else a RunError names what is wrong).
    `prompt_sha256`: prompt_files_sha256 of the prompt files when the trainer read them, what every save records;
    `validation_adapter`: the adapter the trainer validates with, what evaluate.py scores by default."""
    state = {"iteration": 0, "optimizer_steps": 0, "eval": [], "iteration_s": [], "start_iterations": [],
             "peak_mem_gib": {}}
    if args.output.resume_from:
        state = load_checkpoint(args.output.resume_from, transformer, optimizer, device)
        sampler.load_state_dict(state["sampler"])
        recorded = state.get("validation_adapter")  # absent in checkpoints from before it
        if recorded and validation_adapter and recorded != validation_adapter:
            raise RunError(f"--resume-from {args.output.resume_from}: the run validated its {recorded} "
                           f"adapter, this trainer validates {validation_adapter}: its eval curve "
                           "would change adapters mid-run (resume with the trainer that started it, "
                           "or start a new run)")
    check_same_start(state["iteration"], args, device, world_size)
    state["start_iterations"].append(state["iteration"] + 1)  # its time carries this start's torch.compile warm-up
    state.update(sampler=sampler.state_dict(), args=record_args(args), world_size=world_size, algorithm=algorithm,
                 validation_adapter=validation_adapter)
    state["data_sha256"] = prompt_sha256  # a file edited later in the run is then a change that a resume refuses
    return state


def check_same_start(iteration, args, device, world_size):
    """RunError on a rank that starts at another iteration than rank 0 (a collective: every rank
    calls it). Under --resume-from latest each rank finds the newest checkpoint itself; a node whose
    view of the shared run directory lags (a network file system's cached listing right after a
    save) would otherwise train from other adapters than rank 0's."""
    if world_size == 1 or not dist.is_initialized():
        return
    first = torch.tensor([iteration], dtype=torch.int64, device=device)
    dist.broadcast(first, 0)
    if int(first) != iteration:
        start = args.output.resume_from or "a new run"
        raise RunError(f"rank {dist.get_rank()} starts at iteration {iteration} ({start}), rank 0 "
                       f"at iteration {int(first)}: every node must see the same run directory, on "
                       "storage they share")
