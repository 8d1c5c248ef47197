"""Speed of the in-process OCR scorer (ocr_reward.QwenVLScorer) at the recipe's batch: 24 images of 512x512, 32 new tokens.

    python benchmark/reward_speed.py --out reward_speed.json             # random Qwen2.5-VL-3B-sized scorer, CUDA
    python benchmark/reward_speed.py --overlap --out reward_speed.json   # also beside SD3.5-M's no-grad forwards
    python benchmark/reward_speed.py --model DIR --device cpu --size 112 --overlap --sd-model tiny   # CPU smoke check

For each KV cache of generate() ("dynamic": transformers' default; "static": a fixed-size cache, with which generate()
compiles its one-token decode steps on CUDA): the median seconds of a scorer call after one warm-up (the warm-up
includes compiling), split into preprocessing on the CPU (image processor, tokenizer), the vision tower, vision +
prefill (one new token) and the decode steps (the rest); how many transcriptions equal the dynamic cache's, and
generate()'s logits against a plain forward over the sequences it generated (teacher forcing).
--overlap: the scorer (last cache setting; on its own high-priority stream) in a worker thread while the main thread runs
SD3.5-M's compiled CFG-guided base passes of one iteration (216 rows: crd.py's reference velocities), against each alone.
All scorer calls run in one worker thread, as in crd.py (CUDA graphs recorded in one thread replay in that thread).
The scorer itself keeps the dynamic cache: in crd.py the static cache's first call records its CUDA graphs while the
trainer's passes run, and the capture fails ("operation not permitted when stream is capturing").
"""

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rollout  # noqa: E402
from benchmark.sample_speed import median_seconds  # noqa: E402
from ocr_reward import RANDOM_QWEN, make_scorer  # noqa: E402

CACHES = ("dynamic", "static")


def text_images(n: int, size: int) -> np.ndarray:
    """(n, size, size, 3) uint8 images, each with a line of text (what the scorer reads in the recipe)."""
    images = []
    for i in range(n):
        image = Image.new("RGB", (size, size), (245, 240, 225))
        ImageDraw.Draw(image).text((size // 8, size // 2), f'benchmark "{i}"', fill=(20, 20, 60))
        images.append(np.asarray(image))
    return np.stack(images)


def breakdown(scorer, images, targets, worker, sync, repeats) -> tuple[dict, list[str]]:
    """Seconds of a scorer call and of its parts; the transcriptions."""
    pil = [Image.fromarray(image) for image in images]

    def vision():
        inputs = scorer.model_inputs(pil)
        with torch.inference_mode():
            scorer.model.get_image_features(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])

    started = time.perf_counter()
    texts = worker(lambda: scorer(images, targets))[1]
    sync()
    out = {"warmup_s": time.perf_counter() - started}
    out["call_s"] = median_seconds(lambda: worker(lambda: scorer(images, targets)), sync, repeats)
    out["preprocess_s"] = median_seconds(lambda: scorer.model_inputs(pil), sync, repeats)
    out["vision_s"] = median_seconds(lambda: worker(vision), sync, repeats) - out["preprocess_s"]
    new_tokens, scorer.max_new_tokens = scorer.max_new_tokens, 1
    out["prefill_call_s"] = median_seconds(lambda: worker(lambda: scorer(images, targets)), sync, repeats)
    scorer.max_new_tokens = new_tokens
    out["decode_s"] = out["call_s"] - out["prefill_call_s"]
    return out, texts


def teacher_forced(scorer, images) -> dict:
    """generate()'s logits at each new token against one plain forward over the generated sequences.

    Whatever the cache does, the logits of step k must be the plain forward's at position k: a check that holds even
    where greedy decoding of random weights flips between near-tied tokens.
    """
    inputs = scorer.model_inputs([Image.fromarray(image) for image in images])
    with torch.inference_mode():
        out = scorer.model.generate(**inputs, do_sample=False, max_new_tokens=scorer.max_new_tokens, output_logits=True,
                                    return_dict_in_generate=True, pad_token_id=scorer.tokenizer.pad_token_id)
        prompt, new = inputs["input_ids"].shape[1], len(out.logits)
        pad = lambda x, value: torch.nn.functional.pad(x, (0, new), value=value)  # noqa: E731
        full = {**inputs, "input_ids": out.sequences, "attention_mask": pad(inputs["attention_mask"], 1),
                "mm_token_type_ids": pad(inputs["mm_token_type_ids"], 0)}
        plain = scorer.model(**full).logits[:, prompt - 1 : -1].float()  # (B, new, vocab)
    generated = torch.stack(out.logits, 1).float()  # (B, new, vocab)
    return {"max_abs_diff_over_std": float((generated - plain).abs().max() / plain.std()),
            "mean_abs_diff_over_std": float((generated - plain).abs().mean() / plain.std()),
            "argmax_agreement": float((generated.argmax(-1) == plain.argmax(-1)).float().mean())}


def overlap(scorer, images, targets, worker, args, device, sync) -> dict:
    """The scorer beside (and without) one iteration's CFG-guided base passes of SD3.5-M with compiled blocks."""
    cuda = device.type == "cuda"
    pipe = rollout.load_pipeline(args.sd_model, device, torch.bfloat16 if cuda else torch.float32)
    transformer = pipe.transformer
    rollout.add_lora_adapters(transformer, 32, 64)
    if cuda:
        rollout.compile_blocks(transformer)
    rows = 4 * 6 * 9  # groups x images x timesteps
    embeds, pooled = rollout.encode_prompts(pipe, [f'a sign that says "benchmark {i % 4}"' for i in range(rows)])
    negative = rollout.negative_embeddings(pipe)
    size = args.size // 8
    latents = torch.randn(rows, 16, size, size, device=device)  # (216, 16, h, w)
    timesteps = torch.linspace(900, 100, 9, device=device).repeat_interleave(24)  # (216,)
    autocast = torch.autocast("cuda", torch.bfloat16) if cuda else nullcontext()

    def reference():
        with torch.no_grad(), autocast, rollout.use_adapter(transformer, None):
            rollout.predict_velocity(transformer, latents, timesteps, embeds, pooled, 4.5, *negative, max_batch_size=48)

    def score():
        scorer(images, targets)  # on the scorer's own stream; its transcriptions reach the CPU, so it is done

    def both():
        pending = worker(score, wait=False)
        reference()
        pending.result()

    out = {"reference_s": median_seconds(reference, sync, args.repeats),
           "scorer_s": median_seconds(lambda: worker(score), sync, args.repeats),
           "both_s": median_seconds(both, sync, args.repeats)}
    out["hidden_s"] = out["reference_s"] + out["scorer_s"] - out["both_s"]
    out["hidden_fraction_of_scorer"] = out["hidden_s"] / out["scorer_s"]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=RANDOM_QWEN, help="hub id or local dir of the scorer, or random-qwen2.5-vl-3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--size", type=int, default=512, help="image height and width")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--overlap", action="store_true", help="also time the scorer beside SD3.5-M's forwards")
    parser.add_argument("--sd-model", default=rollout.RANDOM_MEDIUM, help="for --overlap: tiny, random-sd3.5-medium, dir")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    pool = ThreadPoolExecutor(1)

    def worker(fn, wait=True):
        future = pool.submit(fn)
        return future.result() if wait else future

    images = text_images(args.images, args.size)
    targets = [f"benchmark {i}" for i in range(args.images)]
    scorer = make_scorer("qwen-vl", device=str(device), model_path=args.model, batch_size=args.images,
                         max_new_tokens=args.max_new_tokens)
    report = {"model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "images": args.images, "size": args.size, "max_new_tokens": args.max_new_tokens,
              "caches": {}}
    texts = {}
    for cache in args.caches:
        scorer.model.generation_config.cache_implementation = cache
        try:
            report["caches"][cache], texts[cache] = breakdown(scorer, images, targets, worker, sync, args.repeats)
        except Exception as error:  # noqa: BLE001 - a setting that fails is reported, the others still run
            report["caches"][cache] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            continue
        report["caches"][cache]["teacher_forced"] = worker(lambda: teacher_forced(scorer, images))
        if "dynamic" in texts:
            same = np.mean([a == b for a, b in zip(texts[cache], texts["dynamic"])])
            report["caches"][cache]["same_transcriptions_as_dynamic"] = float(same)
        print(cache, json.dumps(report["caches"][cache], indent=1), flush=True)
    if args.overlap:
        try:
            report["overlap"] = overlap(scorer, images, targets, worker, args, device, sync)
        except Exception as error:  # noqa: BLE001
            report["overlap"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        print("overlap", json.dumps(report["overlap"], indent=1), flush=True)
    if device.type == "cuda":
        report["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
