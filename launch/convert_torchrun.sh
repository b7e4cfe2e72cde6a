#!/usr/bin/env bash
# The checkpoint converters under torchrun (one process per model shard: NPROC = TP x PP):
#   NPROC=4 bash launch/convert_torchrun.sh [--launch-dry-run] hf_to_megatron --hf-dir DIR --out DIR --tp 2 --pp 2
#   NPROC=1 bash launch/convert_torchrun.sh [--launch-dry-run] megatron_to_hf --load DIR --out DIR
set -euo pipefail
source "$(dirname "$0")/common.sh"
DIRECTION=${ARGS[0]:?first argument: hf_to_megatron or megatron_to_hf}
case "$DIRECTION" in hf_to_megatron|megatron_to_hf) ;; *) echo "unknown direction $DIRECTION" >&2; exit 2;; esac
run torchrun --standalone --nproc-per-node "${NPROC:-1}" "$(dirname "$0")/../tools/convert_${DIRECTION}.py" \
  "${ARGS[@]:1}"
