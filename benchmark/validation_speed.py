"""Where crd.py's validation pass spends its time: 32 prompts, 40 steps, CFG 4.5 (64 rows a step), 512x512.

    python benchmark/validation_speed.py --out validation_speed.json                       # SD3.5-M + 3B scorer, random
    python benchmark/validation_speed.py --model tiny --scorer brightness --device cpu --resolution 64 --steps 2

Runs the steps of `validation.Validation` one at a time, with the same calls and arguments (sampling adapter, bf16
autocast, compiled blocks and VAE decoder as with crd.py's --compile): prompt encoding, the 40 CFG denoising steps
(at --forward-batch-size 48, two chunks of 16 prompts), VAE decoding, the scorer (in a worker thread, as in crd.py),
and the TensorBoard logging (caption grid of 16 images, transcriptions, written to disk). Then the whole pass as
crd.py runs it (each chunk scored while the next samples), against the sum of its parts. Also the denoising as one
call of all 64 rows, as before v7. --reward-gpu: the scorer and the text encoders on cuda:1 (run.sh's layout).
Median of --repeats after one warm-up (the warm-up compiles).
"""

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import lora_adapters  # noqa: E402
import rollout  # noqa: E402
import sd3  # noqa: E402
from benchmark.sample_speed import median_seconds  # noqa: E402
from data import load_prompts  # noqa: E402
from ocr_reward import RANDOM_QWEN, make_scorer  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=sd3.RANDOM_MEDIUM, help="hub id, local dir, tiny, random-sd3.5-medium")
    parser.add_argument("--scorer", default="qwen-vl", help="ocr_reward.make_scorer name")
    parser.add_argument("--scorer-model", default=RANDOM_QWEN)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reward-gpu", action="store_true", help="the scorer and the text encoders on cuda:1")
    parser.add_argument("--prompts", type=Path, default=ROOT / "tests" / "data" / "ocr" / "train.txt")
    parser.add_argument("--num-prompts", type=int, default=32, help="crd.py's --eval-prompts")
    parser.add_argument("--steps", type=int, default=40, help="crd.py's --eval-steps")
    parser.add_argument("--guidance", type=float, default=4.5, help="crd.py's --eval-guidance")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--forward-batch-size", type=int, default=48, help="crd.py's --forward-batch-size")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="also write the results here as JSON")
    args = parser.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    reward_device = torch.device("cuda:1") if args.reward_gpu else device
    sync = (lambda: [torch.cuda.synchronize(d) for d in {device, reward_device}]) if cuda else (lambda: None)
    autocast = (lambda: torch.autocast("cuda", torch.bfloat16)) if cuda else nullcontext
    pipe = sd3.load_pipeline(args.model, device, torch.bfloat16 if cuda else torch.float32,
                                 text_encoder_device=reward_device)
    transformer = pipe.transformer
    lora_adapters.add_lora_adapters(transformer, 32, 64)
    if args.compile and cuda:
        rollout.compile_blocks(transformer)
        rollout.compile_decoder(pipe.vae)
    scorer = make_scorer(args.scorer, device=str(reward_device), model_path=args.scorer_model, batch_size=24)
    scoring = ThreadPoolExecutor(1)
    negative = sd3.negative_embeddings(pipe)
    records = load_prompts(args.prompts)[0][: args.num_prompts]
    prompts, targets = [r["prompt"] for r in records], [r["target"] for r in records]
    seeds = list(range(len(prompts)))
    writer = SummaryWriter(tempfile.mkdtemp())

    def encode():
        return sd3.encode_prompts(pipe, prompts)

    embeds, pooled = encode()  # (N, 333, 4096), (N, 2048)

    def denoise(max_rows=args.forward_batch_size):
        with lora_adapters.use_adapter(transformer, "sampling"), autocast():
            return rollout.sample(pipe, embeds, pooled, seeds, args.steps, args.guidance, args.resolution,
                                  args.resolution, max_rows, negative_embeds=negative[0], negative_pooled=negative[1],
                                  decode=False)

    def decode():
        with autocast():
            return rollout.decode_latents(pipe, latents)

    def score():
        return scoring.submit(scorer, images, targets).result()

    def log(images, scores, texts):
        captions = [f"{s:.2f} {t}" for s, t in zip(scores, targets)]
        writer.add_image("eval/images", rollout.captioned_grid(images[:16], captions[:16]), 0, dataformats="HWC")
        writer.add_text("eval/transcriptions", "\n\n".join(f"{t} -> {x!r}" for t, x in zip(targets, texts)), 0)
        writer.flush()

    def whole_pass():  # validation.Validation (crd.py's validation), step for step
        embeds, pooled = sd3.encode_prompts(pipe, prompts)
        scored = []
        with lora_adapters.use_adapter(transformer, "sampling"), autocast():
            images = rollout.sample(
                pipe, embeds, pooled, seeds, args.steps, args.guidance, args.resolution, args.resolution,
                args.forward_batch_size, negative_embeds=negative[0], negative_pooled=negative[1],
                on_decoded=lambda rows, chunk: scored.append(scoring.submit(scorer, chunk, targets[rows])))["images"]
        chunks = [future.result() for future in scored]
        log(images, np.concatenate([chunk[0] for chunk in chunks]), [text for chunk in chunks for text in chunk[1]])

    started = time.perf_counter()
    latents = denoise()["latents"]  # (N, 16, h, w)
    sync()
    first_denoise_s = time.perf_counter() - started  # compiling, with --compile on CUDA
    images = decode()  # (N, H, W, 3) uint8
    scores, texts = score()
    results = {"model": args.model, "scorer": args.scorer + f" {args.scorer_model}" * (args.scorer == "qwen-vl"),
               "device": torch.cuda.get_device_name(device) if cuda else "cpu", "reward_gpu": args.reward_gpu,
               "prompts": len(prompts), "steps": args.steps, "guidance": args.guidance, "resolution": args.resolution,
               "compile": args.compile, "repeats": args.repeats, "first_denoise_s": first_denoise_s}
    parts = {"encode_s": encode, "denoise_s": denoise, "decode_s": decode, "score_s": score,
             "log_s": lambda: log(images, scores, texts)}
    for name, fn in parts.items():
        results[name] = median_seconds(fn, sync, args.repeats)
    results["parts_sum_s"] = sum(results[name] for name in parts)
    results["whole_s"] = median_seconds(whole_pass, sync, args.repeats)
    results["denoise_one_call_s"] = median_seconds(lambda: denoise(2 * len(prompts)), sync, args.repeats)
    results["denoise_step_s"] = results["denoise_s"] / args.steps
    results["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None  # the actor GPU
    results["torch"] = torch.__version__
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
