#!/usr/bin/env bash
# A memory node killed (-9) under a DDP job using the hook: every worker's
# backward() fails with membox's ProxyUnavailable naming the node (not
# torch's "Unable to cast ... to Tensor"), and `membox launch` stops with a
# non-zero status.
# Usage: ddp_node_loss_test.sh PATH/TO/membox
set -uo pipefail
# MEMBOX_TEST_PYTHON: another interpreter (a venv with PyPI torch 2.x).
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
membox=${1:?usage: ddp_node_loss_test.sh membox}
here=$(cd "$(dirname "$0")/../.." && pwd)
"$py" -c "import torch, sklearn" 2>/dev/null || { echo "SKIP: needs torch and sklearn"; exit 77; }
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$membox" launch --nodes 1 --workers 2 -- "$py" "$here/examples/train_digits.py" \
  --backend membox --epochs 50 >"$log" 2>&1 &
launch=$!
for _ in $(seq 300); do
  grep -q "epoch 1 " "$log" && break
  sleep 0.1
done
grep -q "epoch 1 " "$log" || { cat "$log"; echo "FAIL: training did not start"; exit 1; }
node=$(pgrep -P "$launch" -f "serve") || { echo "FAIL: no node"; exit 1; }
kill -9 "$node"
wait "$launch"
rc=$?
[[ $rc != 0 ]] || { cat "$log"; echo "FAIL: launch exited 0"; exit 1; }
if grep -q "Unable to cast" "$log"; then
  grep "Unable to cast" "$log"; echo "FAIL: torch's cast error reached the user"; exit 1
fi
n=$(grep -c "ProxyUnavailable: UNAVAILABLE: proxy 0 (" "$log")
[[ $n -ge 1 ]] || { grep -v "^\[node" "$log" | tail -30; echo "FAIL: no worker named the node"; exit 1; }
echo "PASS: $n worker(s) got ProxyUnavailable naming the node; launch exit $rc"
