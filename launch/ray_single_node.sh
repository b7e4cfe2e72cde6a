#!/usr/bin/env bash
# One node: start a Ray head, then submit `slime-rl train` as a Ray job.
#   NUM_GPUS=8 bash launch/ray_single_node.sh [--dry-run] --config configs/X.yaml [train flags]
set -euo pipefail
source "$(dirname "$0")/common.sh"
NODE_IP=${NODE_IP:-127.0.0.1}
NUM_GPUS=${NUM_GPUS:-8}
run ray start --head --node-ip-address "$NODE_IP" --num-gpus "$NUM_GPUS" --disable-usage-stats \
  --dashboard-host 127.0.0.1
run ray job submit --address "http://127.0.0.1:8265" \
  --runtime-env-json '{"env_vars": {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}}' \
  -- "$PYTHON" -m slime_rl.cli train ${ARGS[@]+"${ARGS[@]}"}
