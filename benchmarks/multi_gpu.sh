#!/usr/bin/env bash
# The multi-GPU measurements of docs/performance.md, on one machine of 4 GPUs, in parts that each
# finish within SECONDS_LEFT (default 570) seconds; a later part reuses the shards and the compile
# cache of an earlier one when $WORK is kept between them, and makes its own otherwise.
#
#   bash benchmarks/multi_gpu.sh scaling   # shard; weak scaling on 1 and 2 GPUs x ZeRO 0-3 (T5 base;
#                                          # GPUS and CONFIGS pick other GPU counts and stages)
#   bash benchmarks/multi_gpu.sh scaling4  # the same on 4 GPUs (CONFIGS4, default all four stages),
#                                          # efficiency against the 1-GPU rows of `scaling`
#   bash benchmarks/multi_gpu.sh large     # ZeRO 2 on 4 GPUs resumed as ZeRO 3 on 2; XL and XXL on
#                                          # 4 GPUs with ZeRO 3 (LARGE, default "reshard xl xxl"; XL_BATCH,
#                                          # XXL_BATCH: sequences per GPU, the next one tried if a
#                                          # run fails; XXL_STEPS, XXL_LR, XXL_CKPT: XXL's
#                                          # model.activation_checkpointing)
#
# Environment: WIKI (jsonl.gz text, default .gpudata/wiki/*.jsonl.gz), WORK (shards, runs and the
# compile cache, default ${TMPDIR:-/tmp}/t5ds_bench, outside the checkout), OUT (where the
# summaries and log archives go, default $WORK/out).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: multi_gpu.sh scaling|scaling4|large}
WIKI=${WIKI:-.gpudata/wiki/*.jsonl.gz}
WORK=$(realpath -m "${WORK:-${TMPDIR:-/tmp}/t5ds_bench}")
OUT=${OUT:-$WORK/out}
mkdir -p "$WORK" "$OUT"
export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor TRITON_CACHE_DIR=$WORK/triton PYTHONUNBUFFERED=1
DATA=$WORK/shards
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus_$part.txt"

if [ ! -f "$DATA/manifest.json" ]; then
  start=$(date +%s)
  python -m data_prep.shard --input "$WIKI" --validation-input 'assets/c4/en/c4-validation*.json.gz' \
    --output "$DATA" --workers 32 >"$WORK/shard.log" 2>&1 || { tail -20 "$WORK/shard.log"; exit 1; }
  echo "sharded in $(( $(date +%s) - start )) s"
fi

# Each part ends before DEADLINE: a step gets the time left.
DEADLINE=$(( $(date +%s) + ${SECONDS_LEFT:-570} ))
left() { echo $(( DEADLINE - $(date +%s) )); }

case $part in
scaling)
  # Four 1-GPU runs side by side (the baselines of every efficiency), then two 2-GPU runs at a time.
  timeout "$(left)" python benchmarks/scaling.py --data "$DATA" --gpus "${GPUS:-1,2}" --configs "${CONFIGS:-zero0,zero1,zero2,zero3}" \
    --steps 20 --log-every 5 --parallel --out "$WORK/runs/scaling" --json "$OUT/scaling.jsonl" \
    data.num_workers=4 | tee "$OUT/scaling.txt"
  tar czf "$OUT/scaling_logs.tgz" "$WORK"/runs/scaling/*.log "$WORK"/runs/scaling/*/metrics.jsonl 2>/dev/null
  ;;
scaling4)
  [ -f "$OUT/scaling.jsonl" ] || echo "no $OUT/scaling.jsonl (run the scaling part first): no efficiency column"
  touch "$OUT/scaling.jsonl"
  timeout "$(left)" python benchmarks/scaling.py --data "$DATA" --gpus 4 --configs "${CONFIGS4:-zero0,zero1,zero2,zero3}" \
    --steps 20 --log-every 5 --out "$WORK/runs/scaling4" --json "$OUT/scaling4.jsonl" \
    --baseline-json "$OUT/scaling.jsonl" data.num_workers=4 | tee "$OUT/scaling4.txt"
  tar czf "$OUT/scaling4_logs.tgz" "$WORK"/runs/scaling4/*.log "$WORK"/runs/scaling4/*/metrics.jsonl 2>/dev/null
  ;;
large)
  for job in ${LARGE:-reshard xl xxl}; do
    case $job in
    reshard)  # ZeRO 2 on 4 GPUs, checkpoint at step 10, universal conversion, resumed as ZeRO 3 on 2 GPUs.
      timeout "$(( $(left) < 200 ? $(left) : 200 ))" python benchmarks/reshard_resume.py --data "$DATA" \
        --source zero2:4 --target zero3:2 --steps 20 --batch 128 --out "$WORK/runs/reshard" data.num_workers=4 \
        | tee "$OUT/reshard.txt" ;;
    xl)  # T5 v1.1 XL, ZeRO 3 (T5 blocks compiled one by one: model.zero3_compile=blocks), 4 GPUs.
      timeout "$(( $(left) < 240 ? $(left) : 240 ))" python benchmarks/scaling.py --data "$DATA" \
        --config training/configs/t5_xl_c4.yaml --gpus 4 --configs zero3 --per-gpu-batch "${XL_BATCH:-64}" \
        --steps 15 --log-every 5 --out "$WORK/runs/xl" --json "$OUT/large.jsonl" data.num_workers=4 | tee "$OUT/xl.txt" ;;
    xxl)  # T5 v1.1 XXL, ZeRO 3, 4 GPUs: 8 sequences per GPU, 4 if 8 fails (16 ran out of memory eager).
      for batch in ${XXL_BATCH:-8 4}; do
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$(left)" python benchmarks/scaling.py --data "$DATA" \
          --config training/configs/t5_xxl_c4.yaml --gpus 4 --configs zero3 --per-gpu-batch "$batch" \
          --steps "${XXL_STEPS:-40}" --log-every 2 --out "$WORK/runs/xxl_$batch" --json "$OUT/large.jsonl" \
          data.num_workers=4 ${XXL_LR:+optim.base_lr=$XXL_LR} ${XXL_CKPT:+model.activation_checkpointing=$XXL_CKPT} \
          | tee -a "$OUT/xxl.txt"
        [ "${PIPESTATUS[0]}" = 0 ] && break
      done ;;
    *) echo "unknown job $job in LARGE: reshard, xl, xxl" >&2; exit 2 ;;
    esac
  done
  tar czf "$OUT/large_logs.tgz" "$WORK"/runs/reshard/*.log "$WORK"/runs/xl/*.log "$WORK"/runs/xxl_*/*.log \
    "$WORK"/runs/*/*/metrics.jsonl 2>/dev/null
  ;;
*)
  echo "unknown part $part: scaling, scaling4 or large" >&2
  exit 2
  ;;
esac
