#!/usr/bin/env bash
# membox.torch.offload under `membox launch --max-restarts 2`: a worker
# killed (-9) mid-training holds no state the job needs. The launcher
# restarts the worker set, the workers go on at the step every key has
# completed on the memory nodes -- recomputing the step the job died in
# from the values the nodes kept from before it, for the keys whose round
# had finished -- and the job ends with the undisturbed run's final loss,
# to the last digit. Twice, killing at different moments. Needs torch 2.1+.
# Usage: offload_restart_test.sh PATH/TO/membox
set -uo pipefail
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
membox=${1:?usage: offload_restart_test.sh membox}
here=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=restart_lib.sh
source "$here/tests/python/restart_lib.sh"
"$py" -c "import torch, sys; sys.exit(not hasattr(torch.Tensor, 'register_post_accumulate_grad_hook'))" 2>/dev/null \
  || { echo "SKIP: needs torch >= 2.1"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
steps=40
train=("$py" "$here/examples/transformer_lm.py" --backend membox --offload
       --layers 4 --steps $steps)

"$membox" launch --nodes 2 --workers 2 -- "${train[@]}" --out "$tmp/plain.jsonl" \
  >"$tmp/plain.log" 2>&1 || { tail -30 "$tmp/plain.log"; echo "FAIL: undisturbed run"; exit 1; }
want=$(tail -1 "$tmp/plain.jsonl")

for kill_at in 5 17; do
  out="$tmp/killed-$kill_at.jsonl"
  log="$tmp/killed-$kill_at.log"
  kill_one_worker 2 "$out" "$log" "$out" "\"step\": $kill_at," \
    "resumed from the memory nodes at step" -- "${train[@]}"
  got=$(tail -1 "$out")
  [[ $got == "$want" ]] || { grep -v '^\[node' "$log" | tail -20; echo "FAIL: last record $got, undisturbed run $want"; exit 1; }
  echo "kill after step $kill_at: recovered in ${recovery} s; $(grep -h 'resumed from' "$log" | sed 's/^\[worker 0\] //') final $got"
done
# The last rank dies in step 9's backward after the upper layers' pushes:
# their rounds finish on the nodes (the other rank pushes too), the lower
# layers' do not. The restarted set redoes step 9 with the upper layers'
# values from before it and pushes only the lower layers.
out="$tmp/mid.jsonl"
"$membox" launch --nodes 2 --workers 2 --max-restarts 1 -- "${train[@]}" \
  --exit-in-backward 9 --out "$out" >"$tmp/mid.log" 2>&1 \
  || { tail -40 "$tmp/mid.log"; echo "FAIL: launch after a worker died mid-backward"; exit 1; }
line=$(grep -h "resumed from" "$tmp/mid.log" | sed 's/^\[worker 0\] //')
[[ $line == *"at step 9 "* ]] || { grep -v '^\[node' "$tmp/mid.log" | tail; echo "FAIL: did not resume at step 9: $line"; exit 1; }
[[ $line != *"(0 keys"* ]] || { echo "FAIL: no key had finished step 9 on the nodes: $line"; exit 1; }
got=$(tail -1 "$out")
[[ $got == "$want" ]] || { echo "FAIL: last record $got after a death mid-backward, undisturbed run $want"; exit 1; }
echo "died in step 9's backward: $line; final $got"
echo "PASS: every restarted job ended with the undisturbed run's loss ($want)"
