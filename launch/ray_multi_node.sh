#!/usr/bin/env bash
# Several nodes, one Ray node each. The head first, then the others, in any order:
#   head:   MASTER_ADDR=<head ip> NODE_RANK=0 NNODES=<N> NUM_GPUS=8 bash launch/ray_multi_node.sh [train flags]
#   others: MASTER_ADDR=<head ip> NODE_RANK=<1..N-1> NUM_GPUS=8 bash launch/ray_multi_node.sh
# The head starts Ray, waits until all NNODES nodes have joined (at most NODE_WAIT_TIMEOUT seconds, default
# 600; it stops with a message naming the nodes that did join), then runs the driver, `slime-rl train` with
# the flags given (`--dry-run` included), itself, joined to the cluster through RAY_ADDRESS: Ray's job
# server (`ray job submit`, which needs ray[default]) is not needed, the driver's output is this script's,
# and so is its exit status. Each other node waits until the head answers (at most HEAD_WAIT_TIMEOUT
# seconds, default 600; it stops with a message naming the head's address), then joins it.
# When the run ends (or fails, or the head's script gets Ctrl-C / TERM) the head tells the other nodes, which
# stop their Ray and exit; it waits for them (at most NODE_LEAVE_TIMEOUT seconds, default 30), then stops
# its own. --launch-dry-run (or LAUNCH_DRY_RUN=1) prints the commands without running them.
# NODE_IP: this node's address for Ray (default: the one Ray picks); RAY_PORT: the head's port (6379);
# RAY_START_ARGS: more flags for this node's `ray start` (e.g. --temp-dir DIR --num-cpus 32).
set -euo pipefail
source "$(dirname "$0")/common.sh"
: "${MASTER_ADDR:?set MASTER_ADDR to the IP of the head node}" "${NODE_RANK:?set NODE_RANK (0 for the head)}"
NUM_GPUS=${NUM_GPUS:-8}
PORT=${RAY_PORT:-6379}
HEAD="$MASTER_ADDR:$PORT"
if [ -n "${RAY_ADDRESS:-}" ]; then
  echo "note: RAY_ADDRESS=$RAY_ADDRESS in the environment is not used: the cluster is the one at $HEAD" >&2
  unset RAY_ADDRESS
fi
[ "${NNODES:-}" = 1 ] || case "$MASTER_ADDR" in
  127.*|localhost|::1) echo "note: MASTER_ADDR=$MASTER_ADDR is a loopback address: only Ray nodes on this machine can join" >&2;;
esac
if [ "$NODE_RANK" = 0 ]; then
  : "${NNODES:?set NNODES to the number of nodes, the head included (the head waits for all of them)}"
  release_others() {
    if [ "$NNODES" != 1 ] && { [ "$LAUNCH_DRY_RUN" = 1 ] || { [ -n "$RAY_NODE" ] && kill -0 "$RAY_NODE" 2>/dev/null; }; }; then
      run "$PYTHON" -m slime_rl.orchestration.nodes --address "$HEAD" --release --timeout "${NODE_LEAVE_TIMEOUT:-30}" \
        || true
    fi
  }
  trap 'stop_child; release_others; stop_ray_node' EXIT
  start_ray_node --head --node-ip-address "$MASTER_ADDR" --port "$PORT" --num-gpus "$NUM_GPUS" \
    --disable-usage-stats --dashboard-host "$MASTER_ADDR"
  run_wait "$PYTHON" -m slime_rl.orchestration.nodes --address "$HEAD" --nodes "$NNODES" \
    --timeout "${NODE_WAIT_TIMEOUT:-600}" ${RAY_NODE:+--watch-pid "$RAY_NODE"}
  run_wait env RAY_ADDRESS="$HEAD" "$PYTHON" -m slime_rl.cli train ${ARGS[@]+"${ARGS[@]}"}
else
  run_wait "$PYTHON" -m slime_rl.orchestration.nodes --address "$HEAD" --reachable --timeout "${HEAD_WAIT_TIMEOUT:-600}"
  start_ray_node --address "$HEAD" ${NODE_IP:+--node-ip-address "$NODE_IP"} --num-gpus "$NUM_GPUS" --disable-usage-stats
  run_wait "$PYTHON" -m slime_rl.orchestration.nodes --address "$HEAD" --until-released ${RAY_NODE:+--watch-pid "$RAY_NODE"}
fi
