#!/usr/bin/env bash
# One node: a Ray head, then `slime-rl train` as its driver (ray_multi_node.sh's head with NNODES=1: the
# same commands, no job server needed).
#   NUM_GPUS=8 bash launch/ray_single_node.sh [--launch-dry-run] --config configs/X.yaml [train flags]
# NODE_IP: the head's address (default 127.0.0.1); RAY_PORT, RAY_START_ARGS: as in ray_multi_node.sh.
set -euo pipefail
MASTER_ADDR=${NODE_IP:-127.0.0.1} NODE_RANK=0 NNODES=1 exec bash "$(dirname "$0")/ray_multi_node.sh" "$@"
