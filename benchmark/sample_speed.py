"""Rollout speed of rollout.sample() on the recipe's rollout batch: 4 prompts x 6 images, 512x512, 10 steps, CFG 1,
the sampling LoRA adapter (rank 32), bf16 autocast on CUDA. Also one transformer forward of the whole batch.

    python benchmark/sample_speed.py --model random-sd3.5-medium --device cuda --out benchmark/sample_speed_h200.json
    python benchmark/sample_speed.py --model tiny --device cpu --height 64 --width 64      # CPU smoke check

Reports median seconds over --repeats timed runs after one warm-up, images/s, the transformer's FLOPs (torch's
FLOP counter) and achieved TFLOP/s, and peak GPU memory.
"""

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lora_adapters  # noqa: E402
import rollout  # noqa: E402
import sd3  # noqa: E402


def median_seconds(fn, sync, repeats: int) -> float:
    """Median wall time of fn() over `repeats` runs, after one untimed warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=sd3.RANDOM_MEDIUM, help="hub id, local dir, tiny, random-sd3.5-medium")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=6, help="images per prompt")
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="rollout.compile_blocks and compile_decoder")
    parser.add_argument("--out", type=Path, default=None, help="also write the results here as JSON")
    args = parser.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    autocast = (lambda: torch.autocast("cuda", torch.bfloat16)) if cuda else nullcontext

    start = time.perf_counter()
    pipe = sd3.load_pipeline(args.model, device, torch.bfloat16 if cuda else torch.float32)
    transformer = pipe.transformer
    lora_adapters.add_lora_adapters(transformer, rank=args.lora_rank, alpha=2 * args.lora_rank)
    if args.compile:
        rollout.compile_blocks(transformer)
    sync()
    load_s = time.perf_counter() - start
    prompts = [f'a neon sign that says "benchmark {i}"' for i in range(args.num_prompts)]
    embeds, pooled = sd3.encode_prompts(pipe, [p for p in prompts for _ in range(args.group_size)])
    batch = embeds.shape[0]
    seeds = list(range(batch))
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def run_sample(decode: bool) -> dict:
        with lora_adapters.use_adapter(transformer, "sampling"), autocast():
            return rollout.sample(pipe, embeds, pooled, seeds, args.num_steps, 1.0, args.height, args.width,
                                  max_batch_size=batch, decode=decode)

    start = time.perf_counter()
    latents = run_sample(decode=False)["latents"]  # (B, 16, H/8, W/8)
    first_sample_s = time.perf_counter() - start  # with --compile, mostly compiling
    timestep = torch.full((batch,), 500.0, device=device)

    @torch.no_grad()
    def forward():
        with lora_adapters.use_adapter(transformer, "sampling"), autocast():
            rollout.predict_velocity(transformer, latents, timestep, embeds, pooled)

    def decode():
        with autocast():
            rollout.decode_latents(pipe, latents)

    encode_s = median_seconds(lambda: sd3.encode_prompts(pipe, [p for p in prompts for _ in range(args.group_size)]),
                              sync, args.repeats)
    ema_s = median_seconds(lambda: lora_adapters.ema_update_(transformer, "old", "policy", 0.5), sync, args.repeats)
    decode_eager_s = median_seconds(decode, sync, args.repeats)
    if args.compile:
        rollout.compile_decoder(pipe.vae)
    sample_s = median_seconds(lambda: run_sample(decode=True), sync, args.repeats)
    denoise_s = median_seconds(lambda: run_sample(decode=False), sync, args.repeats)
    decode_s = median_seconds(decode, sync, args.repeats)
    forward_s = median_seconds(forward, sync, args.repeats)
    with torch.compiler.set_stance("force_eager"), FlopCounterMode(display=False) as counter:  # counts eager ops
        forward()
    flops = counter.get_total_flops()  # one forward of the whole batch

    results = {
        "model": args.model, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "images": batch, "height": args.height, "width": args.width, "num_steps": args.num_steps,
        "lora_rank": args.lora_rank, "compile": args.compile, "repeats": args.repeats, "load_s": load_s,
        "first_sample_s": first_sample_s,
        "encode_s": encode_s, "ema_s": ema_s, "sample_s": sample_s, "images_per_s": batch / sample_s, "denoise_s": denoise_s, "decode_s": decode_s,
        "decode_eager_s": decode_eager_s,
        "forward_s": forward_s, "forward_tflop": flops / 1e12, "forward_tflop_per_s": flops / forward_s / 1e12,
        "denoise_tflop_per_s": args.num_steps * flops / denoise_s / 1e12,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "torch": torch.__version__,
    }
    print(f"{args.model} on {results['device']}: {batch} images {args.height}x{args.width}, {args.num_steps} steps")
    rows = [("sample (denoise + decode)", f"{sample_s:.3f} s", f"{batch / sample_s:.2f} images/s"),
            ("  denoise", f"{denoise_s:.3f} s", f"{results['denoise_tflop_per_s']:.1f} TFLOP/s"),
            ("  VAE decode", f"{decode_s:.3f} s", f"eager decoder {decode_eager_s:.3f} s"),
            ("prompt encoding", f"{encode_s * 1e3:.1f} ms", f"{args.num_prompts} distinct prompts"),
            ("EMA update of one adapter", f"{ema_s * 1e3:.2f} ms", ""),
            (f"transformer forward x{batch}", f"{forward_s * 1e3:.1f} ms",
             f"{flops / 1e12:.2f} TFLOP, {results['forward_tflop_per_s']:.1f} TFLOP/s")]
    if cuda:
        rows.append(("peak memory", f"{results['peak_mem_gib']:.1f} GiB", ""))
    for row in rows:
        print(f"  {row[0]:<28}{row[1]:>12}   {row[2]}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
