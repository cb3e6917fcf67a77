#!/usr/bin/env bash
# Two "hosts" on this machine: network namespaces mbx-a and mbx-b joined by a
# veth pair (10.77.0.1 <-> 10.77.0.2), real TCP between them. A receiver in
# mbx-a and a sender in mbx-b move static tensors over a TCP-only device;
# then the link is shaped with tc tbf and the transfer must still complete.
# Usage: two_host_test.sh PATH/TO/transport_peer
# Exit 77 (skipped) without root or iproute2.
set -euo pipefail
peer_bin=${1:?usage: two_host_test.sh transport_peer}
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null; then
  echo "SKIP: needs root and iproute2"; exit 77
fi
suffix=$$
A=mbx-a-$suffix B=mbx-b-$suffix
VA=mbxa$suffix VB=mbxb$suffix
VA=${VA:0:15} VB=${VB:0:15}
cleanup() {
  ip netns del "$A" 2>/dev/null || true
  ip netns del "$B" 2>/dev/null || true
}
trap cleanup EXIT
if ! ip netns add "$A" 2>/dev/null; then
  echo "SKIP: cannot create network namespaces here"; exit 77
fi
ip netns add "$B"
ip link add "$VA" type veth peer name "$VB"
ip link set "$VA" netns "$A"
ip link set "$VB" netns "$B"
ip -n "$A" addr add 10.77.0.1/24 dev "$VA"
ip -n "$B" addr add 10.77.0.2/24 dev "$VB"
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set "$VA" up
ip -n "$B" link set "$VB" up

run_round() {  # $1 = bytes, $2 = rounds
  local out; out=$(mktemp)
  ip netns exec "$A" env UCX_NET_DEVICES="$VA" "$peer_bin" recv tcp 10.77.0.1:0 "$1" "$2" >"$out" &
  local rpid=$!
  local ep=""
  for _ in $(seq 100); do
    ep=$(sed -n 's/^READY //p' "$out")
    [[ -n $ep ]] && break
    sleep 0.1
  done
  [[ -n $ep ]] || { echo "FAIL: receiver did not start"; kill $rpid; return 1; }
  echo "receiver in $A listening on $ep"
  local t0; t0=$(date +%s.%N)
  ip netns exec "$B" env UCX_NET_DEVICES="$VB" "$peer_bin" send tcp "$ep" "$1" "$2" >/dev/null
  wait $rpid
  local t1; t1=$(date +%s.%N)
  grep -q "^DONE tcp" "$out" || { echo "FAIL: receiver output:"; cat "$out"; return 1; }
  elapsed=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')
  echo "moved $2 x $1 across namespaces in $elapsed s"
  rm -f "$out"
}

run_round 4MiB 10
# Shape the sender's link to 200 Mbit/s and move the data again.
ip netns exec "$B" tc qdisc add dev "$VB" root tbf rate 200mbit burst 256kb latency 50ms
run_round 4MiB 4
# 16 MiB through a 200 Mbit/s bucket takes >= 0.6 s: the bytes really crossed
# the shaped veth rather than some shortcut between the namespaces.
if awk -v e="$elapsed" 'BEGIN { exit !(e < 0.6) }'; then
  echo "FAIL: shaped transfer took only $elapsed s"; exit 1
fi
echo "PASS: two-host transfer over veth with and without tc shaping"
