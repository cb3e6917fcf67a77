#!/usr/bin/env bash
# Failures that overlap, under `membox launch` with its defaults (replicated
# nodes, node replacement):
# 1. A worker and a memory node killed (-9) within the same second, in both
#    orders (two nodes, --max-restarts 2, DDP with its state in the nodes):
#    the launcher restarts the workers and replaces the node, and the job
#    ends by itself with the undisturbed run's final loss and accuracy --
#    no round lost.
# 2. Two of three memory nodes killed 50 ms apart, before the first one's
#    replacement has its copy (the explicit parameter server): if the one
#    survivor still holds every shard (the ring's unstriped keys), both are
#    replaced and the job ends with the undisturbed run's final loss; if
#    not (striped keys: a shard's owner and its backup both died), the job
#    ends with exit 1 and one error naming both nodes and the shards lost.
#    Which of the two the job's keys are depends on the links the workers
#    measure; src/ps/ps_test.cc (TwoDeathsBeforeAReplacement*) makes each
#    happen.
# Usage: overlapping_failures_test.sh PATH/TO/membox
set -uo pipefail
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
membox=${1:?usage: overlapping_failures_test.sh membox}
here=$(cd "$(dirname "$0")/../.." && pwd)
"$py" -c "import torch, sklearn" 2>/dev/null || { echo "SKIP: needs torch and sklearn"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# wait_job PID LOG: the job's exit status, or FAIL after 240 s.
wait_job() {
  local pid=$1 log=$2
  for _ in $(seq 2400); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    pkill -9 -P "$pid"; kill -9 "$pid"
    tail -60 "$log"; echo "FAIL: the job did not end within 240 s"; exit 1
  fi
  wait "$pid"
}
# await PATTERN FILE: waits up to 60 s for PATTERN in FILE.
await() {
  for _ in $(seq 3000); do grep -q -- "$1" "$2" 2>/dev/null && return 0; sleep 0.02; done
  echo "FAIL: no '$1' in $2 within 60 s"; exit 1
}

# 1. A worker and a node.
epochs=6
digits=("$py" "$here/examples/train_digits.py" --backend membox --epochs $epochs --in-memory-state)
final() {
  grep "\"epoch\": $epochs," "$1" | tail -1 |
    "$py" -c 'import json,sys; r=json.load(sys.stdin); print(r["loss"], r["accuracy"])'
}
"$membox" launch --nodes 2 --workers 2 -- "${digits[@]}" --out "$tmp/plain.jsonl" \
  >"$tmp/plain.log" 2>&1 || { tail -40 "$tmp/plain.log"; echo "FAIL: undisturbed run"; exit 1; }
want=$(final "$tmp/plain.jsonl")
for order in worker-first node-first; do
  out="$tmp/$order.jsonl" log="$tmp/$order.log"
  "$membox" launch --nodes 2 --workers 2 --max-restarts 2 --node-log-level info -- "${digits[@]}" --out "$out" \
    >"$log" 2>&1 &
  launch=$!
  await '"epoch": 2,' "$out"
  worker=$(pgrep -P "$launch" -f -- "--out $out" | tail -1)
  node=$(pgrep -P "$launch" -f -- "--ps-rank 1 ")
  [[ -n $worker && -n $node ]] || { cat "$log"; echo "FAIL: $order: no worker or node to kill"; exit 1; }
  if [[ $order == worker-first ]]; then
    kill -9 "$worker"; sleep 0.3; kill -9 "$node"
  else
    kill -9 "$node"; sleep 0.3; kill -9 "$worker"
  fi
  wait_job "$launch" "$log"
  rc=$?
  if [[ $rc != 0 ]]; then
    # The nodes' own lines too (kept out of the first part): what the
    # replacement said while the restarted workers could not reach it.
    grep -v '^\[node' "$log" | tail -40
    echo "--- the memory nodes' last lines:"
    grep '^\[node' "$log" | tail -60
    echo "FAIL: $order: launch exit $rc"
    exit 1
  fi
  grep -q "restarting the workers (restart 1 of 2)" "$log" || { cat "$log"; echo "FAIL: $order: no worker restart"; exit 1; }
  grep -q "memory node 1 replaced in" "$log" || { cat "$log"; echo "FAIL: $order: node 1 not replaced"; exit 1; }
  got=$(final "$out")
  [[ $got == "$want" ]] || { cat "$out"; echo "FAIL: $order: final (loss accuracy) $got, undisturbed run $want"; exit 1; }
  echo "worker and node killed 0.3 s apart ($order): final $got, as undisturbed"
done

# 2. Two nodes of three.
ps_epochs=20
train=("$py" "$here/examples/train_ps.py" --epochs $ps_epochs)
final_ps() { tail -1 "$1" | "$py" -c 'import json,sys; r=json.load(sys.stdin); print(r["loss"], r["accuracy"])'; }
"$membox" launch --nodes 3 --workers 2 -- "${train[@]}" --out "$tmp/ps-plain.jsonl" \
  >"$tmp/ps-plain.log" 2>&1 || { tail -40 "$tmp/ps-plain.log"; echo "FAIL: undisturbed 3-node run"; exit 1; }
want_ps=$(final_ps "$tmp/ps-plain.jsonl")
out="$tmp/two.jsonl" log="$tmp/two.log"
"$membox" launch --nodes 3 --workers 2 -- "${train[@]}" --out "$out" >"$log" 2>&1 &
launch=$!
await '"epoch": 3,' "$out"
n1=$(pgrep -P "$launch" -f -- "--ps-rank 1 ")
n2=$(pgrep -P "$launch" -f -- "--ps-rank 2 ")
kill -9 "$n1"; sleep 0.05; kill -9 "$n2"
wait_job "$launch" "$log"
rc=$?
if [[ $rc == 0 ]]; then
  grep -q "memory node 2 replaced in" "$log" || { cat "$log"; echo "FAIL: node 2 not replaced"; exit 1; }
  got=$(final_ps "$out")
  [[ $got == "$want_ps" ]] || { cat "$out"; echo "FAIL: two nodes replaced: final $got, undisturbed run $want_ps"; exit 1; }
  echo "two of three nodes killed 50 ms apart: the survivor held every shard; both replaced, final $got, as undisturbed"
else
  last=$(grep "^membox launch: " "$log" | tail -1)
  [[ $last == *"memory node 1 and memory node 2 died"* && $last == *"held only by proxy 1 (replaced) and proxy 2"* && $last == *"key "*" shard "* ]] ||
    { grep -v '^\[worker' "$log" | tail -30; echo "FAIL: the job ended (exit $rc) without one error naming both nodes and the shards lost"; exit 1; }
  echo "two of three nodes killed 50 ms apart: shards lost; the job ended with: $last"
fi
echo "PASS: overlapping failures"
