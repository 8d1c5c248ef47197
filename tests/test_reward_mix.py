"""Tests of reward_mix.py's reward mix on CPU: the spec syntax, the mix scorer, and both aggregations of
Flow-Factory (sum, gdpo) against a float64 reference written out from its loops, with their
invariances; one reward of weight 1 gives the trainers' advantages bit for bit.

Run: python -m pytest -q -n 0 tests/test_reward_mix.py
"""

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import crd
import dgpo
import ocr_reward
from judges import Judge
from ocr_reward import ServerError
from reward_mix import (MixScorer, component_means, format_mix, group_standardize, make_mix,
                        mix_advantages, parse_mix, weighted_sum)
from scoring import GuardedScorer, ScoringThread

# ---- the spec ----------------------------------------------------------------------------------


def test_parse_mix():
    assert parse_mix("qwen-vl=0.8 pickscore=0.2") == {"qwen-vl": 0.8, "pickscore": 0.2}
    assert list(parse_mix(["pickscore=0.2", "qwen-vl=0.8"])) == ["pickscore", "qwen-vl"]  # in order
    assert parse_mix("qwen-vl") == {"qwen-vl": 1.0} == parse_mix(["qwen-vl"])  # today's reward
    assert parse_mix("paddle=1,flat=-0.5") == {"paddle": 1.0, "flat": -0.5}  # a penalty
    assert parse_mix(["vllm=2", "aesthetic=1e-2 brightness"]) == {"vllm": 2.0, "aesthetic": 0.01,
                                                                  "brightness": 1.0}


@pytest.mark.parametrize("spec, message", [
    ("qwen=0.8 pickscore=0.2",
     "reward mix item 'qwen=0.8': unknown reward 'qwen'; choose from paddle,"),
    ("qwen-vl=0.8 pickscore=high",
     "reward mix item 'pickscore=high': the weight must be a finite number"),
    ("qwen-vl=0", "reward mix item 'qwen-vl=0': the weight must be a finite number other than 0"),
    ("qwen-vl=inf", "reward mix item 'qwen-vl=inf': the weight"),
    ("qwen-vl=nan", "reward mix item 'qwen-vl=nan': the weight"),
    ("qwen-vl=", "reward mix item 'qwen-vl=': the weight"),
    ("flat=1e308", "reward mix item 'flat=1e308': the weight 1e+308 is outside float32's range"),
    ("paddle=1 flat=-1e-50",
     "reward mix item 'flat=-1e-50': the weight -1e-50 is outside float32's range"),
    ("=0.5", "reward mix item '=0.5': unknown reward ''"),
    ("paddle=0.5 paddle=0.5", "reward mix item 'paddle=0.5': paddle is listed twice"),
    ("", "empty reward mix"),
    ([], "empty reward mix"),
])
def test_parse_mix_names_the_bad_item_in_one_line(spec, message):
    with pytest.raises(ValueError) as info:
        parse_mix(spec)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_format_mix_round_trips():
    assert format_mix({"qwen-vl": 1.0}) == "qwen-vl"  # a one-reward run is named as today
    assert format_mix({"qwen-vl": 0.8, "pickscore": 0.2}) == "qwen-vl=0.8 pickscore=0.2"
    assert format_mix({"paddle": 1.0, "flat": -0.5}) == "paddle=1 flat=-0.5"
    for weights in ({"paddle": 0.1, "pickscore": 0.30000000000000004}, {"flat": 2.0},
                    {"vllm": 1e-20}, {"qwen-vl": 1 / 3, "aesthetic": 7.0}):
        assert parse_mix(format_mix(weights)) == weights


# ---- the aggregations: a float64 reference written from Flow-Factory's loops -------------------


def reference_normalize(r, group_size, global_std, clip=5.0):
    """The trainers' group_advantages in float64 loops: (r - group mean) / (std + 1e-4), clipped."""
    out = np.empty_like(r, dtype=np.float64)
    for start in range(0, len(r), group_size):
        group = r[start : start + group_size]
        std = r.std() if global_std else group.std()
        out[start : start + group_size] = (group - group.mean()) / (std + 1e-4)
    return np.clip(out, -clip, clip)


def reference_sum(rewards, weights, group_size, global_std):
    """compute_weighted_sum: the weighted reward, then the trainers' normalisation."""
    aggregated = np.zeros(len(rewards))
    for k, weight in enumerate(weights):
        aggregated += rewards[:, k] * weight
    return reference_normalize(aggregated, group_size, global_std)


def reference_gdpo(rewards, weights, group_size, global_std):
    """compute_gdpo: every reward standardised in each group (std floored at 1e-6), weighted,
    summed; then the trainers' normalisation in place of the batch normalisation."""
    combined = np.zeros(len(rewards))
    for k, weight in enumerate(weights):
        for start in range(0, len(rewards), group_size):
            group = rewards[start : start + group_size, k]
            z = (group - group.mean()) / max(group.std(), 1e-6)
            combined[start : start + group_size] += weight * z
    return reference_normalize(combined, group_size, global_std)


def normalizer(group_size, global_std, clip=5.0):
    return partial(crd.group_advantages, group_size=group_size, global_std=global_std, clip=clip)


def random_rewards(n_groups=6, group_size=4, seed=0, scales=(1.0, 30.0, 0.01)):
    """(N, K) float64: rewards of other scales and offsets, a constant group in the first one."""
    rng = np.random.default_rng(seed)
    rewards = np.stack([offset + scale * rng.random(n_groups * group_size)
                        for offset, scale in zip((0.0, -5.0, 0.3), scales)], 1)
    rewards[:group_size, 0] = 0.25  # a group every member of which read the same
    return rewards


@pytest.mark.parametrize("aggregation", ["sum", "gdpo"])
@pytest.mark.parametrize("global_std", [True, False])
def test_aggregations_match_the_float64_reference(aggregation, global_std):
    reference = {"sum": reference_sum, "gdpo": reference_gdpo}[aggregation]
    group_size, weights = 4, [0.8, 0.15, 0.05]
    rewards = random_rewards(group_size=group_size)
    expected = reference(rewards, weights, group_size, global_std)
    normalize = normalizer(group_size, global_std)
    got64 = mix_advantages(torch.from_numpy(rewards), weights, group_size, normalize, aggregation)
    assert got64.dtype == torch.float64 and got64.shape == (len(rewards),)
    np.testing.assert_allclose(got64.numpy(), expected, rtol=0, atol=1e-12)
    got32 = mix_advantages(torch.from_numpy(rewards).float(), weights, group_size, normalize,
                           aggregation)
    assert got32.dtype == torch.float32
    np.testing.assert_allclose(got32.numpy(), expected, rtol=0, atol=2e-4)  # float32 of 30-scale


@pytest.mark.parametrize("group_size", [2, 4, 6])
@pytest.mark.parametrize("global_std", [True, False])
def test_one_reward_of_weight_one_gives_todays_advantages_bit_for_bit(group_size, global_std):
    rng = np.random.default_rng(group_size)
    scores = rng.integers(0, 5, 8 * group_size) / 4  # OCR-like: ties and groups of equal scores
    scores[:group_size] = 1.0
    rewards = torch.as_tensor(scores, dtype=torch.float32)
    for trainer in (crd, dgpo):
        today = trainer.group_advantages(rewards, group_size, global_std, 5.0)
        normalize = partial(trainer.group_advantages, group_size=group_size,
                            global_std=global_std, clip=5.0)
        mixed = mix_advantages(rewards[:, None], [1.0], group_size, normalize, "sum")
        assert torch.equal(mixed, today)
    assert torch.equal(weighted_sum(rewards[:, None], [1.0]), rewards)


def test_gdpo_is_the_flow_factory_batch_normalisation_with_the_global_std():
    """Flow-Factory's last gdpo step is (c - mean) / max(std, 1e-6) over all images: c is centred
    in every group already, so the trainers' global-std normalisation differs by its epsilon."""
    rewards, weights, group_size = random_rewards(), [0.8, 0.15, 0.05], 4
    z = [group_standardize(torch.from_numpy(rewards[:, k]), group_size) for k in range(3)]
    combined = weighted_sum(torch.stack(z, 1), weights).numpy()
    groups = combined.reshape(-1, group_size)
    assert np.abs(groups.mean(1)).max() < 1e-12
    flow_factory = np.clip((combined - combined.mean()) / max(combined.std(), 1e-6), -5, 5)
    ours = mix_advantages(torch.from_numpy(rewards), weights, group_size,
                          normalizer(group_size, True), "gdpo")
    np.testing.assert_allclose(ours.numpy(), flow_factory, rtol=1e-3, atol=1e-6)


# ---- invariances -------------------------------------------------------------------------------


def advantages(rewards, weights, aggregation, group_size=4, global_std=True):
    return mix_advantages(torch.as_tensor(rewards, dtype=torch.float64), weights, group_size,
                          normalizer(group_size, global_std), aggregation).numpy()


def test_sum_and_gdpo_differ_when_the_scales_differ():
    rng = np.random.default_rng(1)
    ocr, quality = rng.random(48), rng.random(48)
    weights = [0.5, 0.5]
    same_scale = np.stack([ocr, quality], 1)
    scaled = np.stack([ocr, 100 * quality], 1)  # e.g. a raw PickScore beside an OCR score
    gdpo = advantages(same_scale, weights, "gdpo")
    np.testing.assert_allclose(advantages(scaled, weights, "gdpo"), gdpo, rtol=0, atol=1e-9)
    summed = advantages(scaled, weights, "sum")
    quality_alone = advantages(scaled[:, 1:], [1.0], "sum")
    assert np.corrcoef(summed, quality_alone)[0, 1] > 0.9999  # the larger reward takes the sum over
    assert np.corrcoef(summed, advantages(ocr[:, None], [1.0], "sum"))[0, 1] < 0.5
    assert np.abs(summed - gdpo).max() > 0.5


def test_gdpo_ignores_each_rewards_scale_and_offset():
    rewards = random_rewards()
    affine = rewards * np.array([3.0, 0.02, 500.0]) + np.array([-1.0, 7.0, 0.5])
    weights = [0.8, 0.15, 0.05]
    np.testing.assert_allclose(advantages(affine, weights, "gdpo"),
                               advantages(rewards, weights, "gdpo"), rtol=0, atol=1e-9)
    moved = advantages(affine, weights, "sum") - advantages(rewards, weights, "sum")
    assert np.abs(moved).max() > 0.1


def test_sum_and_gdpo_agree_when_every_group_has_the_same_spread():
    """With each reward's std 1 in every group, standardising in the group changes nothing but
    the group means, which both take away: the same advantages with the per-group std. The
    global std of a sum also counts the spread of the group means, which gdpo has removed, so
    there they agree only when the group means do."""
    rng = np.random.default_rng(2)
    groups = rng.normal(size=(12, 4, 2))
    groups = (groups - groups.mean(1, keepdims=True)) / groups.std(1, keepdims=True)
    centred = groups.reshape(48, 2)
    shifted = (groups + rng.normal(size=(12, 1, 2))).reshape(48, 2)  # the group means differ
    weights = [0.7, 0.3]
    np.testing.assert_allclose(advantages(shifted, weights, "sum", global_std=False),
                               advantages(shifted, weights, "gdpo", global_std=False),
                               rtol=0, atol=1e-9)
    np.testing.assert_allclose(advantages(centred, weights, "sum"),
                               advantages(centred, weights, "gdpo"), rtol=0, atol=1e-9)
    apart = advantages(shifted, weights, "sum") - advantages(shifted, weights, "gdpo")
    assert np.abs(apart).max() > 0.1


def test_weights_set_the_direction():
    rewards = random_rewards()[:, :1]
    twice = np.concatenate([rewards, rewards], 1)
    for aggregation in ("sum", "gdpo"):
        np.testing.assert_array_equal(advantages(twice, [1.0, -1.0], aggregation), 0.0)
        np.testing.assert_allclose(advantages(rewards, [-1.0], aggregation),
                                   -advantages(rewards, [1.0], aggregation), atol=1e-12)
    # a sum's overall scale is normalised away (up to the 1e-4 of the std): only the ratios matter
    np.testing.assert_allclose(advantages(random_rewards(), [8, 1.5, 0.5], "sum"),
                               advantages(random_rewards(), [0.8, 0.15, 0.05], "sum"),
                               rtol=0, atol=1e-3)


def test_a_reward_constant_in_a_group_adds_nothing_there():
    rewards = random_rewards()
    group = slice(0, 4)  # the first reward is 0.25 for all four images of the first group
    z = group_standardize(torch.from_numpy(rewards[:, 0]), 4).numpy()
    np.testing.assert_array_equal(z[group], 0.0)
    constant = rewards.copy()
    constant[:, 0] = 0.5  # the same for every image: gdpo is the other rewards' alone
    np.testing.assert_allclose(advantages(constant, [0.8, 0.15, 0.05], "gdpo"),
                               advantages(constant[:, 1:], [0.15, 0.05], "gdpo"), atol=1e-12)


def test_a_failed_reward_stays_nan():
    rewards = torch.rand(8, 2)
    rewards[3, 1] = float("nan")  # GuardedScorer's NaN: the trainers stop before training on it
    for aggregation in ("sum", "gdpo"):
        out = mix_advantages(rewards, [0.5, 0.5], 4, normalizer(4, True), aggregation)
        assert out.isnan().any()


def test_bad_arguments_are_clear():
    norm = normalizer(4, True)
    with pytest.raises(ValueError, match="unknown aggregation 'mean'; choose from sum, gdpo"):
        mix_advantages(torch.rand(8, 2), [1, 1], 4, norm, "mean")
    with pytest.raises(ValueError, match=r"rewards \(8, 2\) need one column per weight \(3\)"):
        mix_advantages(torch.rand(8, 2), [1, 1, 1], 4, norm)
    with pytest.raises(ValueError, match=r"rewards \(8,\) need one column per weight"):
        weighted_sum(torch.rand(8), [1.0])


# ---- the mix scorer ----------------------------------------------------------------------------


def pictures(n=4):
    rng = np.random.default_rng(0)
    scale = np.arange(1, n + 1, dtype=np.uint8)[:, None, None, None]
    return rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8) // scale


def test_mix_scores_every_component():
    mix = make_mix("brightness=0.7 compressibility=0.3")
    assert mix.names == ["brightness", "compressibility"] and mix.weights == {"brightness": 0.7,
                                                                             "compressibility": 0.3}
    assert mix.spec == "brightness=0.7 compressibility=0.3"
    scores, texts = mix(pictures(), ["t"] * 4)
    assert scores.shape == (4, 2) and scores.dtype == np.float32 and texts == [""] * 4
    np.testing.assert_array_equal(scores[:, 0], ocr_reward.brightness(pictures())[0])
    np.testing.assert_array_equal(scores[:, 1], ocr_reward.compressibility(pictures())[0])
    assert component_means(torch.from_numpy(scores), mix.names) == pytest.approx(
        {"brightness": float(scores[:, 0].mean()), "compressibility": float(scores[:, 1].mean())})
    one = make_mix("brightness")
    assert one(pictures(), ["t"] * 4)[0].shape == (4, 1) and one.spec == "brightness"


def test_mix_gives_the_reading_components_transcriptions():
    dejavu = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
    font = ImageFont.truetype(dejavu, 44) if Path(dejavu).exists() else ImageFont.load_default(size=44)
    image = Image.new("RGB", (512, 512), (245, 240, 225))
    ImageDraw.Draw(image).text((130, 230), "Hello World", fill=(20, 20, 60), font=font)
    mix = make_mix("flat=-0.2 paddle=1")  # the reader listed second
    scores, texts = mix([image], ["Hello World"], ['a sign that says "Hello World"'])
    assert texts == ["Hello World"] and scores[0, 1] == 1.0 and scores[0, 0] > 0.9


def test_mix_in_a_scoring_thread_and_after_a_failure():
    def down(images, targets):
        raise ServerError("vLLM server http://127.0.0.1:1 failed 4 attempts")

    mix = MixScorer([Judge("vllm", down), Judge("brightness", ocr_reward.brightness, reads="image")],
                    {"vllm": 0.8, "brightness": 0.2})
    thread = ScoringThread(GuardedScorer(mix))
    thread.submit(pictures(), ["t"] * 4, ["p"] * 4)
    scores, texts = thread.take()
    assert scores.shape == (4, 2) and np.isnan(scores).all() and texts == [""] * 4
    assert thread.failure == "the reward failed: vLLM server http://127.0.0.1:1 failed 4 attempts"
    working = ScoringThread(GuardedScorer(make_mix("brightness=1 compressibility=1")))
    working.submit(pictures(2), ["t"] * 2, ["p"] * 2)
    working.submit(pictures(3), ["t"] * 3)
    assert working.take()[0].shape == (5, 2) and working.failure is None
    with pytest.raises(ValueError, match="do not match the weights"):
        MixScorer([Judge("brightness", ocr_reward.brightness)], {"flat": 1.0})


def test_a_mix_feeds_mix_advantages_as_the_trainers_will():
    mix = make_mix("brightness=0.7 compressibility=0.3")
    images = np.concatenate([pictures(4), pictures(4)[::-1]])
    rewards = torch.as_tensor(mix(images, [""] * 8)[0])  # what run.gather returns on one rank
    for aggregation in ("sum", "gdpo"):
        out = mix_advantages(rewards, mix.weights.values(), 4, normalizer(4, True), aggregation)
        assert out.shape == (8,) and torch.isfinite(out).all()
        np.testing.assert_allclose(out.reshape(2, 4).sum(1).numpy(), 0.0, atol=1e-5)  # centred
