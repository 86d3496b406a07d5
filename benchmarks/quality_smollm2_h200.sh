#!/usr/bin/env bash
# The embedded target's drafter trained on all of ShareGPT (train split) on one GPU, then tau on
# HumanEval, MT-Bench and held-out ShareGPT (T=0, B=16, 128 new tokens, 40 prompts each).
#   bash benchmarks/quality_smollm2_h200.sh RUN_DIR [extra train flags...]
set -euo pipefail
run=${1:?usage: quality_smollm2_h200.sh RUN_DIR [train flags]}
shift
dft() { python3 -c 'import sys; from dflash_train.cli import main; sys.exit(main())' "$@"; }
start=$(date +%s)
dft train --device cuda --run-dir "$run" --data sharegpt --num-conversations 0 --data-topic any \
  --regen-batch-size 2048 --regen-max-new-tokens 256 --regen-max-prompt-tokens 512 --max-length 1024 \
  --num-layers 3 --block-size 16 --num-anchors 256 --token-budget 16384 --lr 1e-3 --epochs 3 \
  --eval-limit 0 --checkpoint-every 0 --log-every 50 "$@"
for d in humaneval mtbench sharegpt; do
  dft eval --target smollm2-135m --drafter "$run/drafter" --dataset $d --limit 40 --max-new-tokens 128 \
    --json "$run/eval-$d.json" | tail -6
done
echo "wall_s $(( $(date +%s) - start ))"
