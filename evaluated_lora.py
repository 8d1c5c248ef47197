"""The LoRA that evaluate.py scores: read from a trainer checkpoint's adapters or a
diffusers-format directory, checked (rank, alpha, finite weights, the model's layers) and loaded
into the transformer, each error in one line naming its flag."""

import hashlib
from pathlib import Path

import torch

from checkpoint import RunError, read_adapters
from checks import fail
from lora_adapters import add_lora_adapters, load_lora_state_dict


def sha256(*paths):
    """Hex SHA-256 of the files' contents, one after the other."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def check_finite_weights(lora, source):
    """Fail in one line if the LoRA {key: tensor} holds NaN or inf (a diverged run's adapter): its
    images would all be NaN, scored as black images. `source`: what it is, in words."""
    bad = sum(int((~torch.isfinite(value)).sum()) for value in lora.values())
    if bad:
        total = sum(value.numel() for value in lora.values())
        fail(f"{source} holds {bad} NaN or inf weights of {total} (a diverged run?): its images "
             "would be NaN; score an earlier checkpoint")


def read_checkpoint(checkpoint, adapter):
    """(LoRA {key: tensor} of adapter `adapter` (--adapter) of the checkpoint directory `checkpoint`
    (--checkpoint), rank, alpha, the checkpoint's model, sha256 of its adapters file)."""
    try:
        adapters, trained = read_adapters(checkpoint)
    except RunError as error:
        fail(f"--checkpoint {error}")
    path = Path(checkpoint) / "adapters.safetensors"
    if adapter not in adapters:
        fail(f"--adapter {adapter}: {path} holds the adapters {', '.join(sorted(adapters))}")
    check_finite_weights(adapters[adapter], f"--checkpoint {checkpoint}: its {adapter} adapter")
    return (adapters[adapter], trained["lora_rank"], trained["lora_alpha"], trained.get("model"),
            sha256(path))


def read_lora(path, rank, alpha):
    """(LoRA {key: tensor} in lora_state_dict's keys, sha256 of its weights) of a diffusers-format
    directory `path` (--lora), checked against `rank` (--lora-rank) and `alpha` (--lora-alpha)."""
    # here: diffusers takes seconds to import, argument checks do not
    from diffusers import StableDiffusion3Pipeline

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        fail(f"--lora {path}: not a directory holding a diffusers LoRA (*.safetensors)")
    try:
        state, metadata = StableDiffusion3Pipeline.lora_state_dict(str(path),
                                                                   return_lora_metadata=True)
    except (OSError, ValueError, KeyError) as error:
        fail(f"--lora {path}: not a diffusers LoRA "
             f"({type(error).__name__}: {str(error).splitlines()[0]})")
    others = sorted({key.split(".", 1)[0] for key in state} - {"transformer"})
    if others:
        fail(f"--lora {path}: holds LoRA weights for {', '.join(others)}; only the transformer's "
             "are supported")
    state = {key.removeprefix("transformer."): value for key, value in state.items()}
    ranks = sorted({value.shape[0] for key, value in state.items() if ".lora_A." in key})
    if ranks != [rank]:
        fail(f"--lora {path}: a LoRA of rank {'/'.join(map(str, ranks))}, but --lora-rank {rank}")
    recorded = (metadata or {}).get("transformer.lora_alpha")
    if recorded is not None and recorded != alpha:
        fail(f"--lora {path}: a LoRA of alpha {recorded}, but --lora-alpha {alpha}")
    check_finite_weights(state, f"--lora {path}")
    return state, sha256(*files)


def check_lora_fits(transformer, targets, source):
    """Fail in one line if the LoRA's layers (`targets`) are not all `transformer`'s: a LoRA of
    another model. `source`: the flag and path it came from."""
    lacking = sorted(set(targets) - {name for name, _ in transformer.named_modules()})
    if lacking:
        more = f", ({len(lacking) - 3} more)" if len(lacking) > 3 else ""
        fail(f"{source}: the LoRA does not fit the model: its keys name layers the model lacks: "
             f"{', '.join(lacking[:3])}{more}")


def load_lora(transformer, lora, rank, alpha, source):
    """`lora` ({key: tensor}) as adapter "evaluated" of `transformer`, on the layers it names; one
    line naming `source` (the flag and path it came from) if it is a LoRA of another model."""
    targets = sorted({key.split(".lora_")[0] for key in lora})  # the LoRA's own module names
    check_lora_fits(transformer, targets, source)
    add_lora_adapters(transformer, rank, alpha, names=("evaluated",), targets=targets)
    try:
        load_lora_state_dict(transformer, "evaluated", lora)
    except RuntimeError as error:  # the same layer names with other sizes: a LoRA of another model
        fail(f"{source}: the LoRA does not fit the model: {error}")
