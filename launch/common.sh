# Sourced by the launch scripts. `run CMD...` prints the command and runs it; with --launch-dry-run (or
# LAUNCH_DRY_RUN=1) the scripts only print. Every other argument is kept in ARGS for the command the
# script runs, `--dry-run` included: that is `slime-rl train`'s own (check the flags, print the plan).
# (The scripts' print-only switch was named `--dry-run` before; that name now reaches the trainer.)
# The scripts assemble commands; they hold no logic and never kill processes by name: what a script
# starts in the background it stops by its pid when it exits (a Ray node: its `ray start --block`,
# which stops the Ray processes of that node; `ray stop` would stop every Ray of the machine).
LAUNCH_DRY_RUN=${LAUNCH_DRY_RUN:-0}
ARGS=()
for a in "$@"; do
  if [ "$a" = "--launch-dry-run" ]; then LAUNCH_DRY_RUN=1; else ARGS+=("$a"); fi
done
show() { printf '+'; printf ' %q' "$@"; }
run() {
  show "$@"; printf '\n'
  if [ "$LAUNCH_DRY_RUN" != 1 ]; then "$@"; fi
}
# `run_wait CMD...`: run, but in the background while the script waits for it, so that INT/TERM reach the
# script's trap at once (stop_started then stops the command). Returns the command's exit status.
CHILD=
run_wait() {
  show "$@"; printf '\n'
  if [ "$LAUNCH_DRY_RUN" = 1 ]; then return 0; fi
  "$@" &
  CHILD=$!
  local rc=0
  wait "$CHILD" || rc=$?
  CHILD=
  return "$rc"
}
# `start_ray_node ARGS...`: `ray start ARGS --block` in the background (RAY_NODE: its pid), with the flags
# of RAY_START_ARGS (split on spaces: --temp-dir, --num-cpus, --object-store-memory, ...) added.
RAY_NODE=
read -r -a RAY_START_EXTRA <<< "${RAY_START_ARGS:-}"
start_ray_node() {
  show ray start "$@" ${RAY_START_EXTRA[@]+"${RAY_START_EXTRA[@]}"} --block; printf ' &\n'
  if [ "$LAUNCH_DRY_RUN" = 1 ]; then return 0; fi
  ray start "$@" ${RAY_START_EXTRA[@]+"${RAY_START_EXTRA[@]}"} --block &
  RAY_NODE=$!
}
# On exit (the command's end, an error, INT or TERM): the running command first (stop_child), then this
# node's Ray (stop_ray_node); a script may put more between them (its own EXIT trap).
stop_child() {
  if [ -n "$CHILD" ] && kill -0 "$CHILD" 2>/dev/null; then
    kill -TERM "$CHILD" 2>/dev/null || true
    wait "$CHILD" 2>/dev/null || true
  fi
}
stop_ray_node() {
  if [ -n "$RAY_NODE" ] && kill -0 "$RAY_NODE" 2>/dev/null; then
    echo "+ kill -TERM $RAY_NODE  # this node's ray start --block: it stops the Ray processes it started"
    kill -TERM "$RAY_NODE" 2>/dev/null || true
    wait "$RAY_NODE" 2>/dev/null || true
  fi
}
trap 'stop_child; stop_ray_node' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# NVLink multicast off (NCCL, PyTorch, NVSHMEM): see the GPU notes in the README. Every process of the
# run inherits them: the driver from this shell, the actors from their node's `ray start`.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
  NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
# A Ray node stopped by SIGTERM stops at once (Ray's default first drains it for up to 30 s, for Ray Serve).
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}
PYTHON=${PYTHON:-python3}
