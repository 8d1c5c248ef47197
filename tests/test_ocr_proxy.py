"""The OCR proxy benchmark's CPU-checkable parts: the word sets, the renders, and pretraining on a tiny model."""

import json
import re
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from benchmark.ocr_proxy import pretrain
from benchmark.ocr_proxy.ocr_pool import BLIND_MODEL_NAME, MODEL_NAME, OcrPool, serve
from benchmark.ocr_proxy.render import Task, all_words, prompt, render, split_words, write_prompts
from data import load_prompts
from ocr_reward import PaddleScorer, make_scorer
import rollout
import sd3
import zygote

ROOT = Path(__file__).resolve().parent.parent

# 4^3 = 64 words: pretraining renders and encodes every training word, so the test's task is small
SMALL_TASK = Task(alphabet="0123", length=3, resolution=64, font_size=20, test_words=4, validation_words=4)


def test_word_sets_are_disjoint_cover_every_word_and_depend_only_on_the_seed():
    task = Task()
    words = split_words(task, seed=0)
    sets = {name: set(ws) for name, ws in words.items()}
    assert [len(words[k]) for k in ("test", "validation")] == [task.test_words, task.validation_words]
    assert not sets["train"] & sets["test"] and not sets["train"] & sets["validation"]
    assert not sets["test"] & sets["validation"]
    assert sets["train"] | sets["test"] | sets["validation"] == set(all_words(task))
    assert split_words(task, seed=0) == words
    assert split_words(task, seed=1)["test"] != words["test"]
    with pytest.raises(ValueError, match="too few"):
        split_words(Task(alphabet="01", length=3), seed=0)


def test_prompt_file_round_trips_through_the_trainers_loader(tmp_path):
    words = split_words(SMALL_TASK, seed=0)["test"]
    records, skipped = load_prompts(write_prompts(tmp_path / "test.jsonl", words))
    assert skipped == 0 and [r["target"] for r in records] == words
    assert [r["prompt"] for r in records] == [prompt(w) for w in words]


def test_pp_ocr_reads_the_benchmark_renders_exactly():
    task = Task()
    scorer = PaddleScorer()
    words = split_words(task, seed=0)["test"][:3]
    images = np.stack([np.asarray(render(w, task)) for w in words])
    assert images.shape == (3, task.resolution, task.resolution, 3)
    scores, texts = scorer(images, words)
    assert scores.tolist() == [1.0, 1.0, 1.0], texts
    blank = np.full_like(images[:1], 255)
    assert scorer(blank, words[:1])[0].tolist() == [0.0]


def test_encode_ids_is_the_pipelines_prompt_encoding(tiny_pipe):
    prompts = [prompt("0123"), prompt("9"), ""]
    components = tiny_pipe.components
    embeds, pooled = pretrain.encode_ids(components, *pretrain.tokenize(components, prompts, 32))
    expected_embeds, expected_pooled = sd3.encode_prompts(tiny_pipe, prompts, 32)
    torch.testing.assert_close(embeds, expected_embeds)
    torch.testing.assert_close(pooled, expected_pooled)


def _tiny_args(out, seed=0):
    return pretrain.Args(out=str(out), seed=seed, device="cpu", task=SMALL_TASK, model="tiny",
                         vae_steps=2, vae_batch_size=4, steps=4, batch_size=4, eval_every=2, eval_words=2,
                         validation_steps=2, rollout_steps=1, target=2.0,  # 2: never reached, both validations run
                         ocr_workers=0)


def test_pretraining_saves_a_pipeline_the_trainers_load_deterministically_and_reuses_it(tmp_path):
    out = pretrain.pretrain(_tiny_args(tmp_path / "a"))
    metadata = json.loads((out / "proxy.json").read_text())
    assert [e["step"] for e in metadata["history"]] == [2, 4] and metadata["stopped_by"] == "steps"
    assert metadata["words"] == {"test": 4, "validation": 4, "train": 56}
    assert metadata["validation"] == "cfg1_2steps"
    assert set(metadata["test_base"]) == {"words", "cfg1_2steps", "cfg1_1steps", "cfg4.5_2steps"}
    weights = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}

    pipe = sd3.load_pipeline(str(out))
    assert pipe.vae.config.scaling_factor != 1.5305  # measured on the renders, not _build_components' SD3 value
    embeds, pooled = sd3.encode_prompts(pipe, [prompt("012")], 32)
    images = rollout.sample(pipe, embeds, pooled, [0], num_steps=2, height=64, width=64)["images"]
    assert images.shape == (1, 64, 64, 3) and images.dtype == np.uint8

    again = pretrain.pretrain(_tiny_args(tmp_path / "b"))
    assert load_file(again / "transformer" / "diffusion_pytorch_model.safetensors").keys() == weights.keys()
    for key, value in load_file(again / "transformer" / "diffusion_pytorch_model.safetensors").items():
        torch.testing.assert_close(value, weights[key], rtol=0, atol=0)

    stamp = (out / "proxy.json").stat().st_mtime_ns
    assert pretrain.pretrain(_tiny_args(out)) == out and (out / "proxy.json").stat().st_mtime_ns == stamp


def _opencv_threads() -> int:
    """A pool worker's OpenCV threads (cv2's own function pickles by a search of every module)."""
    return cv2.getNumThreads()


def test_the_pool_server_gives_the_trainers_vllm_client_the_paddle_scores():
    task = Task()
    words = split_words(task, seed=0)["test"][:2]
    images = np.stack([np.asarray(render(w, task)) for w in words] + [np.full((128, 128, 3), 255, np.uint8)])
    targets = words + [words[0]]
    expected = PaddleScorer()(images, targets)
    pool = OcrPool(2)
    try:
        # one OpenCV thread a worker (its default, a thread a core, cost a third of the reads' CPU),
        # though this process used OpenCV's threads above (a worker setting them itself then hung)
        assert pool.pool.apply_async(_opencv_threads).get(timeout=60) == 1
        assert pool.score(images, targets)[0].tolist() == expected[0].tolist() == [1.0, 1.0, 0.0]
        with serve(pool) as url:
            scores, texts = make_scorer("vllm", urls=[url], model_path=MODEL_NAME, batch_size=3)(images, targets)
            blind = make_scorer("vllm", urls=[url], model_path=BLIND_MODEL_NAME, batch_size=3)(images, targets)
    finally:
        pool.close()
    assert scores.tolist() == expected[0].tolist() and texts == expected[1]
    assert blind[0].tolist() == [0.0, 0.0, 0.0] and blind[1] == ["", "", ""]  # the KL-only control's reward


def test_a_pool_on_openvino_reads_the_proxy_s_grids_as_onnx_runtime_does():
    """--ocr-engine openvino: the same PP-OCR models at float32 give every transcription and score
    of ONNX Runtime's, on hard images (a stored validation grid's tiles: the proxy's own outputs)
    and on renders; and its workers do run OpenVINO, unpinned (OpenVINO's default pins each
    process's inference to the same first core, and the workers would read by turns)."""
    grid = Image.open(ROOT / "benchmark" / "results" / "ocr_proxy_grid_base.png").convert("RGB")
    row = grid.height // 4
    tiles = [np.asarray(grid.crop((x * 128, y * row, x * 128 + 128, y * row + 128)))
             for y in range(4) for x in range(4)]
    task = Task()
    words = split_words(task, seed=0)["test"][:4]
    images = np.stack(tiles + [np.asarray(render(w, task)) for w in words])
    targets = words * 5
    expected = OcrPool(0).score(images, targets)
    pool = OcrPool(2, engine="openvino")
    try:
        session = pool.pool.apply_async(_recogniser_session).get(timeout=120)
        scores, texts = pool.score(images, targets)
    finally:
        pool.close()
    assert session == ("OpenVinoSession", False)
    assert texts == expected[1] and scores.tolist() == expected[0].tolist()
    assert sum(text == word for text, word in zip(texts[16:], words)) == 4
    assert len({text for text in texts[:16]}) > 4  # tiles that read differently from one another


def _recogniser_session() -> tuple[str, bool]:
    """A pool worker's recognition session: its class, and whether OpenVINO pins its threads."""
    from benchmark.ocr_proxy import ocr_pool

    session = ocr_pool._scorer.engine.text_rec.session
    return type(session).__name__, session.compiled.get_property("ENABLE_CPU_PINNING")


def test_pool_speed_reads_alike_at_each_setting_and_counts_the_workers_threads(tmp_path):
    """benchmark/ocr_proxy/pool_speed.py: the same transcriptions whatever OpenCV's threads and on
    OpenVINO, and one OpenCV thread a worker leaves each worker fewer threads than OpenCV's
    default."""
    out = tmp_path / "speed.json"
    script = Path(pretrain.__file__).with_name("pool_speed.py")
    subprocess.run([sys.executable, str(script), "--workers", "1", "--images", "4", "--noise", "25", "--split",
                    "--settings", "cpu:-1", "cpu:1", "openvino:1", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    settings = ("cpu:-1", "cpu:1", "openvino:1")
    default, one, openvino = (result["settings"][s]["noise25"] for s in settings)
    split = result["one_engine_read"]  # --split: the networks take most of a read
    assert split["reads"] == 2 and 0.5 < split["networks_share"] <= 1 and split["recognition_network_s"] > 0
    for row in (default, one, openvino):
        assert row["identical_to_cpu:-1"] == 4
    for row in (one, openvino):
        assert row["score_difference_to_cpu:-1"] == {"mean": 0.0, "max_abs": 0.0}
    assert one["threads_per_process"][0] < default["threads_per_process"][0]
    assert one["mean_score"] == default["mean_score"] > 0 and one["cpu_s_per_image"] > 0
    bad = subprocess.run([sys.executable, str(script), "--settings", "torch:cuda"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 1
    assert bad.stderr.strip().endswith("--settings one or more of cpu:N or openvino:N")


def _listen_overflows():
    """The kernel's count of connections dropped because a listen queue was full (every socket)."""
    head, values = Path("/proc/net/netstat").read_text().splitlines()[:2]
    return int(values.split()[head.split().index("ListenOverflows")])


def test_the_pool_server_queues_the_connections_of_nine_runs_at_once():
    """Nine runs open 9 x 48 connections at once, an image each: none is dropped (with socketserver's backlog of 5,
    most were, and each dropped connection waited a second to try again)."""
    connections = min(9 * 48, int(Path("/proc/sys/net/core/somaxconn").read_text()))
    with serve(OcrPool(0)) as url:
        before = _listen_overflows()
        sockets = [socket.socket() for _ in range(connections)]
        try:
            for sock in sockets:
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            time.sleep(0.5)  # the kernel answers or drops each handshake meanwhile
            assert _listen_overflows() - before == 0
        finally:
            for sock in sockets:
                sock.close()


@pytest.mark.long
def test_the_benchmark_driver_runs_the_trainers_at_a_matched_budget_and_reports(tmp_path):
    """run_benchmark end to end on the tiny model: real crd.py and nft.py subprocesses on the pool's PP-OCR reward
    (dgpo.py's command is crd.py's without CRD's snapshot flags),
    their TensorBoard curves, checkpoints scored again at every protocol, `run.sh compare`, the plot and the grids;
    and the KL-only control, whose reward reads nothing and whose held-out curve is the trainers' PP-OCR judge."""
    from benchmark.ocr_proxy import run_benchmark

    args = run_benchmark.Args(out=str(tmp_path / "bench"), pretrain=_tiny_args(tmp_path / "model"), seeds=[3],
                              iterations=2, eval_every=1, eval_prompts=2, eval_split="validation", ocr_workers=1,
                              kl_only_control=True, prompts_per_rank=2, group_size=2, train_batch_size=4,
                              algorithms=["crd", "nft"],
                              trainer_args="--num-steps 3 --num-train-timesteps 1")
    report = run_benchmark.main(args)
    out = tmp_path / "bench"
    runs = ("crd_seed3", "nft_seed3", "crd_klonly_seed3", "nft_klonly_seed3")
    assert report["return_codes"] == dict.fromkeys(runs, 0) and report["failed"] == []
    for name in runs[2:]:
        assert [v for _, v in run_benchmark.scalars(out / "runs" / name, "train/reward_mean")] == [0.0, 0.0]
        # the judge reads what the pool reads: the same base, seeds and words give the same first validation
        assert report["runs"][name]["eval"][0] == pytest.approx(report["runs"][name.replace("_klonly", "")]["eval"][0])
        # no advantage and the KL anchor to the unguided base: every adapter's B is still 0, the policy is the base
        adapters = load_file(out / "runs" / name / "global_step_2" / "adapters.safetensors")
        assert [k for k, v in adapters.items() if "lora_B" in k and v.count_nonzero()] == []
        assert any("lora_B" in k for k in adapters)
    for name in runs:
        run = report["runs"][name]
        assert [step for step, _ in run["eval"]] == [0, 1, 2] and run["iterations"] == 2
        # every iteration's seconds, the first (its warm-up) apart from the summary's mean
        assert [step for step, _ in run["iteration_s"]] == [1, 2]
        assert run["mean_iteration_excludes"] == [1]
        assert run["iteration_s"][1][1] == pytest.approx(run["mean_iteration_s"])
        scores = report["final_scores"][name]
        assert scores["checkpoint"] == "global_step_2"
        settings = json.loads((out / "runs" / name / "global_step_2" / "trainer_state.json").read_text())["args"]
        assert settings["kl_cfg"] == 1.0
        # the driver's group structure, the same for both algorithms: 2 prompts x 2 images, one optimizer step of both
        assert (settings["prompts_per_rank"], settings["group_size"], settings["train_batch_size"]) == (2, 2, 4)
        assert json.loads((out / "runs" / name / "summary.json").read_text())["optimizer_steps"] == 2
        # --eval-split validation: the runs validate on the words that stopped pretraining, never on the test words
        assert [r["target"] for r in load_prompts(settings["eval_data"])[0]] == split_words(SMALL_TASK, 0)["validation"]
        if name.startswith("crd"):  # CRD's snapshots keep moving; the others' by their own schedules
            assert settings["sampling_decay"] == [75, 0, 0.0075, 0.9] and settings["old_decay"] == [0, 0.25, 0.005, 0.9]
        protocols = {"cfg1_2steps", "cfg1_1steps", "cfg4.5_2steps", "policy_cfg1_2steps"}
        assert set(scores) == {"checkpoint", "adapter", "per_prompt", *protocols}
        assert set(scores["per_prompt"]) == protocols and scores["adapter"] == "sampling"
        assert all(0.0 <= scores[k] <= 1.0 for k in protocols)
        # every word's score is kept, in report["eval_words"]' order, for paired comparisons
        for protocol in protocols:
            assert len(scores["per_prompt"][protocol]) == 2
            assert np.mean(scores["per_prompt"][protocol]) == pytest.approx(scores[protocol])
        assert sorted(run["per_prompt"]) == ["0", "1", "2"]
        for step, mean in run["eval"]:
            assert np.mean(run["per_prompt"][str(step)], dtype=np.float32) == pytest.approx(mean, rel=1e-6)
    assert report["eval_words"] == split_words(SMALL_TASK, 0)["validation"][:2]
    # the control's per-prompt scores are its PP-OCR judge's, the reward's are the pool's: the same at the base
    assert report["runs"]["crd_klonly_seed3"]["per_prompt"]["0"] == report["runs"]["crd_seed3"]["per_prompt"]["0"]
    assert report["usage"]["trainers_cpu_s"] > 0 and report["usage"]["ocr_pool_threads_median"] >= 1
    # guidance.py scores the same checkpoints at more CFG scales: at the driver's protocols, the driver's scores
    from benchmark.ocr_proxy import guidance

    scales = guidance.main(guidance.Options(out=str(out), seeds=[3], guidances=[4.5, 1.0], ocr_workers=0))
    assert set(scales) == {"base", "crd_seed3", "nft_seed3"}
    for name in scales:
        for protocol in ("cfg1_2steps", "cfg4.5_2steps"):
            assert scales[name]["per_prompt"][protocol] == report["final_scores"][name]["per_prompt"][protocol]
    assert json.loads((out / "guidance.json").read_text())["scores"]["crd_seed3"]["policy_cfg4.5_2steps"] >= 0
    # sampled in two processes side by side, every final score is the driver's own, word by word
    from benchmark.ocr_proxy import final_scores

    speed = final_scores.main(final_scores.Options(out=str(out), workers=[2], ocr_workers=1,
                                                   json=str(tmp_path / "speed.json")))
    assert speed["scores"] == report["final_scores"] and speed["models"] == 5
    means = json.loads((tmp_path / "speed.json").read_text())["means"]
    assert means["crd_seed3"]["cfg1_2steps"] == report["final_scores"]["crd_seed3"]["cfg1_2steps"]
    # the driver's scoring of the last checkpoint reproduces the trainer's last validation (same sampler, seeds, words)
    assert report["final_scores"]["crd_seed3"]["cfg1_2steps"] == pytest.approx(report["runs"]["crd_seed3"]["eval"][-1][1])
    assert set(report["final_scores"]["base"]) == {"cfg1_2steps", "cfg1_1steps", "cfg4.5_2steps", "per_prompt"}
    assert (out / "curves.png").stat().st_size > 10_000 and (out / "benchmark.json").is_file()
    # the plot's title names the runs' own batch, not the driver's defaults (8 x 6)
    assert run_benchmark.batch_structure([out / "runs" / name for name in runs]) == "2 prompts x 2 images"
    assert "crd_seed3" in (out / "compare_seed3.md").read_text()
    assert "crd_klonly_seed3" in (out / "compare_klonly_seed3.md").read_text()
    assert sorted(p.name.split("_iteration")[0] for p in out.glob("grid_*.png")) == sorted(
        f"grid_{name}_{label}" for name in runs for label in ("first", "last"))


@pytest.mark.long
def test_a_benchmark_stopped_part_way_goes_on_with_resume_to_the_same_runs(tmp_path):
    """--resume: a benchmark that ended after 1 of its iterations (as --time-limit-s ends one) goes on from each run's
    checkpoint to the curves and adapters of a benchmark that ran straight through. The pool reads on OpenVINO
    (--ocr-engine openvino), so that the driver runs end to end on it too; the stopped benchmark's
    trainers start through blocking_sync.py (--blocking-sync), which must not change what they
    compute."""
    from benchmark.ocr_proxy import run_benchmark

    def bench(out, iterations, resume=False):
        args = run_benchmark.Args(out=str(tmp_path / out), pretrain=_tiny_args(tmp_path / "model"), seeds=[3],
                                  iterations=iterations, eval_every=1, eval_prompts=2, eval_split="validation",
                                  ocr_workers=1, prompts_per_rank=2, group_size=2, train_batch_size=2,
                                  algorithms=["crd"], final_scores=False, resume=resume, ocr_engine="openvino",
                                  blocking_sync=out == "stopped",
                                  # a guided KL anchor moves the adapters where every reward is 0
                                  trainer_args="--num-steps 3 --num-train-timesteps 1 --kl-cfg 4.5")
        return run_benchmark.main(args)

    straight = bench("straight", 2)
    bench("stopped", 1)
    resumed = bench("stopped", 2, resume=True)
    assert resumed["return_codes"] == {"crd_seed3": 0} and resumed["failed"] == []
    assert resumed["args"]["ocr_engine"] == "openvino"
    for tag in ("train/reward_mean", *run_benchmark.HELD_OUT_TAGS):
        curves = [run_benchmark.scalars(tmp_path / out / "runs" / "crd_seed3", tag) for out in ("straight", "stopped")]
        assert curves[0] == curves[1]
    assert [step for step, _ in resumed["runs"]["crd_seed3"]["eval"]] == [0, 1, 2]
    # both parts' iteration times: each part's first is a warm-up, so the summary's mean has none
    resumed_run = resumed["runs"]["crd_seed3"]
    assert [step for step, _ in resumed_run["iteration_s"]] == [1, 2]
    assert resumed_run["mean_iteration_excludes"] == [1, 2]
    assert resumed_run["mean_iteration_s"] is None
    adapters = [load_file(tmp_path / out / "runs" / "crd_seed3" / "global_step_2" / "adapters.safetensors")
                for out in ("straight", "stopped")]
    assert adapters[0].keys() == adapters[1].keys()
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    # the adapters moved: equal zeros would prove nothing
    assert any(v.count_nonzero() for k, v in adapters[1].items() if "lora_B" in k)
    log = (tmp_path / "stopped" / "runs" / "crd_seed3.log").read_text()
    assert log.index('"iterations": 1') < log.index("--resume-from latest:")  # appended: the first run's lines stay
    assert straight["runs"]["crd_seed3"]["eval"] == resumed["runs"]["crd_seed3"]["eval"]
    assert straight["runs"]["crd_seed3"]["per_prompt"] == resumed["runs"]["crd_seed3"]["per_prompt"]
    # the grids of the resumed run's first and last validation, not those of the first part
    assert sorted(p.name for p in (tmp_path / "stopped").glob("grid_*.png")) == [
        "grid_crd_seed3_first_iteration0.png", "grid_crd_seed3_last_iteration2.png"]


def test_a_resume_with_other_pretraining_settings_is_one_line_before_pretraining(tmp_path):
    """The pretraining cache would build another base for the changed settings, and the resumed runs would go on
    from it: --resume compares them with those of the benchmark's report first."""
    from benchmark.ocr_proxy import run_benchmark

    first = run_benchmark.Args(out=str(tmp_path / "bench"), pretrain=_tiny_args(tmp_path / "model"), eval_prompts=2)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "benchmark.json").write_text(json.dumps({"args": asdict(first)}))
    changed = replace(first, resume=True, pretrain=replace(first.pretrain, steps=6, out=str(tmp_path / "other")))
    with pytest.raises(SystemExit, match=re.escape(
            f"run_benchmark.py: error: --resume: the runs in {tmp_path / 'bench'} were trained on a base of other "
            f"--pretrain settings (--pretrain.steps); resume with those of {tmp_path / 'bench' / 'benchmark.json'}")):
        run_benchmark.main(changed)
    assert not (tmp_path / "model").exists() and not (tmp_path / "other").exists()
    run_benchmark.check_args(replace(changed, pretrain=replace(changed.pretrain, steps=first.pretrain.steps)))
    (tmp_path / "bench" / "benchmark.json").write_text('{"args": {')  # cut short
    with pytest.raises(SystemExit, match=re.escape(f"--resume: {tmp_path / 'bench' / 'benchmark.json'} is not this "
                                                   "driver's report (JSONDecodeError: ")):
        run_benchmark.main(changed)


def test_a_variant_written_algo_name_runs_only_that_algorithm():
    """A sweep gives each algorithm its own variants at the same budget: ALGO:NAME=ARGS runs ALGO alone."""
    from benchmark.ocr_proxy import run_benchmark

    args = run_benchmark.Args(seeds=[10, 11], variants=["default=", "crd:beta2=--crd-beta 2",
                                                          "dgpo:clip1e-5=--clip-range 1e-5"])
    arguments, jobs = run_benchmark.plan(args)
    assert arguments == {**{(a, "default"): "" for a in ("crd", "dgpo", "nft")},
                         ("crd", "beta2"): "--crd-beta 2", ("dgpo", "clip1e-5"): "--clip-range 1e-5"}
    assert sorted(run_benchmark.run_name(*job) for job in jobs) == sorted(
        [f"{a}_default_seed{s}" for a in ("crd", "dgpo", "nft") for s in (10, 11)]
        + [f"crd_beta2_seed{s}" for s in (10, 11)] + [f"dgpo_clip1e-5_seed{s}" for s in (10, 11)])
    # a colon after anything but an algorithm stays in the name (which check_args refuses)
    assert run_benchmark.variant_name("lr:1") == (None, "lr:1")
    # each algorithm's own chosen settings under one name: one run.sh compare table of the three
    args = run_benchmark.Args(seeds=[0], variants=["crd:tuned=--crd-beta 2", "dgpo:tuned=", "nft:tuned="])
    assert [run_benchmark.run_name(*job) for job in run_benchmark.plan(args)[1]] == [
        "crd_tuned_seed0", "dgpo_tuned_seed0", "nft_tuned_seed0"]


def test_the_sweep_choice_keeps_the_default_unless_a_second_half_gain_clears_its_interval():
    from dataclasses import asdict

    from benchmark.ocr_proxy import choose, run_benchmark

    args = run_benchmark.Args(seeds=[10, 11], algorithms=["crd", "dgpo"], eval_split="validation",
                              variants=["default=", "crd:b2=--crd-beta 2", "dgpo:c5=--clip-range 1e-5"])
    late = {"crd_default": 0.5, "crd_b2": 0.6, "dgpo_default": 0.4, "dgpo_c5": 0.4}
    difficulty = np.linspace(-0.2, 0.2, 8)  # of the 8 held-out words, shared by every run
    runs = {}
    for index, (algo, variant, seed) in enumerate(run_benchmark.plan(args)[1]):
        name = run_benchmark.run_name(algo, variant, seed)
        # b2 is the worst at iteration 20, the best from 40 on; seed 11 was cut at 60 by the time limit
        curve = [[0, 0.3], [20, 0.9 - late[f"{algo}_{variant}"]]] + [[i, late[f"{algo}_{variant}"]]
                                                                     for i in (40, 60, 80)]
        noise = np.random.default_rng(index).normal(0, 0.01, 8)  # each run's own images
        curve = curve[:4] if seed == 11 else curve
        per_prompt = {str(i): (score + difficulty + noise).tolist() for i, score in curve}
        runs[name] = {"eval": curve, "per_prompt": per_prompt}
    chosen, table = choose.choose({"args": asdict(args), "runs": runs})
    # b2's 0.1 clears its interval; c5 ties with the default, which a tie keeps
    assert chosen == {"crd": "crd:tuned=--crd-beta 2", "dgpo": "dgpo:tuned="}
    b2, c5 = table["variants"]["crd"]["b2"], table["variants"]["dgpo"]["c5"]
    assert b2["vs_default"]["low"] > 0 and c5["vs_default"]["low"] < 0 < c5["vs_default"]["high"]
    assert table["iterations"] == [40, 60]  # the second half of the 60 iterations every run reached
    assert b2["score"] == pytest.approx(0.6, abs=0.01) and b2["vs_default"]["diff"] == pytest.approx(0.1, abs=0.01)


@pytest.mark.parametrize("flags, message", [
    (dict(variants=["nft:b=--nft-beta 1"], algorithms=["crd"]),
     "--variants 'nft:b=--nft-beta 1': 'nft' is not one of --algorithms crd"),
    (dict(variants=["b=", "dgpo:b=--beta-dpo 30"]),
     "--variants 'dgpo:b=--beta-dpo 30': a second variant named 'b' for dgpo"),
    (dict(variants=["crd:b=--beta-dpo 30"]), "'--beta-dpo 30': not arguments of crd.py"),
    (dict(variants=["lr1e-4"]), "--variants 'lr1e-4': write NAME=TRAINER_ARGS"),
    (dict(variants=["=--learning-rate 1e-4"]), "--variants '=--learning-rate 1e-4': write NAME=TRAINER_ARGS"),
    (dict(trainer_args="--run-name 'a"), "--trainer-args \"--run-name 'a\": No closing quotation"),
    (dict(seeds=[0, 0]), "--seeds 0 0: give one or more distinct seeds"),
    (dict(iterations=0), "--iterations 0: must be at least 1"),
    (dict(eval_prompts=5), "--eval-prompts 5: more than the task's 4 test words (--pretrain.task.test-words)"),
    (dict(eval_prompts=5, eval_split="validation"),
     "--eval-prompts 5: more than the task's 4 validation words (--pretrain.task.validation-words)"),
    (dict(algorithms=[]), "--algorithms: give one or more of crd, dgpo, nft"),
    (dict(trainer_args="--lerning-rate 1e-4"), "'--lerning-rate 1e-4': not arguments of crd.py (see python crd.py --help)"),
    (dict(algorithms=["dgpo"], variants=["a=--clip-range -1"]), "--clip-range -1: must be a finite number >= 0"),
    (dict(kl_only_control=True, scorer="paddle"), "--kl-only-control: the reward that reads no text is served by"),
    (dict(kl_only_control=True, variants=["klonly=--seed 1"]), "--variants: the name 'klonly' is --kl-only-control's"),
    (dict(pretrain=dict(eval_every=0)), "pretrain.py: error: --eval-every 0: must be at least 1"),
    (dict(pretrain=dict(task=Task(alphabet="01", length=3))), "--task: 8 words of 3 symbols of '01': too few to hold"),
    (dict(pretrain=dict(task=Task(resolution=100))), "--task.resolution 100: must be a positive multiple of 16"),
    (dict(pretrain=dict(task=Task(alphabet="0011", length=3))), "--task.alphabet '0011': repeats a symbol"),
    (dict(pretrain=dict(task=Task(font_size=0))), "--task.font-size 0: must be at least 1"),
    (dict(pretrain=dict(prompt_dropout=2.0)), "--prompt-dropout 2: must be a finite number in [0, 1]"),
    (dict(pretrain=dict(learning_rate=float("nan"))), "--learning-rate nan: must be a finite number > 0"),
    (dict(ocr_engine="openvino", scorer="paddle"), "--ocr-engine openvino: the pool's runtime (--scorer pool)"),
    (dict(final_score_workers=-1), "--final-score-workers -1: 0 (the driver samples them) or more"),
    (dict(seeds=[-1]), "--seed -1: must be at least 0"),  # the trainers' check of every seed
    (dict(prompts_per_rank=0), "--prompts-per-rank 0: must be at least 1"),
    (dict(train_batch_size=7), "--train-batch-size 7 must be a multiple of --group-size 6 that divides the 48 images"),
    (dict(seeds=[0, 9999999999]), "--seed 9999999999: must be below 2^23"),
    (dict(out="file"), "run_benchmark.py: error: --out file: a file, not a directory"),
    (dict(out="file/sub"), "run_benchmark.py: error: --out file/sub: file is a file, not a directory"),
    (dict(pretrain=dict(out="file/sub/model")), "pretrain.py: error: --out file/sub/model: file is a file, not a dir"),
    (dict(pretrain=dict(task=Task(font_size=200, resolution=64))),  # the text is cut by the border
     "--task.font-size 200: '0000', the widest word of --task.length 4, does not fit the image of --task.resolution"),
    (dict(pretrain=dict(task=Task(font_size=1))), "--task: '0' renders without ink at --task.font-size 1"),
    (dict(pretrain=dict(task=Task(alphabet="αβγδεζηθικ"))),  # glyphs the font lacks: all drawn as the same box
     "'α' and 'β' render as the same image at --task.font-size 40"),
])
def test_the_benchmark_driver_names_a_bad_argument_before_pretraining(flags, message, tmp_path, monkeypatch):
    from benchmark.ocr_proxy import run_benchmark

    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("")  # in the way of the --out cases' directories
    tiny = _tiny_args(tmp_path / "model")
    pretrain_args = pretrain.Args(**{**vars(tiny), **flags.pop("pretrain", {})})
    args = run_benchmark.Args(pretrain=pretrain_args, **{"out": str(tmp_path / "bench"), "eval_prompts": 2, **flags})
    with pytest.raises(SystemExit, match=re.escape(message)):
        run_benchmark.main(args)
    assert not (tmp_path / "model").exists() and not (tmp_path / "bench").exists()


def test_pretraining_prints_progress_without_changing_what_it_trains(tmp_path):
    """pretrain.py with --progress-every-s 0 (a line at every step; 30 s by default, as a CPU run
    of minutes needs) trains what a run with no line between steps trains: the same validation
    history, autoencoder MSE and weights."""
    task = {"alphabet": "0123", "length": 3, "resolution": 64, "font-size": 20, "test-words": 4,
            "validation-words": 4}
    flags = [f"--task.{name}={value}" for name, value in task.items()]
    quiet = _tiny_args(tmp_path / "quiet")
    quiet.progress_every_s = 1e9
    for name in ("vae_steps", "vae_batch_size", "steps", "batch_size", "eval_every", "eval_words",
                 "validation_steps", "rollout_steps", "target", "ocr_workers"):
        flags += [f"--{name.replace('_', '-')}", str(getattr(quiet, name))]
    # forked from tests/zygote.py's server where the worker has one: torch and diffusers imported
    result = zygote.run([sys.executable, "benchmark/ocr_proxy/pretrain.py", "--out",
                         str(tmp_path / "loud"), "--device", "cpu", "--model", "tiny", *flags,
                         "--progress-every-s", "0"], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [line for line in result.stdout.splitlines()
             if re.match(r"pretrain: \w+ step \d", line)]
    expected = [("autoencoder", i, 2) for i in (1, 2)]
    expected += [("transformer", i, 4) for i in range(1, 5)]
    assert [re.match(r"pretrain: (\w+) step (\d+)/(\d+), loss \d+\.\d{4}, \d+ s$", line).groups()
            for line in steps] == [(what, str(i), str(n)) for what, i, n in expected], result.stdout
    pretrain.pretrain(quiet)
    loud, calm = (json.loads((tmp_path / name / "proxy.json").read_text())
                  for name in ("loud", "quiet"))
    untimed = lambda history: [{k: v for k, v in e.items() if k != "train_s"} for e in history]
    assert untimed(loud["history"]) == untimed(calm["history"])
    assert loud["vae_mse"] == calm["vae_mse"]
    assert loud["config"] == calm["config"]  # how often it prints is no part of the model's
    for weights in ("transformer", "text_encoder", "vae"):
        (file,) = (tmp_path / "loud" / weights).glob("*.safetensors")
        assert file.read_bytes() == (tmp_path / "quiet" / weights / file.name).read_bytes(), weights


def test_blocking_sync_runs_a_script_as_python_would(tmp_path):
    """blocking_sync.py hands the script its arguments, __name__ == "__main__", its own directory
    first on sys.path and its exit status (without a CUDA driver, as here, it only runs it); a
    missing script is one line."""
    script = tmp_path / "tool" / "script.py"
    script.parent.mkdir()
    script.write_text("import json, sys\n"
                      "print(json.dumps([__name__, sys.argv, sys.path[0], __file__]))\n"
                      "sys.exit(3)\n")
    launcher = ROOT / "benchmark" / "ocr_proxy" / "blocking_sync.py"
    ran = subprocess.run([sys.executable, str(launcher), str(script), "--flag", "a b"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert ran.returncode == 3, ran.stderr
    name, argv, first_path, file = json.loads(ran.stdout)
    assert (name, argv) == ("__main__", [str(script), "--flag", "a b"])
    assert (first_path, file) == (str(script.parent), str(script))
    missing = subprocess.run([sys.executable, str(launcher), "nothing.py"], capture_output=True,
                             text=True, cwd=tmp_path)
    assert missing.returncode == 1
    assert missing.stderr.strip() == "blocking_sync.py: error: nothing.py: no such script"
