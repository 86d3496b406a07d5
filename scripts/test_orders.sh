#!/usr/bin/env bash
# Run the tests in two more orders: reversed, and shuffled with a seed. A test that passes in the file
# order but fails here depends on what an earlier test left behind (or forgot to set up).
#   bash scripts/test_orders.sh                   the whole suite, twice
#   bash scripts/test_orders.sh -m "not slow"     the quick set (any pytest arguments pass through)
#   SEED=7 bash scripts/test_orders.sh            another shuffle (default: the day of the year)
set -euo pipefail
cd "$(dirname "$0")/.."
seed=${SEED:-$(date +%j)}
for order in reverse "shuffle:$seed"; do
  echo "test_orders: --test-order $order"
  python3 -m pytest -p no:cacheprovider --test-order "$order" "$@"
done
