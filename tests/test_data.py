"""data.py: conversion, bad input, loading, and the prompt-group sampler."""

import ast
import json
import sys
from pathlib import Path

import pytest

from data import DataError, GroupSampler, convert, load_prompts
from ocr_reward import ocr_score
import zygote

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = Path(__file__).parent / "data" / "ocr"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_convert_sample_in_flow_grpo_format(tmp_path):
    counts = convert([SAMPLE], tmp_path)
    assert counts == {"train": (40, 0), "test": (8, 0)}
    records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert records[0] == {
        "prompt": 'A vintage wooden sign hanging above a bakery door that reads "Fresh Bread Daily"',
        "target": "Fresh Bread Daily",
    }
    from_jsonl, from_txt = load_prompts(tmp_path / "train.jsonl")[0], load_prompts(SAMPLE / "train.txt")[0]
    assert [(r["prompt"], r["target"]) for r in from_jsonl] == [(r["prompt"], r["target"]) for r in from_txt]
    assert from_txt[2]["source"] == f"{SAMPLE / 'train.txt'}:3"  # where each record came from, for later messages


def test_cli_converts_and_reports(tmp_path):
    argv = [sys.executable, "data.py", "--input", str(SAMPLE), "--output-dir", str(tmp_path)]
    out = zygote.run(argv, cwd=ROOT, capture_output=True, text=True, check=True)
    assert "train: 40 prompts written" in out.stdout and (tmp_path / "test.jsonl").is_file()


def test_missing_target_names_file_and_line(tmp_path):
    write(tmp_path / "train.txt", 'A sign "One"\n\nA sign with nothing quoted\n')
    write(tmp_path / "test.txt", 'A sign "Two"\n')
    with pytest.raises(DataError, match=r"train\.txt:3: no quoted target"):
        convert([tmp_path], tmp_path / "out")
    assert not (tmp_path / "out" / "train.jsonl").exists()
    assert convert([tmp_path], tmp_path / "out", skip_untargeted=True)["train"] == (1, 1)
    cli = data_cli("--input", tmp_path, "--output-dir", tmp_path / "o")
    assert cli.returncode == 1 and "train.txt:3" in cli.stderr and "Traceback" not in cli.stderr


def test_missing_file_is_named(tmp_path):
    write(tmp_path / "train.txt", 'A sign "One"\n')
    with pytest.raises(DataError, match=r"test\.txt: prompt file not found"):
        convert([tmp_path], tmp_path / "out")


def test_an_existing_output_is_never_replaced_without_overwrite(tmp_path):
    """data.py --input dir/mine.txt --output-dir dir: dir/mine.jsonl, the user's own file (extra fields and all), is
    refused in one line and kept byte for byte; --overwrite replaces it."""
    write(tmp_path / "mine.txt", 'A sign "One"\n')
    mine = write(tmp_path / "mine.jsonl", '{"prompt": "A sign \\"Two\\"", "note": "my own"}\n')
    before = mine.read_bytes()
    result = data_cli("--input", tmp_path / "mine.txt", "--output-dir", tmp_path)
    assert_one_line_error(result, f"{mine} already exists: converting would replace it; pass --overwrite")
    assert mine.read_bytes() == before and not list(tmp_path.glob(".*.tmp"))
    assert data_cli("--input", tmp_path / "mine.txt", "--output-dir", tmp_path, "--overwrite").returncode == 0
    assert json.loads(mine.read_text()) == {"prompt": 'A sign "One"', "target": "One"}


def test_bad_jsonl_line_is_named(tmp_path):
    path = write(tmp_path / "p.jsonl", '{"prompt": "a \\"b\\""}\n{"text": 1}\n')
    with pytest.raises(DataError, match=r"p\.jsonl:2"):
        load_prompts(path)


def data_cli(*args):
    """python data.py ARGS in a process of its own, forked by tests/zygote.py's server (data.py
    imports torch: ~2 s a fresh interpreter)."""
    return zygote.run([sys.executable, "data.py", *map(str, args)], cwd=ROOT, capture_output=True,
                      text=True)


def assert_one_line_error(result, message):
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("name, text, message", [
    ("p.txt", 'A sign "One"\nA sign that reads ""\n', r'p\.txt:2: an empty target text in prompt .A sign that reads ""'),
    ("p.txt", 'A sign "One"\nA sign that reads "  "\n', r"p\.txt:2: an empty target"),
    ("p.jsonl", '{"prompt": "a \\"b\\""}\n{"prompt": "a sign", "target": ""}\n', r"p\.jsonl:2: an empty target"),
])
def test_empty_target_is_rejected_with_file_and_line(tmp_path, name, text, message):
    """An empty target scores 1 for a blank image (nothing to read, nothing missing): never train on one."""
    path = write(tmp_path / name, text)
    with pytest.raises(DataError, match=message):
        load_prompts(path)
    assert load_prompts(path, skip_untargeted=True)[1] == 1


@pytest.mark.parametrize("line, message", [
    ('{"prompt": 123}', "p.jsonl:2: 'prompt' must be a non-empty string, not 123"),
    ('{"prompt": "a sign \\"Hi\\"", "target": 5}', "p.jsonl:2: 'target' must be a string, not 5"),
    ('{"prompt": ""}', "p.jsonl:2: 'prompt' must be a non-empty string"),
    ('["prompt"]', "p.jsonl:2: not a JSON object with a 'prompt'"),
])
def test_wrongly_typed_jsonl_fields_are_named(tmp_path, line, message):
    path = write(tmp_path / "p.jsonl", '{"prompt": "a \\"b\\""}\n' + line + "\n")
    with pytest.raises(DataError) as error:
        load_prompts(path)
    assert str(error.value).startswith(str(tmp_path / message))


@pytest.mark.parametrize("name", ["p.json", "p.JSONL", "p.Json"])
def test_json_and_upper_case_jsonl_files_are_read_as_json_lines(tmp_path, name):
    path = write(tmp_path / name, '{"prompt": "a sign saying \\"hello\\"", "target": "hello"}\n')
    assert [(r["prompt"], r["target"]) for r in load_prompts(path)[0]] == [('a sign saying "hello"', "hello")]
    convert([path], tmp_path / "out")
    assert json.loads((tmp_path / "out" / "p.jsonl").read_text()) == {"prompt": 'a sign saying "hello"', "target": "hello"}


@pytest.mark.parametrize("text", ['[{"prompt": "A sign \\"One\\""}]\n', '[\n  {"prompt": "A sign \\"One\\""}\n]\n'],
                         ids=["one-line", "indented"])
def test_a_json_array_file_is_named_with_its_line(tmp_path, text):
    with pytest.raises(DataError, match=r"p\.json:1: not a JSON object with a 'prompt' \(one object a line, not a JSON array\)"):
        load_prompts(write(tmp_path / "p.json", text))


def test_a_json_object_in_raw_text_is_named_not_read_as_a_prompt(tmp_path):
    """Read as raw text, its target would be its first quoted word, "prompt"; braces that are not JSON (line 1) are
    part of a prompt."""
    path = write(tmp_path / "p.txt", '{Sale} sign "Open"\n{"prompt": "a sign saying \\"hello\\"", "target": "hello"}\n')
    for skip_untargeted in (False, True):
        with pytest.raises(DataError, match=r"p\.txt:2: a JSON object in a raw text file of prompts; name the file \.jsonl"):
            load_prompts(path, skip_untargeted)


def test_a_non_utf8_file_is_named_with_its_line(tmp_path):
    write(tmp_path / "in" / "train.txt", 'A sign "One"\n')
    (tmp_path / "in" / "test.txt").write_bytes('A sign "One"\nUn café "Crème"\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"test\.txt:2: not UTF-8 text \(byte 0xe9\)"):
        load_prompts(tmp_path / "in" / "test.txt")
    assert_one_line_error(data_cli("--input", tmp_path / "in", "--output-dir", tmp_path / "out"), "test.txt:2: not UTF-8")


def test_a_byte_order_mark_and_old_mac_line_ends_are_read_and_a_nul_byte_or_directory_is_named(tmp_path):
    (tmp_path / "mac.txt").write_bytes(b'\xef\xbb\xbfA sign "One"\rA sign "Two"\r')
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "A sign \\"One\\""}\r\n{"prompt": "x", "target": "Two"}\r\n')
    (tmp_path / "nul.txt").write_bytes(b'A sign "One"\nA sign \0"Two"\n')
    assert [(r["prompt"], r["source"]) for r in load_prompts(tmp_path / "mac.txt")[0]] == [
        ('A sign "One"', f"{tmp_path / 'mac.txt'}:1"), ('A sign "Two"', f"{tmp_path / 'mac.txt'}:2")]
    assert [r["target"] for r in load_prompts(tmp_path / "bom.jsonl")[0]] == ["One", "Two"]
    with pytest.raises(DataError, match=r"nul\.txt:2: a NUL byte"):
        load_prompts(tmp_path / "nul.txt")
    with pytest.raises(DataError, match="a directory, not a prompt file"):
        load_prompts(tmp_path)


def test_convert_single_files(tmp_path):
    write(tmp_path / "a.txt", 'A sign "One"\n')
    write(tmp_path / "b.jsonl", '{"prompt": "A sign", "target": "Two"}\n')
    assert convert([tmp_path / "a.txt"], tmp_path / "out") == {"a": (1, 0)}
    result = data_cli("--input", tmp_path / "a.txt", tmp_path / "b.jsonl", "--output-dir", tmp_path / "out",
                      "--overwrite")  # out/a.jsonl: the line above's
    assert result.returncode == 0 and "a: 1 prompts written" in result.stdout and "b: 1 prompts written" in result.stdout
    assert json.loads((tmp_path / "out" / "b.jsonl").read_text()) == {"prompt": "A sign", "target": "Two"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.jsonl", "b.jsonl"]  # no temporary file left
    with pytest.raises(DataError, match="another input is also named 'a'"):
        convert([tmp_path / "a.txt", write(tmp_path / "x" / "a.txt", 'A "B"\n')], tmp_path / "out")


def test_nothing_is_written_unless_every_input_is_good(tmp_path):
    write(tmp_path / "in" / "train.txt", 'A sign "One"\n')
    write(tmp_path / "in" / "test.txt", 'A sign "Two"\nno target here\n')
    write(tmp_path / "out" / "train.jsonl", "earlier\n")
    with pytest.raises(DataError, match=r"test\.txt:2"):
        convert([tmp_path / "in"], tmp_path / "out")
    assert (tmp_path / "out" / "train.jsonl").read_text() == "earlier\n"  # not replaced by half of a conversion
    with pytest.raises(DataError, match="no-such-dir: prompt file not found"):
        convert([tmp_path / "no-such-dir"], tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_output_dir_naming_a_file_is_one_line(tmp_path):
    write(tmp_path / "in" / "train.txt", 'A sign "One"\n')
    write(tmp_path / "in" / "test.txt", 'A sign "Two"\n')
    taken = write(tmp_path / "taken", "a file\n")
    assert_one_line_error(data_cli("--input", tmp_path / "in", "--output-dir", taken), f"output directory {taken} is a file")
    assert_one_line_error(data_cli("--input", tmp_path / "in", "--output-dir", taken / "sub"), f"output directory {taken / 'sub'}")


def test_empty_lines_ignored_and_unicode_round_trip(tmp_path):
    write(tmp_path / "train.txt", '\n  \nUn café qui dit "Crème Brûlée"\n\nA lantern reading "北京欢迎你"\n')
    write(tmp_path / "test.txt", 'A sign "Ünïcödé ✓"\n')
    convert([tmp_path], tmp_path / "out")
    records, skipped = load_prompts(tmp_path / "out" / "train.jsonl")
    assert skipped == 0 and [r["target"] for r in records] == ["Crème Brûlée", "北京欢迎你"]
    assert load_prompts(tmp_path / "out" / "test.jsonl")[0][0]["target"] == "Ünïcödé ✓"


def test_targets_are_what_a_perfect_read_gives_and_escaped_quotes_are_quotes(tmp_path):
    """A decomposed accent, a bidi mark or a zero-width space in a target would cap a perfect read
    below 1; a raw-text prompt copied from code (\\"HI\\") quotes HI, not HI\\."""
    decomposed = "Cafe\u0301"
    write(tmp_path / "a.txt", f'A sign "{decomposed}"\nA note "\u200fNO\u200bEXIT"\nSay \\"HI\\" loud\n')
    write(tmp_path / "b.jsonl", json.dumps({"prompt": "x", "target": "\u200e" + decomposed}) + "\n")
    records = load_prompts(tmp_path / "a.txt")[0] + load_prompts(tmp_path / "b.jsonl")[0]
    assert [r["target"] for r in records] == ["Caf\u00e9", "NOEXIT", "HI", "Caf\u00e9"]
    assert records[2]["prompt"] == 'Say "HI" loud'
    assert ocr_score("CAF\u00c9", records[0]["target"]) == 1.0  # the composed read PP-OCR gives
    assert ocr_score("CAF\u00c9", decomposed) < 0.8  # what the raw target scored
    write(tmp_path / "c.txt", 'A sign "\u200f"\n')
    with pytest.raises(DataError, match="an empty target text"):
        load_prompts(tmp_path / "c.txt")


def draw(sampler, iterations):
    return [sampler.next_indices() for _ in range(iterations)]


def test_sampler_is_deterministic_and_groups_are_contiguous():
    a, b = GroupSampler(10, 3, 4, seed=7), GroupSampler(10, 3, 4, seed=7)
    batches = draw(a, 5)
    assert batches == draw(b, 5) and batches != draw(GroupSampler(10, 3, 4, seed=8), 5)
    for batch in batches:
        groups = [batch[i : i + 4] for i in range(0, 12, 4)]
        assert all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) == 3


def test_sampler_without_replacement_per_epoch():
    sampler = GroupSampler(9, 3, 2, seed=0)
    first_epoch = [i for batch in draw(sampler, 3) for i in batch[::2]]
    assert sorted(first_epoch) == list(range(9))
    second_epoch = [i for batch in draw(sampler, 3) for i in batch[::2]]
    assert sorted(second_epoch) == list(range(9)) and second_epoch != first_epoch


@pytest.mark.parametrize("world_size", [1, 2])
def test_whole_groups_per_rank(world_size):
    ranks = [GroupSampler(20, 2, 3, seed=1, rank=r, world_size=world_size) for r in range(world_size)]
    for _ in range(6):
        per_rank = [s.next_indices() for s in ranks]
        prompts = [p for batch in per_rank for p in batch[::3]]
        assert len(set(prompts)) == 2 * world_size  # no prompt shared between ranks within an iteration
        for batch in per_rank:
            assert len(batch) == 6 and all(len(set(batch[i : i + 3])) == 1 for i in range(0, 6, 3))


def test_single_rank_equals_union_of_two_ranks():
    single = GroupSampler(20, 4, 2, seed=3)
    pair = [GroupSampler(20, 2, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(7):
        assert single.next_indices() == pair[0].next_indices() + pair[1].next_indices()


def test_sampler_state_round_trip():
    sampler = GroupSampler(11, 2, 3, seed=5)
    draw(sampler, 4)
    restored = GroupSampler(11, 2, 3, seed=5)
    restored.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    assert draw(restored, 6) == draw(sampler, 6)


def test_sampler_rejects_impossible_sizes():
    with pytest.raises(DataError, match="only 3 prompts"):
        GroupSampler(3, 2, 6, seed=0, world_size=2)


MINE = '{"prompt": "A sign \\"Hi\\"", "target": "Hi", "id": 7, "split": "train", "weight": 0.5}\n'


@pytest.mark.parametrize("output_dir", [".", "new/..", "link", "out"],
                         ids=["its-folder", "dotdot-in-a-folder-to-be-made", "a-symlink-to-its-folder",
                              "a-hard-link-of-it"])
def test_an_output_that_is_an_input_is_refused_before_anything_is_written(tmp_path, output_dir):
    """`--output-dir .` beside mine.jsonl replaced it, dropping its extra fields, with rc 0."""
    mine = write(tmp_path / "mine.jsonl", MINE)
    other = write(tmp_path / "other.txt", 'A sign "Other"\n')  # converted first, if at all
    output_dir = tmp_path / output_dir
    (tmp_path / "link").symlink_to(tmp_path, target_is_directory=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.jsonl").hardlink_to(mine)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    result = data_cli("--input", other, mine, "--output-dir", output_dir)
    assert_one_line_error(result, f"data.py: error: {output_dir / 'mine.jsonl'} is the input {mine}")
    assert "Traceback" not in result.stderr and mine.read_text() == MINE
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # not even other.jsonl


def test_converting_json_lines_keeps_their_other_fields(tmp_path):
    extracted = '{"id": "b", "prompt": "A sign \\"Hello\\"", "tags": ["x", {"y": 1}]}\n'
    mine = write(tmp_path / "mine.jsonl", MINE + extracted)
    result = data_cli("--input", mine, "--output-dir", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    lines = (tmp_path / "out" / "mine.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"prompt": 'A sign "Hi"', "target": "Hi", "id": 7, "split": "train", "weight": 0.5},
        {"prompt": 'A sign "Hello"', "target": "Hello", "id": "b", "tags": ["x", {"y": 1}]}]
    assert load_prompts(write(tmp_path / "p.txt", 'A sign "One"\n'))[0][0]["extra"] == {}


@pytest.mark.parametrize("input_option, output_option", [
    ("--input_dir", "--output_dir"), ("--input-dir", "--output-dir"), ("--input", "--output_dir")])
def test_the_recipes_option_spellings_convert(tmp_path, input_option, output_option):
    """The recipe calls the converter with --input_dir and --output_dir."""
    result = data_cli(input_option, SAMPLE, output_option, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert "train: 40 prompts written" in result.stdout and "test: 8 prompts written" in result.stdout
    assert len(load_prompts(tmp_path / "out" / "train.jsonl")[0]) == 40


@pytest.mark.parametrize("name, data, message", [
    ("p.txt", b'A sign "One"\rA sign\r', "p.txt:2: no quoted target"),
    ("p.txt", b'A sign "One"\nA sign \0"Two"\n', "p.txt:2: a NUL byte"),
    ("p.txt", b'{"prompt": "a sign \\"Hi\\""}\n', "p.txt:1: a JSON object in a raw text file"),
    ("p.jsonl", b'\xef\xbb\xbf{"prompt": "A sign"}\n', "p.jsonl:1: no quoted target"),
])
def test_the_checks_a_review_doubted_stay_one_line_errors(tmp_path, name, data, message):
    """A code review asked whether load_prompts' byte-order-mark, line-end, NUL and JSON-in-text
    handling was needed: each guards a user's file (an editor's BOM or CR line ends, a binary file, a
    misnamed JSON Lines file) against a wrong prompt or target taken silently, so each stays."""
    (tmp_path / name).write_bytes(data)
    result = data_cli("--input", tmp_path / name, "--output-dir", tmp_path / "out")
    assert_one_line_error(result, message)
    assert not (tmp_path / "out").exists()


def test_data_py_lines_fit_100_characters_one_statement_each():
    source = (ROOT / "data.py").read_text(encoding="utf-8")
    long = [n for n, line in enumerate(source.splitlines(), start=1) if len(line) > 100]
    assert not long, f"data.py lines over 100 characters: {long}"
    starts = [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.stmt)]
    assert len(starts) == len(set(starts)), "data.py has two statements on one line"
