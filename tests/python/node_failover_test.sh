#!/usr/bin/env bash
# A memory node killed (-9) in the middle of a job, two nodes, under
# `membox launch` with no flags: with several nodes every shard is on two
# of them by default (a striped key's owner copies each round's result to
# its backup before answering). The launcher starts a replacement node with
# --join (it copies the newest state from the survivor); the workers are not
# restarted: their parameter clients keep the dead node's pushes and send
# them to the replacement, the survivor goes on with the shards it owns and
# holds the answers its backup copy must precede. The job ends by
# itself with exit 0 and the same final loss and accuracy as an undisturbed
# run with the same seeds (no round lost or repeated). Done for the explicit
# parameter server (examples/train_ps.py; each node killed once, at
# different moments) and for the DDP hook (examples/train_digits.py).
# Usage: node_failover_test.sh PATH/TO/membox
set -uo pipefail
launch_flags=()
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
membox=${1:?usage: node_failover_test.sh membox}
here=$(cd "$(dirname "$0")/../.." && pwd)
"$py" -c "import torch, sklearn" 2>/dev/null || { echo "SKIP: needs torch and sklearn"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# run NAME VICTIM KILL_PATTERN FINAL_CMD -- COMMAND...: one job, its node
# VICTIM killed when KILL_PATTERN shows in the log (no kill: VICTIM "-").
run() {
  local name=$1 victim_rank=$2 pattern=$3; shift 4
  local log="$tmp/$name.log"
  "$membox" launch --nodes 2 --workers 2 "${launch_flags[@]}" -- "$@" >"$log" 2>&1 &
  local launch=$!
  if [[ $victim_rank != - ]]; then
    for _ in $(seq 1500); do
      grep -q -- "$pattern" "$log" 2>/dev/null && break
      sleep 0.02
    done
    # `membox launch` execs the launcher, whose children are the nodes and
    # the workers.
    local victim
    victim=$(pgrep -P "$launch" -f -- "--ps-rank $victim_rank ")
    [[ -n $victim ]] || { cat "$log"; echo "FAIL: $name: no node $victim_rank to kill"; exit 1; }
    kill -9 $victim
  fi
  wait "$launch"
  local rc=$?
  [[ $rc == 0 ]] || { tail -40 "$log"; echo "FAIL: $name: launch exit $rc"; exit 1; }
  if [[ $victim_rank != - ]]; then
    grep -q "memory node $victim_rank died (exit status -9); replacing it" "$log" || { cat "$log"; echo "FAIL: $name: no replacement logged"; exit 1; }
    grep -q "proxy $victim_rank joined: copied" "$log" || { cat "$log"; echo "FAIL: $name: the replacement did not copy the survivor's state"; exit 1; }
    grep -q "proxy $victim_rank at .* is back after" "$log" || { cat "$log"; echo "FAIL: $name: no worker reconnected to the replacement"; exit 1; }
    if grep -q "restarting the workers" "$log"; then
      grep "restarting the workers" "$log"; echo "FAIL: $name: the workers were restarted"; exit 1
    fi
    echo "$name: $(grep -h 'replaced in\|is back after\|rounds resume after' "$log" | sed 's/^\[[a-z]* [0-9]\] //; s/^\[[^]]*\] \[[^]]*\] \[[^]]*\] //' | tr '\n' ';')"
  fi
}

# The explicit parameter server: final (loss accuracy) from the last record.
epochs=30
train=("$py" "$here/examples/train_ps.py" --epochs $epochs)
final_ps() { tail -1 "$1" | "$py" -c 'import json,sys; r=json.load(sys.stdin); print(r["loss"], r["accuracy"])'; }
launch_flags=(--ps-replicate off)
run ps-unreplicated - "" -- "${train[@]}" --out "$tmp/ps-unreplicated.jsonl"
launch_flags=()
run ps-plain - "" -- "${train[@]}" --out "$tmp/ps-plain.jsonl"
want=$(final_ps "$tmp/ps-plain.jsonl")
[[ $(final_ps "$tmp/ps-unreplicated.jsonl") == "$want" ]] || { echo "FAIL: the replicated run's final (loss accuracy) $want differs from --ps-replicate off's $(final_ps "$tmp/ps-unreplicated.jsonl")"; exit 1; }
for victim in 0 1; do
  kill_at=$((3 + 6 * victim))
  run "ps-node$victim" $victim "\"epoch\": $kill_at," -- "${train[@]}" --out "$tmp/ps-$victim.jsonl"
  got=$(final_ps "$tmp/ps-$victim.jsonl")
  n=$(wc -l <"$tmp/ps-$victim.jsonl")
  [[ $n == "$epochs" ]] || { cat "$tmp/ps-$victim.jsonl"; echo "FAIL: $n epoch records, want $epochs"; exit 1; }
  [[ $got == "$want" ]] || { echo "FAIL: parameter server, node $victim killed: final (loss accuracy) $got, undisturbed run $want"; exit 1; }
done

# The DDP hook: the last epoch line's loss and accuracy.
digits=("$py" "$here/examples/train_digits.py" --backend membox --epochs 12)
final_ddp() { grep "epoch 12 " "$1" | sed 's/.*\(loss [0-9.]*  accuracy [0-9.]*\).*/\1/'; }
run ddp-plain - "" -- "${digits[@]}"
want_ddp=$(final_ddp "$tmp/ddp-plain.log")
[[ -n $want_ddp ]] || { cat "$tmp/ddp-plain.log"; echo "FAIL: no final epoch in the undisturbed DDP run"; exit 1; }
run ddp-node1 1 "epoch 3 " -- "${digits[@]}"
got_ddp=$(final_ddp "$tmp/ddp-node1.log")
[[ $got_ddp == "$want_ddp" ]] || { echo "FAIL: DDP, node 1 killed: final '$got_ddp', undisturbed run '$want_ddp'"; exit 1; }
echo "PASS: jobs whose node was replaced under them ended with the undisturbed runs' loss and accuracy (parameter server: $want; DDP: $want_ddp)"
