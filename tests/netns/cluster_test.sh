#!/usr/bin/env bash
# `membox cluster` end to end: a topology file with 2 worker hosts and 2
# memory hosts (network namespaces, 300 Mbit/s links), brought up, used and
# removed by `membox cluster run` -- PushPull across hosts with exact sums
# (striped and through the proxies' ring; the workers check every sum and
# abort otherwise), a Python worker through `membox launch --attach`, and
# the clean-up when the job fails. Also: `up` without root says so.
# Usage: cluster_test.sh PATH/TO/membox
# Exit 77 (skipped) without root, iproute2, tc or network namespaces.
set -euo pipefail
membox=${1:?usage: cluster_test.sh membox}
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "SKIP: needs root, iproute2 and tc"; exit 77
fi
if ! ip netns add mbx-probe-$$ 2>/dev/null; then
  echo "SKIP: cannot create network namespaces here"; exit 77
fi
ip netns del mbx-probe-$$
dir=$(mktemp -d)
name=ct$(( $$ % 10000 ))
topo=$dir/topology.toml
cat >"$topo" <<TOML
name = "$name"
subnet = "10.84.$(( $$ % 200 ))"
workers = 2
memory = 2
rate = "300mbit"
pool = "256MiB"
emb_budget = "16MiB"
[host.m1]
rate = "200mbit"
TOML
cleanup() {
  "$membox" cluster down "$topo" >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
leftovers() { ip netns list | grep -c "^mbx-$name-" || true; }

# Not root: a clear refusal, nothing created.
if command -v setpriv >/dev/null; then
  out=$(setpriv --reuid=65534 --regid=65534 --clear-groups \
        "$membox" cluster up "$topo" 2>&1) && fail "up as nobody succeeded"
  grep -q "needs root" <<<"$out" || fail "no 'needs root' message: $out"
fi

"$membox" cluster up "$topo"
[[ $(leftovers) -eq 4 ]] || fail "expected 4 namespaces"
"$membox" cluster status "$topo" | tee "$dir/status"
grep -q "m1 .*200mbit.*running" "$dir/status" || fail "status does not show m1"
state=/run/membox-cluster/$name
proxies=$(grep -o "10\.84\.[0-9]*\.10[12]" "$dir/status" | sort -u | sed 's/$/:7310/' | paste -sd,)
for mode in stripe ring; do
  # Fresh keys per mode: each run declares keys 1..3 again, so use one
  # cluster per mode (a key's striping is fixed by its first declaration).
  "$membox" cluster down "$topo" >/dev/null
  "$membox" cluster up "$topo" >/dev/null
  "$membox" cluster run "$topo" --no-attach -- "$membox" bench-peer allreduce \
      worker "$proxies" "$state/secret" 65536,1048576,8388608 3 1048576 "$mode" \
      | tee "$dir/$mode.out"
  [[ $(grep -c "^RESULT membox" "$dir/$mode.out") -eq 3 ]] || fail "$mode: missing results"
done
# The memory nodes really were in other namespaces: each served our workers.
for f in "$state"/m*/serve.log; do
  grep -q "worker rank 1" "$f" || fail "no worker reached $(dirname "$f")"
done

# A Python worker per host through launch --attach: rank, proxies, master.
# One write per rank: unbuffered print() writes piece by piece, and mpirun
# forwards the ranks' pieces interleaved.
"$membox" cluster run "$topo" -- /usr/bin/python3 -c '
import os
e = os.environ
os.write(1, ("ATTACHED %s %s %s %s\n" % (e["RANK"], e["WORLD_SIZE"],
             e["MEMBOX_PROXIES"], e["MASTER_ADDR"])).encode())' | tee "$dir/attach.out"
[[ $(grep -c "^ATTACHED [01] 2 " "$dir/attach.out") -eq 2 ]] || fail "attach"

# A failing job on a cluster that run brings up itself: non-zero status,
# and nothing left behind.
"$membox" cluster down "$topo"
[[ $(leftovers) -eq 0 ]] || fail "down left namespaces"
if "$membox" cluster run "$topo" -- /bin/sh -c 'exit 3'; then
  fail "a failing job reported success"
fi
[[ $(leftovers) -eq 0 ]] || fail "a failed run left namespaces behind"
[[ ! -d $state ]] || fail "a failed run left its state directory"
ip link show "mbx${name}br" >/dev/null 2>&1 && fail "bridge left behind"
echo "PASS: membox cluster up/run/status/down, exact sums across hosts"
