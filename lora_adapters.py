"""The LoRA adapters of one transformer: `policy` (trained) and the EMA snapshots `old` and `sampling`, kept in one set
of peft layers whose weights `use_adapter` points at the adapter that runs (None: the base model, the reference);
their EMA updates, state dicts and the diffusers-format export of one of them.

    add_lora_adapters(pipe.transformer)                       # policy, old, sampling
    with use_adapter(pipe.transformer, "sampling"):
        ...
    ema_update_(pipe.transformer, "old", "policy", decay=0.9)
"""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch

# peft and diffusers are imported in the functions that use them, so that argument checks, --dry-run and --help
# answer before they load.


# the joint-attention projections of every block; "attn." does not match SD3.5-M's second attention, "attn2."
LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]


SLOT = "in_use"  # the one adapter peft's layers run: use_adapter points its tensors at a named adapter's


def add_lora_adapters(transformer, rank: int = 32, alpha: int = 64, names=("policy", "old", "sampling"),
                      targets=LORA_TARGETS) -> None:
    """One gaussian-init LoRA (A random, B zero) per name, all equal to names[0]: the active and only trainable one.

    LoRA tensors are float32 whatever the base dtype (fp32 master weights); everything else is frozen.
    peft's layers always run the adapter SLOT, whose tensors are a named adapter's (see use_adapter).
    """
    from peft import LoraConfig

    with warnings.catch_warnings():  # peft warns that several adapters on one model is unusual; here it is the point
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        slot = [] if SLOT in getattr(transformer, "peft_config", {}) else [SLOT]  # once per model
        for name in (*names, *slot):
            config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(targets))
            transformer.add_adapter(config, adapter_name=name)
    vars(transformer).pop("_lora_layers", None)  # new layers: drop use_adapter's cached list
    for name in names:
        for p in lora_parameters(transformer, name):
            p.data = p.data.float()
    for name in names[1:]:
        load_lora_state_dict(transformer, name, lora_state_dict(transformer, names[0]))
    transformer.requires_grad_(False)
    for p in lora_parameters(transformer, names[0]):
        p.requires_grad_(True)
    for layer in _lora_layers(transformer):
        layer._active_adapter = [SLOT]
        _point_slot_at(layer, names[0])


def _named_lora_parameters(transformer, name: str) -> list[tuple[str, torch.nn.Parameter]]:
    """(key without the adapter name, parameter) of adapter `name`, in module order; keys as in peft's state dicts."""
    pattern = re.compile(rf"\.(lora_[AB])\.{re.escape(name)}\.")
    named = transformer.named_parameters(remove_duplicate=False)  # the slot's tensors are also another adapter's
    return [(pattern.sub(r".\1.", k), p) for k, p in named if pattern.search(k)]


def lora_parameters(transformer, name: str = "policy") -> list[torch.nn.Parameter]:
    """The LoRA tensors of adapter `name`, in a fixed order (the same for every adapter)."""
    return [p for _, p in _named_lora_parameters(transformer, name)]


def lora_state_dict(transformer, name: str) -> dict[str, torch.Tensor]:
    """Adapter `name` as {key: tensor}, keys free of the name; like `state_dict()`, the tensors alias the weights."""
    return {k: p.detach() for k, p in _named_lora_parameters(transformer, name)}


@torch.no_grad()
def load_lora_state_dict(transformer, name: str, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (from `lora_state_dict` of any adapter) into adapter `name`, in place. Other keys: KeyError;
    other shapes (a LoRA of another model with the same layer names): RuntimeError naming the first."""
    params = dict(_named_lora_parameters(transformer, name))
    if params.keys() != state.keys():
        raise KeyError(f"state dict does not match adapter {name!r}: {sorted(params.keys() ^ state.keys())[:3]}")
    for k, p in params.items():
        if state[k].shape != p.shape:
            raise RuntimeError(f"{k} has shape {tuple(state[k].shape)}, the model's layer takes {tuple(p.shape)}")
    for k, p in params.items():
        p.copy_(state[k])


def _lora_layers(transformer) -> list:
    if "_lora_layers" not in vars(transformer):  # collect once: walking SD3.5-M's ~4k modules takes milliseconds
        from peft.tuners.tuners_utils import BaseTunerLayer

        transformer._lora_layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]
    return transformer._lora_layers


def _point_slot_at(layer, name: str) -> None:
    layer.lora_A[SLOT].weight, layer.lora_B[SLOT].weight = layer.lora_A[name].weight, layer.lora_B[name].weight
    layer.scaling[SLOT] = layer.scaling[name]


@contextmanager
def use_adapter(transformer, name: str | None):
    """Run with adapter `name`, or with all adapters disabled (the base model) for None.

    The LoRA layers always run the adapter SLOT, whose tensors are pointed at adapter `name`'s: torch.compile's graphs
    guard on the name of peft's active adapter (one graph per adapter and block kind, a minute of compiling each), not
    on which tensors it holds. peft's set_adapter() would also rewrite requires_grad, freezing or unfreezing the policy
    mid-step; requires_grad is left alone. The base model runs with the adapters disabled rather than through an
    adapter with B = 0, which would save graphs but add LoRA work to every base pass (benchmark/HISTORY.md).
    """
    if name is not None and (name == SLOT or name not in getattr(transformer, "peft_config", {})):
        raise ValueError(f"unknown adapter {name!r}")
    layers = _lora_layers(transformer)
    saved = [(layer._disable_adapters, layer.lora_A[SLOT].weight, layer.lora_B[SLOT].weight, layer.scaling[SLOT])
             for layer in layers]
    for layer in layers:
        layer._disable_adapters = name is None
        if name is not None:
            _point_slot_at(layer, name)
    try:
        yield
    finally:
        for layer, (disabled, a, b, scaling) in zip(layers, saved):
            layer._disable_adapters = disabled
            layer.lora_A[SLOT].weight, layer.lora_B[SLOT].weight, layer.scaling[SLOT] = a, b, scaling


class SnapshotError(ValueError):
    """An EMA decay outside [0, 1] (a schedule's NaN): the snapshot is left as it was."""


@torch.no_grad()
def ema_update_(transformer, target: str, source: str, decay: float) -> None:
    """In place, over LoRA tensors only: target <- decay * target + (1 - decay) * source. A decay
    outside [0, 1], NaN included, raises SnapshotError first: the adapter stays finite."""
    if not 0.0 <= decay <= 1.0:
        raise SnapshotError(f"the {target} adapter's EMA decay is {decay}, outside [0, 1]: its "
                            "schedule (ema_decay and its flag) gave it; the adapter is unchanged")
    torch._foreach_lerp_(lora_parameters(transformer, target), lora_parameters(transformer, source), 1.0 - decay)


def active_adapter(transformer) -> str | None:
    """The adapter `use_adapter` made the LoRA layers run, or None while they run the base model
    (adapters disabled, or none added)."""
    layers = _lora_layers(transformer)
    if not layers or layers[0]._disable_adapters:
        return None
    layer = layers[0]
    for name in transformer.peft_config:
        if name != SLOT and layer.lora_A[name].weight is layer.lora_A[SLOT].weight:
            return name
    raise RuntimeError("the LoRA layers run no named adapter")  # only past use_adapter


def save_peft_lora(state: dict[str, torch.Tensor], config, out_dir: str | Path) -> None:
    """A LoRA as a PEFT adapter directory, as peft's PeftModel.save_pretrained writes one:
    adapter_config.json (`config`, the adapter's LoraConfig: rank, alpha, targets) and
    adapter_model.safetensors, with `state`'s keys (lora_state_dict's, such as
    `transformer_blocks.0.attn.to_q.lora_A.weight`) under `base_model.model.`. vLLM's LoRA loader,
    vLLM-Omni's included, reads this layout."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    tensors = {f"base_model.model.{k}": v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))


def export_lora(transformer, name: str, out_dir: str | Path,
                format: Literal["diffusers", "peft"] = "diffusers") -> None:
    """Adapter `name` in diffusers' LoRA format (safetensors): StableDiffusion3Pipeline.load_lora_weights(out_dir).

    format="peft": a PEFT adapter directory instead (save_peft_lora), the layout vLLM-Omni loads a
    request's LoRA from (omni_rollout)."""
    from diffusers import StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict

    if format == "peft":
        save_peft_lora(lora_state_dict(transformer, name), transformer.peft_config[name], out_dir)
        return
    if format != "diffusers":
        raise ValueError(f"unknown LoRA format {format!r}")
    StableDiffusion3Pipeline.save_lora_weights(
        out_dir, transformer_lora_layers=get_peft_model_state_dict(transformer, adapter_name=name),
        transformer_lora_adapter_metadata=transformer.peft_config[name].to_dict(),  # rank and alpha: the LoRA scale
    )
