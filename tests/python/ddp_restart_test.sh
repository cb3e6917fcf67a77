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
# shellcheck source=restart_lib.sh
source "$here/tests/python/restart_lib.sh"
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
  # Killed once epoch $kill_at is recorded: in the next epoch's first steps.
  kill_one_worker "$nodes" "$out" "$log" "$out" "\"epoch\": $kill_at," \
    "resumed from the memory nodes at step" -- "${train[@]}"
  step=$(sed -n 's/.*resumed from the memory nodes at step \([0-9]*\).*/\1/p' "$log" | head -1)
  [[ -n $step ]] || { grep -v "^\[node" "$log" | tail -30; echo "FAIL: the workers did not resume from the nodes' state"; exit 1; }
  # 45 steps per epoch (1440 images, 2 workers, batches of 16): the kill
  # came after epoch $kill_at, so the nodes held a step in epoch $kill_at+1
  # (up to three commits behind the last one).
  (( step >= kill_at * 45 - 3 )) || { echo "FAIL: resumed at step $step, before epoch $kill_at ended"; exit 1; }
  got=$(final "$out")
  [[ $got == "$want" ]] || { cat "$out"; echo "FAIL: final (loss accuracy) $got, undisturbed run $want"; exit 1; }
  # One record per epoch: a set that resumed a few steps before the end of
  # an epoch it had recorded re-runs those steps but does not record it
  # again.
  "$py" -c 'import json,sys; e=[json.loads(l)["epoch"] for l in open(sys.argv[1]) if l.strip()]; sys.exit(e != list(range(1, int(sys.argv[2]) + 1)))' \
    "$out" "$epochs" || { cat "$out"; echo "FAIL: epoch records are not 1..$epochs once each"; exit 1; }
  echo "$nodes node(s), kill after epoch $kill_at: resumed at step $step, $(grep -h 'workers restarted in' "$log" | head -1 | sed 's/^membox launch: //') back at work ${recovery} s after the kill; final $got"
done
echo "PASS: both restarted DDP jobs ended with the undisturbed run's loss and accuracy ($want)"
