#!/usr/bin/env bash
# The SmolLM2 recipe's quality record run (configs/smollm2-h200.toml): benchmarks/quality_h200.sh, by the
# name its records' commands use.
#   bash benchmarks/quality_smollm2_h200.sh RUN_DIR [train flags]
CONFIG="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/configs/smollm2-h200.toml" \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/quality_h200.sh" "$@"
