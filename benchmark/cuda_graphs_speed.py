"""The passes without gradient eager and from CUDA graphs (cuda_graphs.GraphedPasses, the trainers'
--cuda-graphs), in one process on one model: the same rollout (with the sampling adapter) and base
pass, bitwise, and the host's CPU seconds and the wall seconds of each.

    python benchmark/cuda_graphs_speed.py --model ~/.cache/crd/ocr-proxy --resolution 128 \\
        --max-sequence-length 32 --out cuda_graphs_proxy.json     # the OCR proxy's rollout

Each figure is the median over --repeats after one untimed call (which records the graphs).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lora_adapters  # noqa: E402
import rollout  # noqa: E402
import sd3  # noqa: E402
from cuda_graphs import GraphedPasses  # noqa: E402


def timed(fn, repeats):
    """fn's last result (with graphs: a replay), and the median wall and process-CPU seconds of
    `repeats` calls after one."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        out = fn()
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
    return out, statistics.median(wall), statistics.median(cpu)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny",
                        help="local diffusers folder, tiny or random-sd3.5-medium")
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--max-sequence-length", type=int, default=32)
    parser.add_argument("--images", type=int, default=48, help="a rollout's images (8 prompts x 6)")
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    pipe = sd3.load_pipeline(args.model, "cuda", torch.bfloat16, resolution=args.resolution)
    transformer = pipe.transformer
    lora_adapters.add_lora_adapters(transformer, 32, 64)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lora_adapters.lora_parameters(transformer, "sampling"):
            p.copy_(0.02 * torch.randn(p.shape, generator=generator))
    prompts = [f'the code "{i % 8:04d}"' for i in range(args.images)]
    embeds, pooled = sd3.encode_prompts(pipe, prompts, args.max_sequence_length)
    shape = rollout.latent_shape(pipe, args.resolution, args.resolution)
    noisy = torch.randn((args.images, *shape), generator=generator).cuda()
    timesteps = torch.linspace(999.0, 100.0, args.images).cuda()

    autocast = torch.autocast("cuda", torch.bfloat16)

    def rollout_pass():
        with lora_adapters.use_adapter(transformer, "sampling"), autocast:
            return rollout.sample(pipe, embeds, pooled, list(range(args.images)), args.num_steps,
                                  1.0, args.resolution, args.resolution, max_batch_size=512)

    @torch.no_grad()
    def base_pass():
        with lora_adapters.use_adapter(transformer, None), autocast:
            return rollout.predict_velocity(transformer, noisy, timesteps, embeds, pooled)

    results = {"model": args.model, "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "images": args.images, "resolution": args.resolution,
               "num_steps": args.num_steps, "repeats": args.repeats}
    outputs = {}
    for mode in ("eager", "graphs"):
        if mode == "graphs":
            graphed = GraphedPasses.install(transformer)
        sample, sample_wall, sample_cpu = timed(rollout_pass, args.repeats)
        velocity, base_wall, base_cpu = timed(base_pass, args.repeats)
        outputs[mode] = (sample["latents"], sample["images"], velocity)
        results[mode] = {"rollout_wall_s": sample_wall, "rollout_cpu_s": sample_cpu,
                         "base_pass_wall_s": base_wall, "base_pass_cpu_s": base_cpu}
    results["graphs_recorded"] = sum(entry is not None for entry in graphed.graphs.values())
    (latents_a, images_a, velocity_a), (latents_b, images_b, velocity_b) = outputs.values()
    results["same_latents"] = torch.equal(latents_a, latents_b)
    results["same_images"] = bool((images_a == images_b).all())
    results["same_base_velocity"] = torch.equal(velocity_a, velocity_b)
    results["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
