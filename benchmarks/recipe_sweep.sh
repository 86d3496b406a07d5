#!/usr/bin/env bash
# Recipe levers for the embedded target's drafter, measured side by side on one GPU.
#   bash benchmarks/recipe_sweep.sh OUT_DIR 'NAME|extra train flags' ['NAME|flags' ...]
# The first variant runs configs/smollm2-h200.toml end to end (regeneration included, then its own
# HumanEval eval); the others start once its prepared data exists and train on it, except those
# whose data flags (--regen-*, --max-length, --data-topic, --num-conversations, with their values)
# differ from the first's: they regenerate and prepare their own, at the same time. All variants
# train at once on the one GPU (so each one's wall time is an upper bound of its time alone), then
# each is evaluated on HumanEval, MT-Bench and held-out ShareGPT (T=0, 128 tokens; 40 prompts, MT-Bench all
# 80: its file is sorted by category, so its first 40 hold 4 of the 8).
# OUT_DIR/summary.json and the table printed at the end come from benchmarks/recipe_summary.py.
# EVAL_FLAGS=--no-baseline measures tau only (half the eval time; speedups measured while other
# variants share the GPU say little anyway); SOLO_EVAL=1 then evaluates the variant with the best
# HumanEval tau once more, with the target-only baseline, after every other run has finished
# (OUT_DIR/NAME/eval-humaneval-solo.json: its speedup and lossless check), with SOLO_FLAGS added
# (e.g. SOLO_FLAGS=--compile: the decoders' steps compiled). TARGET (default smollm2-135m) is the evals'
# target: give the variants the same --target.
# The plumbing on a CPU (~30 s; tests/test_benchmarks.py runs it):
#   TARGET=random:tiny EVAL_LIMIT=2 MTBENCH_LIMIT=2 EVAL_TOKENS=8 bash benchmarks/recipe_sweep.sh /tmp/sweep \
#   'base|--device cpu --target random:tiny --num-conversations 40 --no-regenerate --regen-samples 1 --no-compile-drafter --no-compile-masks --no-compile-target
#   --num-layers 1 --intermediate-size 128 --max-steps 2 --max-length 128 --token-budget 512 --eval-limit 2
#   --eval-max-new-tokens 8 --val-conversations 0' 'lr|(the same) --lr 2e-3'
set -uo pipefail
out=${1:?usage: recipe_sweep.sh OUT_DIR 'NAME|flags' ...}
shift
[ $# -ge 1 ] || { echo "recipe_sweep.sh: give at least one 'NAME|flags' variant" >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"  # this tree's code, whatever is installed
config=${CONFIG:-$repo/configs/smollm2-h200.toml} target=${TARGET:-smollm2-135m}
limit=${EVAL_LIMIT:-40} mt_limit=${MTBENCH_LIMIT:-80} tokens=${EVAL_TOKENS:-128}  # smaller for a quick check of the script
eval_flags=${EVAL_FLAGS:-}
mkdir -p "$out"
dft() { python3 -m dflash_train "$@"; }  # the console script's entry (a train job's phases count from the start)

variant() {  # name, data flag (empty for the first), flags...
  local name=$1 data=$2; shift 2
  local dir="$out/$name" start
  start=$(date +%s)
  mkdir -p "$dir"
  # the train job refuses a run directory holding files it did not write: its log goes in once it has ended
  # shellcheck disable=SC2086
  dft train --config "$config" --run-dir "$dir" --quiet $data "$@" > "$dir.train.log" 2>&1
  local rc=$?
  mv -f "$dir.train.log" "$dir/train.log"
  echo "$rc $(( $(date +%s) - start ))" > "$dir/train.status"
  for d in humaneval mtbench sharegpt; do
    n=$limit; [ $d = mtbench ] && n=$mt_limit
    # shellcheck disable=SC2086
    dft eval --target "$target" --drafter "$dir/drafter" --dataset $d --limit "$n" --max-new-tokens "$tokens" \
      --quiet --json "$dir/eval-$d.json" $eval_flags > "$dir/eval-$d.log" 2>&1
  done
}

data_flags() {  # the words of a flag string that choose the data: each data flag and the word after it
  local w keep=0 out=""
  for w in $1; do
    if [ $keep = 1 ]; then out+=" $w"; keep=0; continue; fi
    case $w in --regen-*=*|--max-length=*|--data-topic=*|--num-conversations=*) out+=" $w" ;;
      --regen-*|--max-length|--data-topic|--num-conversations) out+=" $w"; keep=1 ;;
    esac
  done
  echo "$out"
}

first=${1%%|*}; flags=${1#*|}; shift
# shellcheck disable=SC2086
variant "$first" "" $flags &
for _ in $(seq 1200); do  # the others wait for the first one's prepared data (at most 20 min)
  meta=$(ls "$out/$first"/data-*/meta.json 2>/dev/null | head -1)
  [ -n "$meta" ] && break
  sleep 1
done
[ -n "${meta:-}" ] || { echo "no prepared data in $out/$first" >&2; wait; exit 1; }
for v in "$@"; do
  data="--data $(dirname "$meta")"
  [ "$(data_flags "${v#*|}")" = "$(data_flags "$flags")" ] || data=""  # other data: its own
  # shellcheck disable=SC2086
  variant "${v%%|*}" "$data --eval-limit 0" ${v#*|} &
done
wait
python3 "$repo/benchmarks/recipe_summary.py" "$out"
if [ "${SOLO_EVAL:-0}" = 1 ]; then
  best=$(python3 -c 'import json, sys; rows = [r for r in json.load(open(sys.argv[1])) if r.get("tau_humaneval")]
print(max(rows, key=lambda r: r["tau_humaneval"])["name"] if rows else "")' "$out/summary.json")
  [ -n "$best" ] && dft eval --target "$target" --drafter "$out/$best/drafter" --dataset humaneval --limit "$limit" \
    --max-new-tokens "$tokens" --quiet --json "$out/$best/eval-humaneval-solo.json" ${SOLO_FLAGS:-} | tee "$out/$best/eval-humaneval-solo.log"
fi
