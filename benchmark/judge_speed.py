"""What a PickScore judge adds to a validation (issue 34 point 6): judges.PickScoreScorer on a
randomly initialised CLIP-H/14 of PickScore_v1's architecture, scoring one validation's images.

    python benchmark/judge_speed.py --out judge_speed.json              # full size, CUDA, 32 images
    python benchmark/judge_speed.py --tiny --device cpu --out tiny.json  # CPU smoke check

The model: transformers' CLIPModel with the config of yuvalkirstain/PickScore_v1 (ViT-H/14 vision
tower 1280 wide, 32 layers; text tower 1024 wide, 24 layers; projection 1024), built from that
config with random weights (nothing is downloaded), saved, and loaded by PickScoreScorer as the
trainers load the real one. Its processor is judges.py's: CLIPImageProcessorPil (short side to 224
bicubic, centre crop 224, CLIP's mean and std) and a CLIP tokenizer cut at 77 tokens; the
tokenizer here is byte level without merges (a token a character), so prompts are as long as or
longer than CLIP's BPE makes them: an upper bound on the text tower's share.
The images: --num-images of --size pixels (the trainers' defaults: --eval-prompts 32 at
--resolution 512), each with its prompt's target drawn on it, the prompts those of --eval-data in
turn. For each --dtypes entry (float32: as PickScoreScorer loads it today; bfloat16: the model cast
after loading) a warm-up call, then --repeats timed calls of the scorer on all images (--batch-size
images a forward, the trainers' 32), their median and each; the CPU preprocessing apart; the peak
memory of the calls and the weights' memory. JSON to --out.
"""

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data import load_prompts  # noqa: E402
from judges import PickScoreScorer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# yuvalkirstain/PickScore_v1's config.json (laion/CLIP-ViT-H-14-laion2B-s32B-b79K's architecture)
PICKSCORE_V1 = dict(
    text=dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
              num_attention_heads=16, max_position_embeddings=77, hidden_act="gelu"),
    vision=dict(image_size=224, patch_size=14, hidden_size=1280, intermediate_size=5120,
                num_hidden_layers=32, num_attention_heads=16, hidden_act="gelu"),
    projection_dim=1024)
TINY = dict(  # tests/tiny_models.build_tiny_clip's sizes: CPU checks of this script
    text=dict(vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, max_position_embeddings=77),
    vision=dict(image_size=224, patch_size=32, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=2),
    projection_dim=16)
LOGIT_SCALE = 4.6052  # log(100), near PickScore's trained scale


def build_random_clip(out_dir: Path, spec: dict, device: torch.device) -> int:
    """Save a random CLIPModel of `spec` with a byte-level CLIP tokenizer and CLIP's image processor
    to out_dir, as PickScoreScorer loads a model folder; returns its parameter count."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[])
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config = CLIPConfig(text_config={**spec["text"], **ids}, vision_config=spec["vision"],
                        projection_dim=spec["projection_dim"], logit_scale_init_value=LOGIT_SCALE)
    torch.manual_seed(0)
    with device:  # random init on the device: minutes fewer than a CPU's for CLIP-H
        model = CLIPModel(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    CLIPImageProcessorPil().save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def validation_images(records: list[dict], size: int) -> list[Image.Image]:
    """One image per record, its target drawn on a light background (what a validation renders)."""
    images = []
    for record in records:
        image = Image.new("RGB", (size, size), (245, 240, 225))
        text = record["target"] or record["prompt"][:40]
        ImageDraw.Draw(image).text((size // 8, size // 2), text, fill=(20, 20, 60))
        images.append(image)
    return images


def peak_memory_gib(device: torch.device) -> float:
    """The peak allocated on a GPU since the last reset; on the CPU, the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def measure(scorer, images, prompts, device, repeats: int, label: str = "") -> dict:
    """Warm-up, then `repeats` timed calls of the scorer; the preprocessing alone; memory. A
    progress line (prefixed `label`) before the warm-up and after each timed call, outside its
    timing: at full size on a CPU a call takes minutes."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    print(f"{label}: warm-up call on {len(images)} images", flush=True)
    scores = scorer(images, prompts)[0]  # warm-up: kernels picked, allocator filled
    seconds = []
    for call in range(1, repeats + 1):
        sync()
        started = time.perf_counter()
        scorer(images, prompts)  # its scores are copied to the CPU: the call ends synchronised
        seconds.append(time.perf_counter() - started)
        print(f"{label}: timed call {call}/{repeats}: {seconds[-1]:.3f} s", flush=True)
    started = time.perf_counter()
    for chunk_images, chunk_prompts in scorer.clip.chunks(images, prompts):
        scorer.clip.pixel_values(chunk_images)
        scorer.clip.tokens(chunk_prompts)
    sync()
    preprocess = time.perf_counter() - started
    median = statistics.median(seconds)
    result = {"median_s": median, "seconds": seconds, "per_image_ms": 1000 * median / len(images),
              "preprocess_s": preprocess, "peak_mem_gib": peak_memory_gib(device),
              "finite_scores": bool(np.isfinite(scores).all())}
    if device.type == "cuda":
        result["weights_gib"] = weights
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file written")
    parser.add_argument("--tiny", action="store_true",
                        help="tests/tiny_models.build_tiny_clip's sizes, not PickScore_v1's (CPU checks)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-images", type=int, default=32,
                        help="images of one validation (the trainers' --eval-prompts, 32)")
    parser.add_argument("--size", type=int, default=512, help="image side (--resolution, 512)")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="images per forward (make_judge's default, the trainers' judges')")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls after the warm-up")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"],
                        help="float32: as PickScoreScorer loads the model; bfloat16: cast after")
    parser.add_argument("--eval-data", default=str(ROOT / "tests" / "data" / "ocr" / "test.txt"),
                        help="prompts, taken in turn")
    args = parser.parse_args(argv)
    for flag in ("num_images", "size", "batch_size", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    device = torch.device(args.device)
    records = load_prompts(args.eval_data)[0]
    records = [records[i % len(records)] for i in range(args.num_images)]
    prompts = [record["prompt"] for record in records]
    images = validation_images(records, args.size)
    spec = TINY if args.tiny else PICKSCORE_V1
    with tempfile.TemporaryDirectory() as model_dir:
        size = "tiny" if args.tiny else "PickScore_v1-sized (minutes on a CPU)"
        print(f"building a random {size} CLIP on {device} and saving it", flush=True)
        params = build_random_clip(Path(model_dir), spec, device)
        print(f"built {params:,} parameters; loading them as PickScoreScorer does", flush=True)
        started = time.perf_counter()
        scorer = PickScoreScorer(model_dir, model_dir, str(device), args.batch_size)
        load_s = time.perf_counter() - started
    results = {}
    for dtype in args.dtypes:
        scorer.clip.model.to(getattr(torch, dtype))
        results[dtype] = measure(scorer, images, prompts, device, args.repeats, dtype)
        print(f"{dtype}: {results[dtype]['median_s']:.3f} s for {len(images)} images "
              f"({results[dtype]['per_image_ms']:.1f} ms each), peak "
              f"{results[dtype]['peak_mem_gib']:.2f} GiB", flush=True)
    report = {"model": "tiny" if args.tiny else "PickScore_v1 architecture, random weights",
              "parameters": params, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "images": len(images), "size": args.size,
              "batch_size": args.batch_size, "repeats": args.repeats, "load_s": load_s,
              "config": spec, "dtypes": results}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
