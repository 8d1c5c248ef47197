"""Tests of ocr_reward.py on CPU: the score, PP-OCR on rendered text, the tiny (and meta full-size) Qwen2.5-VL, the vLLM
client, cheap rewards.

Run: python -m pytest tests/test_reward.py -q
The vLLM client talks to a real HTTP server on 127.0.0.1 (tests/ocr_server.py) that answers with PP-OCR.
"""

import socket
import time
from pathlib import Path

import numpy as np
import pytest
from ocr_server import ocr_server
from PIL import Image, ImageDraw, ImageFont
from transformers import AutoTokenizer

import ocr_reward
import tiny_models
from ocr_reward import INSTRUCTION, SCORERS, ServerError, extract_target, make_scorer, ocr_score

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
TARGETS = ["OPEN 24 HOURS", "Coffee Shop", "Hello World", "SALE 50%", "Happy Birthday", "No Parking"]


def font(size: int = 44):
    # Pillow >= 10.1's default font is scalable, so tests still run where DejaVu is not installed.
    return ImageFont.truetype(str(FONT), size) if FONT.exists() else ImageFont.load_default(size=size)


def render(lines: list[tuple[str, tuple[int, int]]], size=(512, 512), bg=(245, 240, 225), fg=(20, 20, 60)) -> Image.Image:
    """A sign-like image: each (text, (x, y)) drawn on a plain background."""
    image = Image.new("RGB", size, bg)
    draw = ImageDraw.Draw(image)
    for text, xy in lines:
        draw.text(xy, text, fill=fg, font=font())
    return image


def centred(text: str) -> Image.Image:
    left, top, right, bottom = ImageDraw.Draw(Image.new("RGB", (1, 1))).textbbox((0, 0), text, font=font())
    return render([(text, ((512 - right + left) // 2, (512 - bottom + top) // 2))])


@pytest.fixture(scope="module")
def paddle():
    return make_scorer("paddle")


# ---- the score ----------------------------------------------------------------------------------------------------


def test_score_exact_substring_case_whitespace():
    assert ocr_score("Hello World", "Hello World") == 1.0
    assert ocr_score("The sign says: Hello World!", "Hello World") == 1.0  # a substring counts as exact
    assert ocr_score("HELLO WORLD", "hello world") == 1.0
    assert ocr_score("Hel lo\nWor\tld", "HelloWorld") == 1.0  # all whitespace is removed
    assert ocr_score("Hallo World", "Hello World") == pytest.approx(1 - 1 / 10)


def test_score_capped_distance_and_empty():
    assert ocr_score("a completely different and much longer transcription", "cat") == 0.0  # capped, never < 0
    assert ocr_score("", "cat") == 0.0
    assert ocr_score("", "") == 1.0
    assert ocr_score("   ", "") == 1.0
    assert ocr_score("x", "") == 0.0
    assert all(0.0 <= ocr_score(t, "abc") <= 1.0 for t in ["", "a", "abd", "zzzzzzzzzz", "ABC"])


def test_score_unicode():
    assert ocr_score("CAFÉ", "Café") == 1.0  # lower() handles accents
    assert ocr_score("Cafe", "Café") == pytest.approx(0.75)  # e != é
    assert ocr_score("欢迎 光临", "欢迎光临") == 1.0
    assert ocr_score("欢迎光顾", "欢迎光临") == pytest.approx(0.75)  # distance counts characters, not bytes


def test_extract_target():
    assert extract_target('A neon sign that says "OPEN 24 HOURS" at night') == "OPEN 24 HOURS"
    assert extract_target('a "first" and a "second"') == "first"
    assert extract_target('an empty "" pair') == ""
    assert extract_target("no quotes here") is None
    assert extract_target('an unclosed "quote') is None


def test_make_scorer_names():
    assert SCORERS == ("qwen-vl", "vllm", "paddle", "brightness", "compressibility")
    with pytest.raises(ValueError, match="unknown scorer"):
        make_scorer("clip")
    with pytest.raises(ValueError, match="URL"):
        make_scorer("vllm")


# ---- PP-OCR on rendered text ----------------------------------------------------------------------------------------


def test_paddle_reads_rendered_text(paddle):
    images = [centred(t) for t in TARGETS]
    scores, texts = paddle(np.stack([np.asarray(im) for im in images]), TARGETS)  # the (B, H, W, 3) uint8 form
    assert scores.dtype == np.float32 and scores.shape == (len(TARGETS),)
    assert scores.mean() >= 0.9, list(zip(TARGETS, texts, scores))
    assert paddle(images[:2], TARGETS[:2])[1] == texts[:2]  # the PIL-list form reads the same


def test_paddle_blank_noise_and_wrong_word(paddle):
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (512, 512, 3), dtype=np.uint8))
    scores, _ = paddle([Image.new("RGB", (512, 512), "white"), noise], ["Coffee Shop", "Coffee Shop"])
    assert scores.max() <= 0.1
    image = centred("Coffee Shop")
    right, wrong = paddle([image, image], ["Coffee Shop", "Tea House"])[0]
    assert right >= 0.9 and wrong <= right - 0.5


def test_paddle_reading_order(paddle):
    # lines top to bottom, boxes left to right, even when a right-hand box sits slightly higher on its line
    image = render([("SECOND", (40, 300)), ("FIRST", (300, 120)), ("LEFT", (30, 420)), ("RIGHT", (330, 412))])
    assert paddle.read(image).split() == ["FIRST", "SECOND", "LEFT", "RIGHT"]


def test_paddle_is_configured_as_flow_grpos_paddleocr(paddle):
    # flow_grpo/ocr.py: PaddleOCR(use_angle_cls=False) read with cls=False; PaddleOCR 2.x's detector keeps an image
    # under 960 pixels at its size, where RapidOCR's default would upscale a 512-pixel image to 736
    assert paddle.engine.use_cls is False
    image = np.asarray(centred("Coffee Shop"))
    assert paddle.engine.text_det.get_preprocess(max(image.shape))(image).shape[-2:] == image.shape[:2]


def test_scorer_rejects_mismatched_targets(paddle):
    with pytest.raises(ValueError, match="2 images but 1 targets"):
        paddle([centred("A"), centred("B")], ["A"])


# ---- Qwen2.5-VL (tiny, random weights) ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    return tiny_models.build_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen_vl"))


def test_qwen_vl_tiny_batched(tiny_qwen):
    scorer = make_scorer("qwen-vl", model_path=str(tiny_qwen), batch_size=3, max_new_tokens=6)
    rng = np.random.default_rng(0)
    # different sizes give different numbers of image tokens, so the batch is left-padded
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(64, 64), (112, 112), (48, 160)]]
    images += [centred("Hello World")]  # a fourth image: a second batch of one
    scores, texts = scorer(images, ["Hello World"] * 4)
    assert scores.shape == (4,) and scores.dtype == np.float32
    assert np.isfinite(scores).all() and ((0 <= scores) & (scores <= 1)).all()
    assert len(texts) == 4 and all(isinstance(t, str) for t in texts)
    assert texts == [scorer([im], ["x"])[1][0] for im in images]  # padding does not change greedy outputs
    assert scorer(np.zeros((2, 64, 64, 3), np.uint8), ["a", "b"])[0].shape == (2,)


def test_qwen_vl_prompt_has_instruction_and_image_tokens(tiny_qwen):
    scorer = make_scorer("qwen-vl", model_path=str(tiny_qwen))
    vision = scorer.image_processor(images=[Image.new("RGB", (64, 64))], return_tensors="pt")
    assert vision["image_grid_thw"].tolist() == [[1, 4, 4]]  # 64x64 -> 56x56 -> 4x4 patches -> 4 merged tokens
    prompt = ocr_reward.QWEN_PROMPT.format(image_pads="<|image_pad|>" * 4, instruction=INSTRUCTION)
    ids = scorer.tokenizer(prompt)["input_ids"]
    assert ids.count(scorer.image_token_id) == 4 and scorer.tokenizer.decode(ids) == prompt


@pytest.mark.parametrize("messages, rendered", [
    # OpenAI's image part, and the bare one `vllm serve` passes to the template: the scorer's prompt
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}},
                                   {"type": "text", "text": INSTRUCTION}]}], None),
    ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": INSTRUCTION}]}], None),
    ([{"role": "system", "content": "Read."}, {"role": "user", "content": "1234"}],
     "<|im_start|>system\nRead.<|im_end|>\n<|im_start|>user\n1234<|im_end|>\n"
     "<|im_start|>assistant\n"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "video"}]},
      {"role": "assistant", "content": "b"}],
     "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
     "a<|vision_start|><|video_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
     "<|im_start|>assistant\n"),
])
def test_the_saved_model_s_chat_template_renders_qwen_s_prompt(tiny_qwen, messages, rendered):
    """The folder's chat template (what `vllm serve` builds the prompt from) gives the in-process
    scorer's prompt for a reward request, and Qwen's turns otherwise."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen)
    expected = rendered or ocr_reward.QWEN_PROMPT.format(image_pads="<|image_pad|>",
                                                         instruction=INSTRUCTION)
    assert tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=True) == expected


def test_qwen_vl_missing_model_is_clear(tmp_path):
    """A local path that holds no model is named as --reward-model (transformers would call it a malformed repo id)."""
    (tmp_path / "a_file").write_text("")
    for path, reason in ((tmp_path / "no_such_model", "no such directory"), (tmp_path / "a_file", "not a directory"),
                         (tmp_path, "no config.json in this directory, so not a transformers model")):
        with pytest.raises(RuntimeError) as info:
            make_scorer("qwen-vl", model_path=str(path))
        assert str(info.value) == f"--reward-model {path}: {reason}"


def test_random_qwen_vl_3b_on_meta():
    # the full-size architecture for GPU benchmarks; on "meta" it takes no memory (and cannot run)
    scorer = make_scorer("qwen-vl", model_path=ocr_reward.RANDOM_QWEN, device="meta")
    n_params = sum(p.numel() for p in scorer.model.parameters())  # lm_head is tied to the embeddings: counted once
    assert n_params == 3_754_622_976 and round(n_params, -7) == 3.75e9  # Qwen2.5-VL-3B-Instruct's checkpoint
    assert scorer.model.device.type == "meta"
    assert len(scorer.tokenizer) == scorer.model.config.text_config.vocab_size == 151936
    assert scorer.model.lm_head.weight is scorer.model.model.language_model.embed_tokens.weight
    processor = scorer.image_processor
    assert (processor.size.shortest_edge, processor.size.longest_edge, processor.patch_size, processor.merge_size) == (
        3136, 12845056, 14, 2)
    prompt = ocr_reward.QWEN_PROMPT.format(image_pads="<|image_pad|>" * 4, instruction=INSTRUCTION)
    ids = scorer.tokenizer(prompt)["input_ids"]
    assert ids.count(scorer.image_token_id) == 4 and scorer.tokenizer.decode(ids) == prompt
    assert scorer.model.generation_config.eos_token_id == scorer.tokenizer.convert_tokens_to_ids("<|im_end|>")


# ---- vLLM client against a real HTTP server ---------------------------------------------------------------------------


def test_vllm_matches_paddle(paddle):
    images = [centred(t) for t in TARGETS[:4]]
    with ocr_server(paddle.read) as (url, server):
        scorer = make_scorer("vllm", urls=[url + "/"], batch_size=4, timeout=30)
        scores, texts = scorer(images, TARGETS[:4])
        assert server.requests == 4
    expected_scores, expected_texts = paddle(images, TARGETS[:4])
    assert texts == expected_texts
    np.testing.assert_array_equal(scores, expected_scores)
    assert scores.dtype == np.float32 and scores.mean() >= 0.9


def test_vllm_sends_the_exact_pixels():
    """PNG at any compression level is lossless: the server reads the pixels the trainer rendered,
    over requests one after another on one thread's session."""
    received = []

    def read(image):
        received.append(np.asarray(image))
        return ""

    images = np.random.default_rng(0).integers(0, 256, (3, 32, 48, 3), dtype=np.uint8)
    with ocr_server(read) as (url, server):
        make_scorer("vllm", urls=[url], batch_size=1, timeout=30)(images, ["a", "b", "c"])
        assert server.requests == 3
    assert [image.tobytes() for image in received] == [image.tobytes() for image in images]


def test_vllm_round_robin(paddle):
    with ocr_server(paddle.read) as (url_a, a), ocr_server(paddle.read) as (url_b, b):
        scorer = make_scorer("vllm", urls=[url_a, url_b], batch_size=2, timeout=30)
        scorer([centred("Hi")] * 6, ["Hi"] * 6)
        assert (a.requests, b.requests) == (3, 3)


def closed_port_url() -> str:
    with socket.socket() as s:  # bind to a free port and close it: connections to it are refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_vllm_scorer_probes_its_servers_when_built(paddle):
    url = closed_port_url()
    with pytest.raises(ServerError, match=f"no vLLM server at {url} .ConnectionError.; start one with `vllm serve"):
        make_scorer("vllm", urls=[url], timeout=1.0, max_retries=1)
    with pytest.raises(ServerError, match="reward server URL 127.0.0.1:8000: No connection adapters.*; write it as http://HOST:PORT"):
        make_scorer("vllm", urls=["127.0.0.1:8000"])  # no scheme
    with ocr_server(paddle.read, silent=True) as (silent_url, _):  # accepts connections, never answers
        start = time.monotonic()
        with pytest.raises(ServerError, match=f"{silent_url} did not answer GET /v1/models within 0.5 s"):
            make_scorer("vllm", urls=[silent_url], timeout=0.5)
        assert time.monotonic() - start < 3
    with ocr_server(paddle.read, model="Qwen/Qwen2.5-VL-7B-Instruct") as (other_url, server):
        with pytest.raises(ServerError, match="serves 'Qwen/Qwen2.5-VL-7B-Instruct', not the reward model 'Qwen/Qwen2.5-VL-3B"):
            make_scorer("vllm", urls=[other_url])
        with pytest.raises(ServerError, match="not an OpenAI-compatible server: GET /v1/models gave HTTP 404"):
            make_scorer("vllm", urls=[other_url + "/wrong/prefix"], model_path="Qwen/Qwen2.5-VL-7B-Instruct")
        assert server.requests == 0  # no image was sent


def test_a_server_still_loading_is_named_with_what_to_wait_for():
    """`vllm serve` holds its port while it loads the model but listens only once it serves: a
    trainer started then is told to wait for /health, in one error, having sent nothing."""
    with socket.socket() as loading:
        loading.bind(("127.0.0.1", 0))  # bound, not listening
        url = f"http://127.0.0.1:{loading.getsockname()[1]}"
        with pytest.raises(ServerError) as info:
            make_scorer("vllm", urls=[url], timeout=1.0, max_retries=1)
    assert str(info.value) == (
        f"no vLLM server at {url} (ConnectionError); start one with `vllm serve "
        f"Qwen/Qwen2.5-VL-3B-Instruct` and start training once {url}/health answers (a server "
        "that is still loading its model refuses connections), or pass the URL of a running one")


def test_vllm_server_that_goes_down_is_retried_then_clear(paddle):
    with ocr_server(paddle.read) as (url, _):
        scorer = make_scorer("vllm", urls=[url], timeout=1.0, max_retries=1)
    start = time.monotonic()
    with pytest.raises(ServerError, match=f"{url}.*2 attempts.*ConnectionError"):
        scorer([centred("A")], ["A"])
    assert time.monotonic() - start < 5
    assert issubclass(ServerError, RuntimeError)


def test_vllm_timeout_retries_then_fails(paddle):
    with ocr_server(paddle.read, delay=1.5) as (url, server):
        scorer = make_scorer("vllm", urls=[url], timeout=0.3, max_retries=2)
        start = time.monotonic()
        with pytest.raises(ServerError, match=f"{url}.*3 attempts.*Timeout"):
            scorer([centred("A")], ["A"])
        assert time.monotonic() - start < 5  # 3 x 0.3 s timeouts + 0.25 + 0.5 s backoff
        assert server.requests == 3


def test_vllm_retries_after_500(paddle):
    with ocr_server(paddle.read, fail_first=1) as (url, server):
        scorer = make_scorer("vllm", urls=[url], timeout=30, max_retries=2)
        scores, texts = scorer([centred("Coffee Shop")], ["Coffee Shop"])
        assert server.requests == 2 and scores[0] >= 0.9


def test_vllm_client_error_is_not_retried(paddle):
    with ocr_server(paddle.read, fail_first=1, fail_status=400) as (url, server):
        scorer = make_scorer("vllm", urls=[url], timeout=30, max_retries=3)
        with pytest.raises(ServerError, match="rejected the request: HTTP 400"):
            scorer([centred("A")], ["A"])
        assert server.requests == 1


# ---- cheap rewards ------------------------------------------------------------------------------------------------


def test_brightness_and_compressibility():
    white, black = np.full((1, 64, 64, 3), 255, np.uint8), np.zeros((1, 64, 64, 3), np.uint8)
    noise = np.random.default_rng(0).integers(0, 256, (1, 64, 64, 3), dtype=np.uint8)
    bright = make_scorer("brightness")
    assert bright(white, ["x"])[0][0] == 1.0 and bright(black, ["x"])[0][0] == 0.0
    scores, texts = bright(np.concatenate([white, black, noise]), ["", "", ""])
    assert scores.dtype == np.float32 and texts == ["", "", ""] and 0.4 < scores[2] < 0.6
    compress = make_scorer("compressibility")
    flat, rough = compress(np.concatenate([white, noise]), ["", ""])[0]
    assert 0 <= rough < flat <= 1
    assert compress([Image.fromarray(noise[0])], [""])[0][0] == rough  # deterministic, same for the PIL form
