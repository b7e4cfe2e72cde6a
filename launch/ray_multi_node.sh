#!/usr/bin/env bash
# Several nodes. On every node: MASTER_ADDR=<head ip> NODE_RANK=<0..N-1> NNODES=<N> NUM_GPUS=8 bash launch/ray_multi_node.sh
# [--dry-run] [train flags]. Rank 0 starts the head, waits until all NNODES nodes have joined (at most
# NODE_WAIT_TIMEOUT seconds, default 600; it stops with a message naming the nodes that did join), then
# submits the job with the flags given; the others join the head and wait.
set -euo pipefail
source "$(dirname "$0")/common.sh"
: "${MASTER_ADDR:?set MASTER_ADDR to the IP of the head node}" "${NODE_RANK:?set NODE_RANK (0 for the head)}"
NUM_GPUS=${NUM_GPUS:-8}
PORT=${RAY_PORT:-6379}
if [ "$NODE_RANK" = 0 ]; then
  : "${NNODES:?set NNODES to the number of nodes, the head included (the head waits for all of them)}"
  run ray start --head --node-ip-address "$MASTER_ADDR" --port "$PORT" --num-gpus "$NUM_GPUS" --disable-usage-stats \
    --dashboard-host "$MASTER_ADDR"
  run "$PYTHON" -m slime_rl.orchestration.nodes --address "$MASTER_ADDR:$PORT" --nodes "$NNODES" \
    --timeout "${NODE_WAIT_TIMEOUT:-600}"
  run ray job submit --address "http://$MASTER_ADDR:8265" \
    --runtime-env-json '{"env_vars": {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}}' \
    -- "$PYTHON" -m slime_rl.cli train ${ARGS[@]+"${ARGS[@]}"}
else
  run ray start --address "$MASTER_ADDR:$PORT" --num-gpus "$NUM_GPUS" --disable-usage-stats --block
fi
