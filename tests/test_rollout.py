"""rollout.py on the tiny random SD3 (CPU, fp32): sampler vs diffusers, seeds, text encoding, LoRA adapters, loading."""

import logging
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from safetensors.torch import load_file

import lora_adapters
import precompile
import rollout
import sd3
import zygote

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ['a sign that says "hello"', 'a poster with "CRD 2026" on it']
H = W = 64
T5_TOKENS = 32  # holds the prompts here (at most 30 characters, a token each in the tiny tokenizer): faster than 256


def embed(pipe, n=2):
    """Embeddings of n images, cycling through PROMPTS."""
    return sd3.encode_prompts(pipe, [PROMPTS[i % len(PROMPTS)] for i in range(n)], T5_TOKENS)


@pytest.fixture
def lora_pipe(tiny_model_dir):
    """A fresh tiny pipe with the three adapters (rank 4, alpha 8: a LoRA scale of 2, as in the recipe)."""
    pipe = sd3.load_pipeline(str(tiny_model_dir))
    lora_adapters.add_lora_adapters(pipe.transformer, rank=4, alpha=8)
    return pipe


def perturb(transformer, name, seed=0):
    """Give adapter `name` random non-zero weights (a fresh LoRA has B = 0, i.e. it is the identity)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_adapters.lora_parameters(transformer, name):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def active_velocity(pipe):
    """v of 2 images at t = 700 with whatever adapter is active, on fixed inputs."""
    x = rollout.initial_latents([0, 1], (16, H // 8, W // 8), "cpu", torch.float32)
    return rollout.predict_velocity(pipe.transformer, x, 700.0, *embed(pipe))


def velocity(pipe, name="policy"):
    """active_velocity with adapter `name` (None: the base model)."""
    with lora_adapters.use_adapter(pipe.transformer, name):
        return active_velocity(pipe)


@contextmanager
def compiling():
    """Code inside may compile: on leaving, new graphs must have run (something did run compiled); dynamo is reset."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    try:
        yield
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    finally:
        torch._dynamo.reset()


# ---- sampler ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [1.0, 4.5])
def test_sample_matches_diffusers_pipeline(tiny_pipe, cfg):
    embeds, pooled = embed(tiny_pipe, 3)
    neg, neg_pooled = sd3.negative_embeddings(tiny_pipe, T5_TOKENS)
    seeds = [11, 12, 13]
    out = rollout.sample(tiny_pipe, embeds, pooled, seeds, num_steps=6, guidance_scale=cfg, height=H, width=W)
    latents = rollout.initial_latents(seeds, (16, H // 8, W // 8), "cpu", torch.float32)
    call = dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=neg.expand(3, -1, -1),
                negative_pooled_prompt_embeds=neg_pooled.expand(3, -1), num_inference_steps=6, guidance_scale=cfg,
                latents=latents, height=H, width=W)
    expected = tiny_pipe(**call, output_type="latent").images
    torch.testing.assert_close(out["latents"], expected, atol=1e-5, rtol=1e-5)
    images = tiny_pipe(**call, output_type="np").images  # (B, H, W, 3) floats in [0, 1]
    assert out["images"].shape == (3, H, W, 3) and out["images"].dtype == np.uint8
    assert np.abs(out["images"].astype(int) - (images * 255).round().astype(int)).max() <= 1
    assert out["timesteps"].shape == (6,) and out["sigmas"].shape == (7,) and out["timesteps"].dtype == torch.float32
    torch.testing.assert_close(out["timesteps"], tiny_pipe.scheduler.timesteps)


def test_sigmas_are_shifted_sd3_grid(tiny_pipe):
    out = rollout.sample(tiny_pipe, *embed(tiny_pipe, 1), [0], num_steps=10, height=H, width=W, decode=False)

    def shift(s):  # SD3's time shift, 3.0; diffusers applies it to the shifted minimum sigma once more
        return 3 * s / (1 + 2 * s)

    s = torch.linspace(1.0, shift(1 / 1000), 10, dtype=torch.float64)
    expected = torch.cat([shift(s), torch.zeros(1, dtype=torch.float64)])
    torch.testing.assert_close(out["sigmas"].double(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(out["timesteps"], 1000 * out["sigmas"][:-1])
    assert "images" not in out and out["latents"].dtype == torch.float32


def test_image_is_reproducible_alone_or_in_any_batch(tiny_pipe):
    embeds, pooled = embed(tiny_pipe, 5)
    seeds = [3, 1, 4, 1, 5]
    run = dict(num_steps=4, height=H, width=W, decode=False)
    full = rollout.sample(tiny_pipe, embeds, pooled, seeds, **run)["latents"]
    chunked = rollout.sample(tiny_pipe, embeds, pooled, seeds, max_batch_size=2, **run)["latents"]
    alone = rollout.sample(tiny_pipe, embeds[2:3], pooled[2:3], seeds[2:3], **run)["latents"]
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone[0], full[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full[1], full[3], atol=1e-5, rtol=1e-5)  # same seed, different prompts (0, 1) ...
    assert not torch.allclose(full[0], full[2])  # ... and same prompt, different seeds


def test_sample_chunks_count_rows_and_each_chunk_is_handed_over_decoded(tiny_pipe):
    """With CFG an image takes two rows: 5 images by 6 rows sample as 3 + 2 images (6 and 4 rows a call), the same
    images as in one call, and on_decoded gets each chunk's rows and images before the next chunk samples."""
    embeds, pooled = embed(tiny_pipe, 5)
    run = dict(num_steps=2, guidance_scale=4.5, height=H, width=W)
    events = []
    hook = tiny_pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: events.append(kw["hidden_states"].shape[0]), with_kwargs=True)
    try:
        chunked = rollout.sample(tiny_pipe, embeds, pooled, list(range(5)), max_batch_size=6,
                                 on_decoded=lambda rows, images: events.append((rows, images)), **run)
    finally:
        hook.remove()
    whole = rollout.sample(tiny_pipe, embeds, pooled, list(range(5)), max_batch_size=10, **run)
    assert [e for e in events if isinstance(e, int)] == [6, 6, 4, 4]
    assert [e if isinstance(e, int) else e[0] for e in events] == [6, 6, slice(0, 3), 4, 4, slice(3, 6)]
    handed_over = np.concatenate([e[1] for e in events if not isinstance(e, int)])
    np.testing.assert_array_equal(handed_over, chunked["images"])
    assert np.abs(chunked["images"].astype(int) - whole["images"]).max() <= 1  # fp32 batch-size noise at most
    torch.testing.assert_close(chunked["latents"], whole["latents"], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="decode"):
        rollout.sample(tiny_pipe, embeds, pooled, list(range(5)), decode=False, on_decoded=print, **run)


def test_initial_latents_per_seed():
    x = rollout.initial_latents([7, 8], (16, 8, 8), "cpu", torch.bfloat16)
    assert x.shape == (2, 16, 8, 8) and x.dtype == torch.bfloat16
    alone = rollout.initial_latents([8], (16, 8, 8), "cpu", torch.float32)
    torch.testing.assert_close(x[1], alone[0].bfloat16(), atol=0, rtol=0)


def test_predict_velocity_cfg_is_one_batch_of_unc_and_cond(tiny_pipe):
    transformer = tiny_pipe.transformer
    embeds, pooled = embed(tiny_pipe)
    neg, neg_pooled = sd3.negative_embeddings(tiny_pipe, T5_TOKENS)
    x = rollout.initial_latents([0, 1], (16, 8, 8), "cpu", torch.float32)
    t = torch.tensor([900.0, 300.0])
    v_cond = rollout.predict_velocity(transformer, x, t, embeds, pooled)
    v_unc = rollout.predict_velocity(transformer, x, t, neg.expand(2, -1, -1), neg_pooled.expand(2, -1))
    v = rollout.predict_velocity(transformer, x, t, embeds, pooled, 4.5, neg, neg_pooled)
    torch.testing.assert_close(v, v_unc + 4.5 * (v_cond - v_unc), atol=1e-5, rtol=1e-5)
    assert v.shape == x.shape
    with pytest.raises(ValueError, match="negative"):
        rollout.predict_velocity(transformer, x, t, embeds, pooled, 4.5)


# ---- text ------------------------------------------------------------------------------------------------------------


def test_encode_prompts_shapes_and_dedupe(tiny_pipe, monkeypatch):
    calls = []
    encode_prompt = tiny_pipe.encode_prompt

    def spy(prompt, *args, **kwargs):
        calls.append(prompt)
        return encode_prompt(prompt, *args, **kwargs)

    monkeypatch.setattr(tiny_pipe, "encode_prompt", spy)
    embeds, pooled = sd3.encode_prompts(tiny_pipe, ["a", "b", "a"])
    assert calls == [["a", "b"]]
    assert embeds.shape == (3, 77 + 256, 32) and pooled.shape == (3, 32)
    for i, prompt in enumerate(["a", "b", "a"]):
        alone, alone_pooled = sd3.encode_prompts(tiny_pipe, [prompt])
        torch.testing.assert_close(embeds[i : i + 1], alone, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(pooled[i : i + 1], alone_pooled, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(embeds[0], embeds[1])
    assert sd3.encode_prompts(tiny_pipe, ["a"], max_sequence_length=32)[0].shape == (1, 77 + 32, 32)


def test_expected_prompt_cuts_are_not_logged(tiny_pipe):
    """The tiny tokenizers read a character a token: this prompt passes CLIP's 77 tokens and a T5 limit of 32."""
    long_prompt = 'A hand-painted wooden signboard above a seaside bakery that reads "Fresh Bread Daily" in gold'
    notices = []
    handler = logging.Handler()
    handler.emit = lambda record: notices.append(record.getMessage())
    loggers = [logging.getLogger("diffusers"), logging.getLogger("transformers")]  # they do not propagate to the root
    for logger in loggers:
        logger.addHandler(handler)
    try:
        sd3.encode_prompts(tiny_pipe, [long_prompt * 2] * 2, max_sequence_length=32)
        assert notices == []
        tiny_pipe.encode_prompt([long_prompt * 3], None, None, do_classifier_free_guidance=False, max_sequence_length=32)
        assert any("truncated because CLIP" in n for n in notices)  # the pipeline's own notices are back afterwards
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def test_a_target_beyond_the_t5_cut_is_warned_once_with_its_file_and_line(tiny_pipe, caplog):
    records = [{"prompt": 'a sign "Hi"' + " and more" * 10, "target": "Hi", "source": "p.txt:1"},
               {"prompt": "far away" * 5 + ' a sign "Late"', "target": "Late", "source": "p.txt:2"},
               {"prompt": "far away" * 6 + ' a sign "Later"', "target": "Later", "source": "p.txt:3"},
               {"prompt": "a sign", "target": "not in the prompt", "source": "p.jsonl:1"}]
    sd3.warn_cut_targets(records, tiny_pipe, max_sequence_length=32)
    (warning,) = caplog.records
    assert warning.levelname == "WARNING" and warning.getMessage().startswith(
        "p.txt:2: the target 'Late' lies beyond the first 32 T5 tokens of its prompt")
    assert warning.getMessage().endswith("; 2 prompt(s) like it")
    caplog.clear()
    sd3.warn_cut_targets(records, tiny_pipe, max_sequence_length=256)
    sd3.warn_cut_targets(records[3:], tiny_pipe, max_sequence_length=4)
    assert not caplog.records


def test_no_torchvision_notice_at_import():
    """transformers' notice that its image processors fall back to PIL without torchvision (as on CI) is silenced: it
    comes with the import of diffusers' SD3 pipeline, which sd3 imports where it loads or builds one."""
    result = zygote.run([sys.executable, "-c", "import sd3; from diffusers import StableDiffusion3Pipeline"],
                            cwd=ROOT, capture_output=True, text=True, check=True)
    assert "torchvision" not in result.stderr, result.stderr


def test_entry_points_import_no_model_library():
    """diffusers, transformers and peft take 4 s to import: the trainers and evaluate.py check their arguments, and
    answer --help and --dry-run, without them."""
    code = "import crd, dgpo, evaluate, sys; print(*({'diffusers', 'transformers', 'peft'} & set(sys.modules)))"
    result = zygote.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.split() == []


def test_negative_embeddings_cached(tiny_pipe, monkeypatch):
    first = sd3.negative_embeddings(tiny_pipe, 64)
    monkeypatch.setattr(sd3, "encode_prompts", lambda *a, **k: pytest.fail("negative prompt encoded twice"))
    second = sd3.negative_embeddings(tiny_pipe, 64)
    assert first[0] is second[0] and first[0].shape == (1, 77 + 64, 32) and first[1].shape == (1, 32)


# ---- LoRA adapters ---------------------------------------------------------------------------------------------------


def test_adapters_layout_and_trainability(lora_pipe):
    transformer = lora_pipe.transformer
    blocks = transformer.config.num_layers
    for name in ["policy", "old", "sampling"]:
        params = lora_adapters.lora_parameters(transformer, name)
        assert len(params) == 2 * (8 * blocks - 1)  # A and B; the last block has no to_add_out (context_pre_only)
        assert all(p.dtype == torch.float32 for p in params)
    names = [n for n, p in transformer.named_parameters() if p.requires_grad]
    assert names and all(".policy." in n for n in names)
    trainable = {id(p) for p in transformer.parameters() if p.requires_grad}
    assert {id(p) for p in lora_adapters.lora_parameters(transformer)} == trainable
    lora_modules = [n for n, _ in transformer.named_modules() if n.endswith("lora_A")]
    assert lora_modules and not any("attn2" in n for n in lora_modules)  # SD3.5's dual attention is not adapted
    assert any("attn2" in n for n, _ in transformer.named_modules())
    policy = lora_adapters.lora_state_dict(transformer, "policy")
    for name in ["old", "sampling"]:
        other = lora_adapters.lora_state_dict(transformer, name)
        assert other.keys() == policy.keys()
        assert all(torch.equal(other[k], policy[k]) for k in policy)


def test_fresh_adapters_equal_base(lora_pipe, tiny_pipe):
    base = velocity(lora_pipe, None)
    torch.testing.assert_close(base, active_velocity(tiny_pipe), atol=0, rtol=0)  # the model without any LoRA
    perturb(lora_pipe.transformer, "policy")
    torch.testing.assert_close(velocity(lora_pipe, None), base, atol=0, rtol=0)
    for name in ["old", "sampling"]:
        torch.testing.assert_close(velocity(lora_pipe, name), base, atol=0, rtol=0)


def test_use_adapter_switches_outputs_not_requires_grad(lora_pipe):
    transformer = lora_pipe.transformer
    base = velocity(lora_pipe, None)
    perturb(transformer, "policy")
    grads = {n: p.requires_grad for n, p in transformer.named_parameters()}
    policy = velocity(lora_pipe, "policy")
    assert (policy - base).abs().max() > 1e-3
    torch.testing.assert_close(velocity(lora_pipe, None), base, atol=0, rtol=0)
    torch.testing.assert_close(velocity(lora_pipe, "old"), base, atol=0, rtol=0)
    torch.testing.assert_close(active_velocity(lora_pipe), policy, atol=0, rtol=0)  # policy is active by default
    with lora_adapters.use_adapter(transformer, None):
        with lora_adapters.use_adapter(transformer, "policy"):
            assert {n: p.requires_grad for n, p in transformer.named_parameters()} == grads
        torch.testing.assert_close(active_velocity(lora_pipe), base, atol=0, rtol=0)  # the outer state is back
    torch.testing.assert_close(active_velocity(lora_pipe), policy, atol=0, rtol=0)
    assert {n: p.requires_grad for n, p in transformer.named_parameters()} == grads
    with pytest.raises(ValueError, match="unknown adapter"):
        with lora_adapters.use_adapter(transformer, "polcy"):
            pass


def test_gradients_reach_only_the_policy(lora_pipe):
    transformer = lora_pipe.transformer
    perturb(transformer, "policy")
    velocity(lora_pipe, "policy").square().mean().backward()
    dead = f"transformer_blocks.{transformer.config.num_layers - 1}.attn.add_q_proj"  # the last block drops its text
    keys = lora_adapters.lora_state_dict(transformer, "policy")  # same order as lora_parameters
    for name, p in zip(keys, lora_adapters.lora_parameters(transformer, "policy")):
        assert p.grad is not None and (p.grad.abs().sum() > 0 or name.startswith(dead)), name
    assert all(p.grad is None for n, p in transformer.named_parameters() if ".policy." not in n)


@pytest.mark.long
def test_compiled_blocks_match_eager_with_one_graph_per_block_kind_and_grad_mode():
    """compile_blocks: the same velocities under every adapter, the base model and any batch size, the same policy
    gradient, also with gradient checkpointing (which recomputes the compiled blocks in the backward). SD3.5-M's blocks
    come in three kinds (dual attention, plain, last; here dual, dual, last): the adapters' no-grad passes (any batch
    size) share one graph per kind, the base model's get one more per kind, the policy's grad-mode pass one more per
    kind, the first block included, although its inputs come from eager layers (a view; no grad). use_adapter keeps
    what peft's layers branch and dynamo guards on fixed. Only the batch dimension is symbolic (the default,
    dynamic="batch"), and the same graphs serve both batch sizes."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    config = {**sd3.TINY_CONFIG["transformer"], "num_layers": 3, "dual_attention_layers": (0, 1)}
    transformer = SD3Transformer2DModel(patch_size=2, in_channels=16, out_channels=16, **config)
    lora_adapters.add_lora_adapters(transformer, rank=4, alpha=8)
    for seed, name in enumerate(("policy", "old", "sampling")):
        perturb(transformer, name, seed)
    gen = torch.Generator().manual_seed(0)
    inputs = {n: (torch.randn(n, 16, 8, 8, generator=gen), torch.randn(n, 20, 32, generator=gen),
                  torch.randn(n, 32, generator=gen)) for n in (2, 3)}
    graphs = []

    def outputs():
        out = {}
        with torch.no_grad():
            for name, n in (("sampling", 2), (None, 2), ("old", 2), ("sampling", 3), (None, 3)):
                with lora_adapters.use_adapter(transformer, name):
                    out[name, n] = rollout.predict_velocity(transformer, inputs[n][0], 500.0, *inputs[n][1:])
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        with lora_adapters.use_adapter(transformer, "policy"):
            loss = rollout.predict_velocity(transformer, inputs[3][0], 500.0, *inputs[3][1:]).square().mean()
            grads = torch.autograd.grad(loss, lora_adapters.lora_parameters(transformer, "policy"), allow_unused=True)
        out["gradient"] = torch.cat([g.flatten() for g in grads if g is not None])
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        return out

    eager = outputs()
    with compiling():
        rollout.compile_blocks(transformer)
        start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled = outputs()
        assert (graphs[-2] - start, graphs[-1] - start) == (4, 6)  # (adapters, base) x (dual, last); grad: dual, last
        transformer.enable_gradient_checkpointing()
        checkpointed = outputs()["gradient"]
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-4, atol=1e-5, msg=str(key))
    torch.testing.assert_close(checkpointed, eager["gradient"], rtol=1e-4, atol=1e-5)


def test_compile_cache_carries_compiled_kernels_to_a_fresh_process(tmp_path, monkeypatch, capsys):
    """CompileCache: a run saves what it compiled; the next process, with an empty inductor cache (another machine),
    loads it and finds its graph there instead of compiling it; a damaged file costs one line and a cold start."""
    monkeypatch.setenv("CRD_CACHE", str(tmp_path / "crd"))
    gelu = "torch.compile(lambda x: torch.nn.functional.gelu(x) * 2 + 1)(torch.ones(8, 8))"
    try:
        cache = rollout.CompileCache("tiny", torch.device("cpu"), enabled=True)
        assert cache.cold  # nothing to load: precompile's workers would compile
        eval(gelu)
        cache.save()
    finally:
        torch._dynamo.reset()
    assert not rollout.CompileCache("tiny", torch.device("cpu"), enabled=True).cold
    script = (f"import torch, rollout\ncache = rollout.CompileCache('tiny', torch.device('cpu'), enabled=True)\n{gelu}\n"
              "counts = torch._dynamo.utils.counters['inductor']\n"
              "print('graphs found, compiled:', counts['fxgraph_cache_hit'], counts['fxgraph_cache_miss'])\n")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    fresh = zygote.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert fresh.stdout.splitlines() == ["graphs found, compiled: 1 0"], fresh.stderr[-2000:]

    cache.path.write_bytes(b"not a cache")
    capsys.readouterr()
    assert rollout.CompileCache("tiny", torch.device("cpu"), enabled=True).cold
    damaged = capsys.readouterr()
    assert damaged.out.splitlines() == [f"compile cache {cache.path} not loaded (not a torch.compile cache of this "
                                        "torch version); compiling from scratch"]
    assert "Traceback" not in damaged.err

    monkeypatch.setenv("CRD_CACHE", str(cache.path))  # a file where the cache directory would be
    blocked = rollout.CompileCache("tiny", torch.device("cpu"), enabled=True)
    blocked.save()
    assert capsys.readouterr().out.splitlines() == [f"compile cache not saved to {blocked.path} (Not a directory)"]


@pytest.mark.long
def test_compiled_decoder_decodes_like_eager():
    """compile_decoder: the VAE decoder gives the eager images, for a full and a last, smaller chunk
    of decode_latents. The tiny VAE's layers on two levels, not four (one upsampler): 2/3 of the
    kernels to compile; random weights in every branch (the tiny model zeroes the residual ones)."""
    from diffusers import AutoencoderKL

    config = precompile.model_configs(sd3.TINY)[1]
    levels = ("block_out_channels", "down_block_types", "up_block_types")
    two_levels = {key: config[key][:2] for key in levels}
    torch.manual_seed(0)
    vae = AutoencoderKL.from_config({**config, **two_levels}).eval()
    chunks = [rollout.initial_latents(list(range(n)), (16, H // 8, W // 8), "cpu", torch.float32) for n in (8, 3)]

    def decode():
        with torch.no_grad():
            return [vae.decode(z, return_dict=False)[0] for z in chunks]  # (n, 3, 16, 16)

    eager = decode()
    with compiling():
        rollout.compile_decoder(vae)
        compiled = decode()
    for got, want in zip(compiled, eager):
        assert want.std() > 0.01
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# A bf16 decode of the tiny VAE compiled; the backend is eager, as inductor's CPU code generation for
# bf16 takes minutes here, and dynamo warns while it traces, before any backend runs. Then a warning
# of the same kind from elsewhere, which must still show.
QUIET_DECODER = """
import functools, sys, warnings
import torch
from diffusers import AutoencoderKL
import rollout
torch.compile = functools.partial(torch.compile, backend="eager")
vae = AutoencoderKL.from_pretrained(sys.argv[1], subfolder="vae", torch_dtype=torch.bfloat16)
rollout.compile_decoder(vae)
with torch.no_grad():
    vae.decode(torch.zeros(1, 16, 4, 4, dtype=torch.bfloat16))
assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
warnings.warn_explicit("Dynamo detected a call to a `functools.lru_cache`-wrapped function at "
                       "'elsewhere.py:3'.", UserWarning, "functions.py", 1,
                       module="torch._dynamo.variables.functions")
"""


def test_compiled_decoder_silences_only_diffusers_expected_lru_cache_warnings(tiny_model_dir):
    """diffusers' Upsample2D calls an lru_cache-wrapped version check in bf16 (upsampling.py:156
    and 180), which dynamo reports on every cold start; compile_decoder silences those two alone."""
    result = zygote.run([sys.executable, "-c", QUIET_DECODER, str(tiny_model_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    reported = re.findall(r"lru_cache`-wrapped function at '([^']*)'", result.stderr)
    assert reported == ["elsewhere.py:3"]


def test_lora_tensors_stay_float32_on_bf16_base(tiny_model_dir):
    transformer = sd3.load_pipeline(str(tiny_model_dir), dtype=torch.bfloat16).transformer
    lora_adapters.add_lora_adapters(transformer, rank=4, alpha=8)
    assert transformer.dtype == torch.bfloat16
    for name in ["policy", "old", "sampling"]:
        assert all(p.dtype == torch.float32 for p in lora_adapters.lora_parameters(transformer, name))


def test_lora_state_dict_roundtrip(lora_pipe):
    transformer = lora_pipe.transformer
    perturb(transformer, "policy")
    state = {k: v.clone() for k, v in lora_adapters.lora_state_dict(transformer, "policy").items()}
    assert all(".policy." not in k for k in state) and list(state)[0].endswith("lora_A.weight")
    sampling = lora_adapters.lora_parameters(transformer, "sampling")
    lora_adapters.load_lora_state_dict(transformer, "sampling", state)
    assert all(a is b for a, b in zip(sampling, lora_adapters.lora_parameters(transformer, "sampling")))  # in place
    torch.testing.assert_close(velocity(lora_pipe, "sampling"), velocity(lora_pipe, "policy"), atol=0, rtol=0)
    with pytest.raises(KeyError):
        lora_adapters.load_lora_state_dict(transformer, "old", dict(list(state.items())[1:]))


def test_ema_update_matches_hand_computation(lora_pipe):
    transformer = lora_pipe.transformer
    perturb(transformer, "policy", seed=1)
    perturb(transformer, "old", seed=2)
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    lora_adapters.ema_update_(transformer, "old", "policy", 0.9)
    after = transformer.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and all(".old." in k for k in changed)
    for k in changed:
        expected = 0.9 * before[k] + 0.1 * before[k.replace(".old.", ".policy.")]
        torch.testing.assert_close(after[k], expected, atol=1e-7, rtol=1e-6)
    lora_adapters.ema_update_(transformer, "sampling", "policy", 0.0)  # decay 0 is an exact copy
    assert all(torch.equal(a, b) for a, b in zip(lora_adapters.lora_parameters(transformer, "sampling"),
                                                  lora_adapters.lora_parameters(transformer, "policy")))


def test_exported_lora_loads_in_diffusers(lora_pipe, tiny_model_dir, tmp_path):
    transformer = lora_pipe.transformer
    perturb(transformer, "policy")
    perturb(transformer, "sampling", seed=5)  # must not leak into the export
    lora_adapters.export_lora(transformer, "policy", tmp_path)
    assert len(load_file(tmp_path / "pytorch_lora_weights.safetensors")) == len(lora_adapters.lora_parameters(transformer))
    fresh = StableDiffusion3Pipeline.from_pretrained(tiny_model_dir)
    fresh.load_lora_weights(tmp_path)
    embeds, pooled = embed(lora_pipe)
    x = rollout.initial_latents([0, 1], (16, 8, 8), "cpu", torch.float32)
    torch.testing.assert_close(rollout.predict_velocity(fresh.transformer, x, 700.0, embeds, pooled),
                               velocity(lora_pipe, "policy"), atol=1e-5, rtol=1e-5)
    run = dict(num_steps=4, guidance_scale=4.5, height=H, width=W, decode=False)
    with lora_adapters.use_adapter(transformer, "policy"):
        ours = rollout.sample(lora_pipe, embeds, pooled, [0, 1], **run)["latents"]
    theirs = rollout.sample(fresh, embeds, pooled, [0, 1], **run)["latents"]
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


# ---- loading ---------------------------------------------------------------------------------------------------------


def test_tiny_is_deterministic_and_cached(tmp_path, tiny_pipe, monkeypatch):
    monkeypatch.setenv("CRD_CACHE", str(tmp_path))
    pipe = sd3.load_pipeline(sd3.TINY)  # a second, independent build
    assert (tmp_path / sd3.TINY_DIR_NAME / "model_index.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == [sd3.TINY_DIR_NAME]  # no temporary build directory left behind
    for name in ["transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"]:
        ours, theirs = getattr(pipe, name).state_dict(), getattr(tiny_pipe, name).state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), name
    monkeypatch.setattr(sd3, "_build_components", lambda config: pytest.fail("tiny model rebuilt"))
    again = sd3.load_pipeline(sd3.TINY)
    assert torch.equal(next(again.transformer.parameters()), next(pipe.transformer.parameters()))
    assert not any(p.requires_grad for p in again.transformer.parameters())


def test_tiny_build_is_atomic(tmp_path, monkeypatch):
    path, save = tmp_path / "tiny-sd3", StableDiffusion3Pipeline.save_pretrained

    def interrupted(self, directory, **kwargs):
        save(self, directory, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(StableDiffusion3Pipeline, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sd3.load_pipeline(sd3.TINY, cache_dir=path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written to pick up later

    def concurrent(self, directory, **kwargs):  # another process finishes while this one is still building
        save(self, path, **kwargs)
        save(self, directory, **kwargs)

    monkeypatch.setattr(StableDiffusion3Pipeline, "save_pretrained", concurrent)
    sd3.load_pipeline(sd3.TINY, cache_dir=path)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-sd3"]


def test_an_empty_crd_cache_is_the_default_not_the_current_directory(monkeypatch):
    monkeypatch.setenv("CRD_CACHE", "")
    assert sd3.cache_root() == Path.home() / ".cache" / "crd"


def test_crd_cache_naming_a_file_is_one_line(tmp_path, monkeypatch):
    taken = tmp_path / "taken"
    taken.write_text("a file\n")
    role = re.escape("(the cache of the tiny model and the compile cache)")
    for cache, problem in ((taken, "not a directory"), (taken / "sub", "Not a directory")):
        monkeypatch.setenv("CRD_CACHE", str(cache))
        with pytest.raises(RuntimeError, match=f"^CRD_CACHE {re.escape(str(cache))}: {problem} {role}$"):
            sd3.load_pipeline(sd3.TINY)


def test_a_resolution_beyond_the_position_embedding_is_named(tiny_pipe):
    """What the trainers and evaluate.py print after loading the model, rather than diffusers' error at the first
    sample (the tiny model: 64 patches of 2 x 8 px a side)."""
    assert sd3.resolution_error(tiny_pipe, 1024) is None
    assert sd3.resolution_error(tiny_pipe, 1040) == (
        "--resolution 1040: this model generates at most 1024 px (pos_embed_max_size 64 x patch 2 x VAE 8)")


def test_random_medium_beyond_the_cpus_memory_is_one_line_not_a_killed_process(tmp_path):
    """In a subprocess: without the check, building 29.5 GiB of float32 weights gets it killed by the kernel."""
    if sd3.random_medium_memory_error(torch.float32) is None:
        pytest.skip("this machine holds SD3.5-M in float32")
    result = zygote.run([sys.executable, "crd.py", "--model", sd3.RANDOM_MEDIUM, "--device", "cpu",
                             "--reward", "brightness", "--train-data", "tests/data/ocr/train.txt",
                             "--eval-data", "tests/data/ocr/test.txt", "--output-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert re.search(r"^crd\.py: error: --model random-sd3\.5-medium: its 7\.9B random weights need 29\.5 GiB in "
                     r"float32 on the CPU, and this machine has [\d.]+ GiB available", result.stderr, re.M)


def test_random_medium_has_sd35_medium_size():
    pipe = sd3.load_pipeline(sd3.RANDOM_MEDIUM, device="meta", dtype=torch.bfloat16)

    def count(module):
        return sum(p.numel() for p in module.parameters())

    assert count(pipe.transformer) == 2_243_171_520 and round(count(pipe.transformer) / 1e7) == 224
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.transformer.device.type == "meta"
    assert 80e6 < count(pipe.vae) < 90e6
    assert count(pipe.text_encoder) == 123_650_304  # CLIP-L/14
    assert count(pipe.text_encoder_2) == 694_659_840  # OpenCLIP bigG/14
    assert count(pipe.text_encoder_3) == 4_762_310_656  # T5-XXL encoder
    assert len(pipe.tokenizer) == len(pipe.tokenizer_2) == 49408 and len(pipe.tokenizer_3) == 32128
    assert pipe.vae_scale_factor == 8 and pipe.scheduler.config.shift == 3.0


def test_missing_local_model_has_clear_error(tmp_path):
    for missing in (str(tmp_path / "no-such-model"), "./no-such-model", "~/no-such-model", "a/b/c"):
        with pytest.raises(RuntimeError, match=f"^--model {missing}: no such directory$"):
            sd3.load_pipeline(missing)
    with pytest.raises(RuntimeError, match="no model_index.json in this directory"):
        sd3.load_pipeline(str(tmp_path))
    (tmp_path / "model_index.json").write_text("{}")  # a directory that claims to be a pipeline: diffusers' error
    with pytest.raises(RuntimeError, match="could not load the SD3 model") as info:
        sd3.load_pipeline(str(tmp_path))
    assert info.value.__cause__ is not None and "hf auth login" not in str(info.value)  # a local directory


def test_dry_run_names_a_component_folder_the_model_lacks(tiny_model_dir, tmp_path):
    """A copy of the tiny pipeline without transformer/ (model_index.json lists it): --dry-run
    names that folder in one line, as the real run would, instead of accepting the directory."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    sd3.check_model_path(str(model))  # whole, it passes: null entries (image_encoder) need none
    shutil.rmtree(model / "transformer")
    data = ROOT / "tests" / "data" / "ocr"
    result = zygote.run([sys.executable, "crd.py", "--model", str(model), "--reward", "brightness",
                             "--train-data", data / "train.txt", "--eval-data", data / "test.txt",
                             "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"crd.py: error: --model {model}: no transformer/ folder: model_index.json lists it as the "
        "pipeline's SD3Transformer2DModel"]
    shutil.rmtree(model / "vae")
    with pytest.raises(RuntimeError, match=re.escape(
            f"--model {model}: no transformer/, vae/ folders: model_index.json lists them as the "
            "pipeline's SD3Transformer2DModel, AutoencoderKL")):
        sd3.load_pipeline(str(model))
    (model / "model_index.json").write_text("{")
    with pytest.raises(RuntimeError, match=f"^--model {re.escape(str(model))}: model_index.json "
                                           "cannot be read"):
        sd3.load_pipeline(str(model))


def test_a_damaged_model_file_is_named(tiny_model_dir, tmp_path):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    weights = model / "text_encoder_3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(RuntimeError, match=f"could not load the SD3 model .*: {re.escape(str(weights))}: Error while"):
        sd3.load_pipeline(str(model))
    model = shutil.copytree(tiny_model_dir, tmp_path / "model2")
    (model / "transformer" / "config.json").write_text("{")
    with pytest.raises(RuntimeError, match=re.escape(f"config file at '{model}/transformer/config.json' is not a valid")):
        sd3.load_pipeline(str(model))


def test_text_encoders_go_to_their_own_device(tiny_model_dir):
    pipe = sd3.load_pipeline(str(tiny_model_dir), "cpu", text_encoder_device="meta")  # meta: a second device here
    assert {pipe.text_encoder.device.type, pipe.text_encoder_2.device.type, pipe.text_encoder_3.device.type} == {"meta"}
    assert pipe.transformer.device.type == pipe.vae.device.type == "cpu"


def test_hub_model_offline_has_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once at import
    with pytest.raises(RuntimeError, match="hf auth login"):
        sd3.load_pipeline("crd-tests/no-such-sd3-model")


@pytest.mark.parametrize("guidance, max_batch_size, expected", [
    (1.0, None, [5]), (4.5, None, [10]), (1.0, 2, [2, 2, 1]), (4.5, 4, [4, 4, 2]), (4.5, 1, [2] * 5),
    (1.0, 4, [3, 2]), (4.5, 8, [6, 4])])
def test_predict_velocity_transformer_calls(tiny_pipe, guidance, max_batch_size, expected):
    """The rows each transformer call gets (a CFG image takes two): as few calls as the limit allows, as equal as can
    be (no small remainder call), and the same velocities as one call."""
    embeds, pooled = sd3.encode_prompts(tiny_pipe, ["a", "b", "c", "d", "e"], T5_TOKENS)
    negative = sd3.negative_embeddings(tiny_pipe, T5_TOKENS)
    latents = torch.randn(5, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    rows = []
    hook = tiny_pipe.transformer.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["hidden_states"].shape[0]),
                                                            with_kwargs=True)
    try:
        with torch.no_grad():
            chunked = rollout.predict_velocity(tiny_pipe.transformer, latents, 600.0, embeds, pooled, guidance, *negative,
                                               max_batch_size=max_batch_size)
            rows_chunked, rows[:] = list(rows), []
            whole = rollout.predict_velocity(tiny_pipe.transformer, latents, 600.0, embeds, pooled, guidance, *negative)
    finally:
        hook.remove()
    assert rows_chunked == expected and rows == [10 if guidance > 1 else 5]
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def ink_rows(image):
    """Row indices of an (H, W, 3) caption strip that hold dark (text) pixels."""
    return np.flatnonzero((image.min(2) < 128).any(1))


def test_grid_captions_wrap_to_the_image_width_and_are_never_cut():
    caption = "0.53 Über das Café an der Straße: Ärger für Jürgen"
    font = rollout.caption_font(10)
    lines = rollout.wrap_text(caption, font, 60)
    assert len(lines) >= 4 and all(font.getlength(line) <= 60 for line in lines)
    assert " ".join(lines) == caption  # broken only between words here: every word is narrower than 60 pixels
    assert rollout.wrap_text("Donaudampfschifffahrt", font, 30)[0] != "Donaudampfschifffahrt"  # a too-wide word breaks
    assert "".join(rollout.wrap_text("Donaudampfschifffahrt", font, 30)) == "Donaudampfschifffahrt"

    images = np.full((2, 64, 64, 3), 255, np.uint8)
    grid = rollout.captioned_grid(images, [caption, "0.90 ok"], columns=2)
    line_height = sum(font.getmetrics())
    assert grid.shape == (64 + len(lines) * line_height + 4, 128, 3)
    assert ink_rows(grid[64:, :64]).max() > (len(lines) - 1) * line_height  # the last line is drawn
    assert ink_rows(grid[64:, 64:]).max() < line_height + 2  # a short caption takes one line


def test_grid_captions_draw_accented_letters():
    font = rollout.caption_font(12)
    if font.getname()[0] != "DejaVu Sans":
        pytest.skip(f"{rollout.CAPTION_FONT} is not installed; Pillow's own font has only ASCII glyphs")
    images = np.full((1, 64, 64, 3), 255, np.uint8)
    boxed = rollout.captioned_grid(images, ["Caf\U000f0000"])  # a private-use code point: drawn as the font's box
    for letter in "éÄÖÜßñЖΩ":
        assert not np.array_equal(rollout.captioned_grid(images, [f"Caf{letter}"]), boxed), letter
