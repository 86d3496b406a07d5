#!/usr/bin/env bash
# The quality record run: a recipe config (CONFIG, default configs/smollm2-h200.toml) end to end on one GPU,
# timed as a user runs it
# (data, regeneration, training, export and the config's own HumanEval eval, with the target-only
# baseline), then tau on MT-Bench (all 80 first turns, 10 per category: the file is sorted by category,
# so its first 40 hold 4 of the 8) and held-out ShareGPT (40 prompts); T=0, 128 new tokens.
#   [CONFIG=configs/gemma3-h200.toml] bash benchmarks/quality_h200.sh RUN_DIR [extra train flags, which override
#   the config...]        (benchmarks/quality_smollm2_h200.sh: the SmolLM2 recipe's, by its older name)
# Writes RUN_DIR/quality.json with the keys of benchmarks/results/quality-smollm2-h200.json
# (tau_humaneval, tau_mtbench, tau_sharegpt, speedup, train_tokens, steps, wall_s, device, date,
# command), the job's seconds per phase (phases_s, from RUN_DIR/phases.json) and the GPU's peak memory
# (peak_gpu_memory_gb, from nvidia-smi every 5 s: RUN_DIR/gpu.log). Longer than one
# device call (~15 min on an H200): start it with setsid nohup and poll.
# The plumbing on a CPU (~15 s; tests/test_benchmarks.py runs it):
#   EVAL_LIMIT=2 MTBENCH_LIMIT=2 EVAL_TOKENS=8 bash benchmarks/quality_h200.sh /tmp/q --device cpu --target random:tiny \
#   --num-conversations 40 --no-regenerate --regen-samples 1 --no-compile-drafter --no-compile-masks --no-compile-target \
#   --num-layers 2 --intermediate-size 128 --max-steps 4 --max-length 128 --token-budget 512 --eval-limit 2 \
#   --eval-max-new-tokens 8 --val-conversations 0
set -uo pipefail
run=${1:?usage: quality_h200.sh RUN_DIR [train flags]}
shift
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$repo/src:$repo/benchmarks${PYTHONPATH:+:$PYTHONPATH}"  # this tree's code; recipe_summary
config=${CONFIG:-$repo/configs/smollm2-h200.toml}
limit=${EVAL_LIMIT:-40} mt_limit=${MTBENCH_LIMIT:-80} tokens=${EVAL_TOKENS:-128}
# the target the evals decode with: the config's, or a --target among the flags
target=$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb")).get("run", {}).get("target", "smollm2-135m"))' "$config") || exit 2
for ((i = 1; i < $#; i++)); do [ "${!i}" = --target ] && { j=$((i + 1)); target=${!j}; }; done
dft() { python3 -m dflash_train "$@"; }  # the console script's entry (a train job's phases count from the start)
mkdir -p "$run"
# The train job refuses a run directory that holds files it did not write, so this script's own logs are
# written beside RUN_DIR while the job runs (RUN_DIR.train.log, RUN_DIR.gpu.log) and moved in once it succeeded.
logs=("$run.train.log" "$run.gpu.log")
rm -f "${logs[@]}"
# the GPU's memory, SM clock, power and temperature every 5 s through the train job (quality.json's
# peak_gpu_memory_gb and sm_clock_mhz: a clock that sags under sustained load slows steps that a short bench does not)
smi=""
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -l 5 > "$run.gpu.log" 2>/dev/null &
  smi=$!
fi
# why each torch.compile graph compiled again, in train.log: on a fresh H200 the draft layers compiled anew at
# the epoch boundary (38 s) and the target once in the first epoch (31 s), for reasons not yet known
export TORCH_LOGS="${TORCH_LOGS-recompiles}"
start=$(date +%s)
dft train --config "$config" --run-dir "$run" --quiet "$@" > "$run.train.log" 2>&1
rc=$?
wall=$(( $(date +%s) - start ))
[ -n "$smi" ] && kill "$smi" 2>/dev/null
[ $rc -eq 0 ] || { echo "train: rc $rc in $wall s (log $run.train.log)"; exit $rc; }
for f in "${logs[@]}"; do [ -f "$f" ] && mv -f "$f" "$run/${f#"$run."}"; done
echo "train: rc $rc in $wall s (log $run/train.log)"
for d in mtbench sharegpt; do
  n=$limit; [ $d = mtbench ] && n=$mt_limit
  dft eval --target "$target" --drafter "$run/drafter" --dataset $d --limit "$n" --max-new-tokens "$tokens" \
    --no-baseline --quiet --json "$run/eval-$d.json" > "$run/eval-$d.log" 2>&1 || { cat "$run/eval-$d.log"; exit 1; }
  head -1 "$run/eval-$d.log"
done
python3 - "$run" "$wall" "${CONFIG:+CONFIG=$CONFIG }bash benchmarks/quality_h200.sh $run $*" <<'EOF'
import datetime
import json
import sys
from pathlib import Path

import torch
from recipe_summary import first_tau, trained_tokens  # benchmarks/ is on PYTHONPATH (not a package)

run, wall, command = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


def peak_memory_gb(log: Path) -> float | None:
    """The highest memory.used (MiB) of the nvidia-smi log in GB of 2**30 bytes (the H200's "139 GB");
    None without one (a CPU run)."""
    used = [float(x.split(",")[1]) for x in log.read_text().splitlines() if x.count(",") >= 2] if log.is_file() else []
    return round(max(used) / 1024, 1) if used else None


def sm_clock_mhz(log: Path) -> dict | None:
    """The SM clock's min / median / max (MHz) over the nvidia-smi log's samples while the GPU was busy (utilization
    above 50%); None without such samples (a CPU run, an older log without the clock's column)."""
    rows = [x.split(",") for x in log.read_text().splitlines()] if log.is_file() else []
    mhz = sorted(float(r[3]) for r in rows if len(r) >= 4 and r[2].strip().isdigit() and int(r[2]) > 50
                 and r[3].strip().replace(".", "", 1).isdigit())
    return {"min": mhz[0], "median": mhz[len(mhz) // 2], "max": mhz[-1]} if mhz else None


def regen_line(log: Path) -> str | None:
    """The job's `regenerate: ...` summary, or None when it reused a regenerated file."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if "] regenerate: regenerated" in x]
    return lines[-1].split("regenerate: ", 1)[1] if lines else None


after = json.loads((run / "eval_after.json").read_text())
records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
tokens = trained_tokens(records)
mt = json.loads((run / "eval-mtbench.json").read_text())
out = {"tau_humaneval": after["tau"], "tau_mtbench": mt["tau"],
       "tau_mtbench_first40": first_tau(mt, 40),  # its first 4 categories: what records before 2026-12-02c measured
       "tau_mtbench_by_category": mt["tau_by_category"], "mtbench_prompts": mt["num_prompts"],
       "tau_sharegpt": json.loads((run / "eval-sharegpt.json").read_text())["tau"], "speedup": after["speedup"],
       "lossless_humaneval": after["lossless"], "train_tokens": round(tokens[-1]) if tokens else None,
       "steps": records[-1]["step"] if records else 0, "wall_s": wall,
       "wall_s_note": "the whole train job: data, regeneration, training, export, HumanEval eval (with the target-only baseline)",
       "phases_s": json.loads((run / "phases.json").read_text()),  # the job's own split of its time (app/phases.py)
       "regenerate": regen_line(run / "train.log"),  # its summary line: rate, prefill/decode split, compactions
       "peak_gpu_memory_gb": peak_memory_gb(run / "gpu.log"),  # sampled every 5 s by nvidia-smi
       "sm_clock_mhz": sm_clock_mhz(run / "gpu.log"),  # the same samples, those with the GPU over 50% busy
       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
       "date": datetime.date.today().isoformat(), "command": command}
(run / "quality.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps(out, indent=1))
EOF
