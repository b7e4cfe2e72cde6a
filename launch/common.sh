# Sourced by the launch scripts: `run CMD...` prints the command and runs it, unless --dry-run was
# given (then it only prints). The scripts assemble commands; they hold no logic and never kill
# processes by name (stop a Ray node with `ray stop` on that node).
DRY_RUN=${DRY_RUN:-0}
ARGS=()
for a in "$@"; do
  if [ "$a" = "--dry-run" ]; then DRY_RUN=1; else ARGS+=("$a"); fi
done
run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [ "$DRY_RUN" != 1 ]; then "$@"; fi
}
# NVLink multicast off (NCCL, PyTorch, NVSHMEM): see the GPU notes in the README
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
  NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
PYTHON=${PYTHON:-python3}
