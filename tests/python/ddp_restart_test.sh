#!/usr/bin/env bash
# A DDP worker killed (-9) in the middle of a job that keeps its weights and
# optimizer state in the memory nodes (membox.torch.InMemoryState, the digits
# example's --in-memory-state), under `membox launch --max-restarts 2`: the
# launcher restarts the worker set, the workers continue from the step the
# nodes hold (nothing read from disk; no checkpoint directory is given), and
# the job ends by itself with exit 0 and the undisturbed run's final loss and
# accuracy, to the last digit. Done at two moments, with 1 and 2 memory nodes
# (2: --ps-replicate, so every node holds the state).
# Usage: ddp_restart_test.sh PATH/TO/membox
set -uo pipefail
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
membox=${1:?usage: ddp_restart_test.sh membox}
here=$(cd "$(dirname "$0")/../.." && pwd)
"$py" -c "import torch, sklearn" 2>/dev/null || { echo "SKIP: needs torch and sklearn"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
epochs=6
train=("$py" "$here/examples/train_digits.py" --backend membox --epochs $epochs --in-memory-state)
final() {  # loss and accuracy of the last epoch's record
  grep "\"epoch\": $epochs," "$1" | tail -1 |
    "$py" -c 'import json,sys; r=json.load(sys.stdin); print(r["loss"], r["accuracy"])'
}

"$membox" launch --nodes 1 --workers 2 -- "${train[@]}" --out "$tmp/plain.jsonl" \
  >"$tmp/plain.log" 2>&1 || { cat "$tmp/plain.log"; echo "FAIL: undisturbed run"; exit 1; }
want=$(final "$tmp/plain.jsonl")
[[ -n $want ]] || { cat "$tmp/plain.log"; echo "FAIL: no final record"; exit 1; }

for run in "1 2" "2 4"; do
  read -r nodes kill_at <<<"$run"
  out="$tmp/killed-$kill_at.jsonl"
  log="$tmp/killed-$kill_at.log"
  "$membox" launch --nodes "$nodes" --workers 2 --max-restarts 2 -- "${train[@]}" \
    --out "$out" >"$log" 2>&1 &
  launch=$!
  for _ in $(seq 1500); do
    grep -q "\"epoch\": $kill_at," "$out" 2>/dev/null && break
    sleep 0.02
  done
  sleep 0.1  # into the next epoch: the kill lands between two steps' commits
  victim=$(pgrep -f -- "--out $out" | tail -1)
  [[ -n $victim ]] || { cat "$log"; echo "FAIL: no worker to kill"; exit 1; }
  t0=$(date +%s.%N)
  kill -9 "$victim"
  for _ in $(seq 1500); do
    grep -q "resumed from the memory nodes at step" "$log" && break
    sleep 0.02
  done
  recovery=$("$py" -c "import time; print(round(time.time() - $t0, 2))")
  wait "$launch"
  rc=$?
  [[ $rc == 0 ]] || { grep -v "^\[node" "$log" | tail -30; echo "FAIL: launch exit $rc after a restart"; exit 1; }
  grep -q "restarting the workers (restart 1 of 2)" "$log" || { cat "$log"; echo "FAIL: no restart logged"; exit 1; }
  step=$(sed -n 's/.*resumed from the memory nodes at step \([0-9]*\).*/\1/p' "$log" | head -1)
  [[ -n $step ]] || { grep -v "^\[node" "$log" | tail -30; echo "FAIL: the workers did not resume from the nodes' state"; exit 1; }
  # 45 steps per epoch (1440 images, 2 workers, batches of 16): the kill
  # came after epoch $kill_at, so the nodes held a step in epoch $kill_at+1
  # (up to three commits behind the last one).
  (( step >= kill_at * 45 - 3 )) || { echo "FAIL: resumed at step $step, before epoch $kill_at ended"; exit 1; }
  got=$(final "$out")
  [[ $got == "$want" ]] || { cat "$out"; echo "FAIL: final (loss accuracy) $got, undisturbed run $want"; exit 1; }
  echo "$nodes node(s), kill after epoch $kill_at: resumed at step $step, $(grep -h 'workers restarted in' "$log" | head -1 | sed 's/^membox launch: //') back at work ${recovery} s after the kill; final $got"
done
echo "PASS: both restarted DDP jobs ended with the undisturbed run's loss and accuracy ($want)"
