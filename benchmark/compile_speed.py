"""Compile time of SD3.5-M's three block kinds as the trainers compile them, for each way of compiling the blocks
(benchmark/startup.py's VARIANTS, rollout.compile_blocks' `dynamic`): the cold start's compile work without the rest of
a trainer, so that variants compare in seconds rather than in whole runs.

    python benchmark/compile_speed.py --out compile_speed.json                  # every variant, on the GPU if any
    python benchmark/compile_speed.py --resolution 256 --train-rows 4 --rollout-rows 4 --out cpu.json   # a CPU look
    python benchmark/compile_speed.py --passes rollout cfg --steady-rows 16 24 48   # no-grad kernels' speed, compiled

Each variant runs in a process of its own with new, empty inductor and Triton caches, on one block of each kind (dual
attention, plain, last) at SD3.5-M's width with random weights and the trainers' LoRA adapters (CUDA: bf16 under
autocast, as the trainers; CPU: float32), in the order a first iteration meets them:
    rollout   no-grad forward of the sampling adapter, --rollout-rows rows
    cfg       the same at twice the rows (a validation's guided batch)
    base      no-grad forward with the adapters off (the KL anchor's base model)
    policy    forward and backward of the policy adapter, --train-rows rows
    policy_again, rollout_other   the policy pass again (the steady state) and the rollout pass at one row less
For each: seconds and the graphs compiled so far; and torch.compile's own seconds per phase (torch._dynamo.utils).
--passes picks some of them; --steady-rows then times the compiled sampling pass at those batch sizes (median of 20,
after one call that tunes the kernels for that size), so that the variants' kernels compare in the steady state too.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import precompile  # noqa: E402
import rollout  # noqa: E402
from benchmark.startup import VARIANTS  # noqa: E402

TEXT_TOKENS = 77 + 256  # CLIP's and T5's, as the trainers encode prompts


PASSES = ("rollout", "cfg", "base", "policy", "policy_again", "rollout_other")


def child(variant: str, resolution: int, train_rows: int, rollout_rows: int, names: list[str],
          steady_rows: list[int]) -> dict:
    from diffusers import SD3Transformer2DModel
    from torch._dynamo.utils import compilation_time_metrics, counters

    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    config = precompile.smallest_config(precompile.model_configs(rollout.RANDOM_MEDIUM)[0])  # one block of each kind
    transformer = SD3Transformer2DModel.from_config(config).to(device, dtype).eval()
    rollout.add_lora_adapters(transformer)
    rollout.compile_blocks(transformer, dynamic=VARIANTS[variant])
    autocast = torch.autocast("cuda", torch.bfloat16) if cuda else nullcontext()
    side = resolution // 8

    def run(adapter, rows, grad):
        latents = torch.randn(rows, 16, side, side, device=device, dtype=dtype)  # (B, C, h, w)
        embeds = torch.randn(rows, TEXT_TOKENS, 4096, device=device, dtype=dtype)
        pooled = torch.randn(rows, 2048, device=device, dtype=dtype)
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        with rollout.use_adapter(transformer, adapter), torch.set_grad_enabled(grad), autocast:
            velocity = rollout.predict_velocity(transformer, latents, 700.0, embeds, pooled)
            if grad:
                velocity.float().square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        return {"s": time.perf_counter() - started, "graphs": counters["stats"]["unique_graphs"]}

    passes = {"rollout": ("sampling", rollout_rows, False), "cfg": ("sampling", 2 * rollout_rows, False),
              "base": (None, rollout_rows, False), "policy": ("policy", train_rows, True),
              "policy_again": ("policy", train_rows, True), "rollout_other": ("sampling", rollout_rows - 1, False)}
    result = {}
    for name in names:
        measured = run(*passes[name])
        result[name] = {**measured, "s": round(measured["s"], 2)}
    if steady_rows:
        result["steady_ms"] = {}
        for rows in steady_rows:
            run("sampling", rows, False)
            seconds = statistics.median(run("sampling", rows, False)["s"] for _ in range(20))
            result["steady_ms"][rows] = round(1000 * seconds, 3)
        result["graphs_after_steady"] = counters["stats"]["unique_graphs"]
    result["compile_s"] = {phase: round(sum(seconds), 2) for phase, seconds in compilation_time_metrics.items()
                           if sum(seconds) >= 0.5}
    return result


def measure(variant: str, cli: argparse.Namespace, report: dict) -> None:
    """One variant in a fresh process with empty caches; then the whole report is written again, atomically."""
    with tempfile.TemporaryDirectory() as caches:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor", "TRITON_CACHE_DIR": f"{caches}/triton"}
        cmd = [sys.executable, __file__, "--child", variant, "--resolution", str(cli.resolution),
               "--train-rows", str(cli.train_rows), "--rollout-rows", str(cli.rollout_rows),
               "--passes", *cli.passes, "--steady-rows", *map(str, cli.steady_rows)]
        started = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        report[variant] = {"returncode": done.returncode, "stderr_tail": done.stderr[-3000:]}
    else:
        measured = json.loads(done.stdout.splitlines()[-1])
        report[variant] = {"process_s": round(time.perf_counter() - started, 1), **measured}
    print(variant, json.dumps({k: v for k, v in report[variant].items() if k != "compile_s"}), flush=True)
    partial = cli.out.with_name(cli.out.name + ".partial")
    partial.write_text(json.dumps(report, indent=1))
    partial.replace(cli.out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--resolution", type=int, default=512, help="image side in pixels (multiple of 16)")
    parser.add_argument("--train-rows", type=int, default=18, help="rows of the policy pass (the trainers': 6 x 3)")
    parser.add_argument("--rollout-rows", type=int, default=24, help="rows of a no-grad pass (the recipe's rollout)")
    parser.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES, help="in this order")
    parser.add_argument("--steady-rows", nargs="*", type=int, default=[],
                        help="batch sizes at which to time the compiled sampling pass afterwards")
    parser.add_argument("--out", type=Path, default=Path("compile_speed.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.resolution <= 0 or cli.resolution % 16:
        parser.error(f"--resolution {cli.resolution}: must be a positive multiple of 16")
    if cli.train_rows < 1 or cli.rollout_rows < 3:  # rollout_other's batch of one less would be 1: its own graph
        parser.error("--train-rows must be at least 1 and --rollout-rows at least 3")
    if any(rows < 2 for rows in cli.steady_rows):  # a batch of 1 is a graph of its own
        parser.error(f"--steady-rows {' '.join(map(str, cli.steady_rows))}: each must be at least 2")
    sizes = (cli.resolution, cli.train_rows, cli.rollout_rows, cli.passes, cli.steady_rows)
    if cli.child:
        print(json.dumps(child(cli.child, *sizes)))
        return
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = {"device": device, "torch": torch.__version__, "resolution": cli.resolution, "train_rows": cli.train_rows,
              "rollout_rows": cli.rollout_rows, "passes": cli.passes, "steady_rows": cli.steady_rows}
    try:
        for variant in cli.variants:
            measure(variant, cli, report)
    except KeyboardInterrupt:
        sys.exit(f"compile_speed.py: interrupted; {cli.out} holds the variants that finished")


if __name__ == "__main__":
    main()
