#!/usr/bin/env bash
# The profiler's measurements on one H200 in one go (docs/profiling.md, "## Overhead"):
#   bash benchmarks/profile_h200.sh OUT_DIR      # on the lent GPU machine: OUT_DIR under $OUT (a few MB)
# Needs the SmolLM2 GGUF target (smollm2-135m) in the dflash-train cache; ShareGPT is embedded.
# Steps, each logged to OUT_DIR/<step>.log (rc and seconds in OUT_DIR/steps.tsv; a failing step
# does not stop the next), with rough durations on one H200 (about 6 minutes in all; TRAIN_SECONDS sets most of it):
#   env      versions, GPU                                                                  ~5 s
#   warm     a short SmolLM2 run that prepares the data (CONVS ShareGPT conversations, raw
#            replies: --no-regenerate) and fills the compile caches, so a, b, c start alike  ~60 s
#   a        the clean run: configs/smollm2-h200.toml's drafter and packs; target not compiled
#            (--no-compile-target), no CUDA graphs (only eval and regeneration use them; both
#            off); --profile-cuda-events every INTERVAL s; TRAIN_SECONDS of training after the
#            first step, then stop. Expected (measured with the drafter's chains unfused): drafter-bound
#            (the target waits on a full queue: 6 of 6 steady windows on 2026-12-04, the launch
#            rule holding in 1)                                                                 ~50 s
#   b        a + PLANT_B: 15 ms of host time at the end of drafter.lm_head_loss (a real
#            regression: 2026-12-01's planted sync cost nothing in a GPU-bound run)          ~50 s
#   c        a + PLANT_C: allocator churn there (a buffer of a new size each step, freed, then
#            torch.cuda.empty_cache()). Expected: allocator-churn, as the verdict or, where a role
#            limits the window, in brackets beside it: `drafter-bound (allocator-churn: ...)`     ~50 s
#   d        a with small packs (--token-budget SMALL_BUDGET, 2048): few tokens per kernel, so the
#            launches, not the GPU, should set the pace. Expected: launch-bound (2026-12-01: at
#            16K-token packs run a read balanced, its GPU stages ~105% device-busy)           ~50 s
#   reports  profile-report of a, b, c, d; --compare a->b and a->c, as recorded and on two views of
#            the runs (warm-up windows out; host wall time instead of device time): see
#            benchmarks/profile_h200.py. The plant's stage must rank first                       ~15 s
#   bench    Qwen3-8B shapes, --compile-target: overlap, overlap+wall, overlap+cuda. Overhead of
#            all three clocks <= 1%, verdicts neither launch- nor sync-bound, overlap within 3%
#            of benchmarks/results/h200-qwen3-8b.json's 16,155 tokens/s                         ~120 s
#   summary  OUT_DIR/summary.txt: verdicts per run (and which clock rules hold, whatever matched
#            first), the compare one-liners, bench tokens/s, verdicts and overhead
# Still compiled in a, b, c: FlexAttention and the LM-head loss chunks (no eager switch; eager
# FlexAttention is a CPU reference). The plants: benchmarks/planted.py (patched in-process).
# Knobs (environment): DEVICE TARGET CONFIG CONVS TRAIN_SECONDS WARM_SECONDS INTERVAL MAX_STEPS
# TRAIN_FLAGS (appended to every train) PLANT_B PLANT_C BENCH_FLAGS SKIP_BENCH=1 RUNS (default 'a b c d'). The plumbing on a
# CPU (2 minutes; without CUDA the sync plant is a 20 ms sleep and there is no allocator telemetry, so
# c cannot churn; OMP_NUM_THREADS=1 on a busy host; tests/test_benchmarks.py runs a shorter one):
#   OMP_NUM_THREADS=1 DEVICE=cpu TARGET=random:tiny CONVS=200 TRAIN_SECONDS=15 WARM_SECONDS=1 INTERVAL=2 \
#   TRAIN_FLAGS="--token-budget 512 --max-length 128 --num-anchors 8 --num-layers 1 --intermediate-size 128 \
#   --no-compile-drafter --no-compile-masks --no-compile-target" \
#   BENCH_FLAGS="--target random:tiny --device cpu --num-layers 1 --block-size 4 --num-anchors 8 --seq-len 64 \
#   --steps 2" bash benchmarks/profile_h200.sh /tmp/profile-smoke
set -uo pipefail
out=${1:?usage: profile_h200.sh OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 1
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"  # this tree's code, whatever is installed

DEVICE=${DEVICE:-cuda} TARGET=${TARGET:-smollm2-135m} CONFIG=${CONFIG:-configs/smollm2-h200.toml}
CONVS=${CONVS:-1000} TRAIN_SECONDS=${TRAIN_SECONDS:-30} WARM_SECONDS=${WARM_SECONDS:-3} INTERVAL=${INTERVAL:-5}
MAX_STEPS=${MAX_STEPS:-5000} TRAIN_FLAGS=${TRAIN_FLAGS:-}
# 2026-12-01: a planted sync cost nothing in the GPU-bound run, so b plants host time instead
PLANT_B=${PLANT_B:-sleep:drafter.lm_head_loss:15} PLANT_C=${PLANT_C:-churn:drafter.lm_head_loss}
BENCH_FLAGS=${BENCH_FLAGS:---target random:qwen3-8b --num-layers 5 --block-size 16 --num-anchors 512 --seq-len 3072 --steps 10 --compile-target}
export DEVICE TARGET CONFIG CONVS INTERVAL MAX_STEPS TRAIN_FLAGS

dft() { python3 -m dflash_train "$@"; }  # the console script's entry (a train job's phases count from the start)
say() { echo "[profile_h200 $(date +%H:%M:%S)] $*"; }
: > "$out/steps.tsv"
step() {  # name, time limit (s), command...: output to OUT_DIR/name.log, "name rc seconds" to steps.tsv
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  say "$name: $*"
  timeout -k 10 "$limit" bash -c '"$@"' "$name" "$@" > "$out/$name.log" 2>&1  # bash: runs the functions below too
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$out/steps.tsv"
  say "$name: rc $rc in $(( $(date +%s) - start )) s (log $out/$name.log)"
}

step env 60 bash -c 'git -C "$0" log -1 --format="commit %H %s"; nvidia-smi 2>&1 | head -20
  python3 -c "import torch, transformers; print(\"torch\", torch.__version__, \"transformers\", transformers.__version__,
  \"cuda\", torch.cuda.is_available() and torch.cuda.get_device_name(0))"; env | grep -E "^(DFLASH|PYTORCH|CUDA)" | sort' "$repo"

# One-device train: target and drafter threads in this one process (app/local.py), so the plants reach them.
train() {  # run dir, extra flags...
  local dir=$1 rc
  shift
  # --regen-samples 1: the raw replies are one chain per conversation, whatever the config samples
  # (--no-regenerate refuses a config's regen_samples > 1); TRAIN_FLAGS come last and win
  # shellcheck disable=SC2086
  python3 benchmarks/planted.py train --config "$CONFIG" --run-dir "$dir" --target "$TARGET" \
    --device "$DEVICE" --no-regenerate --regen-samples 1 --num-conversations "$CONVS" --no-compile-target --max-steps "$MAX_STEPS" \
    --eval-limit 0 --checkpoint-every 0 --log-every 50 --profile-interval "$INTERVAL" --profile-cuda-events --val-conversations 0 \
    --quiet --overwrite $TRAIN_FLAGS "$@"
  rc=$?
  rm -rf "$dir/checkpoints"  # the stop's checkpoint (~0.3 GB on the GPU): OUT_DIR keeps only what comes back small
  return $rc
}
export -f dft train

TRAIN_SECONDS=$WARM_SECONDS step warm 240 train "$out/warm"
data=$(ls -d "$out"/warm/data-*/ 2>/dev/null | head -1)
data_flag=()
[ -n "$data" ] && [ -f "$data/meta.json" ] && data_flag=(--data "${data%/}")  # else each run prepares its own
export TRAIN_SECONDS
runs=" ${RUNS:-a b c d} "  # e.g. RUNS=d: the small-pack run alone (compares of missing runs print no output)
[[ $runs == *" a "* ]] && step a 180 train "$out/a" "${data_flag[@]}"
[[ $runs == *" b "* ]] && PLANT=$PLANT_B step b 180 train "$out/b" "${data_flag[@]}"
[[ $runs == *" c "* ]] && PLANT=$PLANT_C step c 180 train "$out/c" "${data_flag[@]}"
[[ $runs == *" d "* ]] && step d 180 train "$out/d" "${data_flag[@]}" --token-budget "${SMALL_BUDGET:-2048}"

# profile-report of a, b, c and --compare a->b, a->c, as recorded and on two views (benchmarks/profile_h200.py)
step reports 150 python3 benchmarks/profile_h200.py reports "$out"

if [ "${SKIP_BENCH:-0}" = 1 ]; then
  say "bench: skipped (SKIP_BENCH=1)"
else
  # shellcheck disable=SC2086
  step bench 360 dft bench $BENCH_FLAGS --variants overlap,overlap+wall,overlap+cuda --json "$out/bench-8b.json"
fi

PLANT_B=$PLANT_B PLANT_C=$PLANT_C python3 benchmarks/profile_h200.py summary "$out"
