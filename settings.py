"""The flags outside the algorithm, in blocks: what scores the images (ScoringArgs, which
evaluate.py shares), the validation, the run's directory and the machine, which the three trainers
hold through TrainerArgs; a run's settings as one flat dict (flat_settings), as the command line,
checkpoints, the ranks' agreement and W&B name them, and Args with some of them changed
(with_settings).

    @dataclass
    class Args(TrainerArgs):    # --reward, --eval-every, --output-dir, --device, ... in their boxes
        seed: int = 42          # the trainer's own flags
        ...

Each block's flags keep their names (--reward, not --scoring.reward); the code reads them through
their block: args.scoring.reward, args.validation.eval_every, args.output.resume_from,
args.machine.device.
"""

from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Annotated, Literal

import torch
import tyro

from judges import AESTHETIC_CLIP, PICKSCORE_MODEL, PICKSCORE_PROCESSOR

# A flag of several words kept as one string, as --reward qwen-vl=0.8 pickscore=0.2 and
# --eval-judge paddle flat take them
WORDS = tyro.constructors.PrimitiveConstructorSpec(
    nargs="*", metavar="NAME[=WEIGHT] ...", instance_from_str=" ".join,
    is_instance=lambda value: isinstance(value, str), str_from_instance=str.split)


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # its flags are --reward, not --scoring.reward
@dataclass
class ScoringArgs:
    """What scores the images: the reward (or a mix of rewards), and where its models and servers
    and the judges' models are found."""

    reward: Annotated[str, WORDS] = "qwen-vl"
    """scorer, or a weighted mix (qwen-vl=0.8 pickscore=0.2): qwen-vl, vllm (OpenAI server), paddle
    (PP-OCR), pickscore, aesthetic, flat, brightness, compressibility"""
    reward_model: str = "Qwen/Qwen2.5-VL-3B-Instruct"
    """hub id or local directory of the OCR model (qwen-vl, vllm)"""
    reward_device: str = ""
    """device of the in-process reward model (empty: --device)"""
    reward_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """base URLs of `vllm serve` reward servers (reward vllm)"""
    reward_timeout: float = 60.0
    """seconds a reward server may take to answer one request (reward vllm)"""
    reward_retries: int = 3
    """retries, with backoff, of an image whose request failed (reward vllm)"""
    pickscore_model: str = PICKSCORE_MODEL
    """hub id or local directory of PickScore's CLIP model (reward or judge pickscore)"""
    pickscore_processor: str = PICKSCORE_PROCESSOR
    """hub id or local directory of PickScore's tokenizer and image processor"""
    aesthetic_model: str = AESTHETIC_CLIP
    """hub id or local directory of the CLIP whose embeddings the aesthetic head reads"""
    aesthetic_head: str = ""
    """the LAION aesthetic head, sac+logos+ava1-l14-linearMSE.pth (reward or judge aesthetic)"""


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)
@dataclass
class ValidationArgs:
    """Validation on held-out prompts (never fed to training): when, which, how sampled, judged."""

    eval_data: str = "data/ocr/test.jsonl"
    """held-out validation prompts"""
    eval_every: int = 10
    """validate before training and every N iterations (0: never)"""
    eval_prompts: int = 32
    """held-out prompts validated (the first N of eval_data)"""
    eval_steps: int = 40
    """validation ODE steps"""
    eval_guidance: float = 4.5
    """validation CFG scale (negative prompt "")"""
    eval_seed: int = 0
    """image i of validation always uses seed eval_seed + i"""
    eval_judge: Annotated[str, WORDS, tyro.conf.arg(metavar="NAME ...")] = "paddle"
    """judges of the validation images beside --reward, as --reward's names (none: off); each logged
    as eval/<name>, PP-OCR as eval/reward_paddle"""


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)
@dataclass
class OutputArgs:
    """Where the run is written, what a start does with a run there, what it keeps and logs."""

    output_dir: str = "runs"
    """runs are written to {output_dir}/{run_name}/"""
    run_name: str = ""
    """run directory name; empty: {exp_name}__{reward}__{seed}__{unix time}"""
    overwrite: bool = False
    """replace a run already in the run directory (else it is refused, unless resumed)"""
    resume_from: str = ""
    """continue a global_step_N checkpoint, or `latest` of --run-name (none yet: start it anew)"""
    dry_run: bool = False
    """check the arguments, prompt files and a local --model directory, then exit"""
    save_every: int = 10
    """checkpoint every N iterations and at the end"""
    keep_last: int = 2
    """latest checkpoints kept (0: keep all)"""
    track: bool = False
    """log the run to Weights & Biases too, TensorBoard's scalars synced (requirements-track.txt)"""
    wandb_project_name: str = "crd"
    """the Weights & Biases project of --track"""
    wandb_entity: str = ""
    """the Weights & Biases entity (team) of --track; empty: the account's default"""


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)
@dataclass
class MachineArgs:
    """Where the models run, and speed against memory: the same math, which a resume may change."""

    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """actor device; under torchrun each rank takes cuda:LOCAL_RANK"""
    text_encoder_device: str = ""
    """device of the CLIP and T5 text encoders (empty: the actor device)"""
    rollout_engine: Literal["diffusers", "vllm-omni"] = "diffusers"
    """what runs the rollout ODE: diffusers, or vLLM-Omni on one GPU (requirements-vllm.txt)"""
    compile: bool = True
    """torch.compile the transformer blocks and the VAE decoder on CUDA"""
    gradient_checkpointing: bool = False
    """recompute each block's activations in the policy backward (less memory, slower)"""
    policy_timesteps_per_forward: int = 3
    """timesteps of a micro batch in one policy forward and backward (more: faster, more memory)"""


@dataclass
class TrainerArgs:
    """A trainer's flags outside its algorithm, a box of --help a block; its Args adds its own."""

    scoring: ScoringArgs = field(default_factory=ScoringArgs)
    """what scores the images: --reward, and where its and the judges' models and servers are"""
    validation: ValidationArgs = field(default_factory=ValidationArgs)
    """the validation of held-out prompts (never fed to training)"""
    output: OutputArgs = field(default_factory=OutputArgs)
    """where the run is written, what a start does with a run there, what it keeps and logs"""
    machine: MachineArgs = field(default_factory=MachineArgs)
    """where the models run, and what trades speed for memory (the same math)"""


def flat_settings(args):
    """{field: value} of an Args (or a namespace of its fields), a nested block's fields beside the
    others: each field is one flag."""
    settings = {}
    for name, value in vars(args).items():
        settings |= flat_settings(value) if is_dataclass(value) else {name: value}
    return settings


def with_settings(args, **settings):
    """A copy of `args` with `settings` changed, each named as flat_settings names it (by its flag),
    in whichever block holds it."""
    changes = {}
    for block in fields(args):
        value = getattr(args, block.name)
        if is_dataclass(value):
            names = {f.name for f in fields(value)} & settings.keys()
            if names:
                changes[block.name] = with_settings(value, **{n: settings.pop(n) for n in names})
    return replace(args, **changes, **settings)
