#!/usr/bin/env bash
# Faults seen from Python, and resuming: examples/train_ps.py (weights and
# optimizer on the memory nodes, a checkpoint per epoch) under `membox
# launch --ps-replicate off` (one copy of each shard: what a node's death
# costs without replication, which is on by default and tested by
# node_failover_test.sh); a memory node is killed with -9 during epoch 3;
# every worker gets ProxyUnavailable naming it and launch stops with a
# non-zero status; then `membox launch --resume` continues from the
# epoch-2 checkpoint.
# Usage: resume_test.sh PATH/TO/membox
set -uo pipefail
# MEMBOX_TEST_PYTHON: another interpreter (a venv with PyPI torch 2.x).
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
membox=${1:?usage: resume_test.sh membox}
here=$(cd "$(dirname "$0")/../.." && pwd)
"$py" -c "import torch, sklearn" 2>/dev/null || { echo "SKIP: needs python3-torch and python3-sklearn"; exit 77; }
ck=$(mktemp -d)
log=$(mktemp)
trap 'rm -rf "$ck" "$log"' EXIT
"$membox" launch --nodes 2 --workers 2 --ps-replicate off --checkpoint-dir "$ck" -- \
  "$py" "$here/examples/train_ps.py" --epochs 4 --pause-after-epoch 2 >"$log" 2>&1 &
launch=$!
for _ in $(seq 300); do
  grep -q '"epoch": 2' "$log" && break
  sleep 0.1
done
grep -q '"epoch": 2' "$log" || { echo "FAIL: epoch 2 never finished"; cat "$log"; exit 1; }
sleep 0.5
# Kill memory node 1 (its command line names this checkpoint directory).
pkill -9 -f -- "--ps-rank 1 .*--checkpoint-dir $ck" || { echo "FAIL: node 1 not found"; exit 1; }
wait $launch
rc=$?
cat "$log" | grep -v '^\[node' | tail -n 12
[[ $rc -ne 0 ]] || { echo "FAIL: launch exited 0 after a node died"; exit 1; }
grep -q "ProxyUnavailable" "$log" || { echo "FAIL: no ProxyUnavailable in the workers' output"; exit 1; }
grep -q "membox launch: .*stopping everything" "$log" || { echo "FAIL: launch did not say why it stopped"; exit 1; }
# Resume: training continues with epoch 3 from the checkpoint.
"$membox" launch --nodes 2 --workers 2 --checkpoint-dir "$ck" --resume -- \
  "$py" "$here/examples/train_ps.py" --epochs 4 >"$log" 2>&1 || { cat "$log"; echo "FAIL: resume"; exit 1; }
grep -v '^\[node' "$log" | tail -n 4
grep -q "resumed from checkpoint at epoch 2" "$log" || { echo "FAIL: did not resume at epoch 2"; exit 1; }
grep -q '"epoch": 3' "$log" && grep -q '"epoch": 4' "$log" || { echo "FAIL: epochs 3-4 missing"; exit 1; }
if grep -q '"epoch": 1' "$log"; then echo "FAIL: started over"; exit 1; fi
echo "PASS: node death seen as ProxyUnavailable; resumed from the checkpoint"
