#!/usr/bin/env bash
# The recipe launcher:
#   bash run.sh crd  [trainer args...]     CRD, defaults of the recipe; extra args are passed last, so they win
#   bash run.sh dgpo [trainer args...]     the matched DGPO baseline
#   bash run.sh compare RUN_DIR_A RUN_DIR_B   the anchor table of two finished runs, side by side
# Environment overrides: NUM_GPUS_ACTOR_ROLLOUT (1), NUM_GPUS_REWARD (1), GROUP_SIZE (6), IMAGE_RESOLUTION (512),
# TOTAL_TRAINING_STEPS (100 iterations), EVAL_PROMPTS (32 held-out prompts per validation; the anchor table used 128),
# OUTPUT_DIR (runs/crd or runs/dgpo), TRAIN_DATA, EVAL_DATA, MODEL,
# REWARD_MODEL, REWARD_PORT (8000), PYTHON (python3: the interpreter with the requirements, e.g. a virtualenv's),
# STOP_TIMEOUT (600: seconds several actor ranks get to finish the iteration and save after SIGTERM/Ctrl-C).
# SIGTERM or Ctrl-C stops the run at the end of its iteration with a checkpoint; the exit status is then 143 / 130.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
usage="usage: bash run.sh crd|dgpo [trainer args...]  |  bash run.sh compare RUN_DIR_A RUN_DIR_B"
algo=${1:-}
[[ $algo == crd || $algo == dgpo || $algo == compare ]] || { echo "$usage" >&2; exit 2; }
shift

if [[ $algo == compare ]]; then
  [[ $# == 2 ]] || { echo "$usage" >&2; exit 2; }
  exec "$PYTHON" - "$@" <<'PY'
import json, sys
from pathlib import Path
# what the table formats: {key: (test, what it must be)}; null: the run has none (no validation, no timed iteration)
number = (lambda v: v is None or type(v) in (int, float), "a number or null")
whole = (lambda v: type(v) is int, "a whole number")
string = (lambda v: type(v) is str, "a string")
fields = {"initial_eval_reward": number, "final_eval_reward": number, "best_eval_reward": number,
          "best_eval_iteration": (lambda v: v is None or type(v) is int, "a whole number or null"),
          "mean_iteration_s": number, "train_images_per_s": number,
          "peak_mem_gib": (lambda v: type(v) is dict and all(type(x) in (int, float) for x in v.values()),
                           "an object of numbers"),
          "iterations": whole, "optimizer_steps": whole}
newer_fields = {"algorithm": string, "reward": string, "initial_eval_judge": number, "final_eval_judge": number,
                "warmup_iteration_s": number}  # older summaries lack them
runs = []
for run in sys.argv[1:]:
    path = Path(run) / "summary.json"
    if not path.is_file():
        sys.exit(f"run.sh compare: {path} not found (did the run finish?)")
    try:
        summary = json.loads(path.read_text())
    except ValueError as error:
        sys.exit(f"run.sh compare: {path} is not JSON ({error})")
    if not isinstance(summary, dict) or not all(key in summary for key in fields):
        sys.exit(f"run.sh compare: {path} is not a trainer's summary (it lacks {', '.join(fields)})")
    for key, (fits, kind) in {**fields, **newer_fields}.items():
        if key in summary and not fits(summary[key]):
            sys.exit(f"run.sh compare: {path}: {key} is {json.dumps(summary[key])}, not {kind}")
    runs.append((Path(run).name, summary))
fmt = lambda v, unit="": "n/a" if v is None else f"{v:.4f}{unit}" if isinstance(v, float) else str(v)
seconds = lambda v: "n/a" if v is None else f"{v:.1f} s"
status = lambda s: "n/a" if "completed" not in s else "yes" if s["completed"] else f"no: stopped by {s['stopped_by']}"
rows = [("Algorithm", lambda s: s.get("algorithm", "n/a")),
        ("Reward", lambda s: s.get("reward", "n/a")),
        ("Completed", status),
        ("Initial held-out reward", lambda s: fmt(s["initial_eval_reward"])),
        ("Final held-out reward", lambda s: fmt(s["final_eval_reward"])),
        ("Best observed held-out reward", lambda s: f"{fmt(s['best_eval_reward'])} (iteration {s['best_eval_iteration']})"),
        ("Initial / final held-out PP-OCR judge", lambda s: f"{fmt(s.get('initial_eval_judge'))} / {fmt(s.get('final_eval_judge'))}"),
        ("Mean training iteration, excluding evaluation and warm-up", lambda s: seconds(s["mean_iteration_s"])),
        ("First iteration (torch.compile warm-up)", lambda s: seconds(s.get("warmup_iteration_s"))),
        ("Training images per second, excluding evaluation and warm-up", lambda s: fmt(s["train_images_per_s"])),
        ("Memory peak per device", lambda s: ", ".join(f"{k}: {v:.1f} GiB" for k, v in s["peak_mem_gib"].items())),
        ("Iterations / optimizer updates", lambda s: f"{s['iterations']} / {s['optimizer_steps']}")]
table = [("Metric", *[name for name, _ in runs])] + [(label, *[get(s) for _, s in runs]) for label, get in rows]
widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
for i, row in enumerate(table):
    print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")
    if i == 0:
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
PY
fi

NUM_GPUS_ACTOR_ROLLOUT=${NUM_GPUS_ACTOR_ROLLOUT:-1}
NUM_GPUS_REWARD=${NUM_GPUS_REWARD:-1}
GROUP_SIZE=${GROUP_SIZE:-6}
IMAGE_RESOLUTION=${IMAGE_RESOLUTION:-512}
TOTAL_TRAINING_STEPS=${TOTAL_TRAINING_STEPS:-100}
EVAL_PROMPTS=${EVAL_PROMPTS:-32}
OUTPUT_DIR=${OUTPUT_DIR:-runs/$algo}
TRAIN_DATA=${TRAIN_DATA:-data/ocr/train.jsonl}
EVAL_DATA=${EVAL_DATA:-data/ocr/test.jsonl}
MODEL=${MODEL:-stabilityai/stable-diffusion-3.5-medium}
REWARD_MODEL=${REWARD_MODEL:-Qwen/Qwen2.5-VL-3B-Instruct}
REWARD_PORT=${REWARD_PORT:-8000}
STOP_TIMEOUT=${STOP_TIMEOUT:-600}
for name in NUM_GPUS_ACTOR_ROLLOUT NUM_GPUS_REWARD GROUP_SIZE IMAGE_RESOLUTION TOTAL_TRAINING_STEPS EVAL_PROMPTS REWARD_PORT \
            STOP_TIMEOUT; do
  [[ ${!name} =~ ^(0|[1-9][0-9]*)$ ]] || { echo "run.sh: error: $name=${!name}: not a whole number" >&2; exit 1; }
done
(( NUM_GPUS_ACTOR_ROLLOUT > 0 )) || { echo "run.sh: error: NUM_GPUS_ACTOR_ROLLOUT=0: at least 1 actor GPU is needed" >&2; exit 1; }
(( REWARD_PORT >= 1 && REWARD_PORT <= 65535 )) || { echo "run.sh: error: REWARD_PORT=$REWARD_PORT: not a TCP port (1-65535)" >&2; exit 1; }

available=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
needed=$((NUM_GPUS_ACTOR_ROLLOUT + NUM_GPUS_REWARD))
if (( needed > available )); then
  echo "run.sh: error: NUM_GPUS_ACTOR_ROLLOUT=$NUM_GPUS_ACTOR_ROLLOUT + NUM_GPUS_REWARD=$NUM_GPUS_REWARD = $needed GPUs asked, $available present" >&2
  exit 1
fi

reward_args=()
if (( NUM_GPUS_REWARD > 0 && NUM_GPUS_ACTOR_ROLLOUT == 1 )); then
  # the text encoders (10 GiB) beside the reward model: the recipe's actor then peaks under 40 GiB
  reward_args=(--text-encoder-device "cuda:$NUM_GPUS_ACTOR_ROLLOUT")
fi
serve_reward=false
if (( NUM_GPUS_REWARD == 0 )); then
  reward_args+=(--reward qwen-vl --reward-model "$REWARD_MODEL")          # scored on each actor's own GPU
elif "$PYTHON" -c "import vllm" 2>/dev/null; then
  serve_reward=true
  reward_args+=(--reward vllm --reward-model "$REWARD_MODEL" --reward-urls "http://127.0.0.1:$REWARD_PORT")
else
  reward_args+=(--reward qwen-vl --reward-model "$REWARD_MODEL" --reward-device "cuda:$NUM_GPUS_ACTOR_ROLLOUT")
fi
trainer=("$algo.py" --model "$MODEL" --train-data "$TRAIN_DATA" --eval-data "$EVAL_DATA" --group-size "$GROUP_SIZE"
         --resolution "$IMAGE_RESOLUTION" --num-iterations "$TOTAL_TRAINING_STEPS" --eval-prompts "$EVAL_PROMPTS"
         --output-dir "$OUTPUT_DIR"
         "${reward_args[@]}" "$@")

if $serve_reward; then
  "$PYTHON" "${trainer[@]}" --dry-run  # a mistyped argument or prompt file must not wait minutes for a healthy server
  reward_gpus=$(seq -s, "$NUM_GPUS_ACTOR_ROLLOUT" $((needed - 1)))
  log="$OUTPUT_DIR/reward_server.log"
  mkdir -p "$OUTPUT_DIR"
  # --gpu-memory-utilization: vLLM's default 0.9 would leave no room for the text encoders beside it
  serve=(vllm serve "$REWARD_MODEL" --host 127.0.0.1 --port "$REWARD_PORT" --data-parallel-size "$NUM_GPUS_REWARD"
         --max-model-len 4096 --limit-mm-per-prompt '{"image": 1}' --gpu-memory-utilization 0.7)
  echo "+ CUDA_VISIBLE_DEVICES=$reward_gpus ${serve[*]} (log: $log)"
  CUDA_VISIBLE_DEVICES=$reward_gpus setsid "${serve[@]}" >"$log" 2>&1 &
  server=$!
  trap 'kill -- -$server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$REWARD_PORT/health" >/dev/null && break
    kill -0 "$server" 2>/dev/null || { echo "run.sh: error: the reward server exited; last lines of $log:" >&2; tail -n 30 "$log" >&2; exit 1; }
    sleep 1
  done
  curl -sf "http://127.0.0.1:$REWARD_PORT/health" >/dev/null \
    || { echo "run.sh: error: the reward server did not become healthy in 600 s; last lines of $log:" >&2; tail -n 30 "$log" >&2; exit 1; }
fi

if (( NUM_GPUS_ACTOR_ROLLOUT == 1 )); then
  launcher=("$PYTHON")  # one process: without torchrun, whose report of a failed rank would bury the trainer's error
else
  # torchrun (launch.py: with the shell's exit codes, no traceback); TORCH_ELASTIC_SHUTDOWN_TIMEOUT: how long the ranks
  # may take to finish their iteration and save after a signal before torchrun kills them (torch >= 2.12 reads it, as
  # its --shutdown-timeout; older torchruns ignore it and keep their 30 s)
  launcher=(env TORCH_ELASTIC_SHUTDOWN_TIMEOUT="$STOP_TIMEOUT" "$PYTHON" launch.py --standalone
            --nproc-per-node "$NUM_GPUS_ACTOR_ROLLOUT")
fi
cmd=("${launcher[@]}" "${trainer[@]}")
echo "+ ${cmd[*]}"
if $serve_reward; then
  # the trainer replaces this shell (exec, same PID), so a signal to run.sh reaches it and its exit status is run.sh's;
  # this watcher takes the reward server down once the trainer has exited (an unreaped zombie counts as exited), not
  # before a graceful stop has scored its last images
  alive() { local state; state=$(ps -o stat= -p "$1") && [[ $state != Z* ]]; }
  trap - EXIT
  ( trap '' INT TERM; while alive $$; do sleep 0.5; done; kill -- -"$server" 2>/dev/null
    while alive "$server"; do sleep 0.2; done ) &
fi
exec "${cmd[@]}"
