#!/usr/bin/env bash
# Does our pre-training help? T5 v1.1 base pre-trained on the bundled text (Wikipedia + the C4 sample)
# for a time budget on one GPU, then fine-tuned on SNI's training tasks; the same fine-tuning from
# random initialisation next to it; test Rouge-L of both (docs/performance.md has the figures).
#
#   bash benchmarks/pretrain_then_finetune.sh
#
# Environment (defaults in brackets): WIKI [.gpudata/wiki/*.jsonl.gz], SNI (compact SNI or a
# natural-instructions checkout) [.gpudata/sni], WORK [${TMPDIR:-/tmp}/t5ds_bench, outside the
# checkout], OUT [$WORK/out], PRETRAIN_HOURS [0.1], LR [5e-3], WARMUP [300], FINETUNE_STEPS [1000],
# EVAL_PER_TASK [12], MODEL_BENCH [1: first time the model alone, for the engine-vs-model
# comparison], PRETRAIN_CONFIG [training/configs/t5_base_c4.yaml], FINETUNE_CONFIG
# [training/configs/sni.yaml], PRETRAIN_OVERRIDES [none: extra key=value for the pre-training run]
# (the tiny configs make a CPU dry run of the whole chain).
# The two fine-tunings run side by side on the GPU (batch 8 leaves most of it idle): their step
# times are not benchmarks; their Rouge-L figures are what this script is for.
set -euo pipefail
cd "$(dirname "$0")/.."
WIKI=${WIKI:-.gpudata/wiki/*.jsonl.gz}
SNI=${SNI:-.gpudata/sni}
WORK=$(realpath -m "${WORK:-${TMPDIR:-/tmp}/t5ds_bench}")
OUT=${OUT:-$WORK/out}
PRETRAIN_HOURS=${PRETRAIN_HOURS:-0.1}
LR=${LR:-5e-3}
WARMUP=${WARMUP:-300}
FINETUNE_STEPS=${FINETUNE_STEPS:-1000}
EVAL_PER_TASK=${EVAL_PER_TASK:-12}
PRETRAIN_CONFIG=${PRETRAIN_CONFIG:-training/configs/t5_base_c4.yaml}
FINETUNE_CONFIG=${FINETUNE_CONFIG:-training/configs/sni.yaml}
mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1
RUNS=$WORK/runs
DATA=$WORK/pretrain_shards

if [ "${MODEL_BENCH:-1}" = 1 ]; then
  python -m training.benchmark --steps 15 2>&1 | tee "$OUT/model_alone.txt"
fi

if [ ! -f "$DATA/manifest.json" ]; then
  text=$WORK/pretrain_text
  mkdir -p "$text"
  for f in $WIKI assets/c4/en/c4-train*.json.gz; do
    # an unmatched glob stays literal: stop rather than pre-train on less text than asked for
    [ -f "$f" ] || { echo "no file matches $f: set WIKI to your text files (jsonl.gz with a text field)" >&2; exit 2; }
    ln -sf "$(realpath "$f")" "$text/"
  done
  python -m data_prep.shard --input "$text/*" --validation-input 'assets/c4/en/c4-validation*.json.gz' \
    --output "$DATA" --workers 16 2>&1 | tail -3
fi

# Pre-training: the nanoT5 recipe with the time budget; the cosine is fitted to the budget, so the
# warm-up is shortened to fit too, and the peak lr is 5e-3 (nanoT5 reaches 2e-2 only after 10k
# warm-up steps; it passes 5e-3 at step 2.5k, where this whole run ends).
python training/pretrain.py --config "$PRETRAIN_CONFIG" --deepspeed_config ds_configs/zero0.json \
  output_dir="$RUNS/pretrain" data.dir="$DATA" budget.hours="$PRETRAIN_HOURS" optim.base_lr="$LR" \
  optim.warmup_steps="$WARMUP" eval.every_steps=500 eval.max_samples=2048 checkpoint.every_steps=0 \
  logging.every_steps=50 logging.wandb=disabled data.num_workers=4 optim.total_steps=65536 ${PRETRAIN_OVERRIDES:-} 2>&1 | tee "$OUT/pretrain.log" | grep -E "\[eval\]|held-out|Error|error" || true
test -f "$RUNS/pretrain/checkpoints/latest" || { echo "pre-training left no checkpoint"; tail -40 "$OUT/pretrain.log"; exit 1; }

finetune() {  # $1 = init, $2 = run name
  python training/finetune.py --config "$FINETUNE_CONFIG" output_dir="$RUNS/$2" init="$1" data.dir="$SNI" \
    optim.total_steps="$FINETUNE_STEPS" eval.max_instances_per_task="$EVAL_PER_TASK" checkpoint.every_steps=0 \
    checkpoint.at_end=false logging.every_steps=100 logging.wandb=disabled >"$OUT/$2.log" 2>&1
}
finetune "$RUNS/pretrain" sni_pretrained & a=$!
finetune random sni_random & b=$!
status=0
wait $a || status=$?
wait $b || status=$?
for run in sni_pretrained sni_random; do
  echo "== $run"; grep -E "SNI test Rouge-L|Error" "$OUT/$run.log" || tail -20 "$OUT/$run.log"
done
cp "$RUNS/pretrain/metrics.jsonl" "$OUT/pretrain_metrics.jsonl"
tar czf "$OUT/finetune_eval.tgz" "$RUNS"/sni_*/metrics.jsonl "$RUNS"/sni_*/sni_eval 2>/dev/null || true
exit $status
