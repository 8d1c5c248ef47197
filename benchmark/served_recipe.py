"""`bash run.sh crd` as a user launches it on a one-GPU machine: a real `vllm serve` reward server
on the actor's GPU (REWARD_ON_ACTOR_GPU=1), side by side with the scorer in the trainer, with
vLLM-Omni rollouts (the recipe's whole stack), evaluate.py against the server, and its faults.

    PYTHONPATH=$VLLM_SITE python benchmark/served_recipe.py --out /tmp/served --time-budget-s 560

`vllm` must be on PATH (run.sh starts `vllm serve`). Phases, in this order; OUT/served_recipe.json
is rewritten after each, so a killed call keeps what finished, and a phase whose estimate no
longer fits in --time-budget-s is skipped:
    model       a random-weight Qwen2.5-VL-3B saved as a folder (ocr_reward.save_random_qwen_vl)
    weights     random SD3.5-M saved as a diffusers folder (vLLM-Omni loads files)
    served      bash run.sh crd with REWARD_ON_ACTOR_GPU=1: random SD3.5-M, --iterations
                iterations, validation every 5 on --eval-prompts prompts (PP-OCR judge beside it)
    in_process  the same with the scorer in the trainer on the same GPU (NUM_GPUS_REWARD=0:
                --reward qwen-vl)
    omni        served, on the saved weights, with --rollout-engine vllm-omni
    evaluate    a server started as run.sh starts it, used as one on another machine: evaluate.py
                --reward vllm while it loads and with a model name it does not serve (each must
                end in one line), then on the omni run's last checkpoint (else the base model);
                run.sh with it as REWARD_URLS, the server killed once a checkpoint exists, then
                the same RUN_NAME again on a new server
    killed      served again, its server killed once a checkpoint exists: the trainer's exit
                status and last lines, the checkpoints; then the same RUN_NAME again (run.sh
                continues it with --resume-from latest) on a new server
For each run: run.sh's lines (the server's start-up), summary.json, the perf/* scalars of its
TensorBoard events, the server's requests from its log, and each process's device memory sampled
every second with nvidia-smi.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import ocr_reward  # noqa: E402
from benchmark import omni_check  # noqa: E402
from benchmark.events import scalars  # noqa: E402

PHASES = ("model", "weights", "served", "in_process", "omni", "evaluate", "killed")
ESTIMATE_S = {"model": 60, "weights": 60, "served": 240, "in_process": 150, "omni": 300,
              "evaluate": 420, "killed": 240}
# run.sh's `vllm serve` arguments besides the model, port and memory share
SERVE_ARGS = ["--host", "127.0.0.1", "--max-model-len", "4096", "--limit-mm-per-prompt",
              '{"image": 1}']
WORDS = ["OPEN", "CRD", "BAKERY", "HELLO", "EXIT", "SALE", "CAFE", "HOTEL", "PARK", "STOP",
         "LIBRARY", "MUSEUM", "TAXI", "PIZZA", "BOOKS", "MARKET", "GARDEN", "STATION", "BANK",
         "ZOO"]


def prompt_files(out: Path) -> tuple[Path, Path]:
    """Train and held-out prompt files of quoted words (the OCR task's form)."""
    templates = ['a neon sign that says "{}"', 'a poster with the word "{}" on it',
                 'a storefront whose sign reads "{}"', 'a chalkboard with "{}" written on it']
    prompts = [t.format(w) for w in WORDS for t in templates]
    (out / "train.txt").write_text("\n".join(prompts[::2]) + "\n")
    (out / "test.txt").write_text("\n".join(prompts[1::2]) + "\n")
    return out / "train.txt", out / "test.txt"


def session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone, or not a process of this machine's view
        return None


class MemorySampler:
    """Device memory of each process (nvidia-smi --query-compute-apps) every second: the peak of
    the trainer (trainer_pid: run.sh execs it in its own process), of the other processes of its
    session (the vLLM-Omni engine), and of the rest, the reward server (run.sh starts it in a
    session of its own, as the child of the process that becomes the trainer)."""

    def __init__(self, trainer_pid: int, env: dict):
        self.trainer_pid, self.env, self.peaks = trainer_pid, env, {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self):
        while not self.stopped.wait(1.0):
            query = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                    "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, env=self.env)
            used = {}
            for line in query.stdout.splitlines():
                fields = [field.strip() for field in line.split(",")]
                if len(fields) != 2 or not all(field.isdigit() for field in fields):
                    continue  # "[N/A]", or no such query on this driver
                pid, mib = fields
                if int(pid) == self.trainer_pid:
                    name = "trainer"
                elif int(pid) == os.getpid():
                    name = "this script"
                elif session(int(pid)) == session(self.trainer_pid) is not None:
                    name = "rollout engine"
                else:
                    name = "reward server"
                used[name] = used.get(name, 0.0) + float(mib) / 1024
            for name, gib in used.items():
                self.peaks[name] = max(self.peaks.get(name, 0.0), gib)

    def stop(self) -> dict:
        self.stopped.set()
        self.thread.join()
        return {name: round(gib, 2) for name, gib in self.peaks.items()}


def reported_scalars(run_dir: Path) -> dict:
    """{tag: [(step, value)]} of the run's timings, validation and training reward."""
    return {tag: [(step, round(value, 4)) for step, value in logged.items()]
            for tag, logged in scalars(run_dir).items()
            if tag.startswith(("perf/", "eval/", "train/reward"))}


def server_requests(log: Path) -> dict:
    text = log.read_text(errors="replace") if log.exists() else ""
    statuses = re.findall(r'"POST /v1/chat/completions HTTP/1\.1" (\d+)', text)
    return {"chat_completions": len(statuses),
            "failed": sum(status != "200" for status in statuses),
            "log_tail": text.splitlines()[-8:]}


def run_sh(name: str, env: dict, args: list[str], kill_server_at: int = 0) -> dict:
    """bash run.sh crd ARGS with ENV; with kill_server_at, the server is killed once the run's
    checkpoint global_step_{kill_server_at} exists."""
    started = time.perf_counter()
    process = subprocess.Popen(["bash", "run.sh", "crd", *args], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    memory = MemorySampler(process.pid, env)
    killed = None
    if kill_server_at:
        checkpoint = Path(env["OUTPUT_DIR"]) / env["RUN_NAME"] / f"global_step_{kill_server_at}"
        while process.poll() is None and not checkpoint.exists():
            time.sleep(0.5)
        # run.sh starts the server in a session of its own: the API server and its engine core
        # this run's server, not another on the machine
        port = (urllib.parse.urlsplit(env["REWARD_URLS"]).port if env.get("REWARD_URLS")
                else env.get("REWARD_PORT", "8000"))
        servers = subprocess.run(["pgrep", "-f", f"vllm.* serve .*--port {port} "],
                                 capture_output=True, text=True)
        groups = set()
        for pid in servers.stdout.split():
            try:
                groups.add(os.getpgid(int(pid)))
            except ProcessLookupError:  # gone since pgrep listed it
                pass
        for group in groups:
            os.killpg(group, signal.SIGKILL)
        killed = {"after_s": round(time.perf_counter() - started, 1), "groups": sorted(groups)}
    stdout, stderr = process.communicate()
    result = {"name": name, "args": args, "exit_status": process.returncode,
              "wall_s": round(time.perf_counter() - started, 1), "device_memory_gib": memory.stop(),
              "stdout_tail": stdout.splitlines()[-12:], "stderr_tail": stderr.splitlines()[-12:]}
    answered = re.search(r"the reward server answered after (\d+) s", stdout)
    result["server_start_s"] = int(answered.group(1)) if answered else None
    if killed:
        result["server_killed"] = killed
    run_dir = Path(env["OUTPUT_DIR"]) / env["RUN_NAME"]
    summary = run_dir / "summary.json"
    result["summary"] = json.loads(summary.read_text()) if summary.exists() else None
    result["checkpoints"] = sorted(p.name for p in run_dir.glob("global_step_*"))
    result["scalars"] = reported_scalars(run_dir)
    result["server"] = server_requests(Path(env["OUTPUT_DIR"]) / "reward_server.log")
    return result


def start_server(model: str, port: int, log: Path, env: dict) -> subprocess.Popen:
    """`vllm serve` as run.sh starts it with REWARD_ON_ACTOR_GPU=1, in a session of its own."""
    with log.open("w") as out:
        return subprocess.Popen(["vllm", "serve", model, "--port", str(port), *SERVE_ARGS,
                                 "--gpu-memory-utilization", "0.3"], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_server(server: subprocess.Popen) -> None:
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:  # killed already
        pass
    server.wait()


def wait_for_health(url: str, server: subprocess.Popen, timeout_s: float) -> bool:
    """Whether url/health answers before the server exits or timeout_s passes."""
    deadline = time.perf_counter() + timeout_s
    while server.poll() is None and time.perf_counter() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return True
        except OSError:  # not listening yet, or no answer yet
            time.sleep(1)
    return False


def start_evaluate(args: list[str], env: dict) -> tuple[subprocess.Popen, float]:
    process = subprocess.Popen([sys.executable, "evaluate.py", *args], cwd=ROOT, env=env,
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return process, time.perf_counter()


def finish_evaluate(started: tuple[subprocess.Popen, float], output_dir: Path) -> dict:
    """evaluate.py's exit status, time and last lines, and its results.json without the prompts."""
    process, start = started
    stdout, stderr = process.communicate()
    result = {"exit_status": process.returncode, "wall_s": round(time.perf_counter() - start, 1),
              "stdout_tail": stdout.splitlines()[-3:], "stderr_tail": stderr.splitlines()[-3:]}
    for path in output_dir.glob("*/results.json"):
        summary = json.loads(path.read_text())
        result["results"] = {key: value for key, value in summary.items() if key != "prompts"}
    return result


def urls_phase(out: Path, model: str, env: dict, what: list[str], port: int,
               run_env: dict | None = None, run_args: list[str] = ()) -> dict:
    """A server started as run.sh starts it, used as a server on another machine is:
    evaluate.py --reward vllm while it loads, with a model name it does not serve, then scoring
    `what` (evaluate.py's arguments for what is scored); with run_env, run.sh given it as
    REWARD_URLS, the server killed once global_step_2 exists, then run.sh again (it continues
    with --resume-from latest) on a new server."""
    url = f"http://127.0.0.1:{port}"
    scoring = ["--reward", "vllm", "--reward-urls", url, *what]
    log = out / "reward_server.log"
    server = start_server(model, port, log, env)
    result = {"command": scoring, "server_start_s": []}
    try:
        server_started = time.perf_counter()
        loading = start_evaluate([*scoring, "--reward-model", model,
                                  "--output-dir", str(out / "loading")], env)
        result["while_loading"] = finish_evaluate(loading, out / "loading")
        result["server_loading"] = server.poll() is None and not wait_for_health(url, server, 0)
        if not wait_for_health(url, server, 600):
            result["server_exit_status"] = server.poll()
            return result
        result["server_start_s"].append(round(time.perf_counter() - server_started, 1))
        wrong = start_evaluate([*scoring, "--reward-model", "Qwen/no-such-model",
                                "--output-dir", str(out / "wrong_name")], env)
        scored = start_evaluate([*scoring, "--reward-model", model,
                                 "--output-dir", str(out / "scored")], env)
        result["wrong_model_name"] = finish_evaluate(wrong, out / "wrong_name")
        result["scored"] = finish_evaluate(scored, out / "scored")
        result["server"] = server_requests(log)
        if run_env is None:
            return result
        run_env = {**run_env, "REWARD_URLS": url, "OUTPUT_DIR": str(out)}
        result["killed"] = run_sh("killed", run_env, run_args, kill_server_at=2)
        stop_server(server)  # killed by run_sh, unless the run ended before its checkpoint
        log = out / "reward_server_2.log"
        server = start_server(model, port, log, env)
        server_started = time.perf_counter()
        if wait_for_health(url, server, 600):
            result["server_start_s"].append(round(time.perf_counter() - server_started, 1))
            result["resumed"] = run_sh("resumed", run_env, run_args)
            result["resumed"]["server"] = server_requests(log)  # run_sh read the first's
    finally:
        stop_server(server)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for the model, runs and results")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--time-budget-s", type=float, default=560)
    parser.add_argument("--trainer-args", default="--no-compile",
                        help="extra arguments for every run (one string)")
    options = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("served_recipe.py: error: needs a CUDA GPU (torch sees none): it serves the "
                 "full-size reward model beside the full-size trainer")
    if not shutil.which("vllm"):
        sys.exit("served_recipe.py: error: no `vllm` on PATH: run.sh starts `vllm serve` "
                 "(pip install -r requirements-vllm.txt)")
    started = time.perf_counter()
    out = Path(options.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    train, test = prompt_files(out)
    model = out / "qwen2.5-vl-3b-random"
    weights = out / "sd3.5-medium-random"
    saved = out / "served_recipe.json"  # a later call adds its phases to an earlier call's
    results = json.loads(saved.read_text()) if saved.exists() else {"phases": {}}
    results["skipped"] = []
    env = {**os.environ, "PYTHON": sys.executable, "MODEL": "random-sd3.5-medium",
           "REWARD_MODEL": str(model), "TRAIN_DATA": str(train), "EVAL_DATA": str(test),
           "TOTAL_TRAINING_STEPS": str(options.iterations),
           "EVAL_PROMPTS": str(options.eval_prompts)}
    common = ["--eval-every", "5", *options.trainer_args.split()]

    def save():
        saved.write_text(json.dumps(results, indent=1))

    for phase in options.phases:
        left = options.time_budget_s - (time.perf_counter() - started)
        missing = (phase not in ("model", "weights") and not (model / "config.json").exists()
                   or phase == "omni" and not (weights / "model_index.json").exists())
        if left < ESTIMATE_S[phase] or missing:
            results["skipped"].append(phase)
            print(f"{phase}: skipped ({left:.0f} s left)", flush=True)
            continue
        phase_started = time.perf_counter()
        if phase == "model":
            ocr_reward.save_random_qwen_vl(str(model), device="cuda")
            size = sum(f.stat().st_size for f in model.iterdir())
            result = {"folder_gib": round(size / 2**30, 2)}
        elif phase == "weights":
            result = omni_check.build_weights(argparse.Namespace(model_dir=weights),
                                              torch.device("cuda"))
        elif phase == "served":
            result = run_sh("served", {**env, "REWARD_ON_ACTOR_GPU": "1", "RUN_NAME": "served",
                                       "OUTPUT_DIR": str(out / "served")}, common)
        elif phase == "in_process":
            result = run_sh("in_process", {**env, "NUM_GPUS_REWARD": "0", "RUN_NAME": "in_process",
                                           "OUTPUT_DIR": str(out / "in_process")}, common)
        elif phase == "omni":
            result = run_sh("omni", {**env, "REWARD_ON_ACTOR_GPU": "1", "RUN_NAME": "omni",
                                     "OUTPUT_DIR": str(out / "omni"), "MODEL": str(weights)},
                            [*common, "--rollout-engine", "vllm-omni"])
        elif phase == "evaluate":
            trained = sorted((out / "omni" / "omni").glob("global_step_*"),
                             key=lambda path: int(path.name.rpartition("_")[2]))
            what = ["--checkpoint", str(trained[-1])] if trained else ["--model", env["MODEL"]]
            what += ["--eval-data", str(test), "--num-prompts", str(options.eval_prompts)]
            (out / "evaluate").mkdir(exist_ok=True)
            fault = {**env, "RUN_NAME": "killed", "TOTAL_TRAINING_STEPS": "4", "EVAL_PROMPTS": "8"}
            result = urls_phase(out / "evaluate", str(model), env, what, 8000, fault,
                                [*common, "--save-every", "2"])
        else:  # fewer validation prompts: the phase is about the fault, not the scores
            fault = {**env, "REWARD_ON_ACTOR_GPU": "1", "RUN_NAME": "killed",
                     "OUTPUT_DIR": str(out / "killed"), "TOTAL_TRAINING_STEPS": "6",
                     "EVAL_PROMPTS": "8"}
            args = [*common, "--save-every", "2"]
            result = {"killed": run_sh("killed", fault, args, kill_server_at=2),
                      "resumed": run_sh("resumed", fault, args)}
        torch.cuda.empty_cache()  # what the model phases built: the runs need the memory
        result["phase_s"] = round(time.perf_counter() - phase_started, 1)
        results["phases"][phase] = result
        save()
        print(f"{phase}: {json.dumps(result)[:1500]}", flush=True)
    save()


if __name__ == "__main__":
    main()
