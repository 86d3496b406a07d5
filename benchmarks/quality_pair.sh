#!/usr/bin/env bash
# Two recipe runs on one GPU for the price of one data stage: run A is the recorded one (timed end to
# end, alone on the GPU until its train job ends); once A's train job has ended, A's data caches
# (regenerated replies, prepared data) are copied into B's run directory and B trains on them while
# A's MT-Bench and ShareGPT evaluations finish. B's tau is its figure, not its time. An optional run C
# starts the same way once B's train job has ended (e.g. a throughput run, alone but for B's evals).
#   bash benchmarks/quality_pair.sh RUN_A RUN_B "A's train flags" "B's train flags" [RUN_C "C's train flags"]
#   e.g. bash benchmarks/quality_pair.sh /tmp/qa /tmp/qb "--max-steps 2664" "--max-steps 2664 --lr 2e-3"
# Each run writes RUN/quality.json (benchmarks/quality_h200.sh); the pair's log is RUN_A.pair.log.
# The plumbing on a CPU (under a minute): the CPU flags of quality_h200.sh's header as both
# runs' flags (B's with --lr 2e-3), with its EVAL_LIMIT=2 MTBENCH_LIMIT=2 EVAL_TOKENS=8.
# Longer than one device call: start it with setsid nohup and poll for RUN_A.pair.done.
set -uo pipefail
a=${1:?usage: quality_pair.sh RUN_A RUN_B FLAGS_A FLAGS_B [RUN_C FLAGS_C]} b=${2:?} flags_a=${3-} flags_b=${4-}
c=${5-} flags_c=${6-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log=$a.pair.log
rm -f "$a.pair.done"

after_train() {  # waits until run $1's train job has ended (or its script $2 has exited)
  until grep -q "^train: rc" "$1.out" 2>/dev/null; do
    kill -0 "$2" 2>/dev/null || break
    sleep 5
  done
  echo "$1's train job ended $(date -u +%T): $(grep "^train: rc" "$1.out")"
}

start_on_a_data() {  # run $1 with flags $2 on A's copied data caches, in the background
  mkdir -p "$1" && cp -r "$a"/regenerated-* "$a"/data-* "$1"/ 2>/dev/null
  # shellcheck disable=SC2086  # the flags are word-split on purpose
  bash "$here/quality_h200.sh" "$1" $2 > "$1.out" 2>&1 &
}

{
  echo "A: $a $flags_a; B: $b $flags_b${c:+; C: $c $flags_c}; start $(date -u +%FT%T)"
  # shellcheck disable=SC2086
  bash "$here/quality_h200.sh" "$a" $flags_a > "$a.out" 2>&1 &
  pa=$!
  after_train "$a" $pa
  start_on_a_data "$b" "$flags_b"
  pb=$!
  if [ -n "$c" ]; then
    after_train "$b" $pb
    start_on_a_data "$c" "$flags_c"
    pc=$!
  fi
  wait $pa; echo "A done: rc $? $(date -u +%T)"
  wait $pb; echo "B done: rc $? $(date -u +%T)"
  if [ -n "$c" ]; then wait "$pc"; echo "C done: rc $? $(date -u +%T)"; fi
} > "$log" 2>&1
touch "$a.pair.done"
