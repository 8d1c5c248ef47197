"""Tests of judges.py's judges on CPU: PickScore and the LAION aesthetic predictor as tiny random
CLIPs saved to disk and loaded through the real from_pretrained path, checked against float64 hand
computations of the anchors' formulas; the flat fraction on synthetic images; judges as a list.

Run: python -m pytest -q -n 0 tests/test_judges.py
"""

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import judges
import ocr_reward
import tiny_models
from judges import Judge, flat_fraction, make_judge, make_judges
from scoring import ScoringThread

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073])
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711])
PROMPTS = ['a neon sign that says "OPEN"', 'a birthday cake with "Happy Birthday" written in icing',
           "a street", 'a shop window that reads "SALE 50%" in red letters', "x"]


def font(size: int = 44):
    if FONT.exists():
        return ImageFont.truetype(str(FONT), size)
    return ImageFont.load_default(size=size)


def noise_image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def hand_pixels(image: Image.Image) -> np.ndarray:
    """CLIP's preprocessing written out in float64: the short side to 224 (bicubic, the long side
    floored), a centred 224x224 crop (offsets floored), scaled to [0, 1], CLIP mean and std."""
    w, h = image.size
    size = (224, int(224 * h / w)) if w <= h else (int(224 * w / h), 224)
    pixels = np.asarray(image.convert("RGB").resize(size, Image.BICUBIC), dtype=np.float64)
    top, left = (pixels.shape[0] - 224) // 2, (pixels.shape[1] - 224) // 2
    pixels = pixels[top : top + 224, left : left + 224] / 255.0
    return ((pixels - CLIP_MEAN) / CLIP_STD).transpose(2, 0, 1)


def images():
    return [noise_image(512, 512, 0), noise_image(200, 301, 1), noise_image(333, 250, 2),
            noise_image(64, 64, 3), noise_image(512, 512, 4)]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    return tiny_models.build_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(scope="module")
def pickscore(tiny_clip):
    return make_judge("pickscore", pickscore_model=str(tiny_clip),
                      pickscore_processor=str(tiny_clip))


@pytest.fixture(scope="module")
def aesthetic(tiny_clip, tmp_path_factory):
    head = tmp_path_factory.mktemp("head") / judges.AESTHETIC_HEAD
    tiny_models.save_random_aesthetic_head(head)
    return make_judge("aesthetic", aesthetic_model=str(tiny_clip), aesthetic_head_path=str(head))


# ---- PickScore ---------------------------------------------------------------------------------


def test_pickscore_is_transformers_clip_loaded_from_disk(pickscore):
    from transformers import CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

    clip = pickscore.scorer.clip
    assert (pickscore.name, pickscore.reads, pickscore.higher_is_better) == (
        "pickscore", "prompt", True)
    assert type(clip.model) is CLIPModel and clip.model.dtype == torch.float32
    assert not clip.model.training
    assert type(clip.image_processor) is CLIPImageProcessorPil
    assert isinstance(clip.tokenizer, CLIPTokenizer)
    scores, texts = pickscore(images(), prompts=PROMPTS)
    assert scores.shape == (5,) and scores.dtype == np.float32 and np.isfinite(scores).all()
    assert texts == [""] * 5


def test_clip_preprocessing_is_the_anchors(pickscore):
    """Resize (short side 224, bicubic), centre crop, rescale, normalise: as transformers' CLIP
    processor that the anchors call, on square (SD3's) and non-square images."""
    processor = pickscore.scorer.clip.image_processor
    crop = processor.crop_size
    assert (processor.size.shortest_edge, crop.height, crop.width) == (224, 224, 224)
    assert processor.resample == Image.BICUBIC and processor.rescale_factor == 1 / 255
    np.testing.assert_allclose(processor.image_mean, CLIP_MEAN)
    np.testing.assert_allclose(processor.image_std, CLIP_STD)
    pixels = pickscore.scorer.clip.pixel_values(images()).numpy()
    assert pixels.shape == (5, 3, 224, 224)
    for got, image in zip(pixels, images()):
        np.testing.assert_allclose(got, hand_pixels(image), rtol=0, atol=2e-6)


def test_legacy_processor_config_loads_the_same(tiny_clip, tmp_path):
    """Older hub processors (as the CLIP-H one) write size and crop_size as integers."""
    legacy = tmp_path / "legacy"
    shutil.copytree(tiny_clip, legacy)
    (legacy / "preprocessor_config.json").write_text(json.dumps({
        "crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": CLIP_MEAN.tolist(),
        "image_std": CLIP_STD.tolist(), "resample": 3, "size": 224}))
    judge = make_judge("pickscore", pickscore_model=str(tiny_clip), pickscore_processor=str(legacy))
    np.testing.assert_array_equal(judge.scorer.clip.pixel_values(images()).numpy(),
                                  judges.ClipModel(str(tiny_clip), str(tiny_clip), "cpu", 8, "x")
                                  .pixel_values(images()).numpy())


def test_pickscore_equals_a_float64_hand_computation(pickscore):
    """score = exp(logit_scale) * cos(text, image) / 26, from the model's own float64 embeddings
    of the hand-preprocessed images; the tiny model's log scale is 2, so a score that used it
    without exp fails."""
    clip = pickscore.scorer.clip
    model64 = copy.deepcopy(clip.model).double()
    pixels = torch.from_numpy(np.stack([hand_pixels(image) for image in images()]))
    tokens = clip.tokens(PROMPTS)
    with torch.no_grad():
        image = model64.get_image_features(pixel_values=pixels).pooler_output.numpy()
        text = model64.get_text_features(**tokens).pooler_output.numpy()
        log_scale = float(model64.logit_scale)
    cosine = (image * text).sum(1) / np.linalg.norm(image, axis=1) / np.linalg.norm(text, axis=1)
    expected = np.exp(log_scale) * cosine / 26.0
    assert log_scale == pytest.approx(2.0)
    scores, _ = pickscore(images(), prompts=PROMPTS)
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(scores, log_scale * cosine / 26.0, rtol=1e-2)


def test_pickscore_batches_and_padding_do_not_change_scores(tiny_clip, pickscore):
    small = make_judge("pickscore", pickscore_model=str(tiny_clip),
                       pickscore_processor=str(tiny_clip), batch_size=2)  # other paddings
    np.testing.assert_allclose(small(images(), prompts=PROMPTS)[0],
                               pickscore(images(), prompts=PROMPTS)[0], rtol=0, atol=1e-6)
    uint8 = np.stack([np.asarray(image.resize((64, 64))) for image in images()])
    assert pickscore(uint8, prompts=PROMPTS)[0].shape == (5,)  # (B, H, W, 3) uint8: the trainers


def test_pickscore_reads_77_tokens_with_the_end_token(pickscore):
    clip = pickscore.scorer.clip
    ids = clip.tokens(["word " * 200, "short"])["input_ids"]
    assert ids.shape == (2, 77)
    assert ids[0, 0] == clip.tokenizer.bos_token_id and ids[0, -1] == clip.tokenizer.eos_token_id
    long_score = pickscore([noise_image(64, 64, 0)], prompts=["word " * 200])[0]
    assert np.isfinite(long_score).all()


def test_pickscore_needs_prompts(pickscore):
    with pytest.raises(ValueError, match="reads the prompts"):
        pickscore(images(), targets=["OPEN"] * 5)
    with pytest.raises(ValueError, match="5 images but 2 prompts"):
        pickscore(images(), prompts=PROMPTS[:2])


def test_a_missing_clip_is_named(tmp_path):
    with pytest.raises(RuntimeError, match="the PickScore model .*no such directory"):
        make_judge("pickscore", pickscore_model=str(tmp_path / "nope"),
                   pickscore_processor=str(tmp_path))


# ---- the aesthetic predictor -------------------------------------------------------------------


def test_aesthetic_head_has_the_laion_checkpoint_layout():
    """The keys and shapes of sac+logos+ava1-l14-linearMSE.pth (for ViT-L/14's 768-d embeddings)."""
    shapes = {k: tuple(v.shape) for k, v in judges.aesthetic_head(768).state_dict().items()}
    assert shapes == {"layers.0.weight": (1024, 768), "layers.0.bias": (1024,),
                      "layers.2.weight": (128, 1024), "layers.2.bias": (128,),
                      "layers.4.weight": (64, 128), "layers.4.bias": (64,),
                      "layers.6.weight": (16, 64), "layers.6.bias": (16,),
                      "layers.7.weight": (1, 16), "layers.7.bias": (1,)}


def test_aesthetic_equals_a_float64_hand_computation(aesthetic):
    """The head (five affine layers) of the L2-normalised image embedding, all in float64."""
    assert (aesthetic.name, aesthetic.reads) == ("aesthetic", "image")
    assert aesthetic.scorer.clip.tokenizer is None
    model64 = copy.deepcopy(aesthetic.scorer.clip.model).double()
    pixels = torch.from_numpy(np.stack([hand_pixels(image) for image in images()]))
    with torch.no_grad():
        x = model64.get_image_features(pixel_values=pixels).pooler_output.numpy()
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    state = {k: v.double().numpy() for k, v in aesthetic.scorer.head.state_dict().items()}
    for i in (0, 2, 4, 6, 7):
        x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    scores, texts = aesthetic(images())  # no targets, no prompts: it reads only the image
    assert scores.dtype == np.float32 and texts == [""] * 5
    np.testing.assert_allclose(scores, x[:, 0], rtol=1e-5, atol=1e-6)


def test_aesthetic_head_file_is_checked(tiny_clip, tmp_path):
    with pytest.raises(RuntimeError, match=r"no file given; it is sac\+logos\+ava1-l14-linearMSE"):
        make_judge("aesthetic", aesthetic_model=str(tiny_clip))
    with pytest.raises(RuntimeError, match="no such file"):
        make_judge("aesthetic", aesthetic_model=str(tiny_clip),
                   aesthetic_head_path=str(tmp_path / "x.pth"))
    wrong = tiny_models.save_random_aesthetic_head(tmp_path / "wide.pth", in_features=768)
    with pytest.raises(RuntimeError, match="not a LAION aesthetic MLP for 16-d embeddings"):
        make_judge("aesthetic", aesthetic_model=str(tiny_clip), aesthetic_head_path=str(wrong))


# ---- the flat fraction: a weight-free judge of the blanked background --------------------------


def sign(background=(245, 240, 225), ink=(20, 20, 60), noise=0.0, seed=0) -> Image.Image:
    """The blanking hack's image: the text alone on a uniform background (render noise optional)."""
    image = Image.new("RGB", (512, 512), background)
    ImageDraw.Draw(image).text((90, 230), "OPEN 24 HOURS", fill=ink, font=font())
    grain = np.random.default_rng(seed).normal(0, noise, (512, 512, 3))
    pixels = np.asarray(image, np.float32) + grain
    return Image.fromarray(np.clip(pixels, 0, 255).round().astype(np.uint8))


def scene(seed=0) -> np.ndarray:
    """A natural-ish picture, (512, 512, 3) uint8: random texture at four scales, from large
    shapes to fine grain."""
    rng = np.random.default_rng(seed)
    pixels = np.full((512, 512, 3), 128, np.float32)
    for cell, amplitude in ((128, 60), (32, 30), (8, 20), (2, 12)):
        coarse = rng.integers(0, 256, (512 // cell, 512 // cell, 3), dtype=np.uint8)
        smooth = Image.fromarray(coarse).resize((512, 512), Image.BICUBIC)
        pixels += amplitude * (np.asarray(smooth, np.float32) / 127.5 - 1)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def sign_in_a_scene(seed=0) -> Image.Image:
    image = Image.fromarray(scene(seed))
    ImageDraw.Draw(image).text((90, 230), "OPEN 24 HOURS", fill=(250, 250, 250), font=font())
    return image


def test_flat_tells_a_blanked_image_from_a_textured_one():
    blanked = [sign(), sign(noise=1.5), sign(background=(4, 4, 4), ink=(240, 240, 240))]
    natural = [sign_in_a_scene(0), sign_in_a_scene(1)]
    scores, texts = flat_fraction(blanked + natural, ["OPEN 24 HOURS"] * 5)
    assert scores.dtype == np.float32 and texts == [""] * 5
    assert (scores[:3] > 0.9).all(), scores  # only the tiles the letters cross are not flat
    assert (scores[3:] < 0.05).all(), scores
    judge = make_judge("flat")
    assert (judge.reads, judge.higher_is_better) == ("image", False)
    np.testing.assert_array_equal(judge(blanked + natural)[0], scores)  # targets are not needed


def test_flat_measures_how_much_is_blank():
    half = scene()
    half[:, :256] = (200, 190, 180)  # the left half painted over
    quarter = scene()
    quarter[:256, :256] = 30
    ramp = np.linspace(40, 230, 512, dtype=np.float32)[:, None, None]
    sky = np.tile(ramp, (1, 512, 3)).astype(np.uint8)
    scores = flat_fraction(np.stack([half, quarter, sky, scene()]))[0]  # (B, H, W, 3) uint8 too
    np.testing.assert_allclose(scores, [0.5, 0.25, 1.0, 0.0])  # a smooth gradient counts as flat
    assert flat_fraction([sign(noise=8.0)])[0][0] < 0.05  # strong grain is texture, not a blank
    assert flat_fraction([Image.new("RGB", (70, 37))])[0][0] == 1.0  # cut to whole 8x8 tiles
    with pytest.raises(ValueError, match="no 8x8 tile"):
        flat_fraction([Image.new("RGB", (7, 64))])


# ---- the judges as a list ----------------------------------------------------------------------


def test_make_judges_builds_named_judges_in_order(tiny_clip):
    judges = make_judges(["paddle", "pickscore", "flat"], pickscore_model=str(tiny_clip),
                         pickscore_processor=str(tiny_clip))
    assert [(j.name, j.reads) for j in judges] == [
        ("paddle", "target"), ("pickscore", "prompt"), ("flat", "image")]
    hello = Image.new("RGB", (512, 512), (245, 240, 225))
    ImageDraw.Draw(hello).text((130, 230), "Hello World", fill=(20, 20, 60), font=font())
    targets, prompts = ["Hello World", "x"], ['a sign that says "Hello World"', 'a "x"']
    results = {j.name: j([hello, sign_in_a_scene()], targets, prompts) for j in judges}
    scores, texts = results["paddle"]  # the PP-OCR judge reads as before
    assert texts[0] == "Hello World" and scores[0] == 1.0
    assert results["pickscore"][0].shape == (2,)
    assert results["flat"][0][0] > 0.9 > results["flat"][0][1]
    assert make_judges(["none"]) == [] and make_judges([]) == []
    names = ["brightness", "compressibility"]
    assert [j.name for j in make_judges(names)] == names


def test_make_judges_rejects_bad_lists_before_loading():
    with pytest.raises(ValueError, match="unknown judge 'clip'; choose from paddle, qwen-vl"):
        make_judges(["flat", "clip"])
    with pytest.raises(ValueError, match="judge 'flat' is listed twice"):
        make_judges(["flat", "pickscore", "flat"])  # no PickScore load: it would fail without a hub
    with pytest.raises(ValueError, match="unknown judge"):
        make_judges(["flat", "none"])
    with pytest.raises(ValueError, match="unknown judge 'nope'"):
        make_judge("nope")


def test_a_judge_reads_in_a_scoring_thread(pickscore):
    thread = ScoringThread(pickscore)
    thread.submit(images()[:2], ["a", "b"], PROMPTS[:2])
    thread.submit(images()[2:], ["c", "d", "e"], PROMPTS[2:])
    scores, texts = thread.take()
    np.testing.assert_allclose(scores, pickscore(images(), prompts=PROMPTS)[0], rtol=0, atol=1e-6)
    assert texts == [""] * 5
    plain = ScoringThread(ocr_reward.brightness)  # plain scorers are submitted as before
    plain.submit(images(), ["x"] * 5)
    assert plain.take()[0].shape == (5,)


def test_judge_repr_and_image_judges_take_no_texts():
    judge = Judge("brightness", ocr_reward.brightness, reads="image")
    assert repr(judge) == "Judge('brightness', reads='image')"
    assert judge(images())[0].shape == (5,)
    with pytest.raises(ValueError, match="the paddle judge reads the targets"):
        Judge("paddle", ocr_reward.brightness)(images())
