"""The OCR proxy benchmark in one command: pretrain (or reuse) the base model, then crd.py, dgpo.py and nft.py on it
with the PP-OCR reward at a matched budget, then learning curves, `run.sh compare` tables and validation grids.

    python benchmark/ocr_proxy/run_benchmark.py --out runs/ocr_proxy      # 3 seeds x CRD, DGPO, NFT, 225 iterations

    # the same in steps of under 10 minutes each on one H200 (pretraining ~2.5 min; each algorithm's 3 runs ~9 min)
    python benchmark/ocr_proxy/pretrain.py --out ~/.cache/crd/ocr-proxy
    python benchmark/ocr_proxy/run_benchmark.py --out runs/ocr_proxy_crd --algorithms crd
    python benchmark/ocr_proxy/run_benchmark.py --out runs/ocr_proxy_dgpo --algorithms dgpo
    bash run.sh compare runs/ocr_proxy_crd/runs/crd_seed0 runs/ocr_proxy_dgpo/runs/dgpo_seed0

The runs are dealt round-robin over the GPUs (one GPU: all share it; none: the CPU, slowly). `--variants` sweeps trainer
settings, `--kl-only-control` adds runs whose reward reads nothing (what the KL anchor teaches alone),
`--final-guidances` scores the final checkpoints at more CFG scales, `--resume` continues runs that `--time-limit-s`
stopped. The reward is PP-OCR: by default the driver serves ocr_reward.PaddleScorer's reads from a pool of
single-threaded engines to the trainers' `--reward vllm` client (the same scores, in parallel; the in-process
`--reward paddle` reads one image at a time, ~0.4-1.3 s each); `--scorer paddle` uses that instead.
Every algorithm gets the same prompts, seeds, iterations, images per iteration and optimizer steps: only the
trainer script differs. All anchor their KL term to the base without guidance (`--kl-cfg 1`; the trainers' default is the
anchors' 4.5), so that a held-out gain is the reward's, not guidance distilled into the CFG-1 policy, and CRD's
snapshot adapters never freeze (CRD_SNAPSHOTS), like DGPO's. Outputs in --out:
    data/train.jsonl, data/{test,validation}.jsonl   RL prompts: the pretraining's training words, and the held-out
                                 words the runs validate on (--eval-split)
    runs/{algo}[_{variant}]_seed{S}/   the trainers' run directories (TensorBoard events, summary.json)
    curves.png                   held-out PP-OCR (at the validation protocol) and rollout reward against iteration
    compare_[{variant}_]seed{S}.md     `bash run.sh compare` of the algorithms' runs
    grid_{run}_{first,last}_iteration{N}.png   the validation grids at the first and last validation
    benchmark.json               base scores, per-run results, the base's and each run's last checkpoint's held-out
                                 PP-OCR at every protocol (pool scorer), each with every word's score (per_prompt,
                                 in eval_words' order: compare.py's input), the seconds of
                                 each run's every iteration (iteration_s), the wall time of
                                 each phase and what the runs used of the machine (usage)

The held-out validation uses the pretraining's validation protocol (`--pretrain.validation-guidance`, default CFG 1,
and `--pretrain.validation-steps`, 40): the policy is trained to sample without guidance (CFG-1 rollouts), and
Flow-Factory's CRD example validates it so (examples/crd/lora/sd3_5/default.yaml, lines 109-110; official DGPO's
wocfg configs validate at their sampling CFG of 1 too). The trainers' own default is the
recipe's CFG 4.5, which guides such a policy a second time; the final scores include it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import tyro
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import checkpoint  # noqa: E402
import run_dirs  # noqa: E402
from benchmark.events import scalars as logged_scalars  # noqa: E402
from benchmark.ocr_proxy import pretrain  # noqa: E402
from benchmark.ocr_proxy.final_scores import final_scores  # noqa: E402
from benchmark.ocr_proxy.machine import Usage, mps_daemon  # noqa: E402
from benchmark.ocr_proxy.ocr_pool import BLIND_MODEL_NAME, MODEL_NAME, OcrPool, serve  # noqa: E402
from benchmark.ocr_proxy.render import split_words, write_prompts  # noqa: E402

ALGORITHMS = ("crd", "dgpo", "nft")
KL_ONLY = "klonly"  # the variant of --kl-only-control
# CRD's snapshot adapters keep moving: with crd.py's defaults (Flow-Factory's OCR schedules,
# examples/crd/lora/sd3_5/default.yaml:55-56) the sampling and old adapters both reach EMA decay 0.999 by iteration
# ~100, and on this proxy CRD then stops learning near 0.40 held-out (HISTORY.md "v5"); with their decay capped it keeps
# rising ("v6"). Both follow those schedules' ramps up to a decay of 0.9 (an EMA over ~10 iterations) and stay there
# ("v7": CRD then rolls out and validates with a decoupled EMA of its policy, as the paper intends). DGPO's snapshot
# never freezes (decay at most 0.3), so this matches the two, it tunes neither
CRD_SNAPSHOTS = ("--sampling-decay", "75", "0", "0.0075", "0.9", "--old-decay", "0", "0.25", "0.005", "0.9")
# held-out PP-OCR in a run's TensorBoard: the trainers' PP-OCR judge where it ran (the control's reward reads nothing),
# else their reward, the pool's PP-OCR
HELD_OUT_TAGS = ("eval/reward_paddle", "eval/reward_mean")


@dataclass
class Args:
    """Pretrain the OCR proxy base model, then train it with CRD, DGPO and DiffusionNFT on the PP-OCR reward."""

    out: str = "runs/ocr_proxy"
    """output directory"""
    pretrain: pretrain.Args = field(default_factory=lambda: pretrain.Args(out="~/.cache/crd/ocr-proxy"))
    """pretraining (its --pretrain.out is the model cache: reused when its configuration matches)"""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """RL seeds; each seed runs every algorithm (and variant)"""
    iterations: int = 225
    """RL iterations of every run"""
    # 8 prompts x 6 images, 2 optimizer steps of 24 images: the recipe's groups, with the paper's 2 optimizer steps per
    # rollout round (Flow-Factory examples/crd/lora/sd3_5/default.yaml:85, gradient_step_per_epoch: 2; its rounds hold
    # 48 prompts x 24 images, 576 an optimizer step). The recipe's 4 x 6 with one group a step learns less per
    # iteration on this proxy (HISTORY.md "v8"); CRD's snapshot schedules then count k = its optimizer steps exactly
    prompts_per_rank: int = 8
    """prompts per iteration of each run"""
    group_size: int = 6
    """images per prompt"""
    train_batch_size: int = 24
    """images per optimizer step, a multiple of --group-size"""
    eval_every: int = 25
    """held-out validation every N iterations (and before training). Flow-Factory's OCR example validates every 20
    (examples/crd/lora/sd3_5/default.yaml:111); 25 keeps one algorithm's three runs in a 10-minute call on one H200"""
    eval_prompts: int = 128
    """held-out words validated"""
    eval_split: Literal["test", "validation"] = "test"
    """held-out words the runs validate on and the final scores use: test (never shown in pretraining, never used for a
    decision: the report), or validation (they stopped pretraining; never trained on): a sweep chooses settings on
    them so that test stays unseen"""
    time_limit_s: float = 0.0
    """if > 0: the whole benchmark's wall-time budget; runs still training then get SIGTERM (each finishes its
    iteration and writes its summary) and the iterations reached are reported"""
    resume: bool = False
    """continue the runs in --out: each trainer starts with --resume-from latest (its newest checkpoint, or a new run
    where it has none; a finished run exits at once), so that a benchmark stopped by --time-limit-s goes on"""
    scorer: Literal["pool", "paddle"] = "pool"
    """pool: the trainers' `--reward vllm` client reads PP-OCR from a local server backed by a pool of engines (the
    same reads and scores as `--reward paddle`, in parallel); paddle: `--reward paddle`, one engine per trainer"""
    ocr_workers: int = 0
    """PP-OCR engines of the pool (0: three fifths of the cores, the reads' share of the CPU)"""
    ocr_engine: Literal["onnxruntime", "openvino"] = "onnxruntime"
    """the pool's PP-OCR runtime: onnxruntime, or openvino (the same models at float32, reads cheaper
    on the CPU; ocr_engine.py compares their reads)"""
    trainer_threads: int = 1
    """CPU threads of each trainer's torch (OMP_NUM_THREADS; 0: torch's default, every core): a
    15.5M-parameter model's CPU work is kernel launches, and many trainers share the cores"""
    mps: bool = False
    """run the trainers through NVIDIA's MPS daemon, so that their kernels share the GPU at once
    rather than by turns"""
    blocking_sync: bool = True
    """trainers wait for the GPU asleep instead of spinning on a core (CUDA's blocking
    synchronisation, blocking_sync.py), leaving the cores to the pool's reads"""
    trainer_args: str = ""
    """extra arguments for every trainer, e.g. '--trainer-args=--learning-rate 1e-4' (with '=')"""
    algorithms: list[Literal["crd", "dgpo", "nft"]] = field(default_factory=lambda: list(ALGORITHMS))
    """trainers run for every seed and variant"""
    variants: list[str] = field(default_factory=list)
    """a sweep: each NAME=ARGS runs every algorithm and seed with ARGS after --trainer-args, as runs
    {algo}_{NAME}_seed{S}, e.g. '--variants default= lr1e-4=--learning-rate 1e-4'; none: runs {algo}_seed{S}.
    ALGO:NAME=ARGS runs only that algorithm, e.g. 'dgpo:clip1e-5=--clip-range 1e-5'"""
    kl_only_control: bool = False
    """also run every algorithm and seed with a reward that reads no text (every score 0, so every advantage 0), as
    runs {algo}_klonly_seed{S}: what the KL anchor teaches the CFG-1 policy without the reward (to the unguided base:
    nothing; with --trainer-args=--kl-cfg 4.5: guidance distillation). Their held-out curve is the trainers' PP-OCR
    judge"""
    final_guidances: list[float] = field(default_factory=list)
    """CFG scales at which the base and each run's last checkpoint are also scored after training (at the validation
    protocol's steps), beside the validation, rollout (CFG 1, 10 steps) and recipe (CFG 4.5, 40 steps) protocols"""
    final_scores: bool = True
    """score the base and each run's last checkpoint after training (a sweep that chooses on the validation curves
    can skip it)"""
    final_score_workers: int = 8
    """processes that sample the final scores side by side on the GPU while the pool reads them (0,
    or no GPU: the driver samples them itself)"""


def check_args(args: Args) -> None:
    """One line for an argument the runs would trip over minutes later."""
    def fail(message):
        sys.exit(f"run_benchmark.py: error: {message}")

    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        fail(f"--seeds {' '.join(map(str, args.seeds))}: give one or more distinct seeds")
    blocked = run_dirs.directory_blocked(Path(args.out))
    if blocked:
        fail(f"--out {args.out}: {blocked}")
    if not args.algorithms:
        fail("--algorithms: give one or more of crd, dgpo, nft")
    for flag in ("iterations", "eval_every", "eval_prompts"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    held_out = getattr(args.pretrain.task, f"{args.eval_split}_words")
    if args.eval_prompts > held_out:
        fail(f"--eval-prompts {args.eval_prompts}: more than the task's {held_out} {args.eval_split} words "
             f"(--pretrain.task.{args.eval_split}-words)")
    runs = set()
    for variant in args.variants:
        only, name = variant_name(variant.split("=", 1)[0])
        if "=" not in variant or not name or "/" in name or ":" in name:
            fail(f"--variants {variant!r}: write NAME=TRAINER_ARGS, e.g. 'lr1e-4=--learning-rate 1e-4' ('base=': none)")
        if only is not None and only not in args.algorithms:
            fail(f"--variants {variant!r}: {only!r} is not one of --algorithms {' '.join(args.algorithms)}")
        named = {(algo, name) for algo in ([only] if only else args.algorithms)}
        if named & runs:
            fail(f"--variants {variant!r}: a second variant named {name!r} for {sorted(named & runs)[0][0]}")
        runs |= named
    if args.final_score_workers < 0:
        fail(f"--final-score-workers {args.final_score_workers}: 0 (the driver samples them) or "
             "more")
    if args.trainer_threads < 0:
        fail(f"--trainer-threads {args.trainer_threads}: 0 (torch's default) or more")
    if args.ocr_engine != "onnxruntime" and args.scorer != "pool":
        fail(f"--ocr-engine {args.ocr_engine}: the pool's runtime (--scorer pool)")
    if args.ocr_engine == "openvino" and importlib.util.find_spec("openvino") is None:
        fail("--ocr-engine openvino: the openvino package is not installed (pip install openvino)")
    if args.kl_only_control and args.scorer != "pool":
        fail("--kl-only-control: the reward that reads no text is served by the pool (--scorer pool)")
    if args.kl_only_control and any(variant_name(v.split("=", 1)[0])[1] == KL_ONLY for v in args.variants):
        fail(f"--variants: the name {KL_ONLY!r} is --kl-only-control's")
    for flag, value in [("trainer-args", args.trainer_args), *(("variants", v) for v in args.variants)]:
        try:
            shlex.split(value)
        except ValueError as error:
            fail(f"--{flag} {value!r}: {error}")
    for algo in args.algorithms:  # the trainers' own checks, now rather than after minutes of pretraining
        trainer = importlib.import_module(algo)
        for variant in args.variants or ["="]:
            if variant_name(variant.split("=", 1)[0])[0] not in (None, algo):
                continue
            given = shlex.split(args.trainer_args) + shlex.split(variant.split("=", 1)[1])
            driver = [*group_structure(args), "--no-compile", "--kl-cfg", "1",
                      *(CRD_SNAPSHOTS if algo == "crd" else ())]
            for seed in args.seeds:  # as launch() passes them: before the given arguments, which may set another
                try:
                    trainer_args = tyro.cli(trainer.Args, args=["--seed", str(seed), *driver, *given],
                                            console_outputs=False)
                except SystemExit:
                    fail(f"{shlex.join(given)!r}: not arguments of {algo}.py (see python {algo}.py --help)")
                trainer_args.train_batch_size = trainer_args.train_batch_size or trainer_args.group_size
                trainer.check_args(trainer_args)
    pretrain.check_args(args.pretrain)
    report = Path(args.out) / "benchmark.json"
    if args.resume and report.is_file():  # else the runs would go on, silently, from another base model
        try:
            first = json.loads(report.read_text())["args"]["pretrain"]
        except (ValueError, KeyError, TypeError) as error:
            fail(f"--resume: {report} is not this driver's report ({type(error).__name__}: {error})")
        now = json.loads(json.dumps(pretrain.config_key(args.pretrain)))  # as the report stored it
        changed = [k for k in now if first.get(k) != now[k]]
        if changed:
            fail(f"--resume: the runs in {args.out} were trained on a base of other --pretrain settings ("
                 f"{', '.join('--pretrain.' + k.replace('_', '-') for k in changed)}); resume with those of {report}")


def gpu_count() -> int:
    """Without initialising CUDA in this process (its PP-OCR pool forks)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return sum(line.startswith("GPU") for line in out.splitlines())


def variant_name(written: str) -> tuple[str | None, str]:
    """(the one algorithm it runs, or None for all; its name) of a variant's NAME or ALGO:NAME."""
    only, colon, name = written.partition(":")
    return (only, name) if colon and only in ALGORITHMS else (None, written)


def plan(args: Args) -> tuple[dict[tuple[str, str], str], list[tuple[str, str, int]]]:
    """{(algorithm, variant): trainer arguments} and the runs, as (algorithm, variant, seed)."""
    arguments = {}
    for variant in args.variants:
        written, given = variant.split("=", 1)
        only, name = variant_name(written)
        arguments.update({(algo, name): given for algo in ([only] if only else args.algorithms)})
    if not args.variants:
        arguments = {(algo, ""): "" for algo in args.algorithms}
    if args.kl_only_control:
        arguments.update({(algo, KL_ONLY): f"--reward-model {BLIND_MODEL_NAME} --eval-judge paddle"
                          for algo in args.algorithms})
    names = dict.fromkeys(name for _, name in arguments)
    jobs = [(algo, name, seed) for seed in args.seeds for name in names for algo in args.algorithms
            if (algo, name) in arguments]
    return arguments, jobs


def group_structure(args: Args) -> list[str]:
    return ["--prompts-per-rank", str(args.prompts_per_rank), "--group-size", str(args.group_size),
            "--train-batch-size", str(args.train_batch_size)]


def run_name(algo: str, variant: str, seed: int) -> str:
    return f"{algo}_{variant}_seed{seed}" if variant else f"{algo}_seed{seed}"


def launch(algo: str, variant: str, seed: int, gpu: int | None, cores: list[int], model: Path, data: Path, runs: Path,
           max_sequence_length: int, reward: list[str], variant_args: str, args: Args,
           extra_env: dict) -> subprocess.Popen:
    launcher = [str(Path(__file__).with_name("blocking_sync.py"))] if args.blocking_sync else []
    command = [sys.executable, *launcher, str(ROOT / f"{algo}.py"), "--model", str(model), *reward,
               "--train-data", str(data / "train.jsonl"), "--eval-data", str(data / f"{args.eval_split}.jsonl"),
               "--resolution", str(args.pretrain.task.resolution), "--max-sequence-length", str(max_sequence_length),
               "--num-iterations", str(args.iterations), "--eval-every", str(args.eval_every),
               "--eval-prompts", str(args.eval_prompts), "--eval-guidance", str(args.pretrain.validation_guidance),
               "--eval-steps", str(args.pretrain.validation_steps), "--save-every", str(args.iterations),
               "--seed", str(seed),
               "--output-dir", str(runs), "--run-name", run_name(algo, variant, seed),
               "--device", "cpu" if gpu is None else "cuda", *group_structure(args),
               "--no-compile",  # a 15.5M-parameter model: compiling would take longer than it saves
               # whole passes in one forward: the defaults cut them for SD3.5-M's memory, and a model this small runs
               # launch-bound (same numbers up to float rounding; six runs sharing one H200: 2.2-2.4 -> 1.6-1.8 s an
               # iteration, benchmark/HISTORY.md "v4")
               "--forward-batch-size", "512", "--policy-timesteps-per-forward", "9",
               # the KL anchor without guidance: the anchors' CFG-4.5 anchor distils guidance into the CFG-1 policy,
               # which on this proxy alone gives all of the held-out gain (HISTORY.md "v4": a control with no reward
               # rose as far); to the unguided base, that control stays at the base to the bit ("v5"), so the curves
               # are the reward's. --trainer-args=--kl-cfg 4.5 restores the trainers' default
               "--kl-cfg", "1",
               *(CRD_SNAPSHOTS if algo == "crd" else ()),
               *(["--resume-from", "latest"] if args.resume else []),
               *shlex.split(args.trainer_args), *shlex.split(variant_args)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "" if gpu is None else str(gpu), **extra_env}
    if args.trainer_threads:
        env |= {name: str(args.trainer_threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    print("+ " + " ".join(command), flush=True)
    # the child keeps its own copy of the file; a resumed run's lines follow its first lines
    with open(runs / f"{run_name(algo, variant, seed)}.log", "a" if args.resume else "w") as log:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.sched_setaffinity(0, cores))


def progress(runs: Path, jobs: list[tuple[str, str, int]], iterations: int) -> str:
    """'iterations 40-45 of 225 (30 of 30 runs started)', from the progress bars in the runs' logs."""
    reached = []
    for job in jobs:
        log = runs / f"{run_name(*job)}.log"
        with open(log, "rb") if log.is_file() else nullcontext(None) as file:
            if file is None:
                continue
            file.seek(max(0, log.stat().st_size - 4096))
            bars = re.findall(rb"iterations:.*?\| *(\d+)/\d+ \[", file.read())
        reached += [int(bars[-1])] if bars else []
    if not reached:
        return "the runs are loading"
    return f"iterations {min(reached)}-{max(reached)} of {iterations} ({len(reached)} of {len(jobs)} runs started)"


def per_prompt_scores(run_dir: Path) -> dict[str, list[float]]:
    """{iteration: every held-out word's PP-OCR score, in the eval set's order} of a run's validations
    (its eval_scores.jsonl): the trainers' PP-OCR judge where it ran (the control's reward reads nothing), else
    their reward, the pool's PP-OCR. An iteration validated again after a resume: its last line."""
    path = run_dir / checkpoint.EVAL_SCORES
    scores = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            entry = json.loads(line)
        except ValueError:  # a torn last line of a killed run
            continue
        scores[str(entry["iteration"])] = entry["judges"].get("paddle", entry["reward"])
    return scores


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """[(step, value)] of one tag ([] when the trainer stopped before it wrote anything)."""
    return list(logged_scalars(run_dir).get(tag, {}).items())


def save_grids(run_dir: Path, out: Path, name: str) -> list[str]:
    """The first and last validation grids of a run, as the trainer logged them (PNG); a resumed benchmark's new last
    grid replaces the one its earlier part wrote."""
    if not run_dir.is_dir():
        return []
    events = EventAccumulator(str(run_dir), size_guidance={"images": 0}).Reload()
    grids = events.Images("eval/images") if "eval/images" in events.Tags()["images"] else []
    written = []
    for label, event in (("first", grids[0]), ("last", grids[-1])) if grids else ():
        for earlier in out.glob(f"grid_{name}_{label}_iteration*.png"):
            earlier.unlink()
        path = out / f"grid_{name}_{label}_iteration{event.step}.png"
        path.write_bytes(event.encoded_image_string)
        written.append(path.name)
    return written


def batch_structure(run_dirs: list[Path]) -> str:
    """'8 prompts x 6 images' as the runs' own checkpoints record it (several, joined by ' / ')."""
    seen = []
    for run_dir in run_dirs:
        saved = checkpoint.checkpoints(run_dir) if run_dir.is_dir() else []
        if saved:
            trained = json.loads((saved[-1] / "trainer_state.json").read_text())["args"]
            label = f"{trained['prompts_per_rank']} prompts x {trained['group_size']} images"
            seen += [label] if label not in seen else []
    return " / ".join(seen) or "no checkpoint"


def plot_curves(curves: dict, path: Path, title: str, validation: str) -> None:
    """Held-out PP-OCR and rollout reward against iteration: each seed thin, the mean over seeds thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, tag, label in ((axes[0], "held_out", f"held-out PP-OCR ({validation})"),
                           (axes[1], "train/reward_mean", "rollout PP-OCR (training words, CFG 1, 10 steps)")):
        for (name, seeds), color in zip(curves.items(), plt.get_cmap("tab10").colors):
            runs = [dict(c[tag]) for c in seeds.values() if c[tag]]
            for run in runs:
                ax.plot(list(run), list(run.values()), color=color, alpha=0.3, linewidth=0.8)
            steps = sorted(set.intersection(*(set(r) for r in runs))) if runs else []
            if steps:
                mean = [sum(r[s] for r in runs) / len(runs) for s in steps]
                ax.plot(steps, mean, color=color, linewidth=2, label=f"{name} (mean of {len(runs)} seeds)")
        ax.set_xlabel("iteration")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a control alone has no rollout reward to plot
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: Args) -> dict:
    check_args(args)
    out = Path(args.out).resolve()
    runs, data = out / "runs", out / "data"
    runs.mkdir(parents=True, exist_ok=True)
    report = {"args": asdict(args), "phases_s": {}}

    started = benchmark_started = time.perf_counter()
    arguments, jobs = plan(args)
    cores = sorted(os.sched_getaffinity(0))
    workers = args.ocr_workers or max(1, round(len(cores) * 3 / 5))
    pool = OcrPool(workers, engine=args.ocr_engine) if args.scorer == "pool" else None
    model = pretrain.pretrain(args.pretrain)  # forks its own PP-OCR pool before this process touches CUDA
    report["phases_s"]["pretrain"] = time.perf_counter() - started
    proxy = json.loads((model / "proxy.json").read_text())
    report["base"] = {k: proxy[k] for k in ("chosen", "test_base", "stopped_by", "times", "parameters", "vae_mse")}
    words = split_words(args.pretrain.task, args.pretrain.seed)
    write_prompts(data / "train.jsonl", words["train"])
    write_prompts(data / f"{args.eval_split}.jsonl", words[args.eval_split])
    report["eval_words"] = words[args.eval_split][: args.eval_prompts]  # the order of every per_prompt list

    started = time.perf_counter()
    gpus = gpu_count()
    processes = {}
    with ExitStack() as stack:
        mps_env = stack.enter_context(mps_daemon(out / "mps")) if args.mps else {}
        url = stack.enter_context(serve(pool)) if pool else None
        usage = Usage({"trainers": lambda: [p.pid for p in processes.values() if p.poll() is None],
                       "ocr_pool": pool.pids if pool else list, "driver": lambda: [os.getpid()]})
        if pool:
            # the reward is already PP-OCR: no second, in-process PP-OCR judge of the validation images
            reward = ["--reward", "vllm", "--reward-urls", url, "--reward-model", MODEL_NAME, "--eval-judge", "none"]
            per_job = len(cores)
        else:  # each run on its own cores: each engine uses every core it sees, and side by side they would thrash
            reward, per_job = ["--reward", "paddle"], max(1, len(cores) // len(jobs))
        processes = {job: launch(*job, i % gpus if gpus else None,
                                 cores[i * per_job % len(cores) :][:per_job], model, data, runs,
                                 args.pretrain.max_sequence_length, reward, arguments[job[:2]], args, mps_env)
                     for i, job in enumerate(jobs)}
        stopped, last_line = False, time.perf_counter()
        while any(p.poll() is None for p in processes.values()):
            usage.sample()
            if time.perf_counter() - last_line > 60:
                last_line = time.perf_counter()
                print(f"run_benchmark: {last_line - started:.0f} s: {progress(runs, jobs, args.iterations)}; "
                      f"{usage.line()}", flush=True)
            if args.time_limit_s and not stopped and time.perf_counter() - benchmark_started > args.time_limit_s:
                for p in processes.values():
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                stopped = True
                print(f"run_benchmark: time limit of {args.time_limit_s:.0f} s: asked every run to stop", flush=True)
            time.sleep(2)
    report["phases_s"]["rl"] = time.perf_counter() - started
    report["usage"] = usage.summary()  # what bounded the runs: read in docs/ocr-proxy.md
    print(f"run_benchmark: while the runs trained: {report['usage']}", flush=True)
    if pool and args.final_scores:
        started = time.perf_counter()
        protocols = {**pretrain.protocols(args.pretrain),
                     **{f"cfg{g:g}_{args.pretrain.validation_steps}steps": (g, args.pretrain.validation_steps)
                        for g in args.final_guidances}}
        report["final_scores"] = final_scores(model, {run_name(*job): runs / run_name(*job) for job in jobs},
                                              words[args.eval_split][: args.eval_prompts], pool,
                                              args.pretrain.max_sequence_length, args.pretrain.task.resolution,
                                              protocols, args.final_score_workers if gpus else 0)
        report["phases_s"]["final_scores"] = time.perf_counter() - started
        means = {name: {k: round(v, 4) for k, v in entry.items() if isinstance(v, float)}
                 for name, entry in report["final_scores"].items()}
        print(f"run_benchmark: held-out PP-OCR of the base and each run's last checkpoint: {means}")
    if pool:
        pool.close()
    report["return_codes"] = {run_name(*job): p.returncode for job, p in processes.items()}

    started = time.perf_counter()
    curves, report["runs"], report["grids"] = {}, {}, []
    for algo, variant, seed in jobs:
        name, run_dir = run_name(algo, variant, seed), runs / run_name(algo, variant, seed)
        logged = {tag: list(steps.items()) for tag, steps in logged_scalars(run_dir).items()}
        held_out = next((logged[tag] for tag in HELD_OUT_TAGS if logged.get(tag)), [])
        # the control's rollout rewards are all 0
        rollout_reward = [] if variant == KL_ONLY else logged.get("train/reward_mean", [])
        curve = {"held_out": held_out, "train/reward_mean": rollout_reward}
        label = f"{algo.upper()}, KL-only control" if variant == KL_ONLY else f"{algo.upper()} {variant}".strip()
        curves.setdefault(label, {})[seed] = curve
        summary = run_dir / "summary.json"
        report["runs"][name] = {**(json.loads(summary.read_text()) if summary.is_file() else {}), "eval": held_out,
                                "per_prompt": per_prompt_scores(run_dir),
                                "iteration_s": logged.get("perf/iteration_s", [])}
        report["grids"] += save_grids(run_dir, out, name)
    for variant in dict.fromkeys(name for _, name, _ in jobs):  # a table where every algorithm ran it
        every = all((algo, variant) in arguments for algo in args.algorithms)
        for seed in args.seeds if len(args.algorithms) > 1 and every else ():
            table = subprocess.run(["bash", str(ROOT / "run.sh"), "compare",
                                    *(str(runs / run_name(a, variant, seed)) for a in args.algorithms)],
                                   capture_output=True, text=True, check=False)
            (out / f"compare_{run_name('', variant, seed).lstrip('_')}.md").write_text(table.stdout + table.stderr)
    structure = batch_structure([runs / run_name(*job) for job in jobs])
    plot_curves(curves, out / "curves.png", f"OCR proxy: {len(args.seeds)} seed(s), {args.iterations} iterations, "
                f"{structure}, PP-OCR reward; base validation {proxy['chosen'][proxy['validation']]:.2f}",
                proxy["validation"])
    report["phases_s"]["report"] = time.perf_counter() - started
    for name, run in report["runs"].items():
        if run["eval"]:
            best = max(run["eval"], key=lambda entry: entry[1])
            print(f"{name}: held-out PP-OCR {run['eval'][0][1]:.3f} -> {run['eval'][-1][1]:.3f} (best {best[1]:.3f} "
                  f"at {best[0]}), {run.get('iterations')} iterations")
    report["failed"] = []
    for name, code in report["return_codes"].items():
        if stopped and code in (-signal.SIGTERM, 128 + signal.SIGTERM):
            print(f"run_benchmark: {name} stopped by the time limit after {report['runs'][name].get('iterations')} "
                  "iterations", flush=True)
        elif code:
            report["failed"].append(name)
            text = (runs / f"{name}.log").read_text(errors="replace")
            lines = [line.strip(" │╭╰╮╯─") for line in text.splitlines() if any(c.isalnum() for c in line)] or [""]
            print(f"run_benchmark: {name} failed (exit {code}); {runs / name}.log ends: {lines[-1]}", flush=True)
    partial = out / ".benchmark.json.tmp"  # replaced at once: a kill never leaves half a report for --resume to read
    partial.write_text(json.dumps(report, indent=1))
    partial.replace(out / "benchmark.json")
    print(f"run_benchmark: phases {report['phases_s']}; outputs in {out}", flush=True)
    return report


if __name__ == "__main__":
    sys.exit(1 if main(tyro.cli(Args))["failed"] else 0)
