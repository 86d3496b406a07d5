#!/usr/bin/env bash
# Two recipe runs on one GPU for the price of one data stage: run A is the recorded one (timed end to
# end, alone on the GPU until its train job ends); once A's train job has ended, A's data caches
# (regenerated replies, prepared data) are copied into B's run directory and B trains on them while
# A's MT-Bench and ShareGPT evaluations finish. B's tau is its figure, not its time.
#   bash benchmarks/quality_pair.sh RUN_A RUN_B "A's train flags" "B's train flags"
#   e.g. bash benchmarks/quality_pair.sh /tmp/qa /tmp/qb "--max-steps 2664" "--max-steps 2664 --lr 2e-3"
# Each run writes RUN/quality.json (benchmarks/quality_smollm2_h200.sh); the pair's log is RUN_A.pair.log.
# The plumbing on a CPU (under a minute): the CPU flags of quality_smollm2_h200.sh's header as both
# runs' flags (B's with --lr 2e-3), with its EVAL_LIMIT=2 MTBENCH_LIMIT=2 EVAL_TOKENS=8.
# Longer than one device call: start it with setsid nohup and poll for RUN_A.pair.done.
set -uo pipefail
a=${1:?usage: quality_pair.sh RUN_A RUN_B FLAGS_A FLAGS_B} b=${2:?} flags_a=${3-} flags_b=${4-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log=$a.pair.log
rm -f "$a.pair.done"
{
  echo "A: $a $flags_a; B: $b $flags_b; start $(date -u +%FT%T)"
  # shellcheck disable=SC2086  # the flags are word-split on purpose
  bash "$here/quality_smollm2_h200.sh" "$a" $flags_a > "$a.out" 2>&1 &
  pa=$!
  until grep -q "^train: rc" "$a.out" 2>/dev/null; do
    kill -0 $pa 2>/dev/null || break
    sleep 5
  done
  echo "A's train job ended $(date -u +%T): $(grep "^train: rc" "$a.out")"
  mkdir -p "$b" && cp -r "$a"/regenerated-* "$a"/data-* "$b"/ 2>/dev/null
  # shellcheck disable=SC2086
  bash "$here/quality_smollm2_h200.sh" "$b" $flags_b > "$b.out" 2>&1 &
  pb=$!
  wait $pa; echo "A done: rc $? $(date -u +%T)"
  wait $pb; echo "B done: rc $? $(date -u +%T)"
} > "$log" 2>&1
touch "$a.pair.done"
