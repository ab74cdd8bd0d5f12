#!/usr/bin/env bash
# The main job end to end on the bundled sample: install, shard the bundled real C4 documents,
# verify the shards, pre-train a tiny T5 with DeepSpeed (CPU, or the GPUs present), print the
# held-out loss. Run directory: runs/demo (rerunning resumes/finishes the same run; delete it to
# start over).
#   bash scripts/demo.sh [key=value ...]    extra run-config overrides, e.g. optim.total_steps=100
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/install.sh

echo "== shard the bundled C4 sample"
python -m data_prep.shard --input 'assets/c4/en/c4-*.json.gz' --tokenizer assets/t5/spiece.model \
  --output runs/demo/shards --input-length 128 --rows-per-shard 512 --workers 2
echo "== verify the shards"
python -m data_prep.verify runs/demo/shards

if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "== pre-train a tiny T5 (training/configs/tiny_demo.yaml) on every GPU of this machine"
  # A free port: another job on this machine may hold the launcher's default one.
  port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  launcher=(deepspeed --log_level warning --master_port "$port")
else
  echo "== pre-train a tiny T5 (training/configs/tiny_demo.yaml) on the CPU"
  # One process needs no launcher (training/distributed.py starts a one-rank group on a free port),
  # and DeepSpeed is told the accelerator instead of guessing it, and warning, in every process.
  export DS_ACCELERATOR=cpu
  launcher=(python)
fi
"${launcher[@]}" training/pretrain.py --config training/configs/tiny_demo.yaml \
  --deepspeed_config ds_configs/zero0.json "$@"
echo "== demo done in $((SECONDS / 60)) min $((SECONDS % 60)) s"
