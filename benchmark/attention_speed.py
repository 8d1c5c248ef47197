"""Where a transformer forward's time goes beyond its matmuls: the attention kernel and the LoRA adapter.

    python benchmark/attention_speed.py --out benchmark/results/attention_speed_h200.json     # one H200, ~4 minutes

1. scaled_dot_product_attention alone at SD3.5-M's shapes (24 heads of 64; 1357 joint tokens at 512², and the 1024
   image tokens of the first 13 blocks' extra self-attention), forward at 24 rows and forward + backward at 18 rows
   (the rollout and policy batches), with each SDPA backend torch offers and with its default choice; the output's
   difference from a float32 reference shows they compute the same thing.
2. One forward of the random full-size transformer at 24 rows, compiled like crd.py (rollout.compile_blocks): base
   model against a rank-32 LoRA adapter, and the SDPA backend that was fastest in 1 against the default.
"""

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lora_adapters  # noqa: E402
import rollout  # noqa: E402
import sd3  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def cuda_seconds(fn, repeats=10):
    """Median seconds of fn() over `repeats` runs after two warm-ups."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_table():
    rows = []
    for tokens in (1357, 1024):
        for batch, backward in ((24, False), (18, True)):
            q, k, v = (torch.randn(batch, 24, tokens, 64, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
                       for _ in range(3))
            reference = F.scaled_dot_product_attention(q[:2].double(), k[:2].double(), v[:2].double())
            flops = 4 * batch * 24 * tokens**2 * 64 * (3.5 if backward else 1.0)  # backward: 2.5x the forward
            for name, backend in [("default", None), *BACKENDS.items()]:
                def context():
                    return sdpa_kernel(backend) if backend else nullcontext()

                def run():
                    with context():
                        out = F.scaled_dot_product_attention(q, k, v)
                        if backward:
                            out.backward(torch.ones_like(out))

                try:
                    seconds = cuda_seconds(run)
                    with context(), torch.no_grad():
                        error = (F.scaled_dot_product_attention(q[:2], k[:2], v[:2]).double() - reference).abs().max()
                except RuntimeError as e:  # a backend that does not take these shapes
                    rows.append(dict(tokens=tokens, batch=batch, backward=backward, backend=name, error=str(e)[:120]))
                    continue
                rows.append(dict(tokens=tokens, batch=batch, backward=backward, backend=name, ms=seconds * 1e3,
                                 tflops=flops / seconds / 1e12, max_abs_diff_vs_fp64=float(error)))
                print(rows[-1], flush=True)
    return rows


def lora_transformer():
    """The random SD3.5-M transformer in bfloat16 on the GPU, frozen, with crd.py's rank-32
    adapters, the sampling one nonzero as a trained adapter is."""
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        transformer = sd3.random_transformer(sd3.MEDIUM_CONFIG).eval().requires_grad_(False)
    torch.set_default_dtype(torch.float32)
    lora_adapters.add_lora_adapters(transformer, 32, 64)
    for p in lora_adapters.lora_parameters(transformer, "sampling"):
        p.data.normal_(0, 1e-3)
    return transformer


def transformer_forwards(fastest):
    transformer = lora_transformer()
    rollout.compile_blocks(transformer)
    x = torch.randn(24, 16, 64, 64, device="cuda")
    embeds, pooled = torch.randn(24, 333, 4096, device="cuda"), torch.randn(24, 2048, device="cuda")
    t = torch.full((24,), 500.0, device="cuda")
    results, outputs = {}, {}
    for backend in ["default", fastest] if fastest != "default" else ["default"]:
        torch._dynamo.reset()  # the backend is chosen when a graph is traced
        for adapter in (None, "sampling"):
            def forward():
                with torch.no_grad(), torch.autocast("cuda", torch.bfloat16), lora_adapters.use_adapter(transformer, adapter), \
                        (sdpa_kernel(BACKENDS[backend]) if backend in BACKENDS else nullcontext()):
                    return rollout.predict_velocity(transformer, x, t, embeds, pooled)

            started = time.perf_counter()
            outputs[backend, adapter] = forward().float()
            compile_s = time.perf_counter() - started
            key = f"{backend}/{adapter or 'base'}"
            results[key] = dict(ms=cuda_seconds(forward) * 1e3, first_call_s=compile_s)
            print(key, results[key], flush=True)
    if len(results) > 2:
        a, b = outputs["default", "sampling"], outputs[fastest, "sampling"]
        results["relative_l2_diff_default_vs_fastest"] = float((a - b).norm() / a.norm())
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="also write the results here as JSON")
    args = parser.parse_args()
    attention = attention_table()
    by_backend = {}
    for row in attention:
        if "ms" in row and row["backend"] != "default":
            by_backend[row["backend"]] = by_backend.get(row["backend"], 0.0) + row["ms"]
    fastest = min(by_backend, key=by_backend.get)
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, attention=attention,
               attention_total_ms_by_backend=by_backend, fastest=fastest, transformer=transformer_forwards(fastest))
    print(json.dumps(out["transformer"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
