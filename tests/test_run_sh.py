"""run.sh: GPU accounting, the reward server's life cycle, and its failure, with stand-ins for nvidia-smi and vllm.

The stand-in `vllm serve` is a real HTTP server on 127.0.0.1 that answers /health and OpenAI chat completions (with
an empty transcription), so the trainer really scores through it; the trainer itself runs on the tiny model on CPU.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data" / "ocr"

FAKE_VLLM = """#!PYTHON
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
if "--fail" in open(sys.argv[0] + ".mode").read():
    print("RuntimeError: CUDA error: no kernel image is available (stand-in failure)", flush=True)
    sys.exit(1)
port = int(sys.argv[sys.argv.index("--port") + 1])
print(f"serving {sys.argv[2]} on 127.0.0.1:{port}", flush=True)

class Handler(BaseHTTPRequestHandler):
    def reply(self, payload):
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        print("chat completion", flush=True)
        self.reply({"choices": [{"message": {"content": ""}}]})

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_tools(tmp_path, gpus=2, vllm_mode="serve"):
    """A bin/ with nvidia-smi (listing `gpus` GPUs) and vllm, and an importable `vllm` package."""
    bin_dir = tmp_path / "bin"
    (bin_dir / "vllm_pkg" / "vllm").mkdir(parents=True)
    (bin_dir / "vllm_pkg" / "vllm" / "__init__.py").write_text("")
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'\n" for i in range(gpus)))
    vllm = bin_dir / "vllm"
    vllm.write_text(FAKE_VLLM.replace("PYTHON", sys.executable))
    (bin_dir / "vllm.mode").write_text(vllm_mode)
    for tool in (smi, vllm):
        tool.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(bin_dir / "vllm_pkg")}


def run_sh(env, *args, timeout=300):
    return subprocess.run(["bash", "run.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_more_gpus_than_present_is_a_clear_error(tmp_path):
    env = {**fake_tools(tmp_path, gpus=2), "NUM_GPUS_ACTOR_ROLLOUT": "2", "NUM_GPUS_REWARD": "1"}
    result = run_sh(env, "crd")
    assert result.returncode == 1 and "= 3 GPUs asked, 2 present" in result.stderr


def test_reward_server_serves_the_run_and_stops_with_it(tmp_path, tiny_model_dir):
    port = free_port()
    env = {**fake_tools(tmp_path), "CRD_CACHE": str(tiny_model_dir.parent), "OUTPUT_DIR": str(tmp_path / "runs"),
           "REWARD_PORT": str(port), "TRAIN_DATA": str(DATA / "train.txt"), "EVAL_DATA": str(DATA / "test.txt"),
           "GROUP_SIZE": "2", "IMAGE_RESOLUTION": "64", "TOTAL_TRAINING_STEPS": "1"}
    result = run_sh(env, "crd", "--model", "tiny", "--device", "cpu", "--prompts-per-rank", "1", "--eval-every", "0",
                    "--run-name", "served", "--text-encoder-device", "cpu")  # extra args win over run.sh's layout
    assert result.returncode == 0, result.stderr[-3000:]
    assert "vllm serve Qwen/Qwen2.5-VL-3B-Instruct --host 127.0.0.1" in result.stdout
    assert "--gpu-memory-utilization 0.7" in result.stdout  # room for the text encoders beside the reward model
    assert "--text-encoder-device cuda:1 --reward vllm" in result.stdout
    assert f"--reward vllm --reward-model Qwen/Qwen2.5-VL-3B-Instruct --reward-urls http://127.0.0.1:{port}" in result.stdout
    assert (tmp_path / "runs" / "served" / "summary.json").is_file()
    server_log = (tmp_path / "runs" / "reward_server.log").read_text()
    assert server_log.count("chat completion") == 2  # one request per image: 1 prompt x 2 images
    with socket.socket() as s:  # the server went down with the run
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_a_reward_server_that_fails_to_start_shows_its_log(tmp_path):
    env = {**fake_tools(tmp_path, vllm_mode="--fail"), "OUTPUT_DIR": str(tmp_path / "runs"), "REWARD_PORT": str(free_port())}
    result = run_sh(env, "crd", timeout=60)
    assert result.returncode == 1 and "the reward server exited; last lines of" in result.stderr
    assert "CUDA error: no kernel image is available (stand-in failure)" in result.stderr
