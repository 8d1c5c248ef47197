#!/usr/bin/env bash
# The recipe launcher:
#   bash run.sh crd  [trainer args...]     CRD, defaults of the recipe; extra args are passed last, so they win
#   bash run.sh dgpo [trainer args...]     the matched DGPO baseline
#   bash run.sh nft  [trainer args...]     the matched DiffusionNFT baseline
#   bash run.sh compare RUN_DIR [RUN_DIR...]   the anchor table of finished runs, side by side
# Environment overrides: NUM_GPUS_ACTOR_ROLLOUT (1), NUM_GPUS_REWARD (1), REWARD_ON_ACTOR_GPU (0; 1: `vllm serve` on
# the one actor GPU, for one-GPU machines), REWARD_GPU_MEMORY (the fraction of its GPU the server takes: 0.7 alone,
# 0.3 beside the actor), GROUP_SIZE (6), IMAGE_RESOLUTION (512),
# TOTAL_TRAINING_STEPS (100 iterations), EVAL_PROMPTS (32 held-out prompts per validation; the anchor table used 128),
# OUTPUT_DIR (runs/crd, runs/dgpo or runs/nft), TRAIN_DATA, EVAL_DATA, MODEL,
# REWARD_MODEL, REWARD_PORT (8000), PYTHON (python3: the interpreter with the requirements, e.g. a virtualenv's),
# STOP_TIMEOUT (600: seconds several actor ranks get to finish the iteration and save after SIGTERM/Ctrl-C).
# Several nodes and restarts (docs/multi-node.md): NNODES (1), NODE_RANK (0; node 0
# hosts the rendezvous), MASTER_ADDR (node 0's address) and MASTER_PORT (29500) or RDZV_ENDPOINT
# (host:port), RDZV_ID (RUN_NAME), MAX_RESTARTS (0: how often torchrun restarts all ranks after one
# fails), JOIN_TIMEOUT (600: seconds an agent waits for every node to join the rendezvous, at the start
# and at each restart), RUN_NAME (the run OUTPUT_DIR/RUN_NAME, started or continued by --resume-from latest;
# needed with NNODES > 1, made up once per launch with MAX_RESTARTS on one node), REWARD_URLS (vLLM
# servers elsewhere, comma-separated: none is started here; else every node starts its own).
# EXIT_BARRIER_TIMEOUT (30: seconds a node's agent waits at the end for the other nodes' agents)
# and LOST_NODE_TIMEOUT (30: seconds a restart waits for a node whose agent is gone), read by
# launch.py.
# SIGTERM or Ctrl-C stops the run at the end of its iteration with a checkpoint; the exit status is then 143 / 130.
# With --device cpu on a host without GPUs: NUM_GPUS_ACTOR_ROLLOUT CPU ranks, each scoring its own images.
# The vLLM reward server is started (where vllm is installed) only for a run that reads it: no
# --reward (run.sh's own, the served Qwen-VL), or a --reward or --eval-judge that names vllm.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
usage="usage: bash run.sh crd|dgpo|nft [trainer args...]  |  bash run.sh compare RUN_DIR [RUN_DIR...]"
algo=${1:-}
[[ $algo == crd || $algo == dgpo || $algo == nft || $algo == compare ]] || { echo "$usage" >&2; exit 2; }
shift

if [[ $algo == compare ]]; then
  (( $# >= 1 )) || { echo "$usage" >&2; exit 2; }  # one run: its table alone
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
          "iterations": whole, "optimizer_steps": whole, "algorithm": string, "reward": string,
          "initial_eval_judge": number, "final_eval_judge": number, "warmup_iteration_s": number}
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
    for key, (fits, kind) in fields.items():
        if not fits(summary[key]):
            sys.exit(f"run.sh compare: {path}: {key} is {json.dumps(summary[key])}, not {kind}")
    judged = summary.get("eval_judges", {})  # several judges, or one that is not PP-OCR
    if not (type(judged) is dict and all(type(v) is dict and v.keys() == {"initial", "final"}
                                         and all(map(number[0], v.values())) for v in judged.values())):
        sys.exit(f"run.sh compare: {path}: eval_judges is {json.dumps(judged)}, not an object of "
                 '{"initial": number or null, "final": number or null} objects')
    runs.append((Path(run).name, summary))
fmt = lambda v, unit="": "n/a" if v is None else f"{v:.4f}{unit}" if isinstance(v, float) else str(v)
seconds = lambda v: "n/a" if v is None else f"{v:.1f} s"
# each judge's initial and final: eval_judges, else the first judge's (PP-OCR alone, or none)
judges = lambda s: s.get("eval_judges") or {"paddle": {"initial": s["initial_eval_judge"],
                                                       "final": s["final_eval_judge"]}}
judge_names = list(dict.fromkeys(name for _, s in runs for name in judges(s)))
judge_cell = lambda s, name: " / ".join(fmt(judges(s).get(name, {}).get(key)) for key in ("initial", "final"))
status = lambda s: "n/a" if "completed" not in s else "yes" if s["completed"] else f"no: stopped by {s['stopped_by']}"
rows = [("Algorithm", lambda s: s["algorithm"]),
        ("Reward", lambda s: s["reward"]),
        ("Completed", status),
        ("Initial held-out reward", lambda s: fmt(s["initial_eval_reward"])),
        ("Final held-out reward", lambda s: fmt(s["final_eval_reward"])),
        ("Best observed held-out reward", lambda s: f"{fmt(s['best_eval_reward'])} (iteration {s['best_eval_iteration']})"),
        *[(f"Initial / final held-out {'PP-OCR' if name == 'paddle' else name} judge",
           lambda s, name=name: judge_cell(s, name)) for name in judge_names],
        ("Mean training iteration, excluding evaluation and warm-up", lambda s: seconds(s["mean_iteration_s"])),
        # summary.json does not say whether the run compiled (CPU runs and --no-compile do not)
        ("First iteration (including torch.compile's warm-up, if any)",
         lambda s: seconds(s["warmup_iteration_s"])),
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
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-$MASTER_ADDR:$MASTER_PORT}
MAX_RESTARTS=${MAX_RESTARTS:-0}
JOIN_TIMEOUT=${JOIN_TIMEOUT:-600}
RUN_NAME=${RUN_NAME:-}
RDZV_ID=${RDZV_ID:-$RUN_NAME}
REWARD_URLS=${REWARD_URLS:-}
REWARD_ON_ACTOR_GPU=${REWARD_ON_ACTOR_GPU:-0}
if [[ $REWARD_ON_ACTOR_GPU == 1 ]]; then
  REWARD_GPU_MEMORY=${REWARD_GPU_MEMORY:-0.3}  # vLLM's share; the trainer keeps the rest
else
  REWARD_GPU_MEMORY=${REWARD_GPU_MEMORY:-0.7}  # vLLM's default 0.9 would leave no room for the text encoders
fi
for name in NUM_GPUS_ACTOR_ROLLOUT NUM_GPUS_REWARD GROUP_SIZE IMAGE_RESOLUTION TOTAL_TRAINING_STEPS EVAL_PROMPTS REWARD_PORT \
            STOP_TIMEOUT NNODES NODE_RANK MASTER_PORT MAX_RESTARTS JOIN_TIMEOUT; do
  [[ ${!name} =~ ^(0|[1-9][0-9]*)$ ]] || { echo "run.sh: error: $name=${!name}: not a whole number" >&2; exit 1; }
done
(( NUM_GPUS_ACTOR_ROLLOUT > 0 )) || { echo "run.sh: error: NUM_GPUS_ACTOR_ROLLOUT=0: at least 1 actor GPU is needed" >&2; exit 1; }
(( REWARD_PORT >= 1 && REWARD_PORT <= 65535 )) || { echo "run.sh: error: REWARD_PORT=$REWARD_PORT: not a TCP port (1-65535)" >&2; exit 1; }
error() { echo "run.sh: error: $*" >&2; exit 1; }
[[ $REWARD_ON_ACTOR_GPU == [01] ]] || error "REWARD_ON_ACTOR_GPU=$REWARD_ON_ACTOR_GPU: 0 or 1"
[[ $REWARD_GPU_MEMORY =~ ^0?\.[0-9]*[1-9][0-9]*$ ]] \
  || error "REWARD_GPU_MEMORY=$REWARD_GPU_MEMORY: a fraction of the GPU's memory, between 0 and 1"
if [[ $REWARD_ON_ACTOR_GPU == 1 ]]; then
  (( NUM_GPUS_ACTOR_ROLLOUT == 1 )) \
    || error "REWARD_ON_ACTOR_GPU=1: the server shares one actor GPU, not $NUM_GPUS_ACTOR_ROLLOUT"
  [[ -z $REWARD_URLS ]] || error "REWARD_ON_ACTOR_GPU=1 and REWARD_URLS: the servers run elsewhere"
  NUM_GPUS_REWARD=0  # no GPU of its own
fi
(( NNODES >= 1 )) || error "NNODES=0: at least 1 node is needed"
(( NODE_RANK < NNODES )) || error "NODE_RANK=$NODE_RANK: must be below NNODES=$NNODES"
(( MASTER_PORT >= 1 && MASTER_PORT <= 65535 )) \
  || error "MASTER_PORT=$MASTER_PORT: not a TCP port (1-65535)"
if (( NNODES > 1 )) && [[ -z $RUN_NAME ]]; then
  error "RUN_NAME: needed with NNODES=$NNODES, for every node and restart to name one run" \
        "directory"
fi
if (( MAX_RESTARTS > 0 )) && [[ -z $RUN_NAME ]]; then
  RUN_NAME=$algo-$(date +%Y%m%d-%H%M%S)  # one node: one name for every restart of this launch
fi

[[ -z $REWARD_URLS ]] || NUM_GPUS_REWARD=0  # the servers of REWARD_URLS run elsewhere
# the words of the trainer flag $1 among the extra args, the last given winning (tyro's rule);
# status 1 if it is not given
given() {
  local flag=$1 value="" found=false taking=false arg
  shift
  for arg in "$@"; do
    if [[ $arg == "$flag="* ]]; then
      value=${arg#*=}; found=true; taking=false
    elif [[ $arg == "$flag" ]]; then
      value=""; found=true; taking=true
    elif [[ $arg == --* ]]; then
      taking=false
    elif $taking; then
      value+=" $arg"
    fi
  done
  $found && echo "$value"
}
# whether the run reads the vLLM-served reward: run.sh's own reward (no --reward given), or a
# --reward or --eval-judge that names vllm (--reward pickscore=1 or qwen-vl alone: no server)
reads_served_reward() {
  local reward judges item items
  reward=$(given --reward "$@") || reward=vllm
  judges=$(given --eval-judge "$@") || judges=""
  read -ra items <<<"${reward//,/ } ${judges//,/ }"
  for item in "${items[@]}"; do
    [[ ${item%%=*} != vllm ]] || return 0
  done
  return 1
}
available=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
device=$(given --device "$@") || device=""
needed=$((NUM_GPUS_ACTOR_ROLLOUT + NUM_GPUS_REWARD))
if [[ ${device# } == cpu ]] && (( available == 0 )); then
  NUM_GPUS_REWARD=0  # a CPU host: NUM_GPUS_ACTOR_ROLLOUT CPU ranks, each scoring its own images
elif (( needed > available )); then
  error "NUM_GPUS_ACTOR_ROLLOUT=$NUM_GPUS_ACTOR_ROLLOUT + NUM_GPUS_REWARD=$NUM_GPUS_REWARD =" \
        "$needed GPUs asked, $available present (--device cpu runs on the CPU)"
fi
reward_args=()
if (( NUM_GPUS_REWARD > 0 && NUM_GPUS_ACTOR_ROLLOUT == 1 )); then
  # the text encoders (10 GiB) beside the reward model: the recipe's actor then peaks under 40 GiB
  reward_args=(--text-encoder-device "cuda:$NUM_GPUS_ACTOR_ROLLOUT")
fi
serve_reward=false
if [[ -n $REWARD_URLS ]]; then
  read -ra urls <<<"${REWARD_URLS//,/ }"
  reward_args+=(--reward vllm --reward-model "$REWARD_MODEL" --reward-urls "${urls[@]}")
elif (( NUM_GPUS_REWARD == 0 && REWARD_ON_ACTOR_GPU == 0 )); then
  reward_args+=(--reward qwen-vl --reward-model "$REWARD_MODEL")          # scored on each actor's own GPU
elif reads_served_reward "$@" && "$PYTHON" -c "import vllm" 2>/dev/null; then
  serve_reward=true
  reward_args+=(--reward vllm --reward-model "$REWARD_MODEL" --reward-urls "http://127.0.0.1:$REWARD_PORT")
elif (( REWARD_ON_ACTOR_GPU == 1 )); then
  reward_args+=(--reward qwen-vl --reward-model "$REWARD_MODEL")          # in the trainer, on its GPU
else
  reward_args+=(--reward qwen-vl --reward-model "$REWARD_MODEL" --reward-device "cuda:$NUM_GPUS_ACTOR_ROLLOUT")
fi
trainer=("$algo.py" --model "$MODEL" --train-data "$TRAIN_DATA" --eval-data "$EVAL_DATA" --group-size "$GROUP_SIZE"
         --resolution "$IMAGE_RESOLUTION" --num-iterations "$TOTAL_TRAINING_STEPS" --eval-prompts "$EVAL_PROMPTS"
         --output-dir "$OUTPUT_DIR"
         "${reward_args[@]}")
if [[ -n $RUN_NAME ]]; then
  trainer+=(--run-name "$RUN_NAME" --resume-from latest)  # a restart or a rerun continues the run
fi
trainer+=("$@")

if $serve_reward; then
  checked=$("$PYTHON" "${trainer[@]}" --dry-run)  # a mistyped argument or prompt file must not wait minutes for a server
  echo "$checked"
  [[ $checked != *" is complete: "* ]] || exit 0  # RUN_NAME's run did all its iterations (a rerun, a requeued job)
  reward_gpus=$(seq -s, "$NUM_GPUS_ACTOR_ROLLOUT" $((needed - 1)))
  serving_gpus=$NUM_GPUS_REWARD
  if (( REWARD_ON_ACTOR_GPU == 1 )); then
    reward_gpus=0  # the actor's
    serving_gpus=1
  fi
  log="$OUTPUT_DIR/reward_server.log"
  if (( NNODES > 1 )); then
    log="$OUTPUT_DIR/reward_server.node$NODE_RANK.log"  # one server per node, OUTPUT_DIR shared
  fi
  mkdir -p "$OUTPUT_DIR"
  serve=(vllm serve "$REWARD_MODEL" --host 127.0.0.1 --port "$REWARD_PORT" --data-parallel-size "$serving_gpus"
         --max-model-len 4096 --limit-mm-per-prompt '{"image": 1}' --gpu-memory-utilization "$REWARD_GPU_MEMORY")
  echo "+ CUDA_VISIBLE_DEVICES=$reward_gpus ${serve[*]} (log: $log)"
  CUDA_VISIBLE_DEVICES=$reward_gpus setsid "${serve[@]}" >"$log" 2>&1 &
  server=$!
  trap 'kill -- -$server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
  started=$SECONDS
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$REWARD_PORT/health" >/dev/null && break
    kill -0 "$server" 2>/dev/null || { echo "run.sh: error: the reward server exited; last lines of $log:" >&2; tail -n 30 "$log" >&2; exit 1; }
    sleep 1
  done
  curl -sf "http://127.0.0.1:$REWARD_PORT/health" >/dev/null \
    || { echo "run.sh: error: the reward server did not become healthy in 600 s; last lines of $log:" >&2; tail -n 30 "$log" >&2; exit 1; }
  echo "run.sh: the reward server answered after $(( SECONDS - started )) s"
fi

if (( NUM_GPUS_ACTOR_ROLLOUT == 1 && NNODES == 1 && MAX_RESTARTS == 0 )); then
  launcher=("$PYTHON")  # one process: without torchrun, whose report of a failed rank would bury the trainer's error
else
  # torchrun (launch.py: with the shell's exit codes, no traceback); TORCH_ELASTIC_SHUTDOWN_TIMEOUT: how long the ranks
  # may take to finish their iteration and save after a signal before torchrun kills them (torch >= 2.12 reads it, as
  # its --shutdown-timeout; older torchruns ignore it and keep their 30 s)
  torchrun_args=(--standalone)
  if (( NNODES > 1 )); then
    # c10d: the agents of all nodes meet at RDZV_ENDPOINT, whose store node 0's agent hosts
    # (is_host, not guessed from host names); the rendezvous numbers the ranks, NODE_RANK only
    # picks the host
    torchrun_args=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
                   --rdzv-id "$RDZV_ID"
                   --rdzv-conf "is_host=$(( NODE_RANK == 0 )),join_timeout=$JOIN_TIMEOUT")
  fi
  if (( MAX_RESTARTS > 0 )); then
    # launch.py gives each attempt's ranks a store of their own, which a restart after a killed
    # rank 0 needs
    torchrun_args+=(--max-restarts "$MAX_RESTARTS")
  fi
  launcher=(env TORCH_ELASTIC_SHUTDOWN_TIMEOUT="$STOP_TIMEOUT" "$PYTHON"
            launch.py "${torchrun_args[@]}" --nproc-per-node "$NUM_GPUS_ACTOR_ROLLOUT")
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
