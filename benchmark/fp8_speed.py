"""Whether float8 pays for the passes without gradient: the rollout and the guided base pass.

    python benchmark/fp8_speed.py --out benchmark/results/fp8_speed_h200.json   # one H200

The random full-size SD3.5-M transformer with crd.py's three rank-32 LoRA adapters, its blocks
compiled as crd.py compiles them (rollout.compile_blocks), runs the two frozen passes of an
iteration in bfloat16, then again after torchao has turned every base linear layer (not the LoRA
ones) into float8 with dynamic activation scales, per row and per tensor:
1. the time of one rollout forward (24 images, the sampling adapter, CFG 1) and one guided base
   forward (24 images at CFG 4.5: 48 rows, no adapter), the median of 10 after two warm-ups;
2. how far float8 moves them: the relative L2 difference from bfloat16 of the velocities, and of
   the latents after a whole 10-step rollout from the same noise;
3. what it would save of an iteration, from the recipe's work in image-forwards (crd.py's
   defaults: 4 x 6 images, 10 rollout steps, 9 trained timesteps): rollout 240, guided base 432
   (two rows an image), old adapter 216, policy forward and backward 648 (a backward about twice
   a forward): float8 could speed up 672 of 1536, the passes that do not enter the log-ratio.
"""

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lora_adapters  # noqa: E402
import rollout  # noqa: E402
from benchmark.attention_speed import cuda_seconds, lora_transformer  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: E402

IMAGES = 24
GUIDANCE = 4.5
FORWARDS = {"rollout": 240, "guided_base": 432, "old": 216, "policy": 648}  # image-forwards


def relative_l2(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def to_float8(transformer, granularity):
    """torchao's float8 weights and dynamic activation scales for every base linear layer."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor
    from torchao.quantization import quantize_

    scales = {"row": PerRow(), "tensor": PerTensor()}[granularity]
    config = Float8DynamicActivationFloat8WeightConfig(  # inductor's settings stay bf16's
        granularity=scales, set_inductor_config=False)

    def base_linear(module, name):
        return isinstance(module, torch.nn.Linear) and "lora_" not in name

    quantize_(transformer, config, filter_fn=base_linear)


def passes(transformer, inputs, schedule):
    """The two frozen passes: their times, outputs and a whole rollout's final latents."""
    x, t, embeds, pooled, negative, negative_pooled = inputs

    def rollout_forward():
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16), \
                lora_adapters.use_adapter(transformer, "sampling"):
            return rollout.predict_velocity(transformer, x, t, embeds, pooled)

    def guided_forward():
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16), \
                lora_adapters.use_adapter(transformer, None):
            return rollout.predict_velocity(transformer, x, t, embeds, pooled, GUIDANCE,
                                            negative, negative_pooled)

    started = time.perf_counter()
    outputs = {"rollout": rollout_forward().float(), "guided_base": guided_forward().float()}
    first_calls_s = time.perf_counter() - started  # the compiling of both
    ms = {"rollout": cuda_seconds(rollout_forward) * 1e3,
          "guided_base": cuda_seconds(guided_forward) * 1e3}
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16), \
            lora_adapters.use_adapter(transformer, "sampling"):
        latents = rollout.euler_rollout(transformer, torch.randn(
            x.shape, generator=torch.Generator("cuda").manual_seed(0), device="cuda"),
            embeds, pooled, *schedule)
    return dict(ms=ms, first_calls_s=first_calls_s), outputs, latents


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="also write the results here")
    parser.add_argument("--granularities", nargs="+", default=["row", "tensor"],
                        choices=["row", "tensor"], help="float8 scales: per row, per tensor")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = lora_transformer()
    generator = torch.Generator("cuda").manual_seed(1)
    inputs = (torch.randn(IMAGES, 16, 64, 64, device="cuda", generator=generator),
              torch.full((IMAGES,), 700.0, device="cuda"),
              torch.randn(IMAGES, 333, 4096, device="cuda", generator=generator),
              torch.randn(IMAGES, 2048, device="cuda", generator=generator),
              torch.randn(1, 333, 4096, device="cuda", generator=generator),
              torch.randn(1, 2048, device="cuda", generator=generator))
    timesteps, sigmas = rollout.euler_schedule(FlowMatchEulerDiscreteScheduler(shift=3.0), 10)
    schedule = (timesteps.cuda(), sigmas)
    results = {}
    reference = None
    for variant in ["bf16", *args.granularities]:
        torch.cuda.reset_peak_memory_stats()
        transformer = copy.deepcopy(model)  # the model itself stays uncompiled, in bfloat16
        if variant != "bf16":
            to_float8(transformer, variant)
        torch._dynamo.reset()
        rollout.compile_blocks(transformer)
        timing, outputs, latents = passes(transformer, inputs, schedule)
        if reference is None:
            reference = outputs, latents
        else:
            timing["relative_l2_vs_bf16"] = {
                **{name: relative_l2(outputs[name], reference[0][name]) for name in outputs},
                "rollout_latents_10_steps": relative_l2(latents, reference[1])}
        timing["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        results[variant] = timing
        print(variant, json.dumps(timing), flush=True)
        del transformer
        torch.cuda.empty_cache()
    bf16_ms = results["bf16"]["ms"]
    total = sum(FORWARDS.values())
    for variant in args.granularities:
        speedup = {name: bf16_ms[name] / results[variant]["ms"][name] for name in bf16_ms}
        saved = sum(FORWARDS[name] * (1 - 1 / speedup[name]) for name in speedup) / total
        results[variant]["speedup"] = speedup
        results[variant]["iteration_work_saved"] = saved
        print(f"{variant}: rollout {speedup['rollout']:.3f}x, guided base "
              f"{speedup['guided_base']:.3f}x: {saved:.1%} of an iteration's transformer work",
              flush=True)
    import torchao

    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               torchao=torchao.__version__, images=IMAGES, guidance=GUIDANCE,
               image_forwards_per_iteration=FORWARDS, variants=results)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
