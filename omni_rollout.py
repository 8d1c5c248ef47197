"""vLLM-Omni as an optional rollout engine: rollouts run inside vLLM-Omni, through OUR Euler ODE.

vLLM-Omni (0.26 and 0.30, through the API both share) runs SD3.5-M with its own transformer. A
custom pipeline class (`custom_pipeline_args={"pipeline_class": ...}`; the engine still loads the
transformer's weights and each request's LoRA) runs rollout.euler_rollout, the loop
rollout.sample runs, from the trainer's seeded initial latents and prompt embeddings, and returns
the final latents, which the trainer decodes with its own VAE as rollout.sample does; the engine
keeps no text encoder and no VAE of its own:

    engine = OmniRollout(pipe, args.model, device, world_size)  # after add_lora_adapters
    with use_adapter(pipe.transformer, "sampling"):
        out = engine.sample(pipe, embeds, pooled, seeds, 10)    # rollout.sample's call and dict

One request per rollout carries it all: the distinct prompt embeddings (and the empty prompt's,
for CFG), the initial latents (B, C, h, w) float32, the schedule's UNSHIFTED sigmas (vLLM-Omni's
pipelines hand them to the scheduler, which applies the shift; ours checks them and takes its grid
from rollout.euler_schedule), the seeds, and the active adapter as a PEFT directory
(lora_adapters.export_lora) under a new adapter id, since the engine does not reload an id it has.

RolloutEngine is what the trainers' loop samples with: rollout.sample (--rollout-engine diffusers)
or this engine's call (vllm-omni).

Importing this module imports no vLLM: vllm_omni is imported when an engine starts, and the
pipeline class is made when the engine's worker first asks this module for it.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import tempfile
import weakref
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from checks import loading_errors_as_one_line
import lora_adapters
import rollout
import sd3

FLAG = "--rollout-engine vllm-omni"
PIPELINE_CLASS = "omni_rollout.EulerRolloutPipeline"  # made by __getattr__, in the engine's worker
PAYLOAD = "crd_rollout"  # the extra_args key of what only our pipeline reads
ENGINE_DEVICE_TYPES = ("cuda",)  # vLLM-Omni has no CPU diffusion path
PROBE_SIZE, PROBE_STEPS = 64, 2  # the start-up adapter check: one image, 64 px, 2 steps
# what the trainer runs itself: the engine's pipeline drops them
UNUSED_MODULES = ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")


def check_engine(world_size: int, device, model: str | None = None) -> None:
    """Why this run cannot roll out with vLLM-Omni, as a RuntimeError of one line: several ranks, a
    device that is not the first CUDA GPU, vllm-omni not installed, a `model` built in memory.
    Loads nothing."""
    device = torch.device(device)
    if world_size > 1:
        raise RuntimeError(f"{FLAG} runs on one actor rank; this run has {world_size} (use the "
                           "diffusers engine, or one actor GPU)")
    if device.type not in ENGINE_DEVICE_TYPES:
        raise RuntimeError(f"{FLAG} needs a CUDA GPU (vLLM-Omni has no CPU diffusion path); this "
                           f"run's device is {device}")
    if device.type == "cuda" and (device.index or 0) != 0:
        raise RuntimeError(f"{FLAG} starts its engine on the first visible GPU; this run's device "
                           f"is {device} (make the actor GPU the first with CUDA_VISIBLE_DEVICES)")
    if importlib.util.find_spec("vllm_omni") is None:
        raise RuntimeError(f"{FLAG}: vllm-omni is not installed (pip install -r "
                           "requirements-vllm.txt on a GPU machine), or use the diffusers engine")
    if model == sd3.RANDOM_MEDIUM:
        engine_model_path(model)  # its line: the engine loads files


def engine_model_path(model: str) -> str:
    """What vLLM-Omni loads for the trainer's --model, the same weights as the trainer's pipeline:
    the diffusers folder (absolute) or the hub id. RANDOM_MEDIUM has no files: a RuntimeError."""
    if model == sd3.RANDOM_MEDIUM:
        raise RuntimeError(f"{FLAG} loads the model from files; --model {model} is built in memory "
                           "(save its pipeline with save_pretrained and pass that folder)")
    if model == sd3.TINY:
        return str(sd3._tiny_model_dir(None))
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model  # the engine's processes resolve it


class OmniRollout:
    """One vLLM-Omni engine on the actor GPU, made once; `sample` is rollout.sample through it.

    `pipe` is the trainer's pipeline with its LoRA adapters (lora_adapters.add_lora_adapters): its
    scheduler makes the grid, its VAE decodes, and the adapter its LoRA layers run (use_adapter)
    goes to the engine before each rollout. At the start a non-zero LoRA must change the engine's
    output, else a RuntimeError line says the adapter bound no module. `engine_kwargs` go to
    vllm_omni.Omni (enforce_eager, diffusion_attention_backend, ...).
    """

    def __init__(self, pipe, model: str, device, world_size: int = 1,
                 dtype: torch.dtype = torch.bfloat16, **engine_kwargs):
        check_engine(world_size, device)
        if not getattr(pipe.transformer, "peft_config", None):
            raise ValueError("OmniRollout needs the pipeline's LoRA adapters (add_lora_adapters)")
        path = engine_model_path(model)
        try:
            from vllm_omni import Omni
        except ImportError as error:  # installed, but a vllm that does not fit this torch, ...
            raise RuntimeError(f"{FLAG}: vllm_omni does not import ({error})") from None
        here = str(Path(__file__).resolve().parent)  # the engine's workers import this module
        python_path = os.environ.get("PYTHONPATH", "")
        if here not in python_path.split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, python_path) if p)
        self.adapter_dir = Path(tempfile.mkdtemp(prefix="crd-omni-lora-", dir=_fast_tmp()))
        weakref.finalize(self, shutil.rmtree, self.adapter_dir, True)
        self.adapter_ids = itertools.count(1)  # vLLM's LoRA ids start at 1; one more per rollout
        self.last_adapter: tuple[str, int] | None = None  # (name, id) last sent
        with start_errors_as_one_line():
            self.omni = Omni(model=path, dtype=str(dtype).removeprefix("torch."),
                             custom_pipeline_args={"pipeline_class": PIPELINE_CLASS},
                             **engine_kwargs)
        self.check_adapter(pipe)

    # ---- the trainer's side -------------------------------------------------------------------

    @torch.no_grad()
    def sample(self, pipe, prompt_embeds, pooled, seeds: list[int], num_steps: int = 10,
               guidance_scale: float = 1.0, height: int = 512, width: int = 512,
               max_batch_size: int = 32, negative_embeds=None, negative_pooled=None,
               decode: bool = True, progress: bool = False, on_decoded=None) -> dict:
        """rollout.sample through the engine: the same arguments and dict (latents, timesteps,
        sigmas, finite, images), the images decoded by the trainer's VAE in sample's chunks.

        The adapter the LoRA layers run (use_adapter) is exported and sent under a new id; the
        base model (use_adapter(None)) sends none. `progress` is accepted and ignored."""
        if len(seeds) != prompt_embeds.shape[0]:
            raise ValueError(f"{len(seeds)} seeds for {prompt_embeds.shape[0]} prompt embeddings")
        if on_decoded is not None and not decode:
            raise ValueError("on_decoded needs decode=True")
        if guidance_scale > 1 and negative_embeds is None:
            negative_embeds, negative_pooled = sd3.negative_embeddings(
                pipe, prompt_embeds.shape[1] - pipe.tokenizer_max_length)
        timesteps, sigmas = rollout.euler_schedule(pipe.scheduler, num_steps)
        shape = rollout.latent_shape(pipe, height, width)
        latents = rollout.initial_latents(seeds, shape, "cpu", torch.float32)
        transformer = pipe.transformer
        lora = self._adapter_request(transformer, lora_adapters.active_adapter(transformer))
        prompt, params = self.request(pipe.scheduler, prompt_embeds, pooled, seeds, latents,
                                      num_steps, guidance_scale, height, width, max_batch_size,
                                      negative_embeds, negative_pooled, lora)
        latents = self._generate(prompt, params).to(transformer.device)
        self._drop_adapters_before(lora)
        decoded = rollout.ChunkDecoder(pipe, on_decoded) if decode else None
        if decoded is not None:
            per_call = rollout.images_per_call(len(seeds), max_batch_size, guidance_scale)
            for start in range(0, len(seeds), per_call):
                chunk = slice(start, start + per_call)
                decoded(chunk, latents[chunk])
        return rollout.sample_output(latents, timesteps, sigmas, decoded)

    @staticmethod
    def request(scheduler, prompt_embeds, pooled, seeds, latents, num_steps, guidance_scale,
                height, width, max_batch_size, negative_embeds=None, negative_pooled=None,
                lora_request=None):
        """The (prompt, sampling params) of one rollout's request, all on the CPU.

        prompt: vLLM-Omni's prompt dict with the distinct prompt embeddings (U, S, D) and pooled
        (U, P) (a batch repeats each prompt group_size times), for CFG also the negative ones
        (1, S, D), (1, P). Sampling params: the initial latents (B, C, h, w) float32, the
        unshifted sigmas (T,), the steps, CFG scale, size, the first seed (else vLLM-Omni draws
        one), the LoRA request; extra_args[PAYLOAD] holds each image's prompt index, the seeds and
        the rows per transformer call.
        """
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        unique, index = _unique_rows(prompt_embeds, pooled)
        prompt = {"prompt": f"{len(seeds)} rollout images",  # a label: the embeddings are read
                  "prompt_embeds": prompt_embeds[unique].cpu(),
                  "pooled_prompt_embeds": pooled[unique].cpu()}
        if guidance_scale > 1:
            prompt["negative_prompt_embeds"] = negative_embeds.cpu()
            prompt["negative_pooled_prompt_embeds"] = negative_pooled.cpu()
        payload = {"prompt_index": index, "seeds": list(seeds), "max_batch_size": max_batch_size}
        params = OmniDiffusionSamplingParams(
            height=height, width=width, num_inference_steps=num_steps,
            sigmas=rollout.unshifted_sigmas(scheduler, num_steps), guidance_scale=guidance_scale,
            latents=latents.cpu(), seed=seeds[0], lora_request=lora_request, lora_scale=1.0,
            extra_args={PAYLOAD: payload})
        return prompt, params

    def _generate(self, prompt, params) -> torch.Tensor:
        """The final latents (B, C, h, w) float32 of one request, on the CPU."""
        outputs = self.omni.generate([prompt], [params], use_tqdm=False)
        latents = getattr(outputs[0], "latents", None) if outputs else None
        if latents is None and outputs:
            latents = getattr(outputs[0], "trajectory_latents", None)
        if not isinstance(latents, torch.Tensor):
            raise RuntimeError(f"{FLAG}: the engine returned no latents (it did not run "
                               "omni_rollout's pipeline)")
        return latents.float().clone()  # not an inference-mode tensor of an in-process engine

    def _adapter_request(self, transformer, name: str | None, state: dict | None = None):
        """Adapter `name` (or `state` under its config) as a PEFT directory under a new id, as a
        vLLM LoRARequest; None for the base model."""
        if name is None:
            return None
        from vllm_omni.lora.request import LoRARequest

        adapter_id = next(self.adapter_ids)
        path = self.adapter_dir / f"{name}-{adapter_id}"
        if state is None:
            lora_adapters.export_lora(transformer, name, path, format="peft")
        else:
            lora_adapters.save_peft_lora(state, transformer.peft_config[name], path)
        self.last_adapter = (name, adapter_id)
        return LoRARequest(lora_name=path.name, lora_int_id=adapter_id, lora_path=str(path))

    def _drop_adapters_before(self, lora_request) -> None:
        """Delete the exported adapters older than this one: their ids are never sent again."""
        keep = Path(lora_request.lora_path).name if lora_request is not None else None
        for path in self.adapter_dir.iterdir():
            if path.name != keep:
                shutil.rmtree(path, ignore_errors=True)

    @torch.no_grad()
    def check_adapter(self, pipe) -> None:
        """A non-zero LoRA (the first adapter's A, random B) must change the engine's output, else
        a RuntimeError line: the adapter bound no module. vLLM-Omni has accepted such adapters
        silently and sampled the base model (verl-omni#552, vllm-omni#7190); 0.30 raises on an
        incomplete binding, which becomes the same line. One image of the empty prompt."""
        transformer = pipe.transformer
        name = next(n for n in transformer.peft_config if n != lora_adapters.SLOT)
        generator = torch.Generator().manual_seed(0)
        state = {k: (torch.randn(v.shape, generator=generator).to(v) if ".lora_B." in k else v)
                 for k, v in lora_adapters.lora_state_dict(transformer, name).items()}
        embeds, pooled = sd3.negative_embeddings(pipe)
        shape = rollout.latent_shape(pipe, PROBE_SIZE, PROBE_SIZE)
        latents = rollout.initial_latents([0], shape, "cpu", torch.float32)
        probe = partial(self.request, pipe.scheduler, embeds, pooled, [0], latents, PROBE_STEPS,
                        1.0, PROBE_SIZE, PROBE_SIZE, 1)
        with start_errors_as_one_line():  # the first generation: a missing kernel fails here
            base = self._generate(*probe())
        lora = self._adapter_request(transformer, name, state)
        try:
            with_lora = self._generate(*probe(lora_request=lora))
        except Exception as error:  # one line, not the engine's traceback
            reason = sd3.error_line(error)
            raise RuntimeError(f"{FLAG}: the adapter bound no module ({reason})") from None
        self._drop_adapters_before(lora)
        if torch.equal(base, with_lora):
            raise RuntimeError(f"{FLAG}: the adapter bound no module (a non-zero LoRA left the "
                               "engine's output unchanged: rollouts would sample the base model)")

    def close(self) -> None:
        """Shut the engine down and delete the exported adapters."""
        close = getattr(self.omni, "close", None)
        if close is not None:
            close()
        shutil.rmtree(self.adapter_dir, ignore_errors=True)


@contextmanager
def start_errors_as_one_line():
    """An engine that fails to start, or to run its first generation, is start_error's line, not
    the engine's traceback; an out-of-memory error stays the trainer's (it names the flags)."""
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError):
        raise
    except Exception as error:
        raise RuntimeError(start_error(error)) from None


def start_error(error: Exception) -> str:
    """The line for an engine that did not start; where vLLM lacks its flash-attention kernels
    (vLLM-Omni's default attention calls them), how to run it with PyTorch's attention instead."""
    hint = ""
    if "_vllm_fa2_C" in str(error) or "_vllm_fa3_C" in str(error):
        hint = (": this vLLM lacks its flash-attention kernels; DIFFUSION_ATTENTION_BACKEND="
                "TORCH_SDPA runs the engine with PyTorch's attention, as diffusers does")
    return f"{FLAG}: the engine did not start ({sd3.error_line(error)}){hint}"


def _fast_tmp() -> str | None:
    """/dev/shm where writable (every rollout's adapter is written and read once), else the
    default temporary folder."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def _unique_rows(prompt_embeds, pooled) -> tuple[list[int], list[int]]:
    """The rows of the distinct prompts (first occurrences) and each row's index among them."""
    unique, index = [], []
    for row in range(len(prompt_embeds)):
        same = next((j for j, u in enumerate(unique)
                     if torch.equal(prompt_embeds[row], prompt_embeds[u])
                     and torch.equal(pooled[row], pooled[u])), None)
        if same is None:
            unique.append(row)
            same = len(unique) - 1
        index.append(same)
    return unique, index


# ---- the engine's side (in vLLM-Omni's worker) ------------------------------------------------


def run_request(transformer, scheduler, device, dtype, prompt: dict, params) -> torch.Tensor:
    """One request of OmniRollout.request through rollout.euler_rollout: the final latents
    (B, C, h, w) float32, on the CPU. The grid is rollout.euler_schedule's of this scheduler (the
    engine's copy of the model's); the request's sigmas must be its unshifted sigmas."""
    payload = params.extra_args[PAYLOAD]
    steps = params.num_inference_steps
    if list(params.sigmas or []) != rollout.unshifted_sigmas(scheduler, steps):
        raise ValueError(f"the request's sigmas are not the scheduler's {steps}-step grid before "
                         "its shift")
    timesteps, sigmas = rollout.euler_schedule(scheduler, steps)
    index = torch.as_tensor(payload["prompt_index"])
    embeds = prompt["prompt_embeds"][index].to(device)
    pooled = prompt["pooled_prompt_embeds"][index].to(device)
    guidance_scale = params.guidance_scale if params.guidance_scale is not None else 1.0
    negative = [None, None]
    if guidance_scale > 1:
        negative = [prompt["negative_prompt_embeds"].to(device),
                    prompt["negative_pooled_prompt_embeds"].to(device)]
    # a copy: the loop runs in place, and an engine in this process shares the request's tensor
    latents = params.latents.to(device=device, dtype=torch.float32, copy=True)
    if not len(latents) == len(payload["seeds"]) == len(index):
        raise ValueError(f"{len(latents)} initial latents for {len(payload['seeds'])} seeds and "
                         f"{len(index)} prompt indices")
    rollout.euler_rollout(transformer, latents, embeds, pooled, timesteps.to(device), sigmas,
                          guidance_scale, *negative, payload["max_batch_size"], dtype=dtype)
    return latents.cpu()


def _make_pipeline_class():
    """vLLM-Omni's SD3 pipeline without its text encoders and VAE (the trainer encodes and
    decodes), whose forward() runs run_request for our requests. Per request it returns a
    DiffusionOutput whose trajectory_latents are the final latents (OmniRequestOutput.latents on
    the trainer's side) and whose `output` is an 8 x 8 black placeholder for the engine's PIL
    post-processing. The engine's start-up warm-up gets the placeholder alone; a text prompt, a
    ValueError."""
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.models.sd3.pipeline_sd3 import StableDiffusion3Pipeline

    rollout.allow_block_graphs()  # a compiled engine compiles its blocks too, in this process

    class EulerRolloutPipeline(StableDiffusion3Pipeline):
        supports_request_batch = True

        def __init__(self, *, od_config, prefix=""):
            super().__init__(od_config=od_config, prefix=prefix)
            # vLLM-Omni builds a custom pipeline on the CPU and then moves it to the GPU: dropped
            # here, the text encoders and the VAE (10.5 of SD3.5-M's 15.6 GiB) never reach it
            for name in UNUSED_MODULES:
                setattr(self, name, None)

        def forward(self, req, *args, **kwargs):
            requests = list(getattr(req, "requests", None) or [req])
            ours = [PAYLOAD in (getattr(r.sampling_params, "extra_args", None) or {})
                    for r in requests]
            if all(r.is_dummy_run() for r in requests):
                return [DiffusionOutput(output=torch.zeros(1, 3, 8, 8)) for _ in requests]
            if not all(ours):
                raise ValueError("the rollout engine runs the trainer's rollout requests only (it "
                                 "holds no text encoder)")
            outputs = []
            for request in requests:
                latents = run_request(self.transformer, self.scheduler, self.device,
                                      self.od_config.dtype, request.prompt, request.sampling_params)
                outputs.append(DiffusionOutput(output=torch.zeros(1, 3, 8, 8),
                                               trajectory_latents=latents))
            return outputs

    EulerRolloutPipeline.__module__ = __name__
    return EulerRolloutPipeline


def __getattr__(name: str):
    if name == PIPELINE_CLASS.rpartition(".")[2]:
        cls = globals()[name] = _make_pipeline_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class RolloutEngine:
    """What runs the loop's rollouts: rollout.sample (--rollout-engine diffusers), or its call
    through vLLM-Omni on the one actor GPU (vllm-omni: omni_rollout.OmniRollout, started once the
    LoRA adapters exist). Made inside loading_errors_as_one_line: a run the engine cannot serve
    (several ranks, no CUDA GPU, vllm-omni missing, weights built in memory) is one line."""

    def __init__(self, args, world_size, device):
        self.args = args
        self.world_size = world_size
        self.omni = None
        self.sample = rollout.sample
        if args.machine.rollout_engine == "vllm-omni":
            check_engine(world_size, device, args.model)  # loads nothing: before the models

    def start(self, pipe, dtype):
        """The vLLM-Omni engine, on `pipe` with its adapters; its start-up check (a non-zero adapter
        changes its output) failing is one line."""
        if self.args.machine.rollout_engine != "vllm-omni":
            return
        with loading_errors_as_one_line():
            self.omni = OmniRollout(pipe, self.args.model, pipe.transformer.device, self.world_size,
                                    dtype, enforce_eager=not self.args.machine.compile)
        self.sample = self.omni.sample

    def close(self):
        """Shut the engine down (its processes end before the trainer exits)."""
        if self.omni is not None:
            self.omni.close()
            self.omni = None
            self.sample = rollout.sample
