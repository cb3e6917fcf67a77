#!/usr/bin/env bash
# A memory node killed (-9) in the middle of a job on the explicit parameter
# server, two nodes, under `membox launch --max-restarts 2` (which turns on
# --ps-replicate: every node keeps every key). The launcher starts a
# replacement node with --join (it copies the newest state from the
# survivor) and restarts the workers, which continue at the step the nodes'
# version says. The job ends by itself with exit 0 and the same final loss
# and accuracy as an undisturbed run with the same seeds (no round lost or
# repeated). Done for each node, at different moments.
# Usage: node_failover_test.sh PATH/TO/membox
set -uo pipefail
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
membox=${1:?usage: node_failover_test.sh membox}
here=$(cd "$(dirname "$0")/../.." && pwd)
"$py" -c "import torch, sklearn" 2>/dev/null || { echo "SKIP: needs torch and sklearn"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
epochs=30
train=("$py" "$here/examples/train_ps.py" --epochs $epochs)

"$membox" launch --nodes 2 --workers 2 --ps-replicate on -- "${train[@]}" \
  --out "$tmp/plain.jsonl" >"$tmp/plain.log" 2>&1 ||
  { cat "$tmp/plain.log"; echo "FAIL: undisturbed run"; exit 1; }
want=$(tail -1 "$tmp/plain.jsonl" | "$py" -c 'import json,sys; r=json.load(sys.stdin); print(r["loss"], r["accuracy"])')

for victim_rank in 0 1; do
  kill_at=$((3 + 6 * victim_rank))
  out="$tmp/killed-$victim_rank.jsonl"
  log="$tmp/killed-$victim_rank.log"
  "$membox" launch --nodes 2 --workers 2 --max-restarts 2 -- "${train[@]}" \
    --out "$out" >"$log" 2>&1 &
  launch=$!
  for _ in $(seq 1500); do
    grep -q "\"epoch\": $kill_at," "$log" 2>/dev/null && break
    sleep 0.02
  done
  # `membox launch` execs the launcher, whose children are the nodes and
  # the workers.
  victim=$(pgrep -P "$launch" -f -- "--ps-rank $victim_rank ")
  [[ -n $victim ]] || { cat "$log"; echo "FAIL: no node $victim_rank to kill"; exit 1; }
  t0=$(date +%s.%N)
  kill -9 $victim
  for _ in $(seq 1500); do
    grep -q "resumed from the memory nodes at epoch" "$log" && break
    sleep 0.02
  done
  recovery=$("$py" -c "import time; print(round(time.time() - $t0, 2))")
  wait "$launch"
  rc=$?
  [[ $rc == 0 ]] || { tail -40 "$log"; echo "FAIL: launch exit $rc after node $victim_rank was replaced"; exit 1; }
  grep -q "memory node $victim_rank died (exit status -9); replacing it" "$log" || { cat "$log"; echo "FAIL: no replacement logged"; exit 1; }
  grep -q "proxy $victim_rank joined: copied" "$log" || { cat "$log"; echo "FAIL: the replacement did not copy the survivor's state"; exit 1; }
  grep -q "resumed from the memory nodes at epoch" "$log" || { cat "$log"; echo "FAIL: the workers did not resume from the nodes' version"; exit 1; }
  got=$(tail -1 "$out" | "$py" -c 'import json,sys; r=json.load(sys.stdin); print(r["loss"], r["accuracy"])')
  n=$(wc -l <"$out")
  [[ $n == "$epochs" ]] || { cat "$out"; echo "FAIL: $n epoch records, want $epochs"; exit 1; }
  [[ $got == "$want" ]] || { echo "FAIL: final (loss accuracy) $got, undisturbed run $want"; exit 1; }
  echo "node $victim_rank killed after epoch $kill_at: recovered in ${recovery} s; $(grep -h 'replaced in\|resumed from\|restarted in' "$log" | sed 's/^\[worker 0\] //' | tr '\n' ';') final $got"
done
echo "PASS: both jobs whose node was replaced ended with the undisturbed run's loss and accuracy ($want)"
