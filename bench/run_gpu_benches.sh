#!/bin/bash
# Runs the GPU benches and writes their outputs under $OUT (default bench/results/raw).
#   bash bench/run_gpu_benches.sh sync     # 2 GPUs: weight sync, full path vs raw broadcast
#   bash bench/run_gpu_benches.sh mfu      # 1 GPU: train MFU, with a kernel profile
#   bash bench/run_gpu_benches.sh engine   # 1 GPU: built-in engine vs HF generate
#   bash bench/run_gpu_benches.sh moe      # 1 GPU: colocated loop, ~2.25B Qwen3-MoE shape (gap, MFU, sync)
# NVLink multicast stays off (the H200 hosts are shared; see the device notes).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/raw}
mkdir -p "$OUT"
day=$(date -u +%F)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case "$1" in
  sync)
    b=${BUCKET_MB:-512}
    python3 bench/weight_sync.py --shapes ${SHAPES:-0.5b 1.5b 4b} --repeats 5 --bucket-mb $b \
      --out "$OUT/weight_sync_2xH200_${b}MB_$day.json" 2>&1 | tee "$OUT/weight_sync_2xH200_${b}MB_$day.txt" ;;
  mfu)
    python3 bench/train_mfu.py --shape 1.5b --profile --out "$OUT/train_mfu_1xH200_$day.json" 2>&1 \
      | grep -v Warning | tee "$OUT/train_mfu_1xH200_$day.txt" ;;
  engine)
    python3 bench/engine_throughput.py --shape 1.5b --out "$OUT/engine_throughput_1xH200_$day.json" 2>&1 \
      | grep -v -e Warning -e "it/s]" | tee "$OUT/engine_throughput_1xH200_$day.txt" ;;
  moe)
    python3 bench/moe_gpu.py --out "$OUT/moe_gpu_1xH200_$day.json" 2>&1 \
      | grep -v -e Warning -e "it/s]" | tee "$OUT/moe_gpu_1xH200_$day.txt" ;;
  *) echo "usage: $0 sync|mfu|engine|moe" >&2; exit 2 ;;
esac
