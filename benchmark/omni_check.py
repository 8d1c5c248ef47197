"""The vLLM-Omni rollout engine (--rollout-engine vllm-omni) against diffusers, on one GPU.

    PYTHONPATH=$VLLM_SITE python benchmark/omni_check.py --out /tmp/omni --time-budget-s 1500
    python benchmark/omni_check.py --out /tmp/omni --device cpu --phases smoke  # a CPU stand-in

Phases, in this order; each prints its results and duration as it ends, and --out/omni_check.json
is rewritten after each, so a killed run keeps what finished. A phase whose estimate (ESTIMATE_S)
no longer fits in --time-budget-s is skipped, as is one whose input an earlier phase did not make:
    smoke    tiny model: both engines' final latents of a few images, a non-zero sampling adapter
    weights  random SD3.5-M weights, built as --model random-sd3.5-medium builds them, saved as a
             diffusers folder (--model-dir, local disk: the engine loads files); reused if there
    zero     the trainers' rollout (4 prompts x 6 images, 512 px, 10 Euler steps, CFG 1, their
             image seeds) from both engines, the LoRA at its initial (zero) state: max and mean
             |engine - diffusers| of the final latents
    lora     a random LoRA B (--lora-b-std): the engine's latents against diffusers+peft's with
             that adapter, and how far each moved from its zero-LoRA latents (the moves' cosine)
    speed    the 24 images' rollout, decoded as the trainers decode: median seconds of --repeats
             warm runs, and peak device memory (every process: the engine runs in its own)
    train    --train-iterations of crd.py with each engine (reward brightness, no validation), in
             subprocesses: perf/rollout_s and train/reward_mean per iteration
Both engines run eager unless --compile (diffusers compiles its blocks, vLLM-Omni its transformer).
"""

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import lora_adapters  # noqa: E402
import omni_rollout  # noqa: E402
import rollout  # noqa: E402
import sd3  # noqa: E402
from benchmark.events import scalars  # noqa: E402

PHASES = ("smoke", "weights", "zero", "lora", "speed", "train")
# the least time left in which each phase is started: a ten-minute call can run train alone
ESTIMATE_S = {"smoke": 120, "weights": 120, "zero": 240, "lora": 60, "speed": 120, "train": 300}
PROMPTS = ['a neon sign that says "open late"', 'a poster with "CRD 2026" on it',
           'a storefront whose sign reads "BAKERY"', 'a chalkboard with "hello world" on it']
SEED = 42  # the trainers' default --seed: image j of iteration 0 has seed image_seed(42, 0, j)


def image_seeds(n):
    return [(SEED << 40) + j for j in range(n)]  # iteration.image_seed(SEED, 0, j)


class Check:
    """The phases' results, written to omni_check.json after each phase; the time budget."""

    def __init__(self, args):
        self.args = args
        self.start = time.perf_counter()
        self.path = args.out / "omni_check.json"
        self.results = {"args": {k: str(v) for k, v in vars(args).items()}, "versions": versions(),
                        "phases": {}}
        self.current = None
        self.write()
        # a phase that hangs past the budget: its record says so and the process ends
        self.watchdog = threading.Timer(max(self.left_s(), 0), self.out_of_time)
        self.watchdog.daemon = True
        self.watchdog.start()

    def out_of_time(self):
        if self.current is not None:
            self.results["phases"][self.current] = {"status": "stopped",
                                                    "reason": "the time budget ran out"}
        self.write()
        print(f"omni_check: the time budget ran out in phase {self.current}", flush=True)
        os._exit(124)

    def left_s(self):
        return self.args.time_budget_s - (time.perf_counter() - self.start)

    def write(self):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=2) + "\n")
        tmp.replace(self.path)

    def run(self, name, phase, *needs):
        """phase() -> dict, recorded under `name`; skipped when not asked for, when its estimate no
        longer fits, or when a phase it needs did not finish."""
        if name not in self.args.phases:
            return None
        missing = [n for n in needs if self.results["phases"].get(n, {}).get("status") != "ok"]
        if missing:
            return self.record(name, {"status": "skipped", "reason": f"needs {', '.join(missing)}"})
        if self.left_s() < ESTIMATE_S[name]:
            reason = f"{self.left_s():.0f} s of the budget left, estimate {ESTIMATE_S[name]} s"
            return self.record(name, {"status": "skipped", "reason": reason})
        print(f"== {name} ...", flush=True)
        self.current = name
        start = time.perf_counter()
        try:
            result = {"status": "ok", **phase()}
        except Exception as error:  # the next phases still run; the traceback's end is kept
            result = {"status": "failed", "error": f"{type(error).__name__}: {error}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.perf_counter() - start, 1)
        self.current = None
        return self.record(name, result)

    def record(self, name, result):
        self.results["phases"][name] = result
        self.write()
        shown = {k: v for k, v in result.items() if k != "traceback"}
        print(f"== {name}: {json.dumps(shown)}", flush=True)
        if "traceback" in result:
            print(result["traceback"], file=sys.stderr, flush=True)
        return result


def versions():
    """The installed versions, read from their metadata (importing vllm here would be slow)."""
    found = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for name in ("diffusers", "transformers", "peft", "vllm", "vllm-omni"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


class MemoryPeak:
    """Peak used memory of the whole device (every process: the engine's workers too), polled."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.peak = 0
        self.stop = threading.Event()

    def used(self):
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def __enter__(self):
        if self.cuda:
            self.idle = self.peak = self.used()
            self.thread = threading.Thread(target=self.poll, daemon=True)
            self.thread.start()
        return self

    def poll(self):
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, self.used())

    def __exit__(self, *exc):
        if self.cuda:
            self.stop.set()
            self.thread.join()
            self.peak = max(self.peak, self.used())

    @property
    def gib(self):
        return round(self.peak / 2**30, 2) if self.cuda else None

    @property
    def added_gib(self):
        """The peak over the memory in use when it began (the models both engines hold)."""
        return round((self.peak - self.idle) / 2**30, 2) if self.cuda else None


class Engines:
    """A pipeline with the trainers' adapters, the rollout batch, and a vLLM-Omni engine on it."""

    def __init__(self, args, model, device, num_prompts, group_size, resolution, max_tokens):
        self.args = args
        self.device = device
        cuda = device.type == "cuda"
        self.dtype = torch.bfloat16 if cuda else torch.float32
        self.autocast = (lambda: torch.autocast("cuda", torch.bfloat16)) if cuda else nullcontext
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        start = time.perf_counter()
        self.pipe = sd3.load_pipeline(model, device, self.dtype)
        lora_adapters.add_lora_adapters(self.pipe.transformer, args.lora_rank, 2 * args.lora_rank)
        if args.compile and cuda:
            rollout.compile_blocks(self.pipe.transformer)
            rollout.compile_decoder(self.pipe.vae)
        self.load_s = time.perf_counter() - start
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_prompts) for _ in range(group_size)]
        self.embeds, self.pooled = sd3.encode_prompts(self.pipe, prompts, max_tokens)
        self.seeds = image_seeds(len(prompts))
        self.resolution = resolution
        start = time.perf_counter()
        used = MemoryPeak(device).used() if cuda else 0
        self.omni = omni_rollout.OmniRollout(self.pipe, model, device, 1, self.dtype,
                                             enforce_eager=not args.compile)
        self.engine_start_s = time.perf_counter() - start  # its load and the adapter check
        self.engine_gib = round((MemoryPeak(device).used() - used) / 2**30, 2) if cuda else None

    def sample(self, engine, adapter="sampling", decode=False):
        run = self.omni.sample if engine == "vllm-omni" else rollout.sample
        with lora_adapters.use_adapter(self.pipe.transformer, adapter), self.autocast():
            out = run(self.pipe, self.embeds, self.pooled, self.seeds, self.args.num_steps, 1.0,
                      self.resolution, self.resolution, self.args.forward_batch_size, decode=decode)
        self.sync()
        return out

    def latents(self, engine, adapter="sampling"):
        return self.sample(engine, adapter)["latents"].float().cpu()

    def close(self):
        self.omni.close()


def differences(engine, diffusers):
    diff = (engine - diffusers).abs()
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
            "latent_abs_mean": diffusers.abs().mean().item(),
            "bitwise_equal": torch.equal(engine, diffusers),
            "finite": bool(torch.isfinite(engine).all() and torch.isfinite(diffusers).all())}


def randomise_lora_b(transformer, name, std, seed=0):
    """Adapter `name` with random B (a fresh LoRA's B is 0: the base model), its A kept."""
    generator = torch.Generator().manual_seed(seed)
    state = {k: (std * torch.randn(v.shape, generator=generator)).to(v) if ".lora_B." in k else v
             for k, v in lora_adapters.lora_state_dict(transformer, name).items()}
    lora_adapters.load_lora_state_dict(transformer, name, state)


# ---- the phases ----------------------------------------------------------------------------


def smoke(args, device):
    """Tiny model: both engines' final latents of a few images, a non-zero sampling adapter."""
    engines = Engines(args, sd3.TINY, device, 2, 2, 64, 96)
    try:
        randomise_lora_b(engines.pipe.transformer, "sampling", 0.1)
        diffusers = engines.latents("diffusers")
        engine = engines.latents("vllm-omni")
        base = engines.latents("vllm-omni", adapter=None)
        return {"images": len(engines.seeds), "engine_start_s": round(engines.engine_start_s, 1),
                **differences(engine, diffusers),
                "engine_lora_moved_mean": (engine - base).abs().mean().item()}
    finally:
        engines.close()


def build_weights(args, device):
    """Random SD3.5-M, as --model random-sd3.5-medium builds it, saved as a diffusers folder."""
    folder = args.model_dir
    if (folder / "model_index.json").exists():
        return {"model_dir": str(folder), "reused": True}
    start = time.perf_counter()
    build_device = device if device.type == "cuda" else "cpu"
    pipe = sd3.load_pipeline(sd3.RANDOM_MEDIUM, build_device, torch.bfloat16)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    tmp = folder.with_name(f".{folder.name}.partial")
    pipe.save_pretrained(tmp)
    tmp.rename(folder)
    save_s = time.perf_counter() - start
    del pipe
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"   built in {build_s:.1f} s, saved {size / 2**30:.1f} GiB to {folder} in "
          f"{save_s:.1f} s", flush=True)
    return {"model_dir": str(folder), "reused": False, "build_s": round(build_s, 1),
            "save_s": round(save_s, 1), "size_gib": round(size / 2**30, 2)}


def zero_lora(engines):
    """The trainers' rollout with the LoRA at its initial (zero) state, from both engines."""
    diffusers = engines.latents("diffusers")
    engine = engines.latents("vllm-omni")
    engines.zero = diffusers, engine
    return {"images": len(engines.seeds), "load_s": round(engines.load_s, 1),
            "engine_start_s": round(engines.engine_start_s, 1),
            "engine_device_gib": engines.engine_gib, **differences(engine, diffusers)}


def random_lora(engines, std):
    """A random LoRA B on the sampling adapter: the engine against diffusers+peft, and each's move
    from its base model (the zero-LoRA latents of the last phase)."""
    randomise_lora_b(engines.pipe.transformer, "sampling", std)
    diffusers = engines.latents("diffusers")
    engine = engines.latents("vllm-omni")
    base_diffusers, base_engine = engines.zero
    moved_d, moved_e = (diffusers - base_diffusers).flatten(), (engine - base_engine).flatten()
    cosine = torch.nn.functional.cosine_similarity(moved_d, moved_e, dim=0).item()
    return {"lora_b_std": std, **differences(engine, diffusers),
            "diffusers_moved_mean_abs": moved_d.abs().mean().item(),
            "engine_moved_mean_abs": moved_e.abs().mean().item(),
            "moves_cosine": cosine, "engine_bound": bool(moved_e.abs().max() > 0)}


def speed(engines, repeats):
    """The 24 images' rollout, decoded: median warm seconds and peak device memory per engine."""
    results = {}
    for engine in ("diffusers", "vllm-omni"):
        engines.sample(engine, decode=True)  # warm-up
        times = []
        if engines.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with MemoryPeak(engines.device) as memory:
            for _ in range(repeats):
                start = time.perf_counter()
                engines.sample(engine, decode=True)
                times.append(time.perf_counter() - start)
        median = statistics.median(times)
        results[engine] = {"median_s": round(median, 3), "times_s": [round(t, 3) for t in times],
                           "images_per_s": round(len(engines.seeds) / median, 2),
                           "device_peak_gib": memory.gib, "device_added_gib": memory.added_gib}
        if engines.device.type == "cuda":  # this process's: diffusers's all, the engine's decoding
            peak = torch.cuda.max_memory_allocated()
            results[engine]["process_peak_gib"] = round(peak / 2**30, 2)
        print(f"   {engine:<10} {median:7.3f} s  {len(engines.seeds) / median:6.2f} images/s  "
              f"device peak {memory.gib} GiB (+{memory.added_gib})", flush=True)
    times = [results[engine]["median_s"] for engine in ("diffusers", "vllm-omni")]
    results["speedup"] = round(times[0] / times[1], 3)
    return results


def train_runs(args, check):
    """--train-iterations of crd.py with each engine, in subprocesses, on the saved weights."""
    results = {}
    for engine in ("diffusers", "vllm-omni"):
        out = args.out / "train"
        cmd = [sys.executable, "crd.py", "--model", str(args.model_dir), "--reward", "brightness",
               "--eval-every", "0", "--eval-judge", "none", "--save-every", "1000",
               "--train-data", "tests/data/ocr/train.txt", "--eval-data", "tests/data/ocr/test.txt",
               "--num-iterations", str(args.train_iterations), "--device", args.device,
               "--output-dir", str(out), "--run-name", engine, "--overwrite",
               "--rollout-engine", engine, "--compile" if args.compile else "--no-compile"]
        timeout = max(check.left_s() / (2 if engine == "diffusers" else 1), 60)
        start = time.perf_counter()
        log = args.out / f"train_{engine}.log"
        with log.open("w") as stream:
            try:
                code = subprocess.run(cmd, cwd=ROOT, stdout=stream, stderr=subprocess.STDOUT,
                                      timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        run = {"exit": code, "seconds": round(time.perf_counter() - start, 1), "log": str(log)}
        logged = scalars(out / engine)
        tags = ("perf/rollout_s", "perf/iteration_s", "train/reward_mean")
        if all(tag in logged for tag in tags):
            run |= {tag: [round(value, 5) for value in logged[tag].values()] for tag in tags}
        else:  # no events: the log says why
            run["tail"] = log.read_text()[-1500:]
        results[engine] = run
        print(f"   {engine}: {json.dumps(run)}", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="omni_check.json and logs go here")
    parser.add_argument("--time-budget-s", type=float, default=1500.0,
                        help="later phases are skipped rather than run past this many seconds")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/omni_check_sd35m"),
                        help="where the random SD3.5-M folder is saved (local disk), or reused")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--max-sequence-length", type=int, default=256)
    parser.add_argument("--forward-batch-size", type=int, default=48, help="as the trainers' flag")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--lora-b-std", type=float, default=0.01, help="the lora phase's random B")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs each, after a warm-up")
    parser.add_argument("--compile", action="store_true",
                        help="compiled diffusers blocks, vLLM-Omni's transformer compiled")
    parser.add_argument("--train-iterations", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(args)
    print(f"omni_check: {json.dumps(check.results['versions'])}", flush=True)
    try:
        run_phases(args, check, torch.device(args.device))
    finally:
        check.watchdog.cancel()  # a caller that goes on (a test) is not ended at the budget
    print(f"omni_check: {check.path} ({time.perf_counter() - check.start:.0f} s)", flush=True)


def run_phases(args, check, device):
    check.run("smoke", lambda: smoke(args, device))
    check.run("weights", lambda: build_weights(args, device))
    engines = []  # the SD3.5-M pipeline and engine of the zero, lora and speed phases

    def start_engines():
        engines.append(Engines(args, str(args.model_dir), device, args.num_prompts,
                               args.group_size, args.resolution, args.max_sequence_length))
        return zero_lora(engines[0])

    try:
        check.run("zero", start_engines, "weights")
        check.run("lora", lambda: random_lora(engines[0], args.lora_b_std), "zero")
        check.run("speed", lambda: speed(engines[0], args.repeats), "zero")
    finally:
        for engine in engines:
            engine.close()
    engines.clear()  # the crd.py runs below get the memory
    if device.type == "cuda":
        torch.cuda.empty_cache()
    check.run("train", lambda: train_runs(args, check), "weights")


if __name__ == "__main__":
    main()
