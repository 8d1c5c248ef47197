"""run.sh: GPU accounting, the reward server's life cycle, and its failure, with stand-ins for nvidia-smi and vllm.

The stand-in `vllm serve` is a real HTTP server on 127.0.0.1 that answers /health, /v1/models and OpenAI chat
completions (with an empty transcription), so the trainer really scores through it; the trainer itself runs on the
tiny model on CPU. The `python3` first on PATH is one without torch (as when the requirements live in a virtualenv
that is not activated): run.sh must use $PYTHON, which the tests set to this interpreter.
"""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data" / "ocr"

FAKE_VLLM = """#!PYTHON
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
mode = open(sys.argv[0] + ".mode").read()
if "--fail" in mode:
    print("RuntimeError: CUDA error: no kernel image is available (stand-in failure)", flush=True)
    sys.exit(1)
port = int(sys.argv[sys.argv.index("--port") + 1])
if "--slow" in mode and not os.path.exists(sys.argv[0] + ".loaded"):  # loading, not listening
    time.sleep(float(mode.split("--slow")[1].split()[0]))
    open(sys.argv[0] + ".loaded", "w").close()  # a second start is a quick one
print(f"serving {sys.argv[2]} on 127.0.0.1:{port}", flush=True)

class Handler(BaseHTTPRequestHandler):
    def reply(self, payload):
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        served = "someone/another-model" if "other-model" in mode else sys.argv[2]
        self.reply({"data": [{"id": served}]} if self.path == "/v1/models" else {})

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


def port_open(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def fake_tools(tmp_path, gpus=2, vllm_mode="serve"):
    """A bin/ with nvidia-smi (listing `gpus` GPUs), vllm and a python3 without torch, an importable `vllm` package,
    and PYTHON set to this interpreter."""
    bin_dir = tmp_path / "bin"
    (bin_dir / "vllm_pkg" / "vllm").mkdir(parents=True)
    (bin_dir / "vllm_pkg" / "vllm" / "__init__.py").write_text("")
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'\n" for i in range(gpus)))
    vllm = bin_dir / "vllm"
    vllm.write_text(FAKE_VLLM.replace("PYTHON", sys.executable))
    (bin_dir / "vllm.mode").write_text(vllm_mode)
    python3 = bin_dir / "python3"
    python3.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch' (python3 from PATH)\" >&2\nexit 1\n")
    for tool in (smi, vllm, python3):
        tool.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(bin_dir / "vllm_pkg"),
            "PYTHON": sys.executable}


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
           "GROUP_SIZE": "2", "IMAGE_RESOLUTION": "64", "TOTAL_TRAINING_STEPS": "1", "EVAL_PROMPTS": "3"}
    result = run_sh(env, "crd", "--model", "tiny", "--device", "cpu", "--prompts-per-rank", "1", "--eval-every", "0",
                    "--run-name", "served", "--text-encoder-device", "cpu")  # extra args win over run.sh's layout
    assert result.returncode == 0, result.stderr[-3000:]
    assert "vllm serve Qwen/Qwen2.5-VL-3B-Instruct --host 127.0.0.1" in result.stdout
    assert f"+ {sys.executable} crd.py --model " in result.stdout  # one actor: no torchrun
    assert "--gpu-memory-utilization 0.7" in result.stdout  # room for the text encoders beside the reward model
    assert "--text-encoder-device cuda:1 --reward vllm" in result.stdout
    assert f"--reward vllm --reward-model Qwen/Qwen2.5-VL-3B-Instruct --reward-urls http://127.0.0.1:{port}" in result.stdout
    assert (tmp_path / "runs" / "served" / "summary.json").is_file()
    state = json.loads((tmp_path / "runs" / "served" / "global_step_1" / "trainer_state.json").read_text())
    assert state["args"]["eval_prompts"] == 3  # EVAL_PROMPTS reached the trainer
    server_log = (tmp_path / "runs" / "reward_server.log").read_text()
    assert server_log.count("chat completion") == 2  # one request per image: 1 prompt x 2 images
    with socket.socket() as s:  # the server went down with the run
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_one_gpu_serves_the_reward_beside_the_actor(tmp_path):
    """REWARD_ON_ACTOR_GPU=1 on a one-GPU machine: the server goes on GPU 0 with a third of its
    memory, run.sh says when it answered, and the trainer (PYTHON: a stand-in that prints its
    arguments) reads it with the text encoders and the reward off no other GPU."""
    port = free_port()
    env = {**fake_tools(tmp_path, gpus=1), "PYTHON": "echo", "REWARD_PORT": str(port),
           "OUTPUT_DIR": str(tmp_path / "runs"), "REWARD_ON_ACTOR_GPU": "1"}
    result = run_sh(env, "crd", timeout=60)
    assert result.returncode == 0, result.stderr
    assert ("+ CUDA_VISIBLE_DEVICES=0 vllm serve Qwen/Qwen2.5-VL-3B-Instruct --host 127.0.0.1 "
            f"--port {port} --data-parallel-size 1 ") in result.stdout
    assert "--gpu-memory-utilization 0.3 " in result.stdout
    assert re.search(r"^run\.sh: the reward server answered after \d+ s$", result.stdout, re.M)
    command = result.stdout.splitlines()[-1]
    assert "--text-encoder-device" not in command and "--reward-device" not in command
    assert command.endswith("--reward vllm --reward-model Qwen/Qwen2.5-VL-3B-Instruct "
                            f"--reward-urls http://127.0.0.1:{port}")
    deadline = time.time() + 10  # the watcher takes the server down once the launcher exited
    while port_open(port):
        assert time.time() < deadline, "the reward server outlived the run"
        time.sleep(0.1)


@pytest.mark.long
def test_the_served_recipe_s_fault_phase_kills_the_server_and_the_run_goes_on(tmp_path,
                                                                              tiny_model_dir):
    """benchmark/served_recipe.py's `killed` phase against the stand-in server: killed once the
    run's first checkpoint exists, it stops the trainer in one line with a checkpoint; the same
    RUN_NAME again (run.sh adds --resume-from latest) ends the run on a new server."""
    spec = importlib.util.spec_from_file_location("served_recipe",
                                                  ROOT / "benchmark" / "served_recipe.py")
    served_recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(served_recipe)

    env = {**fake_tools(tmp_path, gpus=1), "CRD_CACHE": str(tiny_model_dir.parent),
           "OUTPUT_DIR": str(tmp_path / "runs"), "REWARD_PORT": str(free_port()),
           "REWARD_ON_ACTOR_GPU": "1", "RUN_NAME": "killed", "TRAIN_DATA": str(DATA / "train.txt"),
           "EVAL_DATA": str(DATA / "test.txt"), "GROUP_SIZE": "2", "IMAGE_RESOLUTION": "64",
           "TOTAL_TRAINING_STEPS": "8", "EVAL_PROMPTS": "3"}
    args = ["--model", "tiny", "--device", "cpu", "--prompts-per-rank", "1", "--eval-every", "0",
            "--save-every", "1", "--reward-retries", "1"]
    killed = served_recipe.run_sh("killed", env, args, kill_server_at=1)
    assert killed["exit_status"] == 1 and killed["server_killed"]["groups"], killed["stderr_tail"]
    line = killed["stderr_tail"][-1]
    assert line.startswith("crd.py: error: the reward failed: vLLM server http://127.0.0.1:")
    assert "stopped after iteration" in line and "Traceback" not in killed["stderr_tail"]
    assert killed["summary"]["completed"] is False
    assert f"global_step_{killed['summary']['iterations']}" in killed["checkpoints"]
    resumed = served_recipe.run_sh("resumed", env, args)
    assert resumed["exit_status"] == 0, resumed["stderr_tail"]
    assert resumed["summary"]["completed"] and resumed["summary"]["iterations"] == 8
    assert resumed["server_start_s"] is not None


@pytest.mark.long
def test_the_served_recipe_s_urls_phase_loading_wrong_name_scoring_kill_and_resume(
        tmp_path, tiny_model_dir):
    """benchmark/served_recipe.py's `evaluate` phase against the stand-in server, started as run.sh
    starts it: evaluate.py while it loads and with a model name it does not serve each end in
    one line naming what to do, then scores every prompt through it; run.sh given it as
    REWARD_URLS stops in one line with a checkpoint when it is killed, and goes on to the end
    on a new server."""
    spec = importlib.util.spec_from_file_location("served_recipe",
                                                  ROOT / "benchmark" / "served_recipe.py")
    served_recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(served_recipe)
    env = {**fake_tools(tmp_path, gpus=1, vllm_mode="serve --slow 12"),
           "CRD_CACHE": str(tiny_model_dir.parent)}
    what = ["--model", "tiny", "--device", "cpu", "--eval-data", str(DATA / "test.txt"),
            "--num-prompts", "3", "--resolution", "64", "--judge", "none"]
    run_env = {**env, "RUN_NAME": "killed", "REWARD_MODEL": "org/reward-model",
               "TRAIN_DATA": str(DATA / "train.txt"),
               "EVAL_DATA": str(DATA / "test.txt"), "GROUP_SIZE": "2", "IMAGE_RESOLUTION": "64",
               "TOTAL_TRAINING_STEPS": "8", "EVAL_PROMPTS": "3"}
    run_args = ["--model", "tiny", "--device", "cpu", "--prompts-per-rank", "1", "--eval-every",
                "0", "--save-every", "2", "--reward-retries", "1"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    result = served_recipe.urls_phase(tmp_path, "org/reward-model", env, what, port, run_env,
                                      run_args)
    loading = result["while_loading"]
    assert loading["exit_status"] == 1 and result["server_loading"], loading
    line = loading["stderr_tail"][-1]
    assert line.startswith(f"evaluate.py: error: no vLLM server at {url}"), loading
    assert "still loading" in line and f"{url}/health" in line
    assert not any("Loading pipeline" in line for line in loading["stderr_tail"])  # checked first
    wrong = result["wrong_model_name"]
    assert wrong["exit_status"] == 1, wrong
    line = wrong["stderr_tail"][-1]
    assert line.startswith(f"evaluate.py: error: vLLM server {url} serves 'org/reward-model'")
    assert "Qwen/no-such-model" in line
    scored = result["scored"]
    assert scored["exit_status"] == 0, scored["stderr_tail"]
    assert scored["results"]["num_prompts"] == 3 and scored["results"]["reward"] == "vllm"
    assert result["server"]["chat_completions"] == 3 and result["server"]["failed"] == 0
    killed, resumed = result["killed"], result["resumed"]
    assert killed["exit_status"] == 1 and killed["server_killed"]["groups"], killed["stderr_tail"]
    stopped = killed["stderr_tail"][-1]
    assert stopped.startswith(f"crd.py: error: the reward failed: vLLM server {url}")
    assert "global_step_2" in killed["checkpoints"] and not killed["summary"]["completed"]
    assert resumed["exit_status"] == 0, resumed["stderr_tail"]
    assert resumed["summary"]["completed"] and resumed["summary"]["iterations"] == 8
    left = 8 - killed["summary"]["iterations"]  # each scores its 2 images on the new server
    assert resumed["server"]["chat_completions"] == 2 * left and resumed["server"]["failed"] == 0
    assert len(result["server_start_s"]) == 2 and not port_open(port)  # taken down at the end


def test_a_cpu_host_runs_the_recipe_launcher_with_device_cpu(tmp_path, tiny_model_dir):
    """--device cpu on a host without a GPU (nvidia-smi finds no driver): run.sh counts no GPU,
    starts no reward server and trains; without --device cpu it names the GPUs missing."""
    env = {**fake_tools(tmp_path, gpus=0), "CRD_CACHE": str(tiny_model_dir.parent),
           "OUTPUT_DIR": str(tmp_path / "runs"), "TRAIN_DATA": str(DATA / "train.txt"),
           "EVAL_DATA": str(DATA / "test.txt"), "GROUP_SIZE": "2", "IMAGE_RESOLUTION": "64",
           "TOTAL_TRAINING_STEPS": "1", "EVAL_PROMPTS": "3"}
    (tmp_path / "bin" / "nvidia-smi").write_text(
        "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\n"
        "exit 9\n")
    args = ["crd", "--model", "tiny", "--device", "cpu", "--reward", "brightness",
            "--prompts-per-rank", "1", "--eval-every", "0", "--run-name", "cpu"]
    result = run_sh(env, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"+ {sys.executable} crd.py --model " in result.stdout and "vllm serve" not in result.stdout
    assert "--text-encoder-device" not in result.stdout and "cuda" not in result.stdout
    summary = json.loads((tmp_path / "runs" / "cpu" / "summary.json").read_text())
    assert summary["completed"] and summary["iterations"] == 1
    result = run_sh(env, *[a for a in args if a not in ("--device", "cpu")], timeout=120)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "run.sh: error: NUM_GPUS_ACTOR_ROLLOUT=1 + NUM_GPUS_REWARD=1 = 2 GPUs asked, 0 present "
        "(--device cpu runs on the CPU)"]


def tiny_run_env(tmp_path, **tools):
    return {**fake_tools(tmp_path, **tools), "CRD_CACHE": str(tmp_path / "no-cache"), "OUTPUT_DIR": str(tmp_path / "runs"),
            "REWARD_PORT": str(free_port()), "TRAIN_DATA": str(DATA / "train.txt"), "EVAL_DATA": str(DATA / "test.txt")}


def test_a_reward_server_that_fails_to_start_shows_its_log(tmp_path):
    # the tiny model: the hub id's dry run would refuse SD3.5-M's 24 images in this CPU's memory
    env = {**tiny_run_env(tmp_path, vllm_mode="--fail"), "MODEL": "tiny"}
    result = run_sh(env, "crd", "--text-encoder-device", "cpu", timeout=120)
    assert result.returncode == 1 and "the reward server exited; last lines of" in result.stderr
    assert "CUDA error: no kernel image is available (stand-in failure)" in result.stderr


@pytest.mark.parametrize("algo", ["crd", "nft"])
def test_a_bad_argument_stops_the_run_before_the_reward_server_starts(algo, tmp_path):
    env = {**tiny_run_env(tmp_path), "TRAIN_DATA": "data/ocr/typo.jsonl"}
    result = run_sh(env, algo, "--text-encoder-device", "cpu", timeout=120)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"{algo}.py: error: data/ocr/typo.jsonl: prompt file not found"]
    assert "vllm serve" not in result.stdout and not (tmp_path / "runs" / "reward_server.log").exists()


def test_a_trainer_error_is_its_one_line(tmp_path):
    """One actor runs without torchrun, whose report of a failed rank is ~40 lines; here the trainer finds that the
    reward server serves another model."""
    result = run_sh(tiny_run_env(tmp_path, vllm_mode="other-model"), "crd", "--model", "tiny",
                    "--text-encoder-device", "cpu", timeout=120)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "crd.py: error: vLLM server http://127.0.0.1:{} serves 'someone/another-model', not the reward model "
        "'Qwen/Qwen2.5-VL-3B-Instruct'".format(result.stdout.split("--port ")[1].split()[0])]


@pytest.mark.parametrize("override, message", [
    ({"NUM_GPUS_ACTOR_ROLLOUT": "abc"}, "NUM_GPUS_ACTOR_ROLLOUT=abc: not a whole number"),
    ({"NUM_GPUS_ACTOR_ROLLOUT": "0", "NUM_GPUS_REWARD": "0"}, "NUM_GPUS_ACTOR_ROLLOUT=0: at least 1 actor GPU is needed"),
    ({"NUM_GPUS_REWARD": "-1"}, "NUM_GPUS_REWARD=-1: not a whole number"),
    ({"GROUP_SIZE": "6x"}, "GROUP_SIZE=6x: not a whole number"),
    ({"REWARD_PORT": "70000"}, "REWARD_PORT=70000: not a TCP port (1-65535)"),
    ({"NNODES": "0"}, "NNODES=0: at least 1 node is needed"),
    ({"NNODES": "2", "NODE_RANK": "2", "RUN_NAME": "r"}, "NODE_RANK=2: must be below NNODES=2"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT=0: not a TCP port (1-65535)"),
    ({"MAX_RESTARTS": "two"}, "MAX_RESTARTS=two: not a whole number"),
    ({"NNODES": "2"}, "RUN_NAME: needed with NNODES=2, for every node and restart to name one run "
                      "directory"),
    ({"REWARD_ON_ACTOR_GPU": "yes"}, "REWARD_ON_ACTOR_GPU=yes: 0 or 1"),
    ({"REWARD_GPU_MEMORY": "1"}, "REWARD_GPU_MEMORY=1: a fraction of the GPU's memory, between 0 and 1"),
    ({"REWARD_GPU_MEMORY": "0.0"},
     "REWARD_GPU_MEMORY=0.0: a fraction of the GPU's memory, between 0 and 1"),
    ({"REWARD_ON_ACTOR_GPU": "1", "NUM_GPUS_ACTOR_ROLLOUT": "2"},
     "REWARD_ON_ACTOR_GPU=1: the server shares one actor GPU, not 2"),
    ({"REWARD_ON_ACTOR_GPU": "1", "REWARD_URLS": "http://10.0.0.2:8000"},
     "REWARD_ON_ACTOR_GPU=1 and REWARD_URLS: the servers run elsewhere"),
])
def test_bad_environment_overrides_are_one_line(tmp_path, override, message):
    result = run_sh({**fake_tools(tmp_path), **override}, "crd", timeout=30)
    assert result.returncode == 1 and result.stderr.splitlines() == [f"run.sh: error: {message}"]


# a summary.json as the trainers write it (run_summary.write_summary)
SUMMARY = {"algorithm": "crd", "reward": "paddle", "completed": True, "stopped_by": None, "iterations": 3,
           "optimizer_steps": 6, "world_size": 1, "initial_eval_reward": 0.25, "final_eval_reward": 0.5,
           "best_eval_reward": 0.5, "best_eval_iteration": 3, "initial_eval_judge": None, "final_eval_judge": None,
           "warmup_iteration_s": 20.5, "mean_iteration_s": 2.25, "mean_iteration_excludes": [1],
           "train_images_per_s": 10.7, "peak_mem_gib": {"actor cuda:0": 31.5}}


@pytest.mark.parametrize("field, value, kind", [
    ("peak_mem_gib", None, "an object of numbers"),
    ("peak_mem_gib", {"actor cuda:0": "31.5"}, "an object of numbers"),
    ("mean_iteration_s", "2.25 s", "a number or null"),
    ("warmup_iteration_s", [20.5], "a number or null"),
    ("iterations", 3.5, "a whole number"),
])
def test_compare_names_a_summary_field_of_the_wrong_type(field, value, kind, tmp_path):
    for run, summary in (("a", SUMMARY), ("b", {**SUMMARY, field: value})):
        (tmp_path / run).mkdir()
        (tmp_path / run / "summary.json").write_text(json.dumps(summary))
    result = run_sh({**os.environ, "PYTHON": sys.executable}, "compare", tmp_path / "a", tmp_path / "b", timeout=30)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"run.sh compare: {tmp_path / 'b' / 'summary.json'}: {field} is {json.dumps(value)}, not {kind}"]


def test_compare_of_one_run_prints_its_table_and_the_first_iteration_without_claiming_a_compile(
        tmp_path):
    """One run is a table of one column, not the usage; summary.json does not say whether the run
    compiled (CPU runs never do), so the first iteration's row claims no torch.compile warm-up."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "summary.json").write_text(json.dumps(SUMMARY))
    result = run_sh({**os.environ, "PYTHON": sys.executable}, "compare", tmp_path / "a", timeout=30)
    assert result.returncode == 0, result.stderr
    table = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines()]
    rows = {label: cells for label, *cells in table[2:]}
    assert table[0] == ["Metric", "a"]
    assert rows["Final held-out reward"] == ["0.5000"]
    assert rows["First iteration (including torch.compile's warm-up, if any)"] == ["20.5 s"]
    assert "(torch.compile warm-up)" not in result.stdout
    usage = run_sh({**os.environ, "PYTHON": sys.executable}, "compare", timeout=30)
    assert usage.returncode == 2 and "bash run.sh compare RUN_DIR [RUN_DIR...]" in usage.stderr


def test_launch_py_reports_a_failed_rank_in_one_line_with_its_exit_code(tmp_path):
    """torchrun's ~40-line ChildFailedError report becomes one line after the rank's own error, with its exit code."""
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit('fails.py: error: rank 1 gives up')\n")
    result = subprocess.run([sys.executable, "launch.py", "--standalone", "--nproc-per-node", "2", str(script)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert "fails.py: error: rank 1 gives up" in lines
    assert lines[-1] == (f"launch.py: rank 1 of {script} failed (exit code 1); its error is printed "
                         "above. Once it is fixed, --resume-from latest (on every node) continues from "
                         "the run's latest checkpoint")


@pytest.mark.parametrize("flag, message", [
    (["--nproc_per_node=0"], "--nproc-per-node 0: must be at least 1"),  # torchrun's other spelling and form
    (["--nproc-per-node", "abc"], "--nproc-per-node abc: not a number of processes, nor one of auto, cpu, gpu, xpu"),
    pytest.param(["--nproc-per-node", "gpu"], "--nproc-per-node gpu: Cuda is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_launch_py_names_a_bad_nproc_per_node_before_torchrun_starts(flag, message, tmp_path):
    result = subprocess.run([sys.executable, "launch.py", "--standalone", *flag, str(tmp_path / "never_run.py")],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr.splitlines() == [f"launch.py: error: {message}"]


@pytest.mark.parametrize("name,value", [
    ("EXIT_BARRIER_TIMEOUT", "abc"), ("EXIT_BARRIER_TIMEOUT", "0"), ("EXIT_BARRIER_TIMEOUT", "inf"),
    ("LOST_NODE_TIMEOUT", "-1"), ("LOST_NODE_TIMEOUT", "1 min")])
def test_launch_py_names_a_bad_timeout_of_its_own_before_torchrun_starts(name, value, tmp_path):
    result = subprocess.run([sys.executable, "launch.py", "--standalone", "--nproc-per-node", "1",
                             str(tmp_path / "never_run.py")], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env={**os.environ, name: value})
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"launch.py: error: {name}={value}: not a number of seconds above 0"]


@pytest.mark.parametrize("value", ["abc", "-5"])
def test_launch_py_names_a_bad_join_timeout_before_torchrun_starts(value, tmp_path):
    result = subprocess.run([sys.executable, "launch.py", "--standalone", "--rdzv-conf", f"join_timeout={value}",
                             "--nproc-per-node", "1", str(tmp_path / "never_run.py")], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"launch.py: error: --rdzv-conf join_timeout={value}: not a number of seconds above 0"]


def test_ctrl_c_to_run_sh_stops_several_ranks_with_a_checkpoint_and_exit_130(tmp_path, tiny_model_dir):
    """SIGINT to run.sh's process alone (it execs the launcher, so no shell stands between): torchrun forwards it, the
    2 ranks (gloo on CPU) finish their iteration, rank 0 saves, and run.sh exits 130 without a traceback."""
    env = {**fake_tools(tmp_path, gpus=2), "NUM_GPUS_ACTOR_ROLLOUT": "2", "NUM_GPUS_REWARD": "0", "OMP_NUM_THREADS": "1",
           "CRD_CACHE": str(tiny_model_dir.parent), "OUTPUT_DIR": str(tmp_path / "runs"), "GROUP_SIZE": "4",
           "IMAGE_RESOLUTION": "64", "TRAIN_DATA": str(DATA / "train.txt"), "EVAL_DATA": str(DATA / "test.txt"),
           "TOTAL_TRAINING_STEPS": "1000"}
    process = subprocess.Popen(["bash", "run.sh", "crd", "--model", "tiny", "--device", "cpu", "--reward", "brightness",
                                "--prompts-per-rank", "1", "--eval-every", "0", "--save-every", "1000",
                                "--run-name", "stopped"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    run = tmp_path / "runs" / "stopped"
    try:
        deadline = time.time() + 120
        while not list(run.glob("events.*")) and time.time() < deadline:
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert f"+ env TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600 {sys.executable} launch.py --standalone --nproc-per-node 2 crd.py " in stdout
    assert "launch.py: stopped by SIGINT" in stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] is False and summary["stopped_by"] == "SIGINT" and summary["world_size"] == 2
    assert [p.name for p in run.glob("*global_step_*")] == [f"global_step_{summary['iterations']}"]


def launched(env, **overrides):
    """The command run.sh launches, with PYTHON a stand-in that prints its arguments."""
    result = run_sh({**env, "PYTHON": "echo", **overrides}, "crd", timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[0]


@pytest.mark.parametrize("extra, served", [
    (["--reward", "pickscore=1"], False),
    (["--reward", "qwen-vl=0.8", "pickscore=0.2", "--eval-judge", "paddle", "pickscore"], False),
    (["--reward=brightness", "--eval-judge", "flat,vllm"], True),  # a judge reads the server
])
def test_the_reward_server_starts_only_for_a_run_that_reads_it(tmp_path, extra, served):
    """A --reward (mix) or --eval-judge list that names no vllm starts no server, and its rewards
    run on the reward GPU; one that names vllm, in either flag and either form, starts it. PYTHON
    is a stand-in that prints its arguments (and imports vllm)."""
    port = free_port()
    env = {**fake_tools(tmp_path), "PYTHON": "echo", "REWARD_PORT": str(port),
           "OUTPUT_DIR": str(tmp_path / "runs")}
    result = run_sh(env, "crd", *extra, timeout=60)
    assert result.returncode == 0, result.stderr
    command = result.stdout.splitlines()[-1]
    assert command.endswith(" ".join(extra))
    assert ("vllm serve Qwen/Qwen2.5-VL-3B-Instruct" in result.stdout) == served
    assert (tmp_path / "runs" / "reward_server.log").exists() == served
    layout = (f"--reward vllm --reward-model Qwen/Qwen2.5-VL-3B-Instruct --reward-urls "
              f"http://127.0.0.1:{port}" if served else "--reward-device cuda:1")
    assert layout in command
    deadline = time.time() + 10  # the watcher takes the server down once the launcher exited
    while served and port_open(port):
        assert time.time() < deadline, "the reward server outlived the run"
        time.sleep(0.1)


def test_several_nodes_and_restarts_launch_through_torchrun(tmp_path):
    """One node restarted by torchrun names its run once for all restarts; a node of several meets
    the others at node 0's rendezvous; REWARD_URLS scores on servers elsewhere, starting none."""
    env = fake_tools(tmp_path)
    command = launched(env, MAX_RESTARTS="2", NUM_GPUS_REWARD="0")
    assert command.startswith("+ env TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600 echo launch.py --standalone "
                              "--max-restarts 2 --nproc-per-node 1 crd.py ")
    assert re.search(r" --run-name crd-[0-9]{8}-[0-9]{6} --resume-from latest$", command), command
    command = launched(env, NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1", RUN_NAME="r",
                       REWARD_URLS="http://10.0.0.7:8000,http://10.0.0.8:8000")
    assert command.startswith("+ env TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600 echo launch.py --nnodes 2 "
                              "--rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id r "
                              "--rdzv-conf is_host=0,join_timeout=600 --nproc-per-node 1 crd.py ")
    assert command.endswith(" --reward vllm --reward-model Qwen/Qwen2.5-VL-3B-Instruct --reward-urls "
                            "http://10.0.0.7:8000 http://10.0.0.8:8000 --run-name r --resume-from "
                            "latest")  # no --text-encoder-device: no reward GPU here
