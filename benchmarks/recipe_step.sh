#!/usr/bin/env bash
# The SmolLM2 recipe's drafter step (configs/smollm2-h200.toml) on its own, under each lever, side by side:
#   bash benchmarks/recipe_step.sh OUT_DIR       # one H200, ~5 minutes (the autotune lever: minutes more; past one device
#                                                 # call's 10: start it detached), no data or GGUF (random weights)
# The recipe's train phase is most of its wall time (336 of 512 s on 2026-12-05), nearly all of it steps on
# cached features: this times exactly that step (`bench --variants drafter-only`, features cached during the
# warm-up) on packs shaped like the recipe's: --token-budget 16384 of sequences of SEQ_LEN tokens (614, the
# mean of the shipped data's 24,760 prepared sequences), 128 anchors each, the 12-layer B=8 drafter with a
# 3,072-wide MLP and its one sliding-window layer. Its model FLOPs come from the very packs
# (profiling/flops.py): 15.6 TFLOP a step, so the recipe's ~200K target tokens/s is MFU ~0.19 and the
# goal of 290K is ~0.28.
# Levers, one bench each (each variant in a fresh process; the JSON of each in OUT_DIR/<lever>.json):
#   base       the recipe's settings: --compile-drafter --compile-masks --compile-stack (attention auto: the
#              interval kernels; the 12 layers as one graph, 2 compiled calls a step)
#   eager-masks  base with the interval kernels' masks built eagerly (without --compile-masks)
#   layers     base with a compiled call a layer (without --compile-stack: 24 calls a step)
#   flex       --compile-drafter --attention flex (FlexAttention, a compiled call a layer, masks eager: against
#              `layers` and `eager-masks` for the attention alone; the levers masks, tiles64, tiles128, autotune are its)
#   masks      flex + --compile-masks (the FlexAttention mask tiles compiled: ~80 launches a mask become a few)
#   pack32k    base with 32K-token packs: the same tokens in half the steps, so each launch carries twice
#              the work (a quality question too: the recipe's optimizer steps would halve)
#   eager      base without --compile-drafter (the reference the compiled layers are measured against)
#   split      flex with --attention flex-split (each block's own keys apart from FlexAttention)
#   tiles64    flex with FlexAttention's 64 x 64 tiles forward and backward (DFLASH_FLEX_KERNEL_OPTIONS)
#   tiles128   flex with 128 x 128 forward tiles
#   autotune   flex under TORCHINDUCTOR_MAX_AUTOTUNE=1: Inductor tries its FlexAttention (and GEMM) configs
#              instead of one default each (H200, head_dim 64: forward 128x64 tiles, backward 64/128); it
#              compiles for minutes, which the bench's warm-up absorbs. Says whether the kernels' tiles matter
# Then OUT_DIR/summary.txt: target tokens/s, ms a step and MFU of each lever, and its ratio to base; last,
# on CUDA, benchmarks/drafter_step.py's phases and kernels of the base step (OUT_DIR/profile.json, .log).
# Knobs (environment): DEVICE TARGET LEVERS (default 'base flex split pack32k eager') SHAPE (the drafter and pack
# flags) STEPS PROFILE (1: the kernel profile on a CPU too; its flags: PROFILE_FLAGS). The plumbing on a CPU (tests/test_benchmarks.py; --compile-* need CUDA, so LEVERS leaves them
# out there):
#   DEVICE=cpu TARGET=random:tiny LEVERS="eager pack32k" STEPS=2 \
#   SHAPE="--num-layers 2 --block-size 4 --num-anchors 8 --seq-len 64 --token-budget 256 --sliding-layers 1" \
#   bash benchmarks/recipe_step.sh /tmp/recipe-step
set -uo pipefail
out=${1:?usage: recipe_step.sh OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 1
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"  # this tree's code, whatever is installed

DEVICE=${DEVICE:-cuda} TARGET=${TARGET:-random:smollm2-135m} STEPS=${STEPS:-20}
LEVERS=${LEVERS:-base flex split pack32k eager}
SHAPE=${SHAPE:---num-layers 12 --block-size 8 --intermediate-size 3072 --sliding-layers 1 --num-anchors 128 \
--seq-len 614 --token-budget 16384}

dft() { python3 -m dflash_train "$@"; }  # the console script's entry (a train job's phases count from the start)
flags() {  # the lever's flags on top of SHAPE (a later flag wins)
  case $1 in
    base) echo "--compile-drafter --compile-masks --compile-stack" ;;
    eager-masks) echo "--compile-drafter --compile-stack" ;;
    layers) echo "--compile-drafter --compile-masks" ;;
    flex) echo "--compile-drafter --attention flex" ;;
    masks) echo "--compile-drafter --attention flex --compile-masks" ;;
    pack32k) echo "--compile-drafter --compile-masks --compile-stack --token-budget $(( 2 * $(budget) ))" ;;
    eager) echo "" ;;
    split) echo "--compile-drafter --attention flex-split" ;;
    autotune|tiles64|tiles128) echo "--compile-drafter --attention flex" ;;  # and the environment below
    *) echo "recipe_step.sh: unknown lever $1 (base, eager-masks, layers, flex, masks, split, pack32k, eager, autotune, tiles64, tiles128)" >&2
       return 2 ;;
  esac
}
# FlexAttention's tiles without autotuning (DFLASH_FLEX_KERNEL_OPTIONS): autotune's picks for the recipe's drafter on
# an H100 (2026-12-05; its two masks chose differently, and torch's default forward tile, 128 x 64, came last)
TILES64='{"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4, "bwd_BLOCK_M1": 64,
 "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_stages": 4, "bwd_num_warps": 4}'
TILES128='{"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 3, "fwd_num_warps": 4}'
budget() { grep -oE -- '--token-budget [0-9]+' <<< "$SHAPE" | tail -1 | cut -d' ' -f2; }

python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
  'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')" > "$out/env.log" 2>&1
for lever in $LEVERS; do
  extra=$(flags "$lever") || exit 2
  if [ "$DEVICE" = cpu ] && grep -q -- '--compile' <<< "$extra"; then
    extra=$(sed 's/--compile-[a-z]*//g' <<< "$extra")  # CPU plumbing: the compiled paths need CUDA
  fi
  echo "[recipe_step $(date +%H:%M:%S)] $lever: $SHAPE $extra"
  tune=0; [ "$lever" = autotune ] && tune=1
  tiles=""; [ "$lever" = tiles64 ] && tiles=$TILES64; [ "$lever" = tiles128 ] && tiles=$TILES128
  # shellcheck disable=SC2086  # SHAPE and the lever's flags are word lists
  TORCHINDUCTOR_MAX_AUTOTUNE=$tune DFLASH_FLEX_KERNEL_OPTIONS=$tiles \
  dft bench --target "$TARGET" --device "$DEVICE" --steps "$STEPS" --variants drafter-only $SHAPE $extra \
    --json "$out/$lever.json" > "$out/$lever.log" 2>&1
  echo "[recipe_step $(date +%H:%M:%S)] $lever: rc $?"
done

python3 - "$out" $LEVERS > "$out/summary.txt" <<'EOF'
import json, sys
from pathlib import Path
out, levers = Path(sys.argv[1]), sys.argv[2:]
rows = {}
for lever in levers:
    path = out / f"{lever}.json"
    if path.is_file():
        rows[lever] = json.loads(path.read_text())["variants"]["drafter-only"]
base = rows.get("base") or next(iter(rows.values()), None)
print(f"{'lever':<10} {'tokens/s':>10} {'ms/step':>8} {'MFU':>6} {'vs base':>8}")
for lever in levers:
    r = rows.get(lever)
    if r is None:
        print(f"{lever:<10} failed (see {lever}.log)")
        continue
    mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "-"
    ratio = r["tokens_per_s"] / base["tokens_per_s"]
    print(f"{lever:<10} {r['tokens_per_s']:>10,.0f} {1000 * r['step_s']:>8.1f} {mfu:>6} {ratio:>8.3f}")
EOF
cat "$out/summary.txt"
if [ "$DEVICE" != cpu ] || [ "${PROFILE:-0}" = 1 ]; then
  # shellcheck disable=SC2086  # PROFILE_FLAGS is a word list
  python3 benchmarks/drafter_step.py --target "$TARGET" --device "$DEVICE" ${PROFILE_FLAGS:-} \
    --json "$out/profile.json" > "$out/profile.log" 2>&1
  echo "[recipe_step $(date +%H:%M:%S)] profile: rc $? (log $out/profile.log)"
  head -12 "$out/profile.log"
fi
