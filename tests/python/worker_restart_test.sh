#!/usr/bin/env bash
# A worker killed (-9) in the middle of a job on the explicit parameter
# server, under `membox launch --max-restarts 2`: the launcher restarts the
# worker set, the workers continue from the memory node's state at the step
# its version says (no disk), and the job ends by itself with exit 0 and the
# same final loss and accuracy as an undisturbed run with the same seeds (no
# round lost or repeated). Done twice: one kill each in two runs, at
# different moments.
# Usage: worker_restart_test.sh PATH/TO/membox
set -uo pipefail
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
membox=${1:?usage: worker_restart_test.sh membox}
here=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=restart_lib.sh
source "$here/tests/python/restart_lib.sh"
"$py" -c "import torch, sklearn" 2>/dev/null || { echo "SKIP: needs torch and sklearn"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
epochs=30
train=("$py" "$here/examples/train_ps.py" --epochs $epochs)

"$membox" launch --nodes 1 --workers 2 -- "${train[@]}" --out "$tmp/plain.jsonl" \
  >"$tmp/plain.log" 2>&1 || { cat "$tmp/plain.log"; echo "FAIL: undisturbed run"; exit 1; }
want=$(tail -1 "$tmp/plain.jsonl" | "$py" -c 'import json,sys; r=json.load(sys.stdin); print(r["loss"], r["accuracy"])')

for kill_at in 3 9; do
  out="$tmp/killed-$kill_at.jsonl"
  log="$tmp/killed-$kill_at.log"
  kill_one_worker 1 "$out" "$log" "$log" "\"epoch\": $kill_at," \
    "resumed from the memory nodes at epoch" -- "${train[@]}"
  got=$(tail -1 "$out" | "$py" -c 'import json,sys; r=json.load(sys.stdin); print(r["loss"], r["accuracy"])')
  n=$(wc -l <"$out")
  [[ $n == "$epochs" ]] || { cat "$out"; echo "FAIL: $n epoch records, want $epochs"; exit 1; }
  [[ $got == "$want" ]] || { echo "FAIL: final (loss accuracy) $got, undisturbed run $want"; exit 1; }
  echo "kill after epoch $kill_at: recovered in ${recovery} s; $(grep -h 'resumed from\|restarted in' "$log" | sed 's/^\[worker 0\] //' | tr '\n' ';') final $got"
done
echo "PASS: both restarted jobs ended with the undisturbed run's loss and accuracy ($want)"
