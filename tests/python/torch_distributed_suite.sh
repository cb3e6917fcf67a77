#!/usr/bin/env bash
# PyTorch's own distributed tests (torch.testing._internal.distributed.
# distributed_test) on the membox backend: starts a memory node, runs
# tests/python/torch_distributed_suite.py with WORLD_SIZE ranks, and prints
# the pass / skip / expected-failure / fail counts (fail: exit 1).
# Usage: torch_distributed_suite.sh PATH/TO/membox [-k PATTERN ...]
#   With no -k: the CPU collectives CI runs (a share of each kind; every
#   test spawns its ranks, about 3.5 s each here). The full set the issue
#   names: -k test_broadcast -k test_all_reduce -k test_all_gather
#   -k test_gather -k test_scatter -k test_all_to_all -k test_barrier
#   -k test_send_recv -k test_isend -k test_irecv -k object -k test_ddp
set -uo pipefail
py=${MEMBOX_TEST_PYTHON:-/usr/bin/python3}
membox=${1:?usage: torch_distributed_suite.sh membox [-k PATTERN ...]}
shift
here=$(cd "$(dirname "$0")/../.." && pwd)
"$py" -c "from torch._C._distributed_c10d import Backend; import expecttest" \
  2>/dev/null || { echo "SKIP: needs torch 2.x and expecttest"; exit 77; }
filters=("$@")
if [[ ${#filters[@]} == 0 ]]; then
  filters=(-k test_broadcast_object_list -k test_all_gather_object
           -k test_scatter_object_list -k test_all_reduce_sum_async
           -k test_all_reduce_coalesced_max -k test_all_gather_coalesced_simple
           -k test_all_to_all_single_unequal_split -k test_barrier_full_group
           -k test_send_recv_with_tag -k test_scatter_full_group
           -k test_gather_full_group -k test_reduce_full_group_sum
           -k test_broadcast_full_group -k test_irecv -k test_ddp_create_graph
           -k test_send_recv_any_source -k test_barrier_timeout_full_group
           -k test_monitored_barrier_gloo -k test_batch_isend_irecv_gloo)
fi
tmp=$(mktemp -d)
# MEMBOX_SUITE_LOG=F keeps the suite's whole log in F.
trap 'kill $node 2>/dev/null; [[ -n ${MEMBOX_SUITE_LOG:-} ]] &&
      cp "$tmp/suite.log" "$MEMBOX_SUITE_LOG"; rm -rf "$tmp"' EXIT
(umask 077; echo "torch-suite-secret-0123456789abcdefghijkl" >"$tmp/secret")
"$membox" --log-level warn serve --listen 127.0.0.1:0 --pool-size 512MiB \
  --secret-file "$tmp/secret" --exit-with-parent >"$tmp/node.log" 2>&1 &
node=$!
for _ in $(seq 100); do
  ep=$(grep -o "parameter proxy on .*" "$tmp/node.log" | awk '{print $NF}')
  [[ -n $ep ]] && break
  sleep 0.1
done
[[ -n $ep ]] || { cat "$tmp/node.log"; echo "FAIL: no memory node"; exit 1; }
# CI (any value) makes torch's run_tests write XML reports through
# unittest-xml-reporting, which is not installed: the suite would run no
# test. Its reports are not wanted here; the counts below are.
cd "$tmp" && env -u CI -u SANDCASTLE MEMBOX_PROXIES=$ep MEMBOX_SECRET_FILE=$tmp/secret \
  WORLD_SIZE=${WORLD_SIZE:-2} "$py" \
  "$here/tests/python/torch_distributed_suite.py" -v "${filters[@]}" \
  >"$tmp/suite.log" 2>&1
rc=$?
# Counted from unittest's own summary ("Ran N tests", then "OK (skipped=S,
# expected failures=X)" or "FAILED (failures=F, errors=E, ...)"): a test's
# verdict may follow its docstring or the ranks' log lines, not its name.
count() {
  grep -E '^(OK|FAILED)( |$)' "$tmp/suite.log" | tail -n 1 |
    grep -oE "(\(|, )$1=[0-9]+" | cut -d= -f2 | awk '{s += $1} END {print s + 0}'
}
ran=$(grep -E '^Ran [0-9]+ test' "$tmp/suite.log" | tail -n 1 | awk '{print $2}')
ran=${ran:-0}
skip=$(count skipped)
xfail=$(count "expected failures")
fail=$(( $(count failures) + $(count errors) + $(count "unexpected successes") ))
pass=$(( ran - skip - xfail - fail ))
grep -E '^Ran ' "$tmp/suite.log"
echo "torch distributed_test on membox (WORLD_SIZE=${WORLD_SIZE:-2}):" \
  "$pass passed, $skip skipped, $xfail expected failures (torch's" \
  "is_completed() of a Python backend's Work), $fail failed"
if [[ $rc != 0 || $fail != 0 || $((pass + xfail)) == 0 ]]; then
  [[ $((pass + skip + xfail + fail)) != 0 ]] || tail -n 40 "$tmp/suite.log"
  grep -E -A40 '^(ERROR|FAIL): test' "$tmp/suite.log" | grep -v USDT | tail -80
  echo "FAIL: torch distributed_test on membox"
  exit 1
fi
echo "PASS: torch distributed_test on membox"
