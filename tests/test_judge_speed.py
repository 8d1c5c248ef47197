"""benchmark/judge_speed.py: its full-size model is PickScore_v1's CLIP-H/14 (counted on the meta
device, nothing allocated), and the script runs end to end on CPU with --tiny.

Run: python -m pytest -q -n 0 tests/test_judge_speed.py
"""

import json

import torch
from transformers import CLIPConfig, CLIPModel

from benchmark import judge_speed
from benchmark.judge_speed import PICKSCORE_V1


def test_the_full_size_model_is_clip_h_14():
    config = CLIPConfig(text_config=PICKSCORE_V1["text"], vision_config=PICKSCORE_V1["vision"],
                        projection_dim=PICKSCORE_V1["projection_dim"])
    with torch.device("meta"):
        model = CLIPModel(config)
    assert sum(p.numel() for p in model.parameters()) == 986_109_441  # open_clip's ViT-H-14


def test_tiny_run_writes_its_timings(tmp_path):
    """The script's main, in this process (torch is imported already): its JSON holds a timing of
    each dtype."""
    out = tmp_path / "judge_speed.json"
    judge_speed.main(["--tiny", "--device", "cpu", "--num-images", "2", "--size", "64",
                      "--repeats", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["model"] == "tiny" and report["images"] == 2 and report["size"] == 64
    assert list(report["dtypes"]) == ["float32", "bfloat16"]
    for timing in report["dtypes"].values():
        assert len(timing["seconds"]) == 2 and timing["median_s"] > 0
        assert timing["finite_scores"] and timing["peak_mem_gib"] > 0
