#!/usr/bin/env bash
# The main demo: train the default GPT (2 stages x 2 pipelines on CPU) with ds_recycle's launcher, SIGKILL a
# worker mid-run and watch training go on (the launcher starts the worker again RESTART seconds later); then
# vanilla DeepSpeed under the same failure: the same worker is SIGKILLed at the same point, its job dies and
# restarts from its checkpoint. Prints a table, writes throughput.png, compares both final models. Linux only
# (the vanilla worker's pid is found through /proc).
#
#   bash launch/demo.sh                              # 30 iterations, worker (1, 0) killed at iteration 12
#   STEPS=60 KILL=0:1@20:send bash launch/demo.sh    # P:S@N:PHASE (keep worker (0, last stage) alive)
#   RESTART=10 bash launch/demo.sh                   # restart delay, seconds (both systems)
#   SLOW=0:0@4*3,0:0@20*1 bash launch/demo.sh        # also a slow worker, both systems: P:S@N*F, F=1 ends it
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONFIG=${CONFIG:-$ROOT/configs/gpt_cpu_2x2.json}
STEPS=${STEPS:-30}
KILL=${KILL:-1:0@12:backward-input}
RESTART=${RESTART:-5}
SLOW=${SLOW:-}
OUT=${OUT:-$ROOT/runs/demo}
export WANDB_MODE=${WANDB_MODE:-offline} WANDB_DIR=${WANDB_DIR:-$OUT} PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

mkdir -p "$OUT"
cd "$ROOT"
SLOW_ARGS=()
IFS=',' read -ra SLOW_SPECS <<< "$SLOW"
for spec in "${SLOW_SPECS[@]}"; do SLOW_ARGS+=(--slow "$spec"); done
.venv/bin/python launch/failure_demo.py --config "$CONFIG" --steps "$STEPS" --kill "$KILL" \
    --restart_failed_after "$RESTART" --out "$OUT" "${SLOW_ARGS[@]}"
