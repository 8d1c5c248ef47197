"""Score SD3.5 on the held-out OCR prompts: the base model, an adapter of a trainer checkpoint, or a diffusers LoRA.

    python evaluate.py --checkpoint runs/crd/<run>/global_step_100        # the adapter its run validated
    python evaluate.py --checkpoint runs/crd/<run>/global_step_100 --adapter policy --num-prompts 128
    python evaluate.py --lora runs/crd/<run>/global_step_100/policy_lora  # any diffusers-format SD3 LoRA
    python evaluate.py                                                    # the base model

The recipe's protocol by default: every prompt of data/ocr/test.jsonl, image i from seed 0 + i, a 40-step Euler ODE
at CFG 4.5 against the empty prompt, 512x512, the Qwen2.5-VL-3B OCR reward, and PP-OCR (CPU) as an independent judge.
Results go to {output_dir}/{name}/: results.jsonl, one line per prompt appended as each chunk is scored (stop the
run at any time, Ctrl-C or kill, and run the same command to continue without rescoring what is done);
results.json, with every prompt's target, transcriptions and scores, the means with their standard errors and the
settings; grid.png, the first images with their scores.
A --checkpoint is scored by default as its run validated: the adapter the trainer names (its
VALIDATION_ADAPTER, which trainer_state.json records) at its seed, steps, CFG, resolution and T5
tokens (--adapter, --seed, --num-steps, --guidance, --resolution, --max-sequence-length override
them). One process at a time writes a results directory (it holds evaluate.lock there).
"""

import json
import math
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
import tyro
from PIL import Image
from tqdm import tqdm

from checks import check_devices, check_judge_models, check_scoring_args, errors_end_in_one_line, fail
from data import DataError, load_prompts
from eval_results import lock_results, mean_and_stderr, read_results
from evaluated_lora import load_lora, read_checkpoint, read_lora
from judges import JUDGES, judge_names, make_guarded_judges, make_judge
from memory import out_of_memory, out_of_memory_line
from ocr_reward import ServerError
from reward_mix import make_mix, parse_mix
from rollout import captioned_grid, compile_blocks, compile_decoder, sample
from scoring import ScoringThread, image_rewards, scorer_options
from sd3 import check_model_path, encode_prompts, load_pipeline, negative_embeddings, resolution_error
from settings import WORDS, ScoringArgs

DEFAULT_MODEL = "stabilityai/stable-diffusion-3.5-medium"
# what an out-of-memory error advises: the flags that lower the peak of each phase
MEMORY_FLAGS = ("lower --forward-batch-size (rows per transformer call) or --batch-size (the reward's batch), or move the "
                "text encoders with --text-encoder-device or the reward model with --reward-device")
# evaluate.py's protocol flags: {field: (the trainers' Args field, the recipe's value)}. A
# checkpoint's run validated with its own values: the defaults when it is scored (else the recipe's)
PROTOCOL = {"seed": ("eval_seed", 0), "num_steps": ("eval_steps", 40),
            "guidance": ("eval_guidance", 4.5), "resolution": ("resolution", 512),
            "max_sequence_length": ("max_sequence_length", 256)}


def protocol_flag(metavar, trained_field, recipe):
    """tyro's marks of a protocol flag: its --help says where its default comes from."""
    hint = f"(default: --checkpoint's {trained_field}, else {recipe:g})"
    return tyro.conf.arg(metavar=metavar, help_behavior_hint=hint)


@dataclass
class Args:
    """Score SD3.5 (the base model, a trainer checkpoint's adapter or a LoRA) on held-out OCR prompts."""

    # What is evaluated (neither --checkpoint nor --lora: the base model)
    checkpoint: str = ""
    """a global_step_N directory of crd.py or dgpo.py (its LoRA rank, alpha and model are read from trainer_state.json)"""
    adapter: Annotated[str | None, tyro.conf.arg(
        metavar="NAME", help_behavior_hint="(default: the one --checkpoint's run validated, else sampling)")] = None
    """adapter of --checkpoint: policy, old or sampling"""
    lora: str = ""
    """a diffusers-format SD3 LoRA directory (what StableDiffusion3Pipeline.load_lora_weights reads): e.g. policy_lora/"""
    lora_rank: int = 32
    """rank of --lora: a LoRA of another rank is an error"""
    lora_alpha: int = 64
    """alpha of --lora (its scale is alpha / rank): must agree with the alpha the LoRA records, if it records one"""
    model: str = ""
    """hub id or local directory of SD3.5, `tiny` or `random-sd3.5-medium` (default: the checkpoint's, else SD3.5-M)"""

    # Prompts and protocol (defaults: the validation of --checkpoint's run, else the recipe's)
    eval_data: str = "data/ocr/test.jsonl"
    """held-out prompts (.jsonl from data.py, or Flow-GRPO's raw .txt)"""
    num_prompts: int = 0
    """score the first N prompts (0: all); a later run with a larger N continues the same results"""
    # None: not given; take_protocol fills these from --checkpoint's run, else with the recipe's
    seed: Annotated[int | None, protocol_flag("INT", "eval_seed", 0)] = None
    """image i uses seed seed + i (the trainers' --eval-seed)"""
    num_steps: Annotated[int | None, protocol_flag("INT", "eval_steps", 40)] = None
    """Euler ODE steps"""
    guidance: Annotated[float | None, protocol_flag("FLOAT", "eval_guidance", 4.5)] = None
    """CFG scale, against the empty prompt (1: no CFG)"""
    resolution: Annotated[int | None, protocol_flag("INT", "resolution", 512)] = None
    """image height and width in pixels (multiple of 16)"""
    max_sequence_length: Annotated[int | None,
                                   protocol_flag("INT", "max_sequence_length", 256)] = None
    """T5 prompt tokens"""

    # Scoring
    scoring: ScoringArgs = field(default_factory=ScoringArgs)
    """--reward (the trainers' flags: one reward or a weighted mix) and its models and servers"""
    judge: Annotated[str, WORDS, tyro.conf.arg(metavar="NAME ...")] = "paddle"
    """judges beside --reward, as its names: paddle (PP-OCR, independent of the trained reward), pickscore, aesthetic,
    flat, a cheap check, ..., or none; a judge that is part of --reward is not scored again"""

    # Running
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """device of the SD3 model (bfloat16 on CUDA, float32 on the CPU)"""
    text_encoder_device: str = ""
    """device of the CLIP and T5 text encoders (default: --device)"""
    batch_size: int = 32
    """prompts sampled per chunk; a chunk is scored, and appended to results.jsonl, while the next one samples"""
    forward_batch_size: int = 48
    """most rows in one transformer forward (a CFG image takes two)"""
    compile: bool = False
    """torch.compile the transformer blocks and VAE decoder on CUDA (worth it for the whole test set)"""
    output_dir: str = "evals"
    """results are written to {output_dir}/{name}/"""
    name: str = ""
    """results directory name (default: what is evaluated, the reward and the protocol)"""
    grid_images: int = 16
    """images in grid.png (the first prompts'); their PNGs are kept under images/ so that a resumed run can draw it"""
    save_images: bool = False
    """keep every image as images/{index}.png, not only the grid's"""


def check_args(args):
    if args.checkpoint and args.lora:
        fail("--checkpoint and --lora: pass one of them (neither: the base model)")
    take_protocol(args)  # a no-op after the main program's; Args() made in code leaves them None
    for flag in ("num_steps", "resolution", "batch_size", "forward_batch_size"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if args.resolution % 16:
        fail(f"--resolution {args.resolution} is not a multiple of 16 (VAE factor 8 x patch size 2)")
    if args.num_prompts < 0 or args.grid_images < 0:
        fail("--num-prompts and --grid-images must not be negative")
    if not (math.isfinite(args.guidance) and args.guidance >= 1):
        fail(f"--guidance {args.guidance:g}: must be a finite number >= 1 (1: no guidance)")
    if not 1 <= args.max_sequence_length <= 512:
        fail(f"--max-sequence-length {args.max_sequence_length}: must lie in [1, 512] (SD3's T5 encoder)")
    if not 0 <= args.seed < 2**62:
        fail(f"--seed {args.seed}: must lie in [0, 2^62)")
    args.judge = check_scoring_args(args.scoring, args.judge, "--judge")  # canonical, as trainers record
    check_devices(args, "evaluate.py runs")


def take_protocol(args):
    """Fill the protocol flags not given (None): from --checkpoint's run, as it validated (its
    trainer_state.json's Args, and its validation_adapter for --adapter), else with the recipe's
    values ("sampling": a checkpoint that records no adapter validated with it). Returns {flag: value}
    of those taken from the checkpoint."""
    state = {}
    if args.checkpoint:
        try:
            state = json.loads((Path(args.checkpoint) / "trainer_state.json").read_text())
        except (OSError, ValueError):  # read_checkpoint names what is wrong
            state = {}
    if not isinstance(state, dict):
        state = {}
    trained = state.get("args")
    if not isinstance(trained, dict):
        trained = {}
    taken = {}
    if args.adapter is None:
        args.adapter = state.get("validation_adapter") or "sampling"
        if type(args.adapter) is not str:  # a hand-edited file
            fail(f"--checkpoint {args.checkpoint}: its trainer_state.json records validation_adapter "
                 f"{args.adapter!r}, not an adapter's name; pass --adapter")
        if state.get("validation_adapter"):
            taken["--adapter"] = args.adapter
    for name, (trained_name, recipe) in PROTOCOL.items():
        if getattr(args, name) is not None:
            continue
        value = trained.get(trained_name, recipe)
        kinds = (int, float) if name == "guidance" else (int,)
        if type(value) not in kinds:  # a hand-edited file: the checks below would raise TypeError
            fail(f"--checkpoint {args.checkpoint}: its trainer_state.json records {trained_name} "
                 f"{value!r}, not a number; pass --{name.replace('_', '-')}")
        setattr(args, name, value)
        if trained_name in trained:
            taken[f"--{name.replace('_', '-')}"] = value
    return taken


if __name__ == "__main__":
    args = tyro.cli(Args)
    from_checkpoint = take_protocol(args)
    check_args(args)
    device = torch.device(args.device)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else nullcontext()
    reward = args.scoring.reward
    weights = parse_mix(reward)  # {name: weight}: one reward, or a mix
    mix = reward not in JUDGES  # not a bare name: the score is the weighted sum of the components
    judged = [name for name in judge_names(args.judge) if name not in weights]  # a component: scored
    lora, weights_sha256, rank, alpha, trained_model = None, None, None, None, None
    if args.checkpoint:
        lora, rank, alpha, trained_model, weights_sha256 = read_checkpoint(args.checkpoint, args.adapter)
        what = "__".join(Path(args.checkpoint).resolve().parts[-2:]) + f"__{args.adapter}"
    elif args.lora:
        lora, weights_sha256 = read_lora(args.lora, args.lora_rank, args.lora_alpha)
        rank, alpha = args.lora_rank, args.lora_alpha
        what = "__".join(Path(args.lora).resolve().parts[-3:])
    model = args.model or trained_model or DEFAULT_MODEL
    if not (args.checkpoint or args.lora):
        what = f"base__{Path(model).name}"
    try:
        check_model_path(model)
        check_judge_models(args.scoring, set(weights) | set(judged))
        records = load_prompts(args.eval_data)[0]
    except (DataError, RuntimeError) as error:
        fail(error)
    if args.num_prompts > len(records):
        fail(f"--num-prompts {args.num_prompts}: {args.eval_data} holds {len(records)} prompts")
    records = records[: args.num_prompts or None]
    prompts, targets = [r["prompt"] for r in records], [r["target"] for r in records]
    # what defines the scores; a results file continues only under the same
    settings = {"model": model, "checkpoint": str(Path(args.checkpoint).resolve()) if args.checkpoint else None,
                "adapter": args.adapter if args.checkpoint else None,
                "lora": str(Path(args.lora).resolve()) if args.lora else None, "lora_rank": rank, "lora_alpha": alpha,
                "weights_sha256": weights_sha256, "eval_data": str(Path(args.eval_data).resolve()), "seed": args.seed,
                "num_steps": args.num_steps, "guidance": args.guidance, "negative_prompt": "",
                "resolution": args.resolution, "max_sequence_length": args.max_sequence_length,
                "dtype": "bfloat16" if device.type == "cuda" else "float32", "reward": reward,
                "reward_model": args.scoring.reward_model if {"qwen-vl", "vllm"} & set(weights) else None,
                "judge": " ".join(judged) or None}
    for scorer_name, flag in (("pickscore", "pickscore_model"), ("pickscore", "pickscore_processor"),
                              ("aesthetic", "aesthetic_model"), ("aesthetic", "aesthetic_head")):
        if scorer_name in set(weights) | set(judged):  # the quality scorers' models define their scores
            settings[flag] = getattr(args.scoring, flag)
    protocol = f"cfg{args.guidance:g}_{args.num_steps}steps_{args.resolution}px_seed{args.seed}"
    name = args.name or f"{what}__{reward.replace(' ', '+')}__{protocol}"
    out = Path(args.output_dir) / name
    try:
        (out / "images").mkdir(parents=True, exist_ok=True)
    except OSError as error:
        fail(f"--output-dir {args.output_dir}: cannot create {out / 'images'} ({error.strerror or error})")
    lock = lock_results(out)  # held until the process ends; taken first, as results.jsonl is read
    results_path = out / "results.jsonl"
    try:
        done = read_results(results_path, settings, prompts)
    except OSError as error:  # unreadable, or its settings line cannot be written (a full disk)
        fail(f"{results_path}: {error.strerror or error}")
    todo = [i for i in range(len(prompts)) if i not in done]
    if from_checkpoint:
        taken = ", ".join(f"{flag} {value if type(value) is str else format(value, 'g')}"
                          for flag, value in from_checkpoint.items())
        print(f"the validation protocol of {args.checkpoint}'s run: {taken}", flush=True)
    print(f"{out}: {len(prompts) - len(todo)} of {len(prompts)} prompts already scored", flush=True)

    threads = []  # the scorers' threads: they read a chunk while the next one samples
    failed_judges = {}  # {judge: why}: its scores are null from its failure on

    def report_failed_judges():
        """One line for each judge that has failed, the first time (it scores NaN from then on)."""
        for judge_name, judge in zip(judged, judges):
            if judge.failure and judge_name not in failed_judges:
                failed_judges[judge_name] = judge.failure
                tqdm.write(f"evaluate.py: warning: {judge.failure}; the other scores go on (the "
                           "same command scores its prompts again)", file=sys.stderr)

    def stop(signum, frame):
        for thread in threads:
            thread.cancel()
        print(f"\nstopped by signal {signum}: {len(done)} of {len(prompts)} prompts are scored in {results_path}; "
              "the same command continues", file=sys.stderr)
        sys.exit(128 + signum)

    def cannot_write(path, error):
        """One line for a file that cannot be written (a full disk): the prompts scored so far stay
        in results.jsonl, whose lines are whole."""
        for thread in threads:
            thread.cancel()
        fail(f"cannot write {path} ({error.strerror or error}): {len(done)} of {len(prompts)} "
             f"prompts are scored in {results_path}; the same command continues once there is room")

    def save_image(image, path):
        try:
            Image.fromarray(image).save(path)
        except OSError as error:
            path.unlink(missing_ok=True)  # a cut PNG would draw into a later grid
            cannot_write(path, error)

    parts = []  # (indices, images) of the sampled parts of chunks not yet written, in order
    bar = None  # the progress bar, once the models are loaded

    def keep_scored(stopped_by):
        """After a failed allocation: what was sampled before it is scored and written (unless the scorer is what
        failed), and the scorers' other jobs are dropped; returns what is kept, in words."""
        if parts and not phase.startswith("the scoring"):
            try:
                write(len(parts))
            except Exception:  # a scorer that fails on them too leaves these prompts to the same command
                pass
        for thread in threads:
            thread.cancel()
        if bar:
            bar.close()  # the line then starts a line of its own
        return f"{len(done)} of {len(prompts)} prompts are scored in {results_path}; the same command continues"

    phase = "loading the models"  # what an out-of-memory error names
    errors_end_in_one_line(lambda error: out_of_memory_line(error, lambda: phase, device, MEMORY_FLAGS),
                           keep_scored)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    if todo:
        try:
            if "vllm" in weights:  # its servers answer and serve the model before SD3.5 loads
                make_judge("vllm", **scorer_options(args.scoring, device))
            pipe = load_pipeline(model, device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                                 text_encoder_device=args.text_encoder_device or None)
            if error := resolution_error(pipe, args.resolution):
                fail(error)
            if lora:
                load_lora(pipe.transformer, lora, rank, alpha,
                          f"--checkpoint {args.checkpoint}" if args.checkpoint else f"--lora {args.lora}")
            options = {**scorer_options(args.scoring, device), "batch_size": args.batch_size}
            make = make_mix if mix else make_judge
            scorer = ScoringThread(make(reward, **options))
            # a judge that fails to load, or later, is left out (GuardedJudge), not the others
            judges = [ScoringThread(judge) for judge in make_guarded_judges(judged, **options)]
            threads += [scorer, *judges]
            report_failed_judges()  # those that did not load
        except (OSError, RuntimeError, ValueError, KeyError) as error:
            if out_of_memory(error):
                raise  # errors_end_in_one_line tells it
            fail(str(error).splitlines()[0] if str(error) else repr(error))
        if args.compile and device.type == "cuda":
            compile_blocks(pipe.transformer)
            compile_decoder(pipe.vae)
        negative = negative_embeddings(pipe, args.max_sequence_length)

    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), unit="prompt", desc="evaluating")
    started = time.perf_counter()

    def write(count):
        """Append the lines of the first `count` parts to results.jsonl once they are scored, after
        saving the images it keeps."""
        global phase
        if not count:
            return
        taken = parts[:count]
        del parts[:count]
        indices = [i for part, _ in taken for i in part]
        phase = f"the scoring of prompts {indices[0]}-{indices[-1]}"
        components, texts = scorer.take(count)
        scores = image_rewards(components, weights)  # a mix's weighted sum
        judge_results = {name: judge.take(count) for name, judge in zip(judged, judges)}
        report_failed_judges()
        images = np.concatenate([part_images for _, part_images in taken])
        records = {}
        for j, i in enumerate(indices):
            if i < args.grid_images or args.save_images:
                save_image(images[j], out / "images" / f"{i:05d}.png")
            record = {"index": i, "prompt": prompts[i], "target": targets[i], "transcription": texts[j],
                      "score": float(scores[j])}
            if np.ndim(components) == 2:
                record["components"] = dict(zip(weights, map(float, components[j])))
            for judge_name, (judge_scores, judge_texts) in judge_results.items():
                record[f"{judge_name}_transcription"] = judge_texts[j]
                judge_score = float(judge_scores[j])
                record[f"{judge_name}_score"] = None if judge_name in failed_judges else judge_score
            records[i] = record
        lines = [json.dumps(record, ensure_ascii=False) + "\n" for record in records.values()]
        try:
            with results_path.open("a", encoding="utf-8") as results:
                results.write("".join(lines))
        except OSError as error:  # a line cut here is dropped when the file is read again
            cannot_write(results_path, error)
        done.update(records)
        bar.update(len(indices))

    try:
        for first in range(0, len(todo), args.batch_size):
            indices = todo[first : first + args.batch_size]
            phase = f"the sampling of prompts {indices[0]}-{indices[-1]}"
            embeds, pooled = encode_prompts(pipe, [prompts[i] for i in indices], args.max_sequence_length)
            earlier = len(parts)  # the parts of earlier chunks: scored while this one samples

            def score_part(rows, images):
                part = indices[rows]
                part_targets = [targets[i] for i in part]
                part_prompts = [prompts[i] for i in part]
                parts.append((part, images))
                for thread in (scorer, *judges):
                    thread.submit(images, part_targets, part_prompts)

            with autocast:
                seeds = [args.seed + i for i in indices]
                finite = sample(pipe, embeds, pooled, seeds, args.num_steps, args.guidance,
                                args.resolution, args.resolution, args.forward_batch_size,
                                negative_embeds=negative[0], negative_pooled=negative[1],
                                on_decoded=score_part)["finite"]
            if bad := int((~finite).sum()):  # as the trainers warn: else it scores 0 without a word
                tqdm.write(f"evaluate.py: warning: {bad} of {len(indices)} images of prompts "
                           f"{indices[0]}-{indices[-1]} are NaN or inf (a diverged adapter?): they "
                           "decode black and are scored as black images", file=sys.stderr)
            write(earlier)
        write(len(parts))
    except ServerError as error:
        fail(f"{error} ({len(done)} of {len(prompts)} prompts are scored in {results_path}; the same command "
             "continues)")
    bar.close()
    seconds = time.perf_counter() - started

    evaluated = [done[i] for i in range(len(prompts))]
    mean, stderr = mean_and_stderr([r["score"] for r in evaluated])
    summary = {"name": name, "num_prompts": len(prompts), "reward": reward, "mean": mean, "stderr": stderr}
    report = f"{reward} {mean:.4f} ± {stderr or 0:.4f}"
    if mix:  # each component's mean too
        summary["components"] = {}
        for component in weights:
            part_mean, part_stderr = mean_and_stderr([r["components"][component] for r in evaluated])
            summary["components"][component] = {"mean": part_mean, "stderr": part_stderr}
    scored_judges = [judge_name for judge_name in judged if judge_name not in failed_judges]
    for judge_name in scored_judges:
        judge_mean, judge_stderr = mean_and_stderr([r[f"{judge_name}_score"] for r in evaluated])
        summary.setdefault("judges", {})[judge_name] = {"mean": judge_mean, "stderr": judge_stderr}
        report += f", {judge_name} {judge_mean:.4f} ± {judge_stderr or 0:.4f}"
    if scored_judges:  # the first judge, as before a list of them
        summary["judge"] = {"scorer": scored_judges[0], **summary["judges"][scored_judges[0]]}
    if failed_judges:
        summary["failed_judges"] = failed_judges
        report += "; " + "; ".join(failed_judges.values())
    summary.update(this_run={"prompts": len(todo), "seconds": seconds}, settings=settings, prompts=evaluated)
    partial = out / ".results.json.tmp"
    try:
        partial.write_text(json.dumps(summary, indent=1, ensure_ascii=False), encoding="utf-8")
    except OSError as error:
        partial.unlink(missing_ok=True)
        cannot_write(out / "results.json", error)
    partial.replace(out / "results.json")
    grid = [r for r in evaluated[: args.grid_images] if (out / "images" / f"{r['index']:05d}.png").is_file()]
    notes = [", ".join(f"{name} {r[f'{name}_score']:.2f}" for name in scored_judges) for r in grid]
    captions = [f"{r['score']:.2f}" + (f" ({note})" if note else "") + f" {r['target']}"
                for r, note in zip(grid, notes)]
    if grid:
        images = np.stack([np.asarray(Image.open(out / "images" / f"{r['index']:05d}.png")) for r in grid])
        save_image(captioned_grid(images, captions), out / "grid.png")
    print(f"{report} (mean ± standard error over {len(prompts)} prompts): {out / 'results.json'}, {out / 'grid.png'}")
