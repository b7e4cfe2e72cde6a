#!/usr/bin/env bash
# The CPU quickstart: set-up, a tiny random-init Qwen2 and the digit task made locally, then GRPO
# with a TP=2 Megatron trainer and one built-in engine on Ray. Extra flags go to `slime-rl train`.
#   bash launch/quickstart_cpu.sh [--num-rollout 5 ...]
# CONFIG (default configs/quickstart_cpu.yaml) and MODEL_FLAGS (make_tiny_model.py's, default none) choose
# another recipe, e.g. configs/quickstart_cpu_lora.yaml's (its header gives them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
PY=${VENV:-.venv}/bin/python
WORK=${WORK:-runs/quickstart}
mkdir -p "$WORK"
CONFIG=${CONFIG:-configs/quickstart_cpu.yaml}
# shellcheck disable=SC2086  # MODEL_FLAGS: several words
[ -f "$WORK/model/config.json" ] || "$PY" tools/make_tiny_model.py --out "$WORK/model" --seed 0 ${MODEL_FLAGS:-}
[ -f "$WORK/digits.jsonl" ] || "$PY" tools/make_digit_data.py --out "$WORK/digits.jsonl" --n 1000 --seed 0
echo "+ slime-rl train --config $CONFIG --hf-checkpoint $WORK/model --prompt-data $WORK/digits.jsonl --run-dir $WORK/run $*"
exec "$PY" -m slime_rl.cli train --config "$CONFIG" --hf-checkpoint "$WORK/model" \
  --prompt-data "$WORK/digits.jsonl" --run-dir "$WORK/run" "$@"
