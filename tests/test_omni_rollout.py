"""omni_rollout.py (the vLLM-Omni rollout engine) on CPU, against a stand-in vllm_omni package.

vllm and vllm-omni do not install beside CI's CPU torch, so the stand-in below, written to a
temporary folder on sys.path, has the calls omni_rollout makes of vLLM-Omni 0.26 / 0.30 (Omni,
OmniDiffusionSamplingParams, LoRARequest, custom_pipeline_args, the SD3 pipeline class it
subclasses, DiffusionOutput) and a request's way through the engine (LoRA activation by id,
forward, post-processing), with the real tiny diffusers transformer inside. So the engine path
must give bitwise rollout.sample's latents, through the Euler loop both share.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import lora_adapters
import omni_rollout
import rollout
import sd3

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ['a sign that says "hello"', 'a poster with "CRD 2026" on it', "a cat"]
H = W = 64
T5_TOKENS = 32

# The stand-in: path -> source. Names and call shapes are vLLM-Omni 0.30's (0.26's are the same).
STAND_IN = {
    "vllm_omni/__init__.py": "from vllm_omni.entrypoints.omni import Omni\n",
    "vllm_omni/entrypoints/__init__.py": "",
    "vllm_omni/entrypoints/omni.py": '''
        import copy, importlib, itertools
        import torch
        from vllm_omni.diffusion.data import OmniDiffusionConfig
        from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager
        from vllm_omni.diffusion.models.sd3.pipeline_sd3 import get_sd3_image_post_process_func
        from vllm_omni.diffusion.request import OmniDiffusionRequest
        from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams
        from vllm_omni.outputs import OmniRequestOutput

        class Omni:
            """One diffusion stage, in process; max_num_seqs 1."""
            def __init__(self, model, dtype="auto", custom_pipeline_args=None, **kwargs):
                self.kwargs = dict(model=model, dtype=dtype,
                                   custom_pipeline_args=custom_pipeline_args, **kwargs)
                od_config = OmniDiffusionConfig(model=model, dtype=getattr(torch, dtype))
                module, _, name = custom_pipeline_args["pipeline_class"].rpartition(".")  # qualname
                # built on the CPU, then moved to the engine's device (here the CPU too)
                pipeline = getattr(importlib.import_module(module), name)(od_config=od_config)
                self.pipeline = pipeline.to("cpu")
                self.lora_manager = DiffusionLoRAManager(self.pipeline)
                self.post_process = get_sd3_image_post_process_func(od_config)
                self.ids, self.requests = itertools.count(), []
                warmup = OmniDiffusionSamplingParams(height=512, width=512, num_inference_steps=2)
                self._run([OmniDiffusionRequest({"prompt": "dummy run"}, warmup, "dummy_req_id")])
                self.closed = False

            def generate(self, prompts, sampling_params_list=None, *, use_tqdm=True):
                assert len(sampling_params_list) == 1  # one per stage, shared by the prompts
                requests = [OmniDiffusionRequest(p, copy.copy(sampling_params_list[0]),
                                                 f"{next(self.ids)}_r") for p in prompts]
                self.requests += requests
                return self._run(requests)

            def _run(self, requests):
                results = []
                for request in requests:
                    params = request.sampling_params
                    if params.seed is None:
                        params.seed = 1234
                    self.lora_manager.set_active_adapter(params.lora_request, params.lora_scale)
                    with torch.inference_mode():
                        outputs = self.pipeline.forward(DiffusionRequestBatch(requests=[request]))
                    assert isinstance(outputs, list) and len(outputs) == 1
                    out = outputs[0]
                    results.append(OmniRequestOutput(
                        request_id=request.request_id, images=self.post_process(out.output),
                        latents=out.trajectory_latents, trajectory_latents=out.trajectory_latents))
                return results

            def close(self):
                self.closed = True
    ''',
    "vllm_omni/inputs/__init__.py": "",
    "vllm_omni/inputs/data.py": '''
        from dataclasses import dataclass, field
        from typing import Any
        import torch

        @dataclass
        class OmniDiffusionSamplingParams:  # the fields omni_rollout sets, and a few more
            num_outputs_per_prompt: int = 1
            seed: int | None = None
            generator: Any = None
            latents: torch.Tensor | None = None
            height: int | None = None
            width: int | None = None
            num_inference_steps: int | None = None
            guidance_scale: float | None = None
            sigmas: list[float] | None = None
            extra_args: dict[str, Any] = field(default_factory=dict)
            lora_request: Any = None
            lora_scale: float = 1.0
    ''',
    "vllm_omni/lora/__init__.py": "",
    "vllm_omni/lora/request.py": '''
        from dataclasses import dataclass

        @dataclass
        class LoRARequest:  # vllm.lora.request.LoRARequest's fields
            lora_name: str
            lora_int_id: int
            lora_path: str = ""

            def __post_init__(self):
                if self.lora_int_id < 1:
                    raise ValueError(f"id must be > 0, got {self.lora_int_id}")
    ''',
    "vllm_omni/outputs.py": '''
        from dataclasses import dataclass, field
        import torch

        @dataclass
        class OmniRequestOutput:
            request_id: str = ""
            images: list = field(default_factory=list)
            latents: torch.Tensor | None = None
            trajectory_latents: torch.Tensor | None = None
    ''',
    "vllm_omni/diffusion/__init__.py": "",
    "vllm_omni/diffusion/data.py": '''
        from dataclasses import dataclass
        from typing import Any
        import torch

        @dataclass
        class OmniDiffusionConfig:
            model: str
            dtype: torch.dtype = torch.bfloat16
            output_type: str = "pil"

        @dataclass
        class DiffusionOutput:
            output: Any = None
            trajectory_timesteps: Any = None
            trajectory_latents: Any = None
            error: str | None = None
    ''',
    "vllm_omni/diffusion/request.py": '''
        from dataclasses import dataclass
        from typing import Any

        @dataclass
        class OmniDiffusionRequest:
            prompt: Any
            sampling_params: Any
            request_id: str

            def is_dummy_run(self):
                return self.request_id == "dummy_req_id"  # the engine's start-up warm-up
    ''',
    "vllm_omni/diffusion/worker/__init__.py": "",
    "vllm_omni/diffusion/worker/request_batch.py": '''
        from dataclasses import dataclass

        @dataclass
        class DiffusionRequestBatch:
            requests: list

            @property
            def prompts(self):
                return [r.prompt for r in self.requests]

            @property
            def sampling_params_list(self):
                return [r.sampling_params for r in self.requests]
    ''',
    "vllm_omni/diffusion/lora/__init__.py": "",
    "vllm_omni/diffusion/lora/manager.py": '''
        import json
        from pathlib import Path
        from safetensors.torch import load_file
        import lora_adapters
        import rollout
        import sd3

        BIND = True  # False: adapters load but bind no module (verl-omni#552, vllm-omni#7190)

        class DiffusionLoRAManager:
            """Loads an unseen lora_int_id from its PEFT directory (an id it has is not reloaded;
            LRU of 1) and makes the transformer's LoRA layers run it until the next request."""
            def __init__(self, pipeline, max_cached_adapters=1):
                self.transformer, self.max_cached = pipeline.transformer, max_cached_adapters
                self.registered, self.loaded_ids, self.layers = {}, [], None

            def set_active_adapter(self, lora_request, lora_scale=1.0):
                if self.layers is not None:
                    self.layers.__exit__(None, None, None)
                name = None
                if lora_request is not None and lora_scale != 0:
                    adapter_id = lora_request.lora_int_id
                    if adapter_id not in self.registered:
                        self._load(adapter_id, Path(lora_request.lora_path))
                    config, state = self.registered[adapter_id]
                    if BIND:
                        if "engine" not in getattr(self.transformer, "peft_config", {}):
                            lora_adapters.add_lora_adapters(self.transformer, config["r"],
                                                      config["lora_alpha"], names=("engine",),
                                                      targets=config["target_modules"])
                        lora_adapters.load_lora_state_dict(self.transformer, "engine", state)
                        name = "engine"
                self.layers = lora_adapters.use_adapter(self.transformer, name)
                self.layers.__enter__()

            def _load(self, adapter_id, path):
                config = json.loads((path / "adapter_config.json").read_text())
                tensors = load_file(path / "adapter_model.safetensors")
                state = {k.removeprefix("base_model.model."): v for k, v in tensors.items()}
                if len(self.registered) >= self.max_cached:
                    self.registered.pop(next(iter(self.registered)))
                self.registered[adapter_id] = (config, state)
                self.loaded_ids.append(adapter_id)
    ''',
    "vllm_omni/diffusion/models/__init__.py": "",
    "vllm_omni/diffusion/models/sd3/__init__.py": "",
    "vllm_omni/diffusion/models/sd3/pipeline_sd3.py": '''
        import torch
        from vllm_omni.diffusion.data import DiffusionOutput

        STOCK_FORWARDS = []  # request ids the stock forward ran

        class StableDiffusion3Pipeline(torch.nn.Module):
            supports_request_batch = True

            def __init__(self, *, od_config, prefix=""):
                super().__init__()
                import diffusers, transformers
                self.od_config, self.device = od_config, torch.device("cpu")
                model, dtype = od_config.model, od_config.dtype
                self.scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(
                    model, subfolder="scheduler")
                self.tokenizer = transformers.CLIPTokenizer.from_pretrained(
                    model, subfolder="tokenizer")
                for name, cls in [("text_encoder", transformers.CLIPTextModelWithProjection),
                                  ("text_encoder_2", transformers.CLIPTextModelWithProjection),
                                  ("text_encoder_3", transformers.T5EncoderModel)]:
                    setattr(self, name, cls.from_pretrained(model, subfolder=name, dtype=dtype))
                transformer = diffusers.SD3Transformer2DModel.from_pretrained(
                    model, subfolder="transformer", dtype=dtype)
                self.transformer = transformer.eval().requires_grad_(False)
                self.vae = diffusers.AutoencoderKL.from_pretrained(
                    model, subfolder="vae", dtype=dtype)

            def forward(self, req):  # encodes each text prompt, as vLLM-Omni's does
                STOCK_FORWARDS.extend(r.request_id for r in req.requests)
                for prompt in req.prompts:
                    tokens = self.tokenizer(prompt["prompt"], return_tensors="pt").input_ids
                    self.text_encoder(tokens)
                return [DiffusionOutput(output=torch.zeros(1, 3, 8, 8)) for _ in req.requests]

        def get_sd3_image_post_process_func(od_config):
            def post_process(images):
                assert images.ndim == 4 and images.shape[1] == 3, images.shape  # decoded RGB
                return [object() for _ in images]  # PIL images
            return post_process
    ''',
}


def write_stand_in(root):
    """The stand-in vllm_omni package under `root` (put `root` on sys.path to import it)."""
    for path, source in STAND_IN.items():
        file = root / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(textwrap.dedent(source))
    return root


@pytest.fixture(scope="module")
def stand_in_dir(tmp_path_factory):
    return write_stand_in(tmp_path_factory.mktemp("stand_in"))


@pytest.fixture
def stand_in(stand_in_dir, monkeypatch):
    """The stand-in vllm_omni importable for one test; then it and the pipeline class made on it
    are gone."""
    monkeypatch.syspath_prepend(str(stand_in_dir))
    yield stand_in_dir
    for name in [m for m in sys.modules if m.split(".")[0] == "vllm_omni"]:
        del sys.modules[name]
    vars(omni_rollout).pop("EulerRolloutPipeline", None)


@pytest.fixture
def on_cpu(monkeypatch):
    """The stand-in runs on the CPU, where the real engine is refused."""
    monkeypatch.setattr(omni_rollout, "ENGINE_DEVICE_TYPES", ("cuda", "cpu"))


def perturb(transformer, name, seed=0):
    """Give adapter `name` random non-zero weights (a fresh LoRA has B = 0: the base model)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_adapters.lora_parameters(transformer, name):
            p.copy_(0.1 * torch.randn(p.shape, generator=generator))


@pytest.fixture
def lora_pipe(tiny_model_dir):
    """The trainer's side: a fresh tiny pipe with the three adapters, the sampling one non-zero."""
    pipe = sd3.load_pipeline(str(tiny_model_dir))
    lora_adapters.add_lora_adapters(pipe.transformer, rank=4, alpha=8)
    perturb(pipe.transformer, "sampling")
    return pipe


@pytest.fixture
def engine(stand_in, on_cpu, lora_pipe, tiny_model_dir):
    engine = omni_rollout.OmniRollout(lora_pipe, str(tiny_model_dir), "cpu", dtype=torch.float32)
    yield engine
    engine.close()


def embed(pipe, n):
    """Embeddings of n images, group_size 2: each prompt twice in a row, as a rollout's batch."""
    prompts = [PROMPTS[i // 2 % len(PROMPTS)] for i in range(n)]
    return sd3.encode_prompts(pipe, prompts, T5_TOKENS)


def same_bits(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    as_bytes = lambda t: t.reshape(-1).contiguous().view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def assert_same_rollout(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert same_bits(a[key], b[key]), key


def sample_before_the_refactor(pipe, prompt_embeds, pooled, seeds, num_steps, guidance_scale,
                               max_batch_size):
    """rollout.sample's loop as it was before its Euler step and schedule were factored out
    (commit 2a85963)."""
    transformer, device = pipe.transformer, pipe.transformer.device
    negative = [None, None]
    if guidance_scale > 1:
        tokens = prompt_embeds.shape[1] - pipe.tokenizer_max_length
        negative = sd3.negative_embeddings(pipe, tokens)
    pipe.scheduler.set_timesteps(num_steps)
    timesteps, sigmas = pipe.scheduler.timesteps.float(), pipe.scheduler.sigmas.float()
    shape = (transformer.config.in_channels, H // pipe.vae_scale_factor, W // pipe.vae_scale_factor)
    latents = rollout.initial_latents(seeds, shape, device, torch.float32)
    per_call = rollout.images_per_call(len(seeds), max_batch_size, guidance_scale)
    images = []
    for start in range(0, len(seeds), per_call):
        chunk = slice(start, start + per_call)
        x = latents[chunk]
        for i, t in enumerate(timesteps.to(device)):
            v = rollout.predict_velocity(transformer, x, t, prompt_embeds[chunk], pooled[chunk],
                                         guidance_scale, *negative)
            x = x + float(sigmas[i + 1] - sigmas[i]) * v.float()
        latents[chunk] = x
        images.append(rollout.decode_latents(pipe, x))
    return {"latents": latents, "timesteps": timesteps, "sigmas": sigmas,
            "images": np.concatenate(images)}


# ---- the shared Euler step and schedule (rollout.py) ---------------------------------------------


@pytest.mark.parametrize("cfg, max_batch_size", [(1.0, 32), (4.5, 3)])
def test_diffusers_rollout_is_bitwise_the_loop_before_the_refactor(lora_pipe, cfg, max_batch_size):
    embeds, pooled = embed(lora_pipe, 6)
    with lora_adapters.use_adapter(lora_pipe.transformer, "sampling"):
        new = rollout.sample(lora_pipe, embeds, pooled, list(range(6)), 5, cfg, H, W,
                             max_batch_size)
        old = sample_before_the_refactor(lora_pipe, embeds, pooled, list(range(6)), 5, cfg,
                                         max_batch_size)
    for key in old:
        assert same_bits(new[key], old[key]), key


def test_euler_schedule_is_the_schedulers_and_its_unshifted_sigmas_shift_onto_it(tiny_pipe):
    scheduler = tiny_pipe.scheduler
    for steps in (1, 6, 10, 40):
        timesteps, sigmas = rollout.euler_schedule(scheduler, steps)
        scheduler.set_timesteps(steps)
        assert same_bits(timesteps, scheduler.timesteps.float())
        assert same_bits(sigmas, scheduler.sigmas.float())
        assert timesteps.shape == (steps,) and sigmas.shape == (steps + 1,) and sigmas[-1] == 0
        unshifted = rollout.unshifted_sigmas(scheduler, steps)
        assert len(unshifted) == steps and unshifted[0] == 1.0
        scheduler.set_timesteps(sigmas=unshifted)  # vLLM-Omni's stock SD3 pipeline does this
        torch.testing.assert_close(scheduler.sigmas, sigmas, rtol=0, atol=1e-6)
        if steps > 1:
            assert unshifted[1] < sigmas[1].item() - 0.01  # the shift moves them: not sent shifted


def test_euler_step_is_float32_whatever_the_velocity_dtype():
    x = torch.zeros(2, 3)
    v = torch.full((2, 3), 1 / 3, dtype=torch.bfloat16)
    sigmas = torch.tensor([1.0, 0.7], dtype=torch.float32)
    y = rollout.euler_step(x, v, sigmas[0], sigmas[1])
    assert y.dtype == torch.float32 and same_bits(y, x + float(sigmas[1] - sigmas[0]) * v.float())


def test_active_adapter_and_the_peft_export(lora_pipe, tmp_path):
    transformer = lora_pipe.transformer
    assert lora_adapters.active_adapter(transformer) == "policy"  # as add_lora_adapters leaves it
    for name in ("sampling", "old", None):
        with lora_adapters.use_adapter(transformer, name):
            assert lora_adapters.active_adapter(transformer) == name
    lora_adapters.export_lora(transformer, "sampling", tmp_path, format="peft")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert sorted(config["target_modules"]) == sorted(lora_adapters.LORA_TARGETS)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    state = lora_adapters.lora_state_dict(transformer, "sampling")
    assert tensors.keys() == {f"base_model.model.{k}" for k in state}
    assert all(same_bits(tensors[f"base_model.model.{k}"], v) for k, v in state.items())
    with pytest.raises(ValueError, match="unknown LoRA format"):
        lora_adapters.export_lora(transformer, "sampling", tmp_path, format="kohya")


# ---- the engine against the stand-in -------------------------------------------------------------


@pytest.mark.parametrize("cfg, max_batch_size", [(1.0, 32), (1.0, 2), (4.5, 3)])
def test_engine_rollout_is_bitwise_the_diffusers_rollout(engine, lora_pipe, cfg, max_batch_size):
    embeds, pooled = embed(lora_pipe, 6)
    seeds = [11, 12, 13, 14, 15, 16]
    ours, theirs = [], []  # what on_decoded gets: (chunk, images)
    with lora_adapters.use_adapter(lora_pipe.transformer, "sampling"):
        diffusers = rollout.sample(lora_pipe, embeds, pooled, seeds, 5, cfg, H, W, max_batch_size,
                                   on_decoded=lambda *chunk: ours.append(chunk))
        omni = engine.sample(lora_pipe, embeds, pooled, seeds, 5, cfg, H, W, max_batch_size,
                             on_decoded=lambda *chunk: theirs.append(chunk))
    assert_same_rollout(diffusers, omni)
    assert [c for c, _ in ours] == [c for c, _ in theirs]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(ours, theirs))
    base = engine_base_latents(engine, lora_pipe, embeds, pooled, seeds, cfg)
    assert not torch.equal(diffusers["latents"], base)  # the adapter took part


def engine_base_latents(engine, pipe, embeds, pooled, seeds, cfg):
    with lora_adapters.use_adapter(pipe.transformer, None):
        return engine.sample(pipe, embeds, pooled, seeds, 5, cfg, H, W, decode=False)["latents"]


def test_the_base_model_rollout_sends_no_adapter(engine, lora_pipe):
    embeds, pooled = embed(lora_pipe, 4)
    with lora_adapters.use_adapter(lora_pipe.transformer, None):
        ours = rollout.sample(lora_pipe, embeds, pooled, [1, 2, 3, 4], 4, 1.0, H, W, decode=False)
        theirs = engine.sample(lora_pipe, embeds, pooled, [1, 2, 3, 4], 4, 1.0, H, W, decode=False)
    assert_same_rollout(ours, theirs)
    assert "images" not in theirs and engine.omni.requests[-1].sampling_params.lora_request is None


def test_the_request_carries_unshifted_sigmas_latents_seeds_and_unique_embeddings(engine, lora_pipe,
                                                                                    tiny_model_dir):
    embeds, pooled = embed(lora_pipe, 6)
    seeds = [101, 102, 103, 104, 105, 106]
    with lora_adapters.use_adapter(lora_pipe.transformer, "sampling"):
        out = engine.sample(lora_pipe, embeds, pooled, seeds, 7, 4.5, H, W, 4)
    request = engine.omni.requests[-1]
    prompt, params = request.prompt, request.sampling_params
    pipeline_class = {"pipeline_class": "omni_rollout.EulerRolloutPipeline"}
    assert engine.omni.kwargs == {"model": str(tiny_model_dir), "dtype": "float32",
                                  "custom_pipeline_args": pipeline_class}
    # three prompts, each twice: sent once each, with every image's index
    assert same_bits(prompt["prompt_embeds"], embeds[[0, 2, 4]])
    assert same_bits(prompt["pooled_prompt_embeds"], pooled[[0, 2, 4]])
    negative = sd3.negative_embeddings(lora_pipe, T5_TOKENS)
    assert same_bits(prompt["negative_prompt_embeds"], negative[0])
    assert same_bits(prompt["negative_pooled_prompt_embeds"], negative[1])
    payload = params.extra_args[omni_rollout.PAYLOAD]
    assert payload == {"prompt_index": [0, 0, 1, 1, 2, 2], "seeds": seeds, "max_batch_size": 4}
    assert params.seed == seeds[0]
    # the initial latents: each image's seeded noise, float32
    noise = rollout.initial_latents(seeds, (16, H // 8, W // 8), "cpu", torch.float32)
    assert same_bits(params.latents, noise)
    # the sigmas before the shift, which the scheduler applies; the grid ran is the trainer's
    assert params.sigmas == rollout.unshifted_sigmas(lora_pipe.scheduler, 7)
    assert params.num_inference_steps == 7
    assert same_bits(out["sigmas"], rollout.euler_schedule(lora_pipe.scheduler, 7)[1])
    assert (params.height, params.width, params.guidance_scale) == (H, W, 4.5)
    # the sampling adapter as a PEFT directory
    lora = params.lora_request
    assert lora.lora_name == Path(lora.lora_path).name == f"sampling-{lora.lora_int_id}"
    assert params.lora_scale == 1.0
    tensors = load_file(Path(lora.lora_path) / "adapter_model.safetensors")
    state = lora_adapters.lora_state_dict(lora_pipe.transformer, "sampling")
    assert all(same_bits(tensors[f"base_model.model.{k}"], v) for k, v in state.items())
    from vllm_omni.diffusion.models.sd3.pipeline_sd3 import STOCK_FORWARDS

    assert STOCK_FORWARDS == []  # the warm-up too: the stock forward needs the text encoders


def test_the_engine_holds_the_transformer_alone_and_refuses_a_text_prompt(engine, tiny_model_dir):
    """vLLM-Omni's SD3 pipeline loads three text encoders and a VAE (10.5 of SD3.5-M's 15.6 GiB)
    that the trainer runs itself: the engine's pipeline drops them before it is moved to the GPU."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.models.sd3.pipeline_sd3 import StableDiffusion3Pipeline
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    config = OmniDiffusionConfig(model=str(tiny_model_dir), dtype=torch.float32)
    stock, ours = StableDiffusion3Pipeline(od_config=config), engine.omni.pipeline
    assert type(ours) is omni_rollout.EulerRolloutPipeline
    for name in omni_rollout.UNUSED_MODULES:
        assert getattr(stock, name) is not None and getattr(ours, name) is None, name
    parameters = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert parameters(stock) > parameters(stock.transformer)
    assert parameters(ours) == parameters(ours.transformer)
    params = OmniDiffusionSamplingParams(height=H, width=W, num_inference_steps=2)
    with pytest.raises(ValueError, match="rollout requests only"):
        engine.omni.generate([{"prompt": "a cat"}], [params])


def test_every_rollout_sends_the_adapter_under_a_new_id(engine, lora_pipe):
    """The engine does not reload an id it has: the adapter, trained in between, must come under
    a new one."""
    embeds, pooled = embed(lora_pipe, 2)
    transformer = lora_pipe.transformer
    ids = []
    for round_ in range(3):
        perturb(transformer, "sampling", seed=round_ + 1)  # it moved since the last rollout
        with lora_adapters.use_adapter(transformer, "sampling"):
            ours = rollout.sample(lora_pipe, embeds, pooled, [5, 6], 4, 1.0, H, W, decode=False)
            theirs = engine.sample(lora_pipe, embeds, pooled, [5, 6], 4, 1.0, H, W, decode=False)
        assert same_bits(ours["latents"], theirs["latents"])
        ids.append(engine.omni.requests[-1].sampling_params.lora_request.lora_int_id)
    probe = engine.omni.requests[1].sampling_params.lora_request.lora_int_id  # the start-up check
    assert [probe, *ids] == [1, 2, 3, 4] and engine.omni.lora_manager.loaded_ids == [1, 2, 3, 4]
    assert [p.name for p in engine.adapter_dir.iterdir()] == ["sampling-4"]  # older ones deleted
    engine.close()
    assert engine.omni.closed and not engine.adapter_dir.exists()


def test_the_pipeline_refuses_sigmas_that_are_not_the_unshifted_grid(tiny_pipe):
    shifted = rollout.euler_schedule(tiny_pipe.scheduler, 4)[1][:-1].tolist()
    params = type("Params", (), {"extra_args": {omni_rollout.PAYLOAD: {}}, "num_inference_steps": 4,
                                 "sigmas": shifted})
    with pytest.raises(ValueError, match="not the scheduler's 4-step grid before its shift"):
        omni_rollout.run_request(None, tiny_pipe.scheduler, "cpu", torch.float32, {}, params)


def test_the_engines_pipeline_class_lets_dynamo_compile_every_block(stand_in, monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)  # torch's default
    assert omni_rollout.EulerRolloutPipeline.supports_request_batch  # made as the worker makes it
    assert torch._dynamo.config.recompile_limit == 64


# ---- one-line refusals ---------------------------------------------------------------------------


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message and message.startswith("--rollout-engine vllm-omni"), message
    return message


def test_vllm_omni_not_installed_is_one_line(lora_pipe, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("vllm_omni") is not None:  # installed here: pretend it is not
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RuntimeError) as error:
        omni_rollout.OmniRollout(lora_pipe, "tiny", "cuda")
    assert "vllm-omni is not installed (pip install -r requirements-vllm.txt" in one_line(error)


def test_several_ranks_are_one_line(lora_pipe, stand_in):
    with pytest.raises(RuntimeError) as error:
        omni_rollout.OmniRollout(lora_pipe, "tiny", "cuda", world_size=2)
    assert "runs on one actor rank; this run has 2" in one_line(error)


@pytest.mark.parametrize("device, says", [("cpu", "needs a CUDA GPU"),
                                          ("cuda:1", "the first visible GPU")])
def test_a_cpu_device_or_another_gpu_is_one_line(lora_pipe, stand_in, device, says):
    with pytest.raises(RuntimeError) as error:
        omni_rollout.OmniRollout(lora_pipe, "tiny", device)
    assert says in one_line(error)


def test_random_weights_built_in_memory_are_one_line():
    with pytest.raises(RuntimeError) as error:
        omni_rollout.engine_model_path(sd3.RANDOM_MEDIUM)
    assert "built in memory" in one_line(error)


def test_an_adapter_that_binds_nothing_is_one_line(stand_in, on_cpu, lora_pipe, tiny_model_dir,
                                                   monkeypatch):
    from vllm_omni.diffusion.lora import manager

    monkeypatch.setattr(manager, "BIND", False)  # accepted, bound nowhere: the base model samples
    with pytest.raises(RuntimeError) as error:
        omni_rollout.OmniRollout(lora_pipe, str(tiny_model_dir), "cpu", dtype=torch.float32)
    says = "the adapter bound no module (a non-zero LoRA left the engine's output unchanged"
    assert says in one_line(error)


def test_an_adapter_the_engine_refuses_is_one_line(stand_in, on_cpu, lora_pipe, tiny_model_dir,
                                                   monkeypatch):
    from vllm_omni.diffusion.lora import manager

    def refuse(self, adapter_id, path):  # vLLM-Omni 0.30 raises on an incomplete binding
        raise ValueError(f"LoRA adapter {adapter_id} binding is incomplete: bound=0/30,\n"
                         "unbound modules=[...]")

    monkeypatch.setattr(manager.DiffusionLoRAManager, "_load", refuse)
    with pytest.raises(RuntimeError) as error:
        omni_rollout.OmniRollout(lora_pipe, str(tiny_model_dir), "cpu", dtype=torch.float32)
    says = "the adapter bound no module (LoRA adapter 1 binding is incomplete: bound=0/30, unbound"
    assert says in one_line(error)


def test_an_engine_that_does_not_start_is_one_line_with_the_attention_hint(
        stand_in, on_cpu, lora_pipe, tiny_model_dir, monkeypatch):
    import vllm_omni

    start, start_generate = vllm_omni.Omni.__init__, vllm_omni.Omni.generate

    def fail(self, *args, **kwargs):  # vLLM-Omni 0.26's start on a vLLM without its FA2 kernel
        raise RuntimeError("Orchestrator initialization failed: Dummy run failed:\n"
                           "'_OpNamespace' '_vllm_fa2_C' object has no attribute 'varlen_fwd'")

    monkeypatch.setattr(vllm_omni.Omni, "__init__", fail)
    with pytest.raises(RuntimeError) as error:
        omni_rollout.OmniRollout(lora_pipe, str(tiny_model_dir), "cpu", dtype=torch.float32)
    message = one_line(error)
    assert "the engine did not start (Orchestrator initialization failed: Dummy run" in message
    assert message.endswith("DIFFUSION_ATTENTION_BACKEND=TORCH_SDPA runs the engine with "
                            "PyTorch's attention, as diffusers does")

    # the engine starts, and its first generation (the adapter check) fails: as on an H200
    monkeypatch.setattr(vllm_omni.Omni, "__init__", start)
    monkeypatch.setattr(vllm_omni.Omni, "generate", fail)
    with pytest.raises(RuntimeError) as error:
        omni_rollout.OmniRollout(lora_pipe, str(tiny_model_dir), "cpu", dtype=torch.float32)
    assert one_line(error).startswith("--rollout-engine vllm-omni: the engine did not start ("
                                      "Orchestrator initialization failed")
    assert one_line(error).endswith("as diffusers does")

    def other(self, *args, **kwargs):
        raise ValueError("the diffusion stage's worker exited")

    monkeypatch.setattr(vllm_omni.Omni, "generate", start_generate)
    monkeypatch.setattr(vllm_omni.Omni, "__init__", other)
    with pytest.raises(RuntimeError) as error:
        omni_rollout.OmniRollout(lora_pipe, str(tiny_model_dir), "cpu", dtype=torch.float32)
    assert one_line(error) == ("--rollout-engine vllm-omni: the engine did not start (the "
                               "diffusion stage's worker exited)")

    def out_of_memory(self, *args, **kwargs):  # the trainer's own line names the phase and flags
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(vllm_omni.Omni, "__init__", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        omni_rollout.OmniRollout(lora_pipe, str(tiny_model_dir), "cpu", dtype=torch.float32)


def test_importing_the_engine_module_imports_no_model_library():
    libraries = "{'vllm', 'vllm_omni', 'diffusers', 'peft'}"
    modules = "{m.split('.')[0] for m in sys.modules}"
    code = f"import omni_rollout, sys; print(*{modules} & {libraries})"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            check=True)
    assert result.stdout.split() == []
