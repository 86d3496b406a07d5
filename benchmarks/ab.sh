#!/usr/bin/env bash
# A benchmark command in two trees on one machine, alternated: the before/after pair of a change in one call,
# so machine-to-machine spread (~3% between H200s) does not enter the comparison.
#   git archive REV src benchmarks | tar -x -C BASE     (locally: the tree before the change, e.g. REV = HEAD)
#   bash benchmarks/ab.sh BASE ROUNDS COMMAND...
#   e.g. bash benchmarks/ab.sh .gpu/base 2 python3 benchmarks/decode_parts.py --draft-layers 12 --block-size 8
# Each round runs COMMAND in BASE, then in this tree, each from its own root with its own src/ first on
# PYTHONPATH; every output line is prefixed "base1 | ", "new1 | ", ... A COMMAND argument containing {} gets
# "base1", "new1", ... in its place (per-run output files: --json $OUT/parts-{}.json). Exits with the first
# failing run's status, after all runs.
set -uo pipefail
usage="usage: ab.sh BASE ROUNDS COMMAND..."
[ $# -ge 3 ] || { echo "$usage" >&2; exit 2; }
[ -d "$1/src" ] || { echo "ab.sh: BASE $1 has no src/ (git archive REV src benchmarks | tar -x -C $1)" >&2; exit 2; }
[[ $2 =~ ^[1-9][0-9]*$ ]] || { echo "ab.sh: ROUNDS $2 is not a positive whole number; $usage" >&2; exit 2; }
base=$(cd "$1" && pwd) rounds=$2
shift 2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rc=0
for round in $(seq 1 "$rounds"); do
  for side in base new; do
    tree=$here; [ $side = base ] && tree=$base
    tag=$side$round
    (cd "$tree" && PYTHONPATH="$tree/src${PYTHONPATH:+:$PYTHONPATH}" "${@//\{\}/$tag}" 2>&1) | sed "s/^/$tag | /"
    status=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] && rc=$status
  done
done
exit "$rc"
