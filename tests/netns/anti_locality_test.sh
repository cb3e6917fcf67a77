#!/usr/bin/env bash
# Seed 000's "anti-locality" (Fig. 8/15) for real: a worker and two memory
# nodes in network namespaces on one bridge. The "near" node's link is shaped
# to 200 Mbit/s with tc tbf (low bandwidth, no added latency); the "far"
# node's link is not shaped but the worker's link model adds latency to it.
# The worker's profiler must route small tensors near and large ones far,
# and routed synchronisation must beat both single-proxy choices.
# Usage: anti_locality_test.sh PATH/TO/membox PATH/TO/ps_route_peer
# Exit 77 (skipped) without root or iproute2.
set -euo pipefail
membox=${1:?usage: anti_locality_test.sh membox ps_route_peer}
peer=${2:?usage: anti_locality_test.sh membox ps_route_peer}
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "SKIP: needs root, iproute2 and tc"; exit 77
fi
s=$$
SW=mbx-sw-$s W=mbx-w-$s N=mbx-n-$s F=mbx-f-$s
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for ns in "$W" "$N" "$F" "$SW"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT
if ! ip netns add "$SW" 2>/dev/null; then
  echo "SKIP: cannot create network namespaces here"; exit 77
fi
ip -n "$SW" link add br0 type bridge
ip -n "$SW" link set br0 up
i=1
for ns in "$W" "$N" "$F"; do
  ip netns add "$ns"
  host="h$i$s"; port="p$i$s"
  host=${host:0:15}; port=${port:0:15}
  ip link add "$host" type veth peer name "$port"
  ip link set "$host" netns "$ns"
  ip link set "$port" netns "$SW"
  ip -n "$SW" link set "$port" master br0 up
  ip -n "$ns" addr add "10.79.0.$i/24" dev "$host"
  ip -n "$ns" link set "$host" up
  ip -n "$ns" link set lo up
  eval "DEV_$i=$host PORT_$i=$port"
  i=$((i + 1))
done
# Near (10.79.0.2): 200 Mbit/s both ways.
ip netns exec "$N" tc qdisc add dev "$DEV_2" root tbf rate 200mbit burst 64kb latency 100ms
ip netns exec "$SW" tc qdisc add dev "$PORT_2" root tbf rate 200mbit burst 64kb latency 100ms

(umask 077; echo "anti-locality-secret-0123456789abcdefghij" > "$dir/secret")
start_node() {  # ns dev ip rank
  ip netns exec "$1" env UCX_NET_DEVICES="$2" "$membox" --log-level warn serve \
    --listen "$3:7400" --pool-size 16MiB --secret-file "$dir/secret" \
    --transports tcp --ps-listen "$3:7410" --ps-peers 10.79.0.2:7410,10.79.0.3:7410 \
    --ps-rank "$4" --sync-cores 1 >"$dir/node$4.log" 2>&1 &
  pids+=($!)
}
start_node "$N" "$DEV_2" 10.79.0.2 0
start_node "$F" "$DEV_3" 10.79.0.3 1
for r in 0 1; do
  for _ in $(seq 100); do
    grep -q "parameter proxy on" "$dir/node$r.log" && break
    sleep 0.1
  done
  grep -q "parameter proxy on" "$dir/node$r.log" || { echo "FAIL: node $r did not start"; cat "$dir/node$r.log"; exit 1; }
done
if ip netns exec "$W" env UCX_NET_DEVICES="$DEV_1" "$peer" 10.79.0.2:7410 10.79.0.3:7410 \
    anti-locality-secret-0123456789abcdefghij 20 | tee "$dir/peer.log"; then
  echo "PASS: anti-locality routing"
else
  echo "FAIL: see above"; cat "$dir/node0.log" "$dir/node1.log"; exit 1
fi
