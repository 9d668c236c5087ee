#!/usr/bin/env bash
# The main job: train the default GPT (2 stages x 2 pipelines on CPU) with ds_recycle's launcher.
#
#   bash launch/demo.sh                 # 30 iterations of configs/gpt_cpu_2x2.json, metrics in runs/demo/
#   STEPS=60 CONFIG=configs/other.json bash launch/demo.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONFIG=${CONFIG:-$ROOT/configs/gpt_cpu_2x2.json}
STEPS=${STEPS:-30}
OUT=${OUT:-$ROOT/runs/demo}
NPROC=${NPROC:-4}
export WANDB_MODE=${WANDB_MODE:-offline} WANDB_DIR=${WANDB_DIR:-$OUT}

mkdir -p "$OUT"
cd "$ROOT"
.venv/bin/ds-recycle launch --num_accelerators "$NPROC" --master_port 0 launch/train.py \
  --deepspeed_config "$CONFIG" --steps "$STEPS" --metrics "$OUT/metrics.jsonl" --save-final "$OUT/final.pt"
echo "demo: metrics in $OUT/metrics.jsonl, final parameters in $OUT/final.pt, wandb run under $OUT/wandb"
