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
# Rank 0 stops after epoch 5's last round and before that epoch's record
# (the window a kill can hit): the restarted set resumes at epoch 6 and rank
# 0 writes epoch 5's record from the nodes' weights first, so every epoch
# has exactly one record and the job ends as the undisturbed one.
out="$tmp/gap.jsonl"
"$membox" launch --nodes 1 --workers 2 --max-restarts 1 -- "${train[@]}" \
  --exit-before-record 5 --out "$out" >"$tmp/gap.log" 2>&1 \
  || { tail -40 "$tmp/gap.log"; echo "FAIL: launch after an exit before a record"; exit 1; }
"$py" - "$out" "$epochs" <<'PY' || { cat "$out"; echo "FAIL: epoch records after an exit before one"; exit 1; }
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
epochs = [r["epoch"] for r in recs]
assert epochs == list(range(1, int(sys.argv[2]) + 1)), epochs
assert recs[4].get("recovered") and recs[4]["loss"] is None, recs[4]
assert not any(r.get("recovered") for i, r in enumerate(recs) if i != 4)
PY
got=$(tail -1 "$out" | "$py" -c 'import json,sys; r=json.load(sys.stdin); print(r["loss"], r["accuracy"])')
[[ $got == "$want" ]] || { echo "FAIL: final (loss accuracy) $got after an exit before a record, undisturbed run $want"; exit 1; }
echo "exit before epoch 5's record: the restarted set wrote it (recovered), final $got"
echo "PASS: both restarted jobs ended with the undisturbed run's loss and accuracy ($want)"
