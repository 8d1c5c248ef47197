"""`bash run.sh crd` as a user launches it on a one-GPU machine: a real `vllm serve` reward server
on the actor's GPU (REWARD_ON_ACTOR_GPU=1), side by side with the scorer in the trainer.

    PYTHONPATH=$VLLM_SITE python benchmark/served_recipe.py --out /tmp/served --time-budget-s 560

`vllm` must be on PATH (run.sh starts `vllm serve`). Phases, in this order; OUT/served_recipe.json
is rewritten after each, so a killed call keeps what finished, and a phase whose estimate no
longer fits in --time-budget-s is skipped:
    model       a random-weight Qwen2.5-VL-3B saved as a folder (ocr_reward.save_random_qwen_vl)
    served      bash run.sh crd with REWARD_ON_ACTOR_GPU=1: random SD3.5-M, --iterations
                iterations, validation every 5 on --eval-prompts prompts (PP-OCR judge beside it)
    in_process  the same with the scorer in the trainer on the same GPU (NUM_GPUS_REWARD=0:
                --reward qwen-vl)
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import ocr_reward  # noqa: E402

PHASES = ("model", "served", "in_process", "killed")
ESTIMATE_S = {"model": 60, "served": 240, "in_process": 150, "killed": 240}
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


class MemorySampler:
    """Device memory of each process (nvidia-smi --query-compute-apps) every second: the peak of
    the trainer (trainer_pid: run.sh execs it in its own process) and of the rest, the reward
    server (its API server spawns an engine core whose command line does not say vllm)."""

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
                name = "trainer" if int(pid) == self.trainer_pid else "reward server"
                used[name] = used.get(name, 0.0) + float(mib) / 1024
            for name, gib in used.items():
                self.peaks[name] = max(self.peaks.get(name, 0.0), gib)

    def stop(self) -> dict:
        self.stopped.set()
        self.thread.join()
        return {name: round(gib, 2) for name, gib in self.peaks.items()}


def scalars(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"]
            if tag.startswith(("perf/", "eval/", "train/reward"))]
    return {tag: [(e.step, round(e.value, 4)) for e in events.Scalars(tag)] for tag in tags}


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
        port = env.get("REWARD_PORT", "8000")  # this run's server, not another on the machine
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
    result["scalars"] = scalars(run_dir) if run_dir.exists() else {}
    result["server"] = server_requests(Path(env["OUTPUT_DIR"]) / "reward_server.log")
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
    results = {"phases": {}, "skipped": []}
    env = {**os.environ, "PYTHON": sys.executable, "MODEL": "random-sd3.5-medium",
           "REWARD_MODEL": str(model), "TRAIN_DATA": str(train), "EVAL_DATA": str(test),
           "TOTAL_TRAINING_STEPS": str(options.iterations),
           "EVAL_PROMPTS": str(options.eval_prompts)}
    common = ["--eval-every", "5", *options.trainer_args.split()]

    def save():
        path = out / "served_recipe.json"
        path.write_text(json.dumps(results, indent=1))

    for phase in options.phases:
        left = options.time_budget_s - (time.perf_counter() - started)
        if left < ESTIMATE_S[phase] or (phase != "model" and not (model / "config.json").exists()):
            results["skipped"].append(phase)
            print(f"{phase}: skipped ({left:.0f} s left)", flush=True)
            continue
        phase_started = time.perf_counter()
        if phase == "model":
            ocr_reward.save_random_qwen_vl(str(model), device="cuda")
            size = sum(f.stat().st_size for f in model.iterdir())
            result = {"folder_gib": round(size / 2**30, 2)}
        elif phase == "served":
            result = run_sh("served", {**env, "REWARD_ON_ACTOR_GPU": "1", "RUN_NAME": "served",
                                       "OUTPUT_DIR": str(out / "served")}, common)
        elif phase == "in_process":
            result = run_sh("in_process", {**env, "NUM_GPUS_REWARD": "0", "RUN_NAME": "in_process",
                                           "OUTPUT_DIR": str(out / "in_process")}, common)
        else:
            fault = {**env, "REWARD_ON_ACTOR_GPU": "1", "RUN_NAME": "killed",
                     "OUTPUT_DIR": str(out / "killed"), "TOTAL_TRAINING_STEPS": "6"}
            args = [*common, "--save-every", "2"]
            result = {"killed": run_sh("killed", fault, args, kill_server_at=2),
                      "resumed": run_sh("resumed", fault, args)}
        result["phase_s"] = round(time.perf_counter() - phase_started, 1)
        results["phases"][phase] = result
        save()
        print(f"{phase}: {json.dumps(result)[:1500]}", flush=True)
    save()


if __name__ == "__main__":
    main()
