"""The OCR proxy's statistics: compare.difference's intervals (exact, calibrated, powered),
compare.py on a benchmark.json, and choose.py's rule on a sweep."""

import json
import math
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from benchmark.ocr_proxy import choose, run_benchmark
from benchmark.ocr_proxy import compare
from benchmark.ocr_proxy.compare import difference

COMPARE = Path(__file__).resolve().parents[1] / "benchmark" / "ocr_proxy" / "compare.py"
PROMPTS = 128
# a row of compare.py's difference tables: | a - b | diff | [low, high] | mde | yes/no |
ROW = re.compile(r"^\| (?P<pair>[^|]+) \| (?P<diff>[+-][\d.]+) \| \[(?P<low>[+-][\d.]+), "
                 r"(?P<high>[+-][\d.]+)\] \| (?P<mde>[\d.]+) \| (?P<excludes>yes|no) \|$", re.M)


def synthetic(rng, prompt_effect, shift=0.0, seeds=10, seed_effect=None, seed_sd=0.01, noise=0.1):
    """X[s, p] = 0.5 + shift + seed effect + prompt effect (shared by the groups) + this group's
    interaction with the prompt + the image's noise."""
    if seed_effect is None:
        seed_effect = rng.normal(0, seed_sd, seeds)
    interaction = rng.normal(0, 0.03, prompt_effect.size)
    image_noise = rng.normal(0, noise, (seeds, prompt_effect.size))
    return 0.5 + shift + seed_effect[:, None] + prompt_effect + interaction + image_noise


def pair(rng, shift=0.0, seeds=10, paired_seeds=False):
    """Two groups on shared prompts; paired: their seeds' effects are the same."""
    prompt_effect = rng.normal(0, 0.15, PROMPTS)
    seed_effect = rng.normal(0, 0.01, seeds) if paired_seeds else None
    a = synthetic(rng, prompt_effect, shift, seeds, seed_effect)
    return a, synthetic(rng, prompt_effect, 0.0, seeds, seed_effect)


def mean(values):
    return sum(values) / len(values)


def variance(values):
    return sum((v - mean(values)) ** 2 for v in values) / (len(values) - 1)


def residual(x):
    """The two-way ANOVA residual mean square, by loops."""
    seeds, prompts = len(x), len(x[0])
    rows = [mean(row) for row in x]
    columns = [mean([row[p] for row in x]) for p in range(prompts)]
    grand = mean(rows)
    total = 0.0
    for s in range(seeds):
        for p in range(prompts):
            total += (x[s][p] - rows[s] - columns[p] + grand) ** 2
    return total / ((seeds - 1) * (prompts - 1))


def reference(a, b, mode):
    """(V, df) of the module docstring's formulas, by loops over Python floats."""
    a, b = a.tolist(), b.tolist()
    prompts = len(a[0])

    def columns(x):
        return [mean([row[p] for row in x]) for p in range(prompts)]

    def one_sample(x):
        seeds = len(x)
        return [(variance([mean(row) for row in x]) / seeds, seeds - 1),
                (max(0.0, variance(columns(x)) - residual(x) / seeds) / prompts, prompts - 1)]

    if mode == "paired_seeds":
        components = one_sample([[u - v for u, v in zip(ra, rb)] for ra, rb in zip(a, b)])
    elif mode == "pair_prompts":
        d = [u - v for u, v in zip(columns(a), columns(b))]
        interaction = variance(d) - residual(a) / len(a) - residual(b) / len(b)
        components = [(variance([mean(row) for row in a]) / len(a), len(a) - 1),
                      (variance([mean(row) for row in b]) / len(b), len(b) - 1),
                      (max(0.0, interaction) / prompts, prompts - 1)]
    else:
        components = one_sample(a) + one_sample(b)
    total = sum(c for c, _ in components)
    return total, total**2 / sum(c**2 / df for c, df in components if c > 0)


@pytest.mark.parametrize("mode", ["pair_prompts", "paired_seeds", "own_prompts"])
def test_the_variance_is_the_formulas_by_explicit_loops_on_a_small_example(mode):
    rng = np.random.default_rng(1)
    # a strong group-by-prompt interaction, so that the prompt term is above its clip at 0
    a = rng.normal(0.5, 0.1, (3, 4)) + np.array([0.3, -0.2, 0.1, 0.0])
    b = rng.normal(0.4, 0.1, (3, 4))
    flags = {"pair_prompts": {}, "paired_seeds": {"paired_seeds": True},
             "own_prompts": {"pair_prompts": False}}[mode]
    result = difference(a, b, **flags)
    expected, df = reference(a, b, mode)
    assert result["se"] ** 2 == pytest.approx(expected, rel=1e-12)
    assert result["df"] == pytest.approx(df, rel=1e-12)
    assert result["diff"] == pytest.approx(a.mean() - b.mean(), rel=1e-12)
    assert (result["n_seeds_a"], result["n_seeds_b"], result["n_prompts"]) == (3, 3, 4)
    half = stats.t.ppf(0.975, df) * math.sqrt(expected)
    assert (result["low"], result["high"]) == pytest.approx((a.mean() - b.mean() - half,
                                                             a.mean() - b.mean() + half), rel=1e-12)
    mde = half + stats.t.ppf(0.8, df) * math.sqrt(expected)
    assert result["mde"] == pytest.approx(mde, rel=1e-12)


def test_an_interaction_below_its_noise_is_clipped_at_zero():
    """b = a + 0.1: the per-prompt difference is constant, so only the seeds' terms remain."""
    a = np.random.default_rng(2).normal(0.5, 0.1, (3, 4))
    result = difference(a + 0.1, a)
    assert result["diff"] == pytest.approx(0.1, rel=1e-12)
    assert result["se"] ** 2 == pytest.approx(2 * np.var(a.mean(axis=1), ddof=1) / 3, rel=1e-12)
    assert result["df"] == pytest.approx(4.0, rel=1e-12)  # two equal terms of 2 df each


@pytest.mark.parametrize("flags", [{}, {"paired_seeds": True}, {"pair_prompts": False}])
def test_shifts_swaps_and_permutations_leave_the_interval_as_it_should(flags):
    rng = np.random.default_rng(3)
    a, b = pair(rng, shift=0.02, seeds=5)
    result = difference(a, b, **flags)
    shifted = difference(a + 0.25, b + 0.25, **flags)
    assert shifted["diff"] == pytest.approx(result["diff"], rel=1e-9)
    width = result["high"] - result["low"]
    assert shifted["high"] - shifted["low"] == pytest.approx(width, rel=1e-9)
    swapped = difference(b, a, **flags)
    assert swapped["diff"] == pytest.approx(-result["diff"], rel=1e-12)
    assert (swapped["low"], swapped["high"]) == pytest.approx((-result["high"], -result["low"]),
                                                              rel=1e-12)
    prompts = rng.permutation(PROMPTS)
    seeds_a = rng.permutation(5)
    seeds_b = seeds_a if flags.get("paired_seeds") else rng.permutation(5)
    for permuted in (difference(a[:, prompts], b[:, prompts], **flags),
                     difference(a[seeds_a], b[seeds_b], **flags)):
        assert permuted.keys() == result.keys()
        for key, value in result.items():
            assert permuted[key] == pytest.approx(value, rel=1e-12), key


def test_one_seed_mismatched_prompts_and_unequal_pairs_are_refused():
    a = np.zeros((3, 4))
    with pytest.raises(ValueError, match="one seed: its seed variance is unknown"):
        difference(a, np.zeros((1, 4)))
    with pytest.raises(ValueError, match=re.escape("shapes (3, 4) and (3, 5)")):
        difference(a, np.zeros((3, 5)))
    with pytest.raises(ValueError, match="paired seeds: 3 and 2 seeds"):
        difference(a, np.zeros((2, 4)), paired_seeds=True)


@pytest.mark.parametrize("paired_seeds", [False, True])
def test_the_95_percent_interval_covers_no_difference_about_95_percent_of_the_time(paired_seeds):
    rng = np.random.default_rng(4)
    covered = [difference(*pair(rng, paired_seeds=paired_seeds), paired_seeds=paired_seeds)
               for _ in range(400)]
    rate = np.mean([r["low"] <= 0 <= r["high"] for r in covered])
    assert 0.92 <= rate <= 0.98


def test_a_true_shift_is_detected_and_the_mde_is_detected_80_percent_of_the_time():
    rng = np.random.default_rng(5)
    shifted = [difference(*pair(rng, shift=0.03)) for _ in range(400)]
    assert np.mean([r["low"] > 0 for r in shifted]) >= 0.8
    assert max(r["mde"] for r in shifted) <= 0.03
    mde = float(np.median([r["mde"] for r in shifted]))
    at_mde = [difference(*pair(rng, shift=mde)) for _ in range(400)]
    assert 0.65 <= np.mean([r["low"] > 0 for r in at_mde]) <= 0.92


def test_shared_prompts_narrow_the_interval_several_fold():
    a, b = pair(np.random.default_rng(6), shift=0.03)
    shared = difference(a, b)
    own = difference(a, b, pair_prompts=False)
    assert shared["diff"] == own["diff"]
    assert (shared["high"] - shared["low"]) < 0.5 * (own["high"] - own["low"])
    # the shift shows only where the prompts' difficulty cancels
    assert shared["low"] > 0 > own["low"]


def benchmark_report(rng, with_per_prompt=True):
    """A benchmark.json of 5 seeds of CRD and DGPO with their KL-only controls: CRD 0.1 ahead of
    the rest at the last validation and at the final scores, one CRD run validated once more."""
    args = run_benchmark.Args(seeds=[0, 1, 2, 3, 4], algorithms=["crd", "dgpo"],
                              kl_only_control=True)
    prompt_effect = rng.normal(0, 0.15, PROMPTS)
    report = {"args": asdict(args), "runs": {}, "final_scores": {"base": {}}}
    for algo, variant, seed in run_benchmark.plan(args)[1]:
        name = run_benchmark.run_name(algo, variant, seed)
        shift = 0.1 if (algo, variant) == ("crd", "") else 0.0
        last = synthetic(rng, prompt_effect, shift, seeds=1)[0]
        per_prompt = {"0": synthetic(rng, prompt_effect, seeds=1)[0].tolist(), "50": last.tolist()}
        if name == "crd_seed0":
            per_prompt["75"] = last.tolist()
        curve = [[int(i), float(np.mean(s))] for i, s in per_prompt.items()]
        report["runs"][name] = {"eval": curve}
        report["final_scores"][name] = {"checkpoint": "global_step_50", "cfg1_40steps": last.mean(),
                                        "per_prompt": {"cfg1_40steps": last.tolist()}}
        if with_per_prompt:
            report["runs"][name]["per_prompt"] = per_prompt
        else:
            del report["final_scores"][name]["per_prompt"]
    base = synthetic(rng, prompt_effect, seeds=1)[0]
    report["final_scores"]["base"] = {"cfg1_40steps": base.mean(),
                                      "per_prompt": {"cfg1_40steps": base.tolist()}}
    return report


def run_compare(*arguments):
    return subprocess.run([sys.executable, str(COMPARE), *map(str, arguments)], capture_output=True,
                          text=True, check=False)


def test_compare_prints_each_pair_and_the_reward_attributable_gain_with_intervals(tmp_path):
    report = benchmark_report(np.random.default_rng(7))
    (tmp_path / "benchmark.json").write_text(json.dumps(report))
    (tmp_path / "result.json").write_text(json.dumps({"date": "2025-01-01", "commit": "abc",
                                                      "benchmark": report}))
    bare = run_compare(tmp_path / "benchmark.json", "--json", tmp_path / "numbers.json")
    assert bare.returncode == 0, bare.stderr
    sections = bare.stdout.split("\n### ")[1:]
    # the last validation of every run (crd_seed0's extra one is not), then the final scores
    assert [s.splitlines()[0] for s in sections] == ["validation at iteration 50 (128 prompts)",
                                                     "cfg1_40steps (128 prompts)"]
    assert "| base |" in sections[1] and "| base |" not in sections[0]
    for section in sections:
        assert "| crd | " in section and "| 5 |" in section
        pairs, gains = section.split("reward-attributable gain (paired by seed)")
        rows = {m["pair"]: m for m in ROW.finditer(pairs)}
        assert len(rows) == 6  # every pair of the 4 groups
        gain = {m["pair"]: m for m in ROW.finditer(gains)}
        assert list(gain) == ["crd - crd klonly", "dgpo - dgpo klonly"]
        for row in (rows["crd - dgpo"], rows["crd - crd klonly"], gain["crd - crd klonly"]):
            assert float(row["low"]) > 0 and row["excludes"] == "yes"
            assert float(row["low"]) < float(row["diff"]) < float(row["high"])
    numbers = json.loads((tmp_path / "numbers.json").read_text())
    validation = numbers["validation at iteration 50"]
    assert validation["groups"]["crd"]["seeds"] == [0, 1, 2, 3, 4]
    first = validation["differences"][0]
    assert (first["a"], first["b"]) == ("crd", "crd klonly")
    assert f"[{first['low']:+.3f}, {first['high']:+.3f}]" in sections[0]
    assert validation["reward_attributable"][0]["n_seeds_a"] == 5
    assert not list(tmp_path.glob(".*.tmp"))

    wrapped = run_compare(tmp_path / "result.json")
    assert wrapped.returncode == 0, wrapped.stderr
    assert wrapped.stdout.replace("result.json", "benchmark.json") == bare.stdout
    earlier = run_compare(tmp_path / "benchmark.json", "--iteration", 0)
    assert "### validation at iteration 0 (128 prompts)" in earlier.stdout


def test_compare_names_a_report_without_per_prompt_scores_in_one_line(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"benchmark": benchmark_report(np.random.default_rng(8), False)}))
    result = run_compare(path)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"compare.py: error: {path}: no per-prompt scores (runs[...]['per_prompt']): written by a "
        "run_benchmark.py from before them, so no intervals"]


def sweep(rng, variants, seeds=(0, 1, 2)):
    """A sweep's benchmark.json: variants {NAME: (shift, seed sd)} of CRD, validated at 0, 50 and
    100."""
    written = [f"crd:{name}=--crd-beta {i + 1}" for i, name in enumerate(variants)]
    args = run_benchmark.Args(seeds=list(seeds), algorithms=["crd"], eval_split="validation",
                              variants=written)
    prompt_effect = rng.normal(0, 0.15, PROMPTS)
    runs = {}
    for name, (shift, seed_sd) in variants.items():
        scores = synthetic(rng, prompt_effect, shift, len(seeds), seed_sd=seed_sd, noise=0.05)
        for seed, row in zip(seeds, scores):
            # iteration 0 is the base for every variant; the rule averages 50 and 100
            per_prompt = {"0": [0.2] * PROMPTS, "50": row.tolist(), "100": row.tolist()}
            runs[run_benchmark.run_name("crd", name, seed)] = {"per_prompt": per_prompt}
    return {"args": asdict(args), "runs": runs}


def test_choose_keeps_the_default_where_a_variant_leads_by_noise_and_takes_a_real_gain():
    noise = sweep(np.random.default_rng(10), {"default": (0.0, 0.01), "same": (0.0, 0.01)})
    chosen, table = choose.choose(noise)
    rows = table["variants"]["crd"]
    assert rows["same"]["score"] > rows["default"]["score"]  # the highest mean would take it
    assert rows["same"]["vs_default"]["low"] < 0 and rows["chosen"] == "default"
    assert chosen == {"crd": "crd:tuned=--crd-beta 1"}
    assert table["iterations"] == [50, 100]

    real = sweep(np.random.default_rng(9), {"first": (0.0, 0.01), "better": (0.05, 0.01)})
    chosen, table = choose.choose(real, name="picked")
    assert table["variants"]["crd"]["better"]["vs_default"]["low"] > 0  # vs "first": no "default"
    assert chosen == {"crd": "crd:picked=--crd-beta 2"}


def test_choose_takes_the_largest_lower_bound_not_the_largest_mean():
    report = sweep(np.random.default_rng(14), {"default": (0.0, 0.002), "steady": (0.05, 0.002),
                                                "erratic": (0.07, 0.02)})
    chosen, table = choose.choose(report)
    rows = table["variants"]["crd"]
    assert rows["erratic"]["score"] > rows["steady"]["score"]
    assert rows["steady"]["vs_default"]["low"] > rows["erratic"]["vs_default"]["low"] > 0
    assert rows["chosen"] == "steady" and chosen == {"crd": "crd:tuned=--crd-beta 2"}


def test_choose_needs_two_seeds():
    report = sweep(np.random.default_rng(12), {"default": (0.0, 0.01), "b": (0.1, 0.01)},
                   seeds=(4,))
    message = "choose.py: error: the sweep ran one seed (--seeds 4): the rule's interval needs two"
    with pytest.raises(SystemExit, match=re.escape(message)):
        choose.choose(report)


def test_results_md_shows_the_table_compare_prints_for_the_ten_seed_result():
    """RESULTS.md's intervals are compare.py's on the committed result file, row for row."""
    root = COMPARE.parents[2]
    result = root / "benchmark" / "results" / "ocr_proxy_three_way_10seeds_h200.json"
    printed = subprocess.run([sys.executable, str(COMPARE), str(result)], capture_output=True,
                             text=True, check=True).stdout
    validation = printed.split("### validation at iteration 225")[1].split("###")[0]
    rows = [line for line in validation.splitlines() if line.startswith("| ")]
    assert len(ROW.findall(validation)) == 3 and len(rows) == 8  # 3 groups, 3 pairs, 2 headers
    shown = (root / "benchmark" / "RESULTS.md").read_text()
    assert [row for row in rows if row not in shown] == []


def test_results_md_shows_compare_s_numbers_for_diffusionnft_at_crd_s_kl_weight(tmp_path):
    """Each row of RESULTS.md's KL-weight table is compare.py's on the committed file."""
    root = COMPARE.parents[2]
    result = root / "benchmark" / "results" / "ocr_proxy_nft_kl_h200.json"
    numbers = tmp_path / "numbers.json"
    subprocess.run([sys.executable, str(COMPARE), str(result), "--json", str(numbers)],
                   capture_output=True, text=True, check=True)
    protocols = json.loads(numbers.read_text())
    shown = (root / "benchmark" / "RESULTS.md").read_text()
    for scale in ("1", "1.5", "3", "4.5"):
        protocol = protocols[f"cfg{scale}_40steps"]
        groups = protocol["groups"]
        pair = next(d for d in protocol["differences"]
                    if (d["a"], d["b"]) == ("nft kl0.1", "nft tuned"))
        interval = f"{signed(pair['diff'])} [{signed(pair['low'])}, {signed(pair['high'])}]"
        row = (f"| {scale} | {protocol['base']:.3f} | {groups['nft tuned']['mean']:.3f} | "
               f"{groups['nft kl0.1']['mean']:.3f} | {interval} | {pair['mde']:.3f} |")
        assert row in shown, row
    assert len(groups["nft kl0.1"]["seeds"]) == 3 and len(groups["nft tuned"]["seeds"]) == 5


MERGE = COMPARE.with_name("merge.py")
FIVE_SEEDS = COMPARE.parents[2] / "benchmark" / "results" / "ocr_proxy_three_way_5seeds_h200.json"


def part_of(report, seeds):
    """The report run_benchmark.py would have written for `seeds` alone."""
    keep = {name for name in report["runs"] if int(name.rpartition("_seed")[2]) in seeds}
    return {**report, "args": {**report["args"], "seeds": seeds},
            "runs": {name: run for name, run in report["runs"].items() if name in keep},
            "return_codes": {n: c for n, c in report["return_codes"].items() if n in keep},
            "final_scores": {n: s for n, s in report["final_scores"].items()
                             if n in keep or n == "base"}}


def run_merge(out, *reports):
    return subprocess.run([sys.executable, str(MERGE), str(out), *map(str, reports)],
                          capture_output=True, text=True, check=False)


def test_merging_a_result_split_by_seeds_gives_compare_s_tables_back(tmp_path):
    """The 5-seed result split into seeds 0-2 and 3-4 (as if run in two calls) and merged again:
    compare.py prints the same tables as on the committed file."""
    report = json.loads(FIVE_SEEDS.read_text())["benchmark"]
    (tmp_path / "a.json").write_text(json.dumps(part_of(report, [0, 1, 2])))
    (tmp_path / "b.json").write_text(json.dumps({"benchmark": part_of(report, [3, 4])}))
    merged = run_merge(tmp_path / "merged.json", tmp_path / "a.json", tmp_path / "b.json")
    assert merged.returncode == 0, merged.stderr
    assert merged.stdout.startswith("merge.py: 15 runs (crd, dgpo, nft; seeds 0-4) of 2 reports")
    content = json.loads((tmp_path / "merged.json").read_text())
    assert [part["seeds"] for part in content["parts"]] == [[0, 1, 2], [3, 4]]
    before = run_compare(FIVE_SEEDS)
    after = run_compare(tmp_path / "merged.json")
    assert after.returncode == 0, after.stderr
    assert after.stdout.split("\n", 1)[1] == before.stdout.split("\n", 1)[1]
    assert after.stdout.count("| 5 |") == before.stdout.count("| 5 |") > 0


def test_merge_joins_a_part_validated_less_often_and_scored_only_at_validation(tmp_path):
    """Seeds 3-4 as if validated every 75 iterations and run without final scores: merged, the
    validation at 225 gives the committed file's table, and the final scores keep the base and the
    three seeds that have them."""
    report = json.loads(FIVE_SEEDS.read_text())["benchmark"]
    sparse = part_of(report, [3, 4])
    sparse["args"] = {**sparse["args"], "eval_every": 75, "final_scores": False}
    sparse["runs"] = {name: {**run, "per_prompt": {i: run["per_prompt"][i]
                                                   for i in ("0", "75", "150", "225")}}
                      for name, run in sparse["runs"].items()}
    sparse["final_scores"] = {}
    (tmp_path / "a.json").write_text(json.dumps(part_of(report, [0, 1, 2])))
    (tmp_path / "b.json").write_text(json.dumps(sparse))
    merged = run_merge(tmp_path / "merged.json", tmp_path / "a.json", tmp_path / "b.json")
    assert merged.returncode == 0, merged.stderr
    content = json.loads((tmp_path / "merged.json").read_text())
    assert content["final_scores"]["base"] == report["final_scores"]["base"]
    before = run_compare(FIVE_SEEDS).stdout.split("### ")[1]
    tables = run_compare(tmp_path / "merged.json").stdout.split("### ")
    assert tables[1] == before and before.startswith("validation at iteration 225")
    final = tables[2]
    assert final.startswith("cfg1_40steps") and final.count("| 3 |") == 3 and "| base |" in final


@pytest.mark.parametrize("change, message", [
    (lambda r: r["args"].update(trainer_args="--kl-cfg 4.5"),
     "--trainer-args '--kl-cfg 4.5' where {a} has ''"),
    (lambda r: r["args"]["pretrain"].update(steps=100),
     "--pretrain.steps 100 where {a} has 30000"),
    (lambda r: r["eval_words"].reverse(), "other held-out words than {a}'s"),
    (lambda r: r["final_scores"]["base"]["per_prompt"]["cfg4.5_40steps"].reverse(),
     "the base scores other per-prompt values at cfg4.5_40steps than in {a}: another pretrained "
     "base"),
    (lambda r: r["args"]["variants"].__setitem__(0, "crd:tuned=--crd-beta 1"),
     "variant crd:tuned runs '--crd-beta 1' where {a} ran '--crd-beta 0.5'"),
    (lambda r: r["runs"].update(crd_tuned_seed0={}), "run crd_tuned_seed0 is also in {a} and does "
     "not reproduce it: the two share no validation after iteration 0"),
    (lambda r: r["args"].update(ocr_engine="openvino"), "--ocr-engine openvino where {a} ran "
     "onnxruntime, and no run held by a report of each shows that the two read alike"),
])
def test_merge_refuses_reports_of_another_design_in_one_line(tmp_path, change, message):
    report = json.loads(FIVE_SEEDS.read_text())["benchmark"]
    (tmp_path / "a.json").write_text(json.dumps(part_of(report, [0, 1, 2])))
    second = part_of(report, [3, 4])
    change(second)
    (tmp_path / "b.json").write_text(json.dumps(second))
    result = run_merge(tmp_path / "merged.json", tmp_path / "a.json", tmp_path / "b.json")
    assert result.returncode == 1 and result.stdout == ""
    expected = f"merge.py: error: {tmp_path / 'b.json'}: " + message.format(a=tmp_path / "a.json")
    assert result.stderr.splitlines() == [expected]
    assert not (tmp_path / "merged.json").exists()


def test_merge_keeps_once_a_run_two_reports_hold_where_it_reproduces(tmp_path):
    """Seed 2 in both parts, and the second part on OpenVINO: the reproduced runs are kept once and
    listed, the runtimes' reads count as alike, and compare.py gives the committed tables back. A
    report written before --ocr-engine existed ran ONNX Runtime."""
    report = json.loads(FIVE_SEEDS.read_text())["benchmark"]
    first = part_of(report, [0, 1, 2])
    first["args"].pop("ocr_engine", None)
    second = part_of(report, [2, 3, 4])
    second["args"]["ocr_engine"] = "openvino"
    (tmp_path / "a.json").write_text(json.dumps(first))
    (tmp_path / "b.json").write_text(json.dumps(second))
    merged = run_merge(tmp_path / "merged.json", tmp_path / "a.json", tmp_path / "b.json")
    assert merged.returncode == 0, merged.stderr
    content = json.loads((tmp_path / "merged.json").read_text())
    assert len(content["runs"]) == 15 and content["args"]["ocr_engine"] == ["onnxruntime",
                                                                             "openvino"]
    assert [r["run"] for r in content["reproduced"]] == [f"{a}_tuned_seed2"
                                                         for a in ("crd", "dgpo", "nft")]
    assert [part["ocr_engine"] for part in content["parts"]] == ["onnxruntime", "openvino"]
    after = run_compare(tmp_path / "merged.json")
    assert after.stdout.split("\n", 1)[1] == run_compare(FIVE_SEEDS).stdout.split("\n", 1)[1]


@pytest.mark.parametrize("where, message", [
    ("validation", "the validation at iteration 150 differs"),
    ("final", "the final score at cfg4.5_40steps differs"),
])
def test_merge_refuses_a_run_two_reports_hold_that_does_not_reproduce(tmp_path, where, message):
    report = json.loads(FIVE_SEEDS.read_text())["benchmark"]
    second = json.loads(json.dumps(part_of(report, [2, 3, 4])))
    if where == "validation":
        scores = second["runs"]["dgpo_tuned_seed2"]["per_prompt"]["150"]
    else:
        scores = second["final_scores"]["dgpo_tuned_seed2"]["per_prompt"]["cfg4.5_40steps"]
    scores[7] = 1.0 - scores[7]
    (tmp_path / "a.json").write_text(json.dumps(part_of(report, [0, 1, 2])))
    (tmp_path / "b.json").write_text(json.dumps(second))
    result = run_merge(tmp_path / "merged.json", tmp_path / "a.json", tmp_path / "b.json")
    assert result.returncode == 1 and not (tmp_path / "merged.json").exists()
    assert result.stderr.splitlines() == [
        f"merge.py: error: {tmp_path / 'b.json'}: run dgpo_tuned_seed2 is also in "
        f"{tmp_path / 'a.json'} and does not reproduce it: {message}"]


def test_compare_of_some_seeds_is_compare_of_a_report_of_those_seeds_alone(tmp_path):
    """--seeds 3 4 reads the 5-seed file as a report of seeds 3-4 would read (tables, final scores
    and the base's row); a seed no run has is one line."""
    report = json.loads(FIVE_SEEDS.read_text())["benchmark"]
    (tmp_path / "part.json").write_text(json.dumps(part_of(report, [3, 4])))
    some = run_compare(FIVE_SEEDS, "--seeds", "3", "4")
    alone = run_compare(tmp_path / "part.json")
    assert some.returncode == 0, some.stderr
    assert some.stdout.split("\n", 1)[1] == alone.stdout.split("\n", 1)[1]
    assert some.stdout.count("| 2 |") == 3 * some.stdout.count("### ") > 0
    missing = run_compare(FIVE_SEEDS, "--seeds", "99")
    assert missing.returncode == 1 and missing.stderr.splitlines() == [
        f"compare.py: error: --seeds 99: no run of {FIVE_SEEDS} has one of them"]


def test_the_ten_seed_file_holds_the_five_seed_runs_unchanged_and_ten_seeds_of_each():
    ten = json.loads((FIVE_SEEDS.parent / "ocr_proxy_three_way_10seeds_h200.json").read_text())
    five = json.loads(FIVE_SEEDS.read_text())["benchmark"]
    runs, finals = ten["benchmark"]["runs"], ten["benchmark"]["final_scores"]
    assert {name: runs[name] for name in five["runs"]} == five["runs"]
    assert {name: finals[name] for name in five["final_scores"]} == five["final_scores"]
    assert sorted(runs) == sorted(f"{algo}_tuned_seed{seed}" for algo in ("crd", "dgpo", "nft")
                                  for seed in range(10))
    assert all(run["iterations"] == 225 for run in runs.values())


@pytest.mark.parametrize("algo, name, file", [
    ("crd", "CRD", "ocr_proxy_guided_anchor_control_h200.json"),
    ("dgpo", "DGPO", "ocr_proxy_guided_anchor_control_dgpo_h200.json")])
def test_results_md_shows_the_guided_anchor_s_reward_attributable_gain_and_its_context(algo, name,
                                                                                     file):
    """The guided-anchor section's numbers: compare.py's paired gain at iteration 200, and the
    file's comparison with the unguided-anchor runs, recomputed from the two files."""
    results = COMPARE.parents[2] / "benchmark" / "results"
    path = results / file
    printed = run_compare(path, "--iteration", 200).stdout
    validation = printed.split("### validation at iteration 200")[1].split("###")[0]
    gain = validation.split("reward-attributable gain (paired by seed)")[1]
    row = next(ROW.finditer(gain))
    shown = (COMPARE.parents[2] / "benchmark" / "RESULTS.md").read_text()
    section = shown.split("## The guided KL anchor beside a reward-blind control")[1]
    section = section.split("\n## ")[0]
    assert f"{name} **{row['diff']} [{row['low']}, {row['high']}]** (MDE {row['mde']}" in section
    guided = json.loads(path.read_text())
    unguided = json.loads((results / "ocr_proxy_three_way_10seeds_h200.json").read_text())
    assert guided["benchmark"]["args"]["algorithms"] == [algo]

    def at_200(runs, name):
        return np.array([runs[name.format(seed)]["per_prompt"]["200"] for seed in range(3)])

    rewarded = at_200(guided["benchmark"]["runs"], algo + "_seed{}")
    control = at_200(guided["benchmark"]["runs"], algo + "_klonly_seed{}")
    kl_cfg1 = at_200(unguided["benchmark"]["runs"], algo + "_tuned_seed{}")
    for a, key in ((rewarded, f"{algo} (kl-cfg 4.5)"), (control, f"{algo} klonly (kl-cfg 4.5)")):
        expected = difference(a, kl_cfg1)
        assert guided["against_kl_cfg1"][f"{key} - {algo} tuned (kl-cfg 1)"] == expected
        assert (f"{signed(expected['diff'])} [{signed(expected['low'])}, "
                f"{signed(expected['high'])}]") in section
    column = ("CRD", "DGPO").index(name) + 2
    rows = {line.split(" | ")[0].lstrip("| "): line.strip("| ").split(" | ")[column - 1]
            for line in section.splitlines() if line.startswith("| ") and " | " in line}
    assert rows["guided anchor (`--kl-cfg 4.5`)"] == f"{rewarded.mean():.3f}"
    assert rows["its reward-blind control"] == f"{control.mean():.3f}"
    assert rows["unguided anchor (`--kl-cfg 1`; the 10-seed file's seeds 0–2)"] == \
        f"{kl_cfg1.mean():.3f}"


def test_results_md_compares_crd_and_dgpo_under_the_guided_anchor():
    """The files' CRD - DGPO differences under the guided anchor, recomputed from the runs, are
    the section's."""
    results = COMPARE.parents[2] / "benchmark" / "results"
    crd = json.loads((results / "ocr_proxy_guided_anchor_control_h200.json").read_text())
    dgpo = json.loads((results / "ocr_proxy_guided_anchor_control_dgpo_h200.json").read_text())
    shown = (COMPARE.parents[2] / "benchmark" / "RESULTS.md").read_text()
    section = shown.split("## The guided KL anchor beside a reward-blind control")[1]
    section = section.split("\n## ")[0]

    def at_200(report, name):
        runs = report["benchmark"]["runs"]
        return np.array([runs[name.format(seed)]["per_prompt"]["200"] for seed in range(3)])

    crd_rewarded, crd_control = at_200(crd, "crd_seed{}"), at_200(crd, "crd_klonly_seed{}")
    dgpo_rewarded, dgpo_control = at_200(dgpo, "dgpo_seed{}"), at_200(dgpo, "dgpo_klonly_seed{}")
    stored = dgpo["against_crd"]
    pairs = {"crd - dgpo (both kl-cfg 4.5)": (crd_rewarded, dgpo_rewarded),
             "crd klonly - dgpo klonly (both kl-cfg 4.5)": (crd_control, dgpo_control),
             "reward-attributable gain: (crd - crd klonly) - (dgpo - dgpo klonly)":
                 (crd_rewarded - crd_control, dgpo_rewarded - dgpo_control)}
    unguided = json.loads((results / "ocr_proxy_three_way_10seeds_h200.json").read_text())
    key = ("crd tuned - dgpo tuned (both kl-cfg 1, seeds 0-2 of "
           "ocr_proxy_three_way_10seeds_h200.json)")
    pairs[key] = (at_200(unguided, "crd_tuned_seed{}"), at_200(unguided, "dgpo_tuned_seed{}"))
    assert stored.keys() == pairs.keys()
    for key, (a, b) in pairs.items():
        expected = difference(a, b)
        assert stored[key] == expected
        assert (f"{signed(expected['diff'])} [{signed(expected['low'])}, "
                f"{signed(expected['high'])}]") in section


def signed(x):
    """A number as RESULTS.md's prose writes it: sign always, a minus sign for '-'."""
    return f"{x:+.3f}".replace("-", "\u2212")


def test_results_md_shows_choose_s_table_for_the_three_seed_sweep(tmp_path):
    """choose.py on the committed sweep keeps every default, and RESULTS.md's table is its
    table, row for row."""
    path = FIVE_SEEDS.parent / "ocr_proxy_sweep_3seeds_h200.json"
    table = tmp_path / "table.json"
    printed = subprocess.run([sys.executable, str(COMPARE.with_name("choose.py")), "--report",
                              str(path), "--table", str(table)],
                             capture_output=True, text=True, check=True)
    assert printed.stdout.split() == ["crd:tuned=", "dgpo:tuned=", "nft:tuned="]
    choice = json.loads(table.read_text())
    assert choice == json.loads(path.read_text())["choice"] and choice["iterations"] == [60, 80, 100]
    shown = (COMPARE.parents[2] / "benchmark" / "RESULTS.md").read_text()
    names = {"crd": "CRD", "dgpo": "DGPO", "nft": "DiffusionNFT"}
    for algo, rows in choice["variants"].items():
        assert rows["chosen"] == "default"
        assert f"| {names[algo]} | default | {rows['default']['score']:.3f} | | |" in shown
        for variant, row in rows.items():
            if variant in ("default", "chosen"):
                continue
            d = row["vs_default"]
            assert d["low"] < 0 < d["high"] and (d["n_seeds_a"], d["n_seeds_b"]) == (3, 3)
            assert (f"| {names[algo]} | `{row['arguments']}` | {row['score']:.3f} | "
                    f"{signed(d['diff'])} [{signed(d['low'])}, {signed(d['high'])}] | "
                    f"{d['mde']:.3f} |") in shown


def test_results_md_shows_the_ten_seed_defaults_beside_the_tuned_runs(tmp_path):
    """compare.py's tables for the defaults file, and for it merged with the tuned file (its
    'against_tuned' command), are RESULTS.md's rows; the file's stored comparisons are those
    tables' numbers; and its runs repeat the earlier runs of the same settings, validation for
    validation, however often they validated."""
    results = FIVE_SEEDS.parent
    path = results / "ocr_proxy_defaults_10seeds_h200.json"
    stored = json.loads(path.read_text())
    shown = (COMPARE.parents[2] / "benchmark" / "RESULTS.md").read_text()
    printed = run_compare(path, "--json", tmp_path / "defaults.json").stdout
    validation = printed.split("### validation at iteration 225")[1].split("###")[0]
    rows = [line for line in validation.splitlines() if line.startswith("| ")]
    assert len(ROW.findall(validation)) == 3 and len(rows) == 8
    assert [row for row in rows if row not in shown] == []
    assert json.loads((tmp_path / "defaults.json").read_text()) == stored["compare"]
    merged = run_merge(tmp_path / "both.json", results / "ocr_proxy_three_way_10seeds_h200.json",
                       path)
    assert merged.returncode == 0, merged.stderr
    both = run_compare(tmp_path / "both.json", "--json", tmp_path / "b.json").stdout
    validation = both.split("### validation at iteration 225")[1].split("###")[0]
    groups = [line for line in validation.splitlines()
              if line.startswith("| ") and line.count("|") == 4 and "| mean |" not in line]
    assert len(groups) == 6 and [row for row in groups if row not in shown] == []
    pairs = [line for line in validation.splitlines() if " - " in line]
    assert len(pairs) == 15 and len([row for row in pairs if row in shown]) == 11
    tables = json.loads((tmp_path / "b.json").read_text())
    assert {p: {"groups": v["groups"], "differences": v["differences"]}
            for p, v in tables.items()} == stored["against_tuned"]
    runs = stored["benchmark"]["runs"]
    assert sorted(runs) == sorted(f"{algo}_default_seed{seed}" for algo in ("crd", "dgpo", "nft")
                                  for seed in range(10))
    earlier = json.loads((results / "ocr_proxy_crd_dgpo_3seeds_h200.json").read_text())
    for algo in ("crd", "dgpo"):
        for seed in (0, 1, 2):
            before = dict(map(tuple, earlier[algo]["runs"][f"{algo}_seed{seed}"]["eval"]))
            now = dict(map(tuple, runs[f"{algo}_default_seed{seed}"]["eval"]))
            assert {i: before[i] for i in now} == now and set(now) >= {0, 75, 150, 225}


def test_results_md_shows_the_h100_ten_seed_defaults_and_their_seeds_0_to_4_are_the_earlier_runs():
    """compare.py's table for the H100 base's 10 seeds is RESULTS.md's, row for row; seeds 0-4 are
    the ONNX Runtime half's runs, final scores and all, joined to seeds 5-9 (the OpenVINO pool)
    through the OpenVINO half's runs, which scored every word as they did; every run went to 225."""
    results = FIVE_SEEDS.parent
    stored = json.loads((results / "ocr_proxy_defaults_10seeds_mps_h100.json").read_text())
    printed = run_compare(results / "ocr_proxy_defaults_10seeds_mps_h100.json").stdout
    validation = printed.split("### validation at iteration 225")[1].split("###")[0]
    rows = [line for line in validation.splitlines() if line.startswith("| ")]
    assert len(ROW.findall(validation)) == 3 and len(rows) == 8
    shown = (COMPARE.parents[2] / "benchmark" / "RESULTS.md").read_text()
    assert [row for row in rows if row not in shown] == []
    merged = stored["benchmark"]
    assert sorted(merged["runs"]) == sorted(f"{algo}_seed{seed}" for algo in ("crd", "dgpo", "nft")
                                            for seed in range(10))
    assert {name: run["iterations"] for name, run in merged["runs"].items()} == dict.fromkeys(
        merged["runs"], 225)
    earlier = json.loads((results / "ocr_proxy_defaults_5seeds_mps_h100.json").read_text())["benchmark"]
    for name, run in earlier["runs"].items():
        assert merged["runs"][name]["per_prompt"] == run["per_prompt"]
        assert merged["final_scores"][name] == earlier["final_scores"][name]
    bridged = {entry["run"] for entry in merged["reproduced"]}
    assert bridged == set(earlier["runs"])
    assert [part["ocr_engine"] for part in merged["parts"]] == ["onnxruntime", "openvino", "openvino"]
    assert merged["parts"][2]["seeds"] == [5, 6, 7, 8, 9]
    assert stored["call"]["wall_s"] < 600 and stored["throughput"]["run_iterations"] == 15 * 225


def test_results_md_shows_the_h200_trained_ten_seeds_and_a_seed_on_two_gpu_kinds():
    """The two-call file's table is RESULTS.md's, row for row; its 30 runs reached 225 with their
    final scores in two calls under 10 minutes each; DGPO - DiffusionNFT in the three 10-seed sets
    and the same seeds' H100 and H200 runs read as RESULTS.md says."""
    results = FIVE_SEEDS.parent
    path = results / "ocr_proxy_defaults_10seeds_two_calls_h200.json"
    stored = json.loads(path.read_text())
    printed = run_compare(path).stdout
    validation = printed.split("### validation at iteration 225")[1].split("###")[0]
    rows = [line for line in validation.splitlines() if line.startswith("| ")]
    assert len(ROW.findall(validation)) == 3 and len(rows) == 8
    text = (COMPARE.parents[2] / "benchmark" / "RESULTS.md").read_text()
    assert [row for row in rows if row not in text] == []
    shown = re.sub(r"\s+", " ", text)
    merged = stored["benchmark"]
    seeds = [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    assert sorted(merged["runs"]) == sorted(f"{algo}_seed{seed}" for algo in ("crd", "dgpo", "nft")
                                            for seed in seeds)
    assert all(run["iterations"] == 225 for run in merged["runs"].values())
    assert set(merged["runs"]) <= set(merged["final_scores"])
    calls = stored["calls"]
    assert [call["seeds"] for call in calls] == [seeds[:5], seeds[5:]]
    assert all(call["wall_s"] < 600 for call in calls)
    means = [np.mean([merged["runs"][f"{algo}_seed{seed}"]["mean_iteration_s"]
                      for algo in ("crd", "dgpo", "nft") for seed in call["seeds"]])
             for call in calls]
    assert [call["throughput"]["mean_iteration_s_mean_over_runs"] for call in calls] == [
        round(mean, 3) for mean in means]
    assert (f"calls of {calls[0]['wall_s']} s and {calls[1]['wall_s']} s, one after the other on "
            f"one H200") in shown
    assert f"second call's iterations {100 * (means[1] / means[0] - 1):.0f}% slower" in shown
    docs = re.sub(r"\s+", " ", (COMPARE.parents[2] / "docs" / "ocr-proxy.md").read_text())
    phases = [call["phases_s"] for call in calls]
    rl, scoring = [p["rl"] for p in phases], [p["final_scores"] for p in phases]
    assert (f"ran in one call: {calls[0]['wall_s']} s and {calls[1]['wall_s']} s, every run to "
            f"iteration 225 with its final scores ({rl[0]:.1f} and {rl[1]:.1f} s of RL, "
            f"{scoring[0]:.1f} and {scoring[1]:.1f} s of final scores). That is "
            f"{3375 / rl[0]:.2f} and {3375 / rl[1]:.2f} run-iterations a second over the RL, "
            f"{15 / means[0]:.2f} and {15 / means[1]:.2f} in the iterations") in docs
    for row in rows[-3:-1]:  # CRD's two differences, as the docs give them
        diff, low, high = ROW.match(row).group("diff", "low", "high")
        assert f"{diff} [{low}, {high}]".replace("-", "−") in docs
    readme = re.sub(r"\s+", " ", (COMPARE.parents[2] / "README.md").read_text())
    gaps = []
    for name in ("ocr_proxy_defaults_10seeds_h200.json", "ocr_proxy_defaults_10seeds_mps_h100.json",
                 path.name):
        table = compare.main(compare.Options(report=str(results / name)))
        table = table["validation at iteration 225"]
        (gap,) = [d for d in table["differences"] if d["a"].startswith("dgpo")
                  and d["b"].startswith("nft")]
        gaps.append(gap)
        if name != "ocr_proxy_defaults_10seeds_h200.json":  # the second base's two sets
            for d in table["differences"]:
                assert (f"{d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]".replace("-", "−")
                        in readme), (name, d["a"], d["b"])
    assert [gap["diff"] < 0 for gap in gaps] == [True] * 3
    assert [gap["high"] < 0 for gap in gaps] == [False, False, True]
    assert (f"DGPO trails DiffusionNFT by {-gaps[0]['diff']:.3f}, {-gaps[1]['diff']:.3f} and "
            f"{-gaps[2]['diff']:.3f} in the three") in shown
    h100 = json.loads((results / "ocr_proxy_defaults_10seeds_mps_h100.json").read_text())
    h100_runs = h100["benchmark"]["runs"]
    differing, shifts, spread, seed_sd, above = [], {}, {}, {}, {}
    for algo in ("crd", "dgpo", "nft"):
        pairs = []
        for seed in range(5):
            a = h100_runs[f"{algo}_seed{seed}"]["per_prompt"]
            b = merged["runs"][f"{algo}_seed{seed}"]["per_prompt"]
            assert a["0"] == b["0"] and a["225"] != b["225"]
            differing.append(sum(x != y for x, y in zip(a["225"], b["225"])))
            pairs.append(np.mean(b["225"]) - np.mean(a["225"]))
        shifts[algo], spread[algo], above[algo] = np.mean(pairs), np.std(pairs, ddof=1), pairs
        seed_sd[algo] = np.std([np.mean(h100_runs[f"{algo}_seed{seed}"]["per_prompt"]["225"])
                                for seed in range(10)], ddof=1)
    assert f"at 225 from {min(differing)} to {max(differing)} of the 128 words differed" in shown
    assert (f"CRD {shifts['crd']:+.3f}, DGPO {shifts['dgpo']:+.3f}, DiffusionNFT "
            f"{shifts['nft']:+.3f} (CRD's and DiffusionNFT's above 0 on all five)".replace(
                "-", "−")) in shown
    assert min(above["crd"] + above["nft"]) > 0
    assert max(spread.values()) < min(seed_sd.values())
    assert (f"(SD {min(spread.values()):.3f}–{max(spread.values()):.3f}) than seeds do "
            f"(SD {min(seed_sd.values()):.3f}–{max(seed_sd.values()):.3f}") in shown
    assert stored["same_seeds_on_an_h100"]["h200_minus_h100_at_225"] == {
        algo: [round(float(np.mean(merged["runs"][f"{algo}_seed{s}"]["per_prompt"]["225"])
                           - np.mean(h100_runs[f"{algo}_seed{s}"]["per_prompt"]["225"])), 4)
               for s in range(5)] for algo in ("crd", "dgpo", "nft")}
